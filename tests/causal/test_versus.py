"""Rollout and flow against the interventions: the per-layer Spearman table equals one computed by
hand from a plain loop of one-site patches and explicit rank correlations, and each prediction row
is the registered method run on the layers it names (sliced attentions, an independent path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from causal_texts import CLEAN, CORRUPT

import attnflow
from attnflow.causal.api import resolve_metric
from attnflow.causal.patching import Patches, PatchRunner, site_value, stacked
from attnflow.causal.sites import Site
from attnflow.causal.versus import compare_with_patching, spearman_table
from attnflow.errors import InputError
from attnflow.flow_routes.api import prediction_importance
from attnflow.methods.flow import attention_flow
from attnflow.methods.rollout import rollout

PAIRS = ((CLEAN, CORRUPT), ("the dog sat on the mat", "the cat sat on the mat"), (CLEAN, "the cat sat on a mat"))
METHODS = ("rollout", "rollout_above", "flow", "grad_rollout", "routes")


def effects_by_loop(model, clean_text, corrupt_text):
    """``[L + 1, token]`` denoising effects, one forward pass per residual site."""
    clean = model.tokenizer(clean_text, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(corrupt_text, return_tensors="pt")["input_ids"]
    runner = PatchRunner(model, resolve_metric(model, clean))
    with torch.no_grad():
        m_clean, recorded = runner.forward(clean, 1, record=True)
        m_corrupt, _ = runner.forward(corrupt, 1)
        source = stacked(recorded)
        effects = np.zeros((model.n_layers + 1, clean.shape[1]))
        for layer in range(model.n_layers + 1):
            for position in range(clean.shape[1]):
                site = Site("residual", layer, position)
                patches = Patches()
                patches.add(0, site, site_value(source, 0, site, model.n_heads))
                m_patched, _ = runner.forward(corrupt, 1, patches=patches)
                effects[layer, position] = (m_patched.item() - m_corrupt.item()) / (m_clean.item() - m_corrupt.item())
    return effects


def rank(values):
    """Average ranks (ties share the mean of their ranks), by an explicit loop."""
    ranks = np.empty(len(values))
    for i, value in enumerate(values):
        ranks[i] = np.sum(values < value) + (np.sum(values == value) + 1) / 2
    return ranks


def spearman_by_hand(a, b):
    if np.ptp(a) == 0 or np.ptp(b) == 0 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return np.nan
    ra, rb = rank(a) - rank(a).mean(), rank(b) - rank(b).mean()
    return float(ra @ rb / np.sqrt((ra @ ra) * (rb @ rb)))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_spearman_table_equals_a_plain_loop_over_sites_and_prompts(tiny_patch_models, family):
    model = tiny_patch_models[family]
    comparisons = [compare_with_patching(model, clean, corrupt, methods=METHODS) for clean, corrupt in PAIRS]
    by_hand = {method: [] for method in METHODS}  # per method: [prompt][layer] ρ
    for comparison, (clean, corrupt) in zip(comparisons, PAIRS, strict=True):
        effects = effects_by_loop(model, clean, corrupt)
        # batched and single forward passes differ by float rounding (~1e-6 of the metric, whose
        # clean-corrupt gap is ~1e-2 on the tiny BERT); the ranks are taken from the sweep's values
        np.testing.assert_allclose(comparison.effects, effects, atol=1e-3)
        for method in METHODS:
            predicted, swept = comparison.predictions[method], comparison.effects
            by_hand[method].append([spearman_by_hand(predicted[row], swept[row]) for row in range(len(swept))])
    table = spearman_table(comparisons)
    for method in METHODS:
        rhos = np.array(by_hand[method])  # [prompt, L + 1]
        for row in range(rhos.shape[1]):
            defined = rhos[np.isfinite(rhos[:, row]), row]
            assert table[method]["n"][row] == len(defined)
            if len(defined) == 0:
                assert np.isnan(table[method]["mean"][row])
                continue
            assert table[method]["mean"][row] == pytest.approx(defined.mean(), abs=1e-5)
            if len(defined) > 1:
                se = defined.std(ddof=1) / np.sqrt(len(defined))
                assert table[method]["se"][row] == pytest.approx(se, abs=1e-5)
    assert np.isfinite(table["rollout"]["mean"][1:]).any()  # the table is not all NaN


def test_prediction_rows_are_the_methods_on_the_layers_they_name(tiny_patch_models):
    model = tiny_patch_models["llama"]
    comparison = compare_with_patching(model, CLEAN, CORRUPT, methods=("rollout", "rollout_above", "flow"))
    (trace,) = model.trace(CLEAN, needs=("attentions",))
    attentions, n_layers = trace.attentions, model.n_layers  # [layer, head, query, key]
    last = trace.n_tokens - 1  # a causal LM predicts at its last position
    assert np.isnan(comparison.predictions["rollout"][0]).all() and np.isnan(comparison.predictions["flow"][0]).all()
    for layer in range(n_layers):
        below, above = attentions[: layer + 1], attentions[layer + 1 :]
        np.testing.assert_allclose(comparison.predictions["rollout"][layer + 1], rollout(below)[last], atol=1e-12)
        np.testing.assert_allclose(
            comparison.predictions["flow"][layer + 1], attention_flow(below, rows=[last])[0], atol=1e-9
        )
        expected = rollout(above)[last] if len(above) else np.eye(trace.n_tokens)[last]
        np.testing.assert_allclose(comparison.predictions["rollout_above"][layer + 1], expected, atol=1e-12)
    np.testing.assert_allclose(comparison.predictions["rollout_above"][0], rollout(attentions)[last], atol=1e-12)


def test_unknown_methods_are_one_clear_line(tiny_patch_models):
    with pytest.raises(InputError, match="choose from rollout"):
        compare_with_patching(tiny_patch_models["llama"], CLEAN, CORRUPT, methods="rollout,saliency")


def test_patch_versus_prints_and_saves_the_pairs_table(tiny_patch_models, tiny_model_path, tmp_path, capsys):
    import json

    from attnflow.cli import main

    out = tmp_path / "out"
    code = main(
        ["patch", CLEAN, "--corrupt", CORRUPT, "--model", str(tiny_model_path("llama")), "--versus", "rollout,routes",
         "--out", str(out), "--device", "cpu"]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    saved = json.loads((out / "versus.json").read_text())
    expected = compare_with_patching(tiny_patch_models["llama"], CLEAN, CORRUPT, methods=("rollout", "routes"))
    for method, rhos in expected.spearman().items():
        np.testing.assert_allclose(np.asarray(saved["spearman"][method], dtype=float), rhos, atol=1e-9)
    assert "| residual | rollout | routes |" in printed and f"{expected.spearman()['rollout'][1]:+.2f}" in printed


def test_routes_rows_are_the_importance_of_the_stream_each_row_restores(tiny_patch_models):
    model = tiny_patch_models["llama"]
    comparison = compare_with_patching(model, CLEAN, CORRUPT, methods=("routes", "rollout"))
    assert list(comparison.predictions) == ["routes", "rollout"]  # the order asked for
    predicted = comparison.predictions["routes"]
    assert predicted.shape == comparison.effects.shape == (model.n_layers + 1, len(comparison.tokens))
    # row r restores the stream entering layer r (row 0 the embeddings, row l + 1 leaving layer l):
    # the route's node ("in", r, j), read from the routes front door at the predicting position
    routes = attnflow.routes(model, CLEAN)
    np.testing.assert_allclose(predicted, routes.importance.inputs, atol=1e-12)
    np.testing.assert_array_equal(predicted[-1], np.eye(len(comparison.tokens))[-1])  # the top itself


def test_routes_with_the_counterfactual_weigh_each_node_by_the_share_the_corruption_changes(tiny_patch_models):
    model = tiny_patch_models["llama"]
    comparison = compare_with_patching(model, CLEAN, CORRUPT, methods=("routes", "routes_counterfactual"))
    predicted = comparison.predictions["routes_counterfactual"]
    layers = model.hf_model.model.layers
    streams = {}
    handle = layers[-1].register_forward_hook(  # the stream leaving the last layer, before the final norm
        lambda _module, _args, output: streams.__setitem__("last", output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            for name, text in (("clean", CLEAN), ("corrupt", CORRUPT)):
                ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
                hidden = model.hf_model(input_ids=ids, output_hidden_states=True).hidden_states
                streams[name] = torch.stack([*hidden[: len(layers)], streams["last"]])[:, 0].double()  # [L + 1, T, d]
    finally:
        handle.remove()
    changed = (streams["clean"] - streams["corrupt"]).norm(dim=-1) / streams["clean"].norm(dim=-1)
    np.testing.assert_allclose(predicted, comparison.predictions["routes"] * changed.numpy(), rtol=1e-4, atol=1e-9)
    first = next(
        i
        for i, (a, b) in enumerate(zip(*(model.tokenizer(t)["input_ids"] for t in (CLEAN, CORRUPT)), strict=True))
        if a != b
    )
    assert np.all(predicted[:, :first] == 0) and bool((changed[:, first] > 0).all())  # before the swap nothing differs
    with pytest.raises(InputError, match="same token length"):
        prediction_importance(model, CLEAN, "last", corrupt="the cat sat on the big mat")


def test_a_mean_pooled_prediction_weighs_each_final_node_by_its_proximity_to_the_mean(tiny_loaded):
    model = tiny_loaded("bert")
    text = "the movie was great"
    with torch.no_grad():
        ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
        final = model.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].double().numpy()
    n_tokens = final.shape[0]
    pooled = final.mean(axis=0)
    nearness = [max(np.abs(pooled).sum() - np.abs(pooled - x / n_tokens).sum(), 0.0) for x in final]
    weights = np.array(nearness) / np.sum(nearness)
    # the route's keep-or-drop decisions do not depend on the top: importance is linear in it
    by_position = sum(weights[i] * attnflow.routes(model, text, position=i).importance.inputs for i in range(n_tokens))
    np.testing.assert_allclose(prediction_importance(model, text, "mean"), by_position, atol=1e-6)
    np.testing.assert_allclose(prediction_importance(model, text, "mean")[-1], weights, atol=1e-6)
