"""`attnflow routes --data … --versus MODEL` (`attnflow.dataset_audit.routes_versus`): two tiny language
models over the same prompts. A planted change (one head of a copy silenced) is found, every head
number equals a loop over `attnflow.routes` on each prompt with both models, the word changes equal
each model's own maps paired by hand; across architectures only words compare; bad input is one line."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from scipy.stats import norm

import attnflow
from attnflow.cli import main
from attnflow.dataset_audit.routes_versus import routes_versus
from attnflow.dataset_audit.words import word_relevance
from attnflow.runs.engine import EngineOptions

PROMPTS = ["the cat sat on the mat", "the dog ran to the cat", "hello world this is a story", "we ran to the dog",
           "the cat is a good cat", "it was very bad", "the story of the dog", "this is the world"]  # fmt: skip
SILENCED = (1, 2)  # the head of the copy whose output is zeroed


Z = norm.ppf(0.975)  # the two-sided 95 % normal quantile


@pytest.fixture(scope="module")
def pair(tiny_loaded):
    """The tiny Llama and a copy whose layer-1 head 2 writes nothing (its slice of o_proj zeroed)."""
    model = tiny_loaded("llama")
    module = copy.deepcopy(model.hf_model)
    layer, head = SILENCED
    with torch.no_grad():
        module.model.layers[layer].self_attn.o_proj.weight[:, head * model.d_head : (head + 1) * model.d_head] = 0
    silenced = attnflow.AttentionModel(module, model.tokenizer, name="silenced", adapter=model.adapter, device="cpu")
    return model, silenced


def source(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    return str(path)


def paired_words(first, second, word: str) -> np.ndarray:
    """``[prompt]`` the word's share of each model's own map, first minus second (0 where absent)."""
    found = []
    for text in PROMPTS:
        shares = []
        for model in (first, second):
            explanation = model.explain(text, "attnlrp")
            words = word_relevance(text, explanation.offsets, explanation.special_mask, explanation.scores)
            shares.append(abs(words[word][1]) if word in words else 0.0)
        found.append(shares[0] - shares[1])
    return np.array(found)


def test_a_silenced_head_and_every_number_match_loops_over_routes(pair, tmp_path):
    model, silenced = pair
    results = routes_versus(model, silenced, [source(tmp_path)], tmp_path / "out", batch_size=3,
                            engine=EngineOptions(quiet=True), min_count=1)  # fmt: skip
    changes = results["changes"]
    assert results["run"]["sides"] == [model.name, "silenced"] and results["run"]["head_statistics"]
    looped = {name: [] for name in ("a", "b")}
    for text in PROMPTS:
        looped["a"].append(attnflow.routes(model, text, lens="none").importance.heads)
        looped["b"].append(attnflow.routes(silenced, text, lens="none").importance.heads)
    a, b = np.stack(looped["a"]), np.stack(looped["b"])  # [prompt, layer, head]
    d = a - b
    rows = {(row["layer"], row["head"]): row for row in changes["heads"]["heads"]["moved"]}
    for (layer, head), row in rows.items():
        assert row["model"] == pytest.approx(a[:, layer, head].mean(), abs=1e-12)
        assert row["versus"] == pytest.approx(b[:, layer, head].mean(), abs=1e-12)
        se = d[:, layer, head].std(ddof=1) / np.sqrt(len(PROMPTS))
        mean = d[:, layer, head].mean()
        assert (row["change"], *row["ci"]) == pytest.approx((mean, mean - Z * se, mean + Z * se), abs=1e-9)
    # the silenced head: no importance at all in the copy, and among the heads that moved most
    assert rows[SILENCED]["versus"] == 0.0 and rows[SILENCED]["model"] > 0
    assert SILENCED in [(row["layer"], row["head"]) for row in changes["heads"]["heads"]["moved"][:4]]
    assert len(changes["ffn"]) == model.n_layers
    # words: each model's own next-token map, paired per prompt
    top = changes["words"][0]
    d = paired_words(model, silenced, top["word"])
    half = Z * d.std(ddof=1) / np.sqrt(len(d))
    assert (top["change"], *top["ci"]) == pytest.approx((d.mean(), d.mean() - half, d.mean() + half), rel=1e-6)
    assert results["changes"]["lead"] and (tmp_path / "out" / "report.html").is_file()
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Attention heads that moved" in page and "importance for the prediction on the route" in page


def test_across_architectures_only_words_compare(tiny_loaded, tmp_path):
    llama, qwen = tiny_loaded("llama"), tiny_loaded("qwen2")
    results = routes_versus(llama, qwen, [source(tmp_path)], tmp_path / "out", engine=EngineOptions(quiet=True),
                            min_count=1)  # fmt: skip
    changes = results["changes"]
    assert "heads" not in changes and not results["run"]["head_statistics"]
    top = changes["words"][0]
    d = paired_words(llama, qwen, top["word"])
    assert top["change"] == pytest.approx(d.mean(), rel=1e-6) and top["texts"] >= 1
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["changes"]["predictions"]["texts"] == len(PROMPTS)
    # the next tokens that differ: each model's greedy token from a plain forward pass, compared as text
    differ = 0
    for text in PROMPTS:
        tokens = []
        for model in (llama, qwen):
            encoded = model.tokenizer(text, return_tensors="pt")
            with torch.no_grad():
                token = int(model.hf_model(**encoded).logits[0, -1].argmax())
            tokens.append(model.tokenizer.decode([token]).strip())
        differ += tokens[0] != tokens[1]
    assert changes["predictions"]["changed"] == differ
    said = [entry["sentence"] for entry in changes["lead"] if entry["kind"] == "predictions"]
    assert said and said[0].startswith(f"{differ} of {len(PROMPTS)} predicted next tokens differ")


def test_bad_input_is_one_line_and_writes_nothing(tiny_model_path, tmp_path, capsys):
    data = source(tmp_path)
    out = tmp_path / "out"
    model = str(tiny_model_path("llama"))
    cases = [
        (["--data", data, "--versus", str(tmp_path / "nope")], "--versus " + str(tmp_path / "nope")),
        (["the cat", "--versus", model], "--versus would be ignored by routes over a dataset"),
        (["--data", data, "--method", "rollout"], "--method would be ignored without --versus"),
        (["--data", data, "--versus", model, "--method", "nope"], "nope"),
    ]
    for arguments, said in cases:
        assert main(["routes", *arguments, "--model", model, "--out", str(out), "--device", "cpu", "--quiet"]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("attnflow: error: ") and said in lines[0], lines
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_smollm2_against_qwen_at_word_level(tmp_path):
    """The two shipped language models of different architectures on 12 wiki texts: words only."""
    results = routes_versus("smollm2", "qwen2.5-0.5b", ["wiki"], tmp_path / "out", samples=12, max_tokens=24,
                            last_word=True, engine=EngineOptions(quiet=True))  # fmt: skip
    changes = results["changes"]
    assert "heads" not in changes and changes["texts"] == [12, 12] and changes["words"]
    assert all(row["ci"][0] <= row["change"] <= row["ci"][1] for row in changes["words"])
