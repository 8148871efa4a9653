"""Routes on the real smollm2: "The capital of France is" builds its whole graph, every block's
shares sum to 1, the lens at the top node is the model's own prediction, the contrastive route's
direct effects add up to the model's own logit difference, the edge "France" → "is" at layer 23
is carried by head 4 and raises " Paris" over " Rome", and the route is saved with its page; routes
over a file of three prompts average the single-prompt routes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

import attnflow
from attnflow.targets import Target

TEXT = "The capital of France is"


def test_the_capital_of_france(smollm2, tmp_path):
    routes = attnflow.routes(smollm2, TEXT, target=Target(" Paris", contrast=" Rome"))
    graph, n_tokens = routes.graph, len(routes.tokens)
    assert graph.heads.shape == (30, 9, n_tokens, n_tokens)
    np.testing.assert_allclose(
        graph.attention_residual + graph.heads.sum(axis=(1, 3)) + graph.attention_bias, 1, atol=1e-5
    )
    np.testing.assert_allclose(graph.ffn + graph.ffn_residual + graph.ffn_bias, 1, atol=1e-5)
    assert np.triu(graph.attention, k=1).max() == 0  # causal: no edge from a later token
    input_ids = smollm2.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = smollm2.model(input_ids=input_ids).logits[0, -1]
    predicted = int(logits.argmax())
    assert smollm2.tokenizer.decode([predicted]) == " Paris" == routes.prediction["token"]
    top = routes.lens[routes.top]
    assert top["top"][0]["id"] == predicted and top["target"]["rank"] == 0
    assert top["top"][0]["probability"] == pytest.approx(float(logits.softmax(-1)[predicted]), abs=1e-4)
    paris, rome = (smollm2.tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in (" Paris", " Rome"))
    assert routes.direct.total == pytest.approx(float(logits[paris] - logits[rome]), abs=1e-3)
    assert routes.nodes[0] == (routes.top, 1.0) and len(routes.edges) > 10
    assert {entry["kind"] for entry in routes.components} == {"head", "ffn"}
    assert isinstance(routes, attnflow.Routes) and "nodes off the top position" in routes.summary()
    edge = next(e for e in routes.edges if e.kind == "attention" and (e.layer, e.source[2], e.target[2]) == (23, 3, 4))
    assert int(np.argmax(edge.heads)) == 4 and edge.reach > routes.threshold
    assert edge.effects["contrast_effect"] > 1 and " France" in [t["token"] for t in edge.effects["promotes"]]
    routes.save(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["routes.html", "routes.json", "routes.png"]


def test_bfloat16_routes_agree_with_float32(smollm2):
    """smollm2 in bfloat16: its rounding (errors of about 0.01 on layer 0's entries up to 2.6) passes the
    self-check (4 rounding steps of the stream's scale), and the route is float32's: the same prediction,
    the top 10 edges mostly shared and the head importance ranked alike."""
    low = attnflow.load("smollm2", device="cpu", dtype="bfloat16", progress=False)
    full, half = attnflow.routes(smollm2, TEXT, lens="none"), attnflow.routes(low, TEXT, lens="none")
    assert half.prediction["token"] == full.prediction["token"] == " Paris"
    graph = half.graph
    np.testing.assert_allclose(
        graph.attention_residual + graph.attention.sum(axis=2) + graph.attention_bias, 1, atol=1e-5
    )

    def top(routes, k=10):
        return {(edge.kind, edge.layer, edge.source, edge.target) for edge in routes.edges[:k]}

    assert len(top(full) & top(half)) >= 7
    rho = spearmanr(full.importance_full.heads.ravel(), half.importance_full.heads.ravel()).statistic
    assert rho > 0.9


PROMPTS = ["The capital of France is", "import numpy as np\nimport pandas as", "She opened the door and"]


def test_routes_over_three_prompts(smollm2, tmp_path):
    """Routes over a file of three prompts (JSON lines: one holds a newline): each head's mean
    importance is the mean of the three single-prompt routes; the top heads have measured roles,
    the four attention shares sum to 1, and the page is written."""
    from attnflow.flow_routes.dataset import routes_over_data
    from attnflow.runs.engine import EngineOptions

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in PROMPTS), encoding="utf-8")
    summary = routes_over_data(smollm2, [str(source)], tmp_path / "out", engine=EngineOptions(quiet=True))
    domain = summary["domains"][0]
    looped = np.stack([attnflow.routes(smollm2, text, lens="none").importance.heads for text in PROMPTS])
    np.testing.assert_allclose(domain["heads"]["importance"]["mean"], looped.mean(0), rtol=1e-9, atol=1e-12)
    assert summary["n_layers"] == 30 and summary["n_heads"] == 9 and domain["prompts"] == 3
    top = domain["top_heads"][0]
    assert (top["layer"], top["head"]) == np.unravel_index(looped.mean(0).argmax(), (30, 9))
    assert all(entry["role"] for entry in domain["top_heads"]) and domain["chance"]["first_token"] > 0
    shares = np.array([domain["heads"][name]["mean"] for name in ("first_token", "previous_token", "self")])
    shares = np.concatenate([shares, [domain["heads"]["elsewhere"]["mean"]]])
    np.testing.assert_allclose(shares.sum(0), 1, atol=1e-6)
    assert (tmp_path / "out" / "report.html").stat().st_size > 10_000
