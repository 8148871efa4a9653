"""Edges and circuits on tiny models: a circuit of every edge is the clean run and an empty one the
corrupted run (exactly, by the hooks alone); an EAP score equals the gradient through the reading
branch (taken at the layer norm's input, by hand) times the upstream node's change (from the output
projection's own weights), and an EAP-IG score the same with the gradient averaged along the path
from the corrupted embeddings to the clean ones; post-norm families are refused."""

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


def by_hand(model, graph, layer: int, head: int, norm_name: str, alphas) -> float:
    """The edge from head ``head`` of layer ``layer`` into the branch of Llama's layer 1 that reads
    ``norm_name``'s input, by hand: the metric's gradient at that norm's input, averaged over runs of
    the corrupted input whose word embeddings move ``alpha`` of the way to the clean ones (EAP: α = 0),
    times the head's change (through the output projection's own weights), over m_clean − m_corrupted."""
    clean = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    layers, embed = model.hf_model.model.layers, model.hf_model.get_input_embeddings()
    d_head = model.hf_model.config.hidden_size // model.n_heads

    def head_output(ids):  # [token, d_model] through o_proj's weight slice
        seen = {}
        handle = layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda _m, args: seen.update(z=args[0]))
        with torch.no_grad():
            model.hf_model(input_ids=ids)
        handle.remove()
        z = seen["z"][0, :, head * d_head : (head + 1) * d_head]
        return z @ layers[layer].self_attn.o_proj.weight.detach()[:, head * d_head : (head + 1) * d_head].T

    with torch.no_grad():
        towards_clean = embed(clean) - embed(corrupt)
    gradients = []
    for alpha in alphas:
        leaf = {}
        handles = [
            getattr(layers[1], norm_name).register_forward_pre_hook(
                lambda _module, args, leaf=leaf: (leaf_of(args[0], leaf), *args[1:])
            ),
            embed.register_forward_hook(lambda _module, _args, output, alpha=alpha: output + alpha * towards_clean),
        ]
        try:
            with torch.enable_grad():
                value = graph.runner.metric(model.hf_model(input_ids=corrupt).logits).sum()
                (gradient,) = torch.autograd.grad(value, leaf["x"])
        finally:
            for handle in handles:
                handle.remove()
        gradients.append(gradient[0].double())
    change = (head_output(clean) - head_output(corrupt)).double()
    return float((change * torch.stack(gradients).mean(dim=0)).sum()) / graph.difference


EDGES = ((0, 1, "input_layernorm", "a1"), (1, 2, "post_attention_layernorm", "m1"))  # (layer, head, norm, column)


def test_eap_score_is_gradient_times_difference_by_hand(tiny_patch_models):
    model = tiny_patch_models["llama"]
    graph = EdgeGraph(model, CLEAN, CORRUPT)
    scores = graph.scores("eap")
    for layer, head, norm_name, column in EDGES:
        got = scores.scores[graph.upstream.index(f"a{layer}.h{head}"), graph.downstream.index(column)]
        assert got == pytest.approx(by_hand(model, graph, layer, head, norm_name, [0.0]), rel=1e-4, abs=1e-7)
    assert model.n_heads > 2


def test_eap_ig_averages_the_gradient_along_the_path_by_hand(tiny_patch_models):
    """EAP-IG with 3 steps: the gradient at α = 0, ⅓, ⅔ of the way from the corrupted embeddings to the
    clean ones, averaged (by hand, with hooks of this test's own); it is not EAP's number."""
    model = tiny_patch_models["llama"]
    graph = EdgeGraph(model, CLEAN, CORRUPT)
    eap, eap_ig = graph.scores("eap").scores, graph.scores("eap-ig", steps=3).scores
    for layer, head, norm_name, column in EDGES:
        where = graph.upstream.index(f"a{layer}.h{head}"), graph.downstream.index(column)
        expected = by_hand(model, graph, layer, head, norm_name, [0.0, 1 / 3, 2 / 3])
        assert eap_ig[where] == pytest.approx(expected, rel=1e-4, abs=1e-7)
        assert abs(eap_ig[where] - eap[where]) > 1e-3 * abs(eap[where])  # the path matters on this edge


def test_circuits_of_eap_ig_edges_get_faithfulness(tiny_patch_models):
    result = edge_scores(tiny_patch_models["gpt2"], CLEAN, CORRUPT, method="eap-ig", steps=3, circuit_sizes=(5, 10_000))
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
