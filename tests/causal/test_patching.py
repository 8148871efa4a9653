"""Exact activation patching against its own definition: own values change nothing, restoring
the predicting residual restores the metric, restoring the embeddings reproduces the clean run,
a batch of sites equals the sites one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from causal_texts import CLEAN, CORRUPT

from attnflow.causal import patch
from attnflow.causal.api import resolve_metric
from attnflow.causal.patching import Patches, PatchRunner, exact_sweep, site_value, stacked
from attnflow.causal.sites import SITE_KINDS, Site, all_sites

FAMILIES = ("llama", "gpt2", "bert")


def runner_and_ids(model):
    clean = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    return PatchRunner(model, resolve_metric(model, clean)), clean, corrupt


def logits_of(model, ids):
    with torch.no_grad():
        return model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_patching_sites_with_their_own_values_changes_nothing(tiny_patch_models, family):
    model = tiny_patch_models[family]
    runner, clean, _ = runner_and_ids(model)
    with torch.no_grad():
        plain, recorded = runner.forward(clean, 1, record=True)
    own = stacked(recorded)
    patches = Patches()
    n_tokens = clean.shape[1]
    for kind in SITE_KINDS:  # every site of every kind, all in one row
        for site in all_sites(kind, model.n_layers, n_tokens, model.n_heads):
            patches.add(0, site, site_value(own, 0, site, model.n_heads))
    with torch.no_grad():
        patched, _ = runner.forward(clean, 1, patches=patches)
    assert patched.item() == plain.item()  # bit-exact
    assert plain.item() == runner.metric(logits_of(model, clean)).item()  # the hooks change nothing either


@pytest.mark.parametrize("family", FAMILIES)
def test_restoring_the_predicting_residual_gives_effect_one(tiny_patch_models, family):
    model = tiny_patch_models[family]
    runner, clean, corrupt = runner_and_ids(model)
    predicting = 0 if model.target_kind == "class" else clean.shape[1] - 1  # BERT's head reads [CLS]
    final = Site("residual", model.n_layers, predicting)
    with torch.no_grad():
        clean_metric, recorded = runner.forward(clean, 1, record=True)
        patches = Patches()
        patches.add(0, final, site_value(stacked(recorded), 0, final, model.n_heads))
        restored, _ = runner.forward(corrupt, 1, patches=patches)
    assert restored.item() == clean_metric.item()  # bit-exact in a pass of one row: effect exactly 1
    result = patch(model, CLEAN, CORRUPT, sites="residual", methods="exact", progress=False)
    residual = result.effects["exact"]["residual"]
    assert residual.shape == (model.n_layers + 1, len(result.tokens))
    # batched passes: float32 rounding of other rows (relative to the small tiny-model difference m_clean − m_corrupt)
    assert residual[model.n_layers, predicting] == pytest.approx(1.0, abs=1e-4)
    if model.target_kind == "next_token":  # a decoder's other positions cannot reach the prediction
        assert np.all(residual[model.n_layers, :predicting] == 0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_restoring_every_position_at_the_embedding_reproduces_the_clean_run(tiny_patch_models, family):
    model = tiny_patch_models[family]
    runner, clean, corrupt = runner_and_ids(model)
    with torch.no_grad():
        _, recorded = runner.forward(clean, 1, record=True)
    own = stacked(recorded)
    patches = Patches()
    for position in range(clean.shape[1]):
        site = Site("residual", 0, position)
        patches.add(0, site, site_value(own, 0, site, model.n_heads))
    captured = {}
    with torch.no_grad(), runner._hooks(patches, {}, None, False, {}):
        captured["logits"] = logits_of(model, corrupt)
    assert torch.equal(captured["logits"], logits_of(model, clean))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_sites_equals_the_sites_one_by_one(tiny_patch_models, family):
    model = tiny_patch_models[family]
    runner, clean, corrupt = runner_and_ids(model)
    with torch.no_grad():
        _, recorded = runner.forward(clean, 1, record=True)
    source = stacked(recorded)
    every = [site for kind in SITE_KINDS for site in all_sites(kind, model.n_layers, clean.shape[1], model.n_heads)]
    sites = every[::3]  # every kind, a third of the sites: the loop stays cheap
    batched = exact_sweep(runner, corrupt, None, source, sites, 1, 16)
    one_by_one = []
    for site in sites:  # an explicit loop: one forward per site, the site patched by hand
        patches = Patches()
        patches.add(0, site, site_value(source, 0, site, model.n_heads))
        with torch.no_grad():
            one_by_one.append(runner.forward(corrupt, 1, patches=patches)[0].item())
    spread = np.ptp(one_by_one)
    assert spread > 1e-6  # the sites differ: the comparison can fail
    np.testing.assert_allclose(batched, one_by_one, rtol=0, atol=min(1e-5, spread / 100))


def test_noise_samples_are_seeded_and_averaged(tiny_patch_models):
    model = tiny_patch_models["llama"]
    first = patch(model, CLEAN, noise="cat", sites="heads", methods="exact", samples=3, seed=1, progress=False)
    again = patch(model, CLEAN, noise=["cat"], sites="heads", methods="exact", samples=3, seed=1, progress=False)
    other = patch(model, CLEAN, noise="cat", sites="heads", methods="exact", samples=3, seed=2, progress=False)
    np.testing.assert_array_equal(first.effects["exact"]["heads"], again.effects["exact"]["heads"])
    assert first.corrupt_metric != other.corrupt_metric
    assert first.samples == 3 and first.corrupt_tokens == first.tokens


def test_noising_the_predicting_residual_gives_effect_one(tiny_patch_models):
    model = tiny_patch_models["gpt2"]
    result = patch(model, CLEAN, CORRUPT, sites="residual", methods="exact", direction="noising", progress=False)
    residual = result.effects["exact"]["residual"]
    assert residual[model.n_layers, -1] == pytest.approx(1.0, abs=1e-5)  # the clean run given x̃'s last state
    assert np.all(residual[model.n_layers, :-1] == 0.0)


def test_a_head_at_one_position_is_its_slice_of_the_output_projection_input(tiny_patch_models):
    model = tiny_patch_models["llama"]
    runner, clean, corrupt = runner_and_ids(model)
    position, d_head = 3, model.d_head
    result = patch(model, CLEAN, CORRUPT, sites="heads", methods="exact,atp", head_position=position, progress=False)
    with torch.no_grad():
        clean_metric, recorded = runner.forward(clean, 1, record=True)
        corrupt_metric, _ = runner.forward(corrupt, 1)
    clean_heads = stacked(recorded)["heads"][0]  # [layer, token, head * d_head]
    projections = runner.modules.projections
    expected = np.zeros((model.n_layers, model.n_heads))
    for layer in range(model.n_layers):
        for head in range(model.n_heads):
            columns = slice(head * d_head, (head + 1) * d_head)

            def write(_module, args, layer=layer, columns=columns):  # the oracle's own hook
                patched = args[0].clone()
                patched[:, position, columns] = clean_heads[layer, position, columns]
                return (patched, *args[1:])

            handle = projections[layer].register_forward_pre_hook(write)
            try:
                patched_metric = runner.metric(logits_of(model, corrupt)).item()
            finally:
                handle.remove()
            expected[layer, head] = (patched_metric - corrupt_metric.item()) / (clean_metric - corrupt_metric).item()
    np.testing.assert_allclose(result.effects["exact"]["heads"], expected, atol=1e-5)
    assert np.abs(expected).max() > 1e-3
    assert result.to_dict()["head_position"] == position
