"""Edges and circuits on tiny models: a circuit of every edge is the clean run and an empty one the
corrupted run (exactly, by the hooks alone); an EAP score equals the gradient through the reading
branch (taken at the layer norm's input, by hand) times the upstream node's change (from the output
projection's own weights); post-norm families are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from causal_texts import CLEAN, CORRUPT

from attnflow.causal.edges import EdgeGraph, edge_scores
from attnflow.errors import InputError


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_full_and_empty_circuits_are_the_clean_and_corrupted_runs(tiny_patch_models, family):
    graph = EdgeGraph(tiny_patch_models[family], CLEAN, CORRUPT)
    every = [tuple(edge) for edge in np.argwhere(graph.valid)]
    assert graph.circuit_metric(every) == pytest.approx(float(graph.clean_metric), abs=1e-5)
    assert graph.circuit_metric([]) == pytest.approx(float(graph.corrupt_metric), abs=1e-5)
    assert graph.faithfulness(every) == pytest.approx(1.0, abs=1e-3)
    half = graph.faithfulness(every[: len(every) // 2])
    assert np.isfinite(half) and abs(half - 1.0) > 1e-4  # a partial circuit is neither run


def leaf_of(tensor, holder):
    """``tensor`` cut from its graph as a leaf that requires grad, kept in ``holder["x"]``."""
    holder["x"] = tensor.detach().requires_grad_(True)
    return holder["x"]


def test_eap_score_is_gradient_times_difference_by_hand(tiny_patch_models):
    model = tiny_patch_models["llama"]
    graph = EdgeGraph(model, CLEAN, CORRUPT)
    scores = graph.scores("eap")
    clean = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    layers = model.model.model.layers
    n_heads, d_head = model.n_heads, model.model.config.hidden_size // model.n_heads

    def head_output(ids, layer, head):  # [token, d_model] through o_proj's weight slice
        seen = {}
        handle = layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda _m, args: seen.update(z=args[0]))
        with torch.no_grad():
            model.model(input_ids=ids)
        handle.remove()
        z = seen["z"][0, :, head * d_head : (head + 1) * d_head]
        return z @ layers[layer].self_attn.o_proj.weight.detach()[:, head * d_head : (head + 1) * d_head].T

    metric = graph.runner.metric
    for layer, head, norm_name, column in ((0, 1, "input_layernorm", "a1"), (1, 2, "post_attention_layernorm", "m1")):
        norm = getattr(layers[1], norm_name)
        leaf = {}
        handle = norm.register_forward_pre_hook(lambda _module, args, leaf=leaf: (leaf_of(args[0], leaf), *args[1:]))
        with torch.enable_grad():
            value = metric(model.model(input_ids=corrupt).logits).sum()
            (gradient,) = torch.autograd.grad(value, leaf["x"])
        handle.remove()
        change = head_output(clean, layer, head) - head_output(corrupt, layer, head)
        by_hand = float((change.double() * gradient[0].double()).sum()) / graph.difference
        got = scores.scores[graph.upstream.index(f"a{layer}.h{head}"), graph.downstream.index(column)]
        assert got == pytest.approx(by_hand, rel=1e-4, abs=1e-7)
    assert n_heads > 2


def test_eap_ig_with_one_step_is_eap_and_circuits_get_faithfulness(tiny_patch_models):
    model = tiny_patch_models["gpt2"]
    graph = EdgeGraph(model, CLEAN, CORRUPT)
    np.testing.assert_allclose(graph.scores("eap-ig", steps=1).scores, graph.scores("eap").scores, atol=1e-9)
    result = edge_scores(model, CLEAN, CORRUPT, method="eap-ig", steps=3, circuit_sizes=(5, 10_000))
    assert set(result.faithfulness) == {5, 10_000}
    assert result.faithfulness[10_000] == pytest.approx(1.0, abs=1e-3)  # every edge


def test_post_norm_families_are_refused_in_one_line(tiny_patch_models):
    with pytest.raises(InputError, match="pre-norm"):
        EdgeGraph(tiny_patch_models["bert"], CLEAN, CORRUPT)


def test_patch_edges_prints_top_edges_and_saves_every_score(
    tiny_patch_models, tiny_model_path, tiny_classifier_path, tmp_path, capsys
):
    import json

    from attnflow.cli import main

    out = tmp_path / "out"
    arguments = [
        "patch",
        CLEAN,
        "--corrupt",
        CORRUPT,
        "--edges",
        "eap",
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    assert main([*arguments, "--model", str(tiny_model_path("llama"))]) == 0
    saved = json.loads((out / "edges.json").read_text())
    expected = EdgeGraph(tiny_patch_models["llama"], CLEAN, CORRUPT).scores("eap")
    np.testing.assert_allclose(np.asarray(saved["scores"], dtype=float), expected.scores, atol=1e-9)
    assert set(saved["faithfulness"]) == {"10", "50", "200", "1000"}
    printed = capsys.readouterr().out
    up, down = expected.top_edges(1)[0]
    edge = f"{expected.upstream[up]:>8} -> {expected.downstream[down]:<8}"
    assert edge in printed.splitlines()[1]  # under the header
    assert main([*arguments, "--overwrite", "--quiet", "--model", str(tiny_classifier_path("bert"))]) == 2  # post-norm
    error = capsys.readouterr().err.strip()
    assert "pre-norm" in error and "\n" not in error
