"""AtP against the finite-difference derivative of the metric along the patch, AtP* against an
explicit loop over dropped layers, RelP against the AttnLRP rules' own backward and, at every layer
and site kind, against the rules written out (tests/lrp_oracle.py) with plain hooks of this test's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from causal_texts import CLEAN, CORRUPT

import attnflow
from attnflow.causal.api import resolve_metric
from attnflow.causal.approximations import estimate
from attnflow.causal.patching import BaseRun, PatchRunner, exact_sweep, stacked
from attnflow.causal.sites import SITE_KINDS, all_sites
from attnflow.methods.model.lrp import RULES, backward_rules
from lrp_oracle import write_out_llama_rules


def setup(model):
    clean = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    runner = PatchRunner(model, resolve_metric(model, clean))
    with torch.no_grad():
        source = stacked(runner.forward(clean, 1, record=True)[1])
        base = stacked(runner.forward(corrupt, 1, record=True)[1])
    patched = BaseRun(corrupt, None, source, 1)  # the corrupted run, its sites set to the clean values
    return runner, corrupt, source, base, patched


def test_atp_is_the_derivative_of_the_metric_along_the_patch(tiny_model_path):
    # GPT-2 runs wholly in float64 once converted (Llama's RMSNorm computes in float32, which
    # would drown a central difference in rounding).
    model = attnflow.load(str(tiny_model_path("gpt2")), device="cpu")
    model.model.double()
    runner, corrupt, source, base, patched = setup(model)
    atp = estimate("atp", runner, patched, SITE_KINDS)
    step = 1e-4
    sites = [site for kind in SITE_KINDS for site in all_sites(kind, model.n_layers, corrupt.shape[1], model.n_heads)]
    # m(a_base + t (a_source - a_base)) at t = ±step, every site patched by the exact sweep
    forward = exact_sweep(
        runner, corrupt, None, {k: base[k] + step * (source[k] - base[k]) for k in base}, sites, 1, 64
    )
    backward = exact_sweep(
        runner, corrupt, None, {k: base[k] - step * (source[k] - base[k]) for k in base}, sites, 1, 64
    )
    derivative = (forward - backward) / (2 * step)
    expected = np.concatenate([atp[kind].ravel() for kind in SITE_KINDS])
    assert np.abs(derivative).max() > 1e-3
    np.testing.assert_allclose(expected, derivative, rtol=1e-5, atol=1e-8)

    position = 2  # heads patched at one position only
    at_position = estimate("atp", runner, patched, ("heads",), head_position=position)["heads"]
    heads = all_sites("heads", model.n_layers, corrupt.shape[1], model.n_heads, head_position=position)
    up = exact_sweep(runner, corrupt, None, {k: base[k] + step * (source[k] - base[k]) for k in base}, heads, 1, 64)
    down = exact_sweep(runner, corrupt, None, {k: base[k] - step * (source[k] - base[k]) for k in base}, heads, 1, 64)
    np.testing.assert_allclose(at_position.ravel(), (up - down) / (2 * step), rtol=1e-5, atol=1e-8)


def test_atp_star_drops_each_layer_in_turn(tiny_patch_models):
    model = tiny_patch_models["llama"]
    runner, corrupt, source, base, patched = setup(model)
    found = estimate("atp*", runner, patched, SITE_KINDS)
    plain = estimate("atp", runner, patched, SITE_KINDS)
    modules = runner.modules
    per_layer = []
    for dropped in range(model.n_layers):  # an explicit loop: hooks that detach one layer's outputs
        recorded = {kind: [] for kind in SITE_KINDS}
        handles = []

        def record_output(recorded, kind, detach):
            def hook(_module, _args, output):
                hidden = output[0] if isinstance(output, tuple) else output
                recorded[kind].append(hidden)
                new = hidden.detach() if detach else hidden
                return (new, *output[1:]) if isinstance(output, tuple) else new

            return hook

        def record_input(recorded, kind):
            def hook(_module, args, kwargs):
                recorded[kind].append(args[0] if args else kwargs["hidden_states"])

            return hook

        def leaf(_module, _inputs, output):
            return output.detach().requires_grad_(True)

        handles.append(modules.embeddings.register_forward_hook(leaf))
        handles.append(
            modules.blocks[0].register_forward_pre_hook(record_input(recorded, "residual"), with_kwargs=True)
        )
        for layer in range(model.n_layers):
            handles.append(modules.blocks[layer].register_forward_hook(record_output(recorded, "residual", False)))
            handles.append(
                modules.attention[layer].register_forward_hook(record_output(recorded, "attn", layer == dropped))
            )
            handles.append(modules.mlp[layer].register_forward_hook(record_output(recorded, "mlp", layer == dropped)))
            handles.append(
                modules.projections[layer].register_forward_pre_hook(record_input(recorded, "heads"), with_kwargs=True)
            )
        try:
            with torch.enable_grad():
                logits = model.model(input_ids=corrupt).logits
                tensors = [t for kind in SITE_KINDS for t in recorded[kind]]
                grads = torch.autograd.grad(runner.metric(logits).sum(), tensors, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        grads = iter(grads)
        estimates = {}
        for kind in SITE_KINDS:
            layer_values = []
            for layer, tensor in enumerate(recorded[kind]):
                grad = next(grads)
                grad = torch.zeros_like(tensor) if grad is None else grad
                product = (source[kind][0, layer] - base[kind][0, layer]) * grad[0]  # [token, width]
                if kind == "heads":
                    product = product.reshape(product.shape[0], model.n_heads, -1).sum(dim=(0, 2))
                else:
                    product = product.sum(dim=-1)
                layer_values.append(product.detach().double().numpy())
            estimates[kind] = np.stack(layer_values)
        per_layer.append(estimates)
    for kind in SITE_KINDS:
        magnitude = sum(np.abs(estimates[kind]) for estimates in per_layer) / (model.n_layers - 1)
        np.testing.assert_allclose(found[kind], np.sign(plain[kind]) * magnitude, rtol=1e-4, atol=1e-7)
    assert not np.allclose(found["residual"], plain["residual"])  # dropping layers changed something


def test_relp_is_the_attnlrp_backward_at_the_site(tiny_patch_models):
    model = tiny_patch_models["llama"]  # the first block's input is the word embeddings
    runner, corrupt, source, base, patched = setup(model)
    relp = estimate("relp", runner, patched, ("residual",))["residual"]
    with backward_rules(model, RULES["attnlrp"]) as recording, torch.enable_grad():
        logits = model.model(input_ids=corrupt).logits
        (gradient,) = torch.autograd.grad(runner.metric(logits).sum(), [recording.embedding_sum])
    expected = ((source["residual"][0, 0] - base["residual"][0, 0]) * gradient[0]).sum(dim=-1).double().numpy()
    np.testing.assert_allclose(relp[0], expected, rtol=1e-5, atol=1e-8)
    plain = estimate("atp", runner, patched, ("residual",))["residual"]
    assert not np.allclose(relp[0], plain[0], rtol=1e-3)  # the rules change the backward


def test_relp_at_every_layer_is_the_attnlrp_rules_written_out(tiny_patch_models, monkeypatch):
    """Every row of the residual, attention and MLP sweeps: (a_source − a_base) · ∂̃m/∂a with ∂̃ the
    AttnLRP rules written out as explicit forward passes, the sites recorded by plain torch hooks."""
    model = tiny_patch_models["llama"]
    runner, corrupt, source, base, patched = setup(model)
    kinds = ("residual", "attn", "mlp")
    relp = estimate("relp", runner, patched, kinds)
    layers = model.hf_model.model.layers
    recorded: dict[str, list[torch.Tensor]] = {kind: [] for kind in kinds}

    def keep(kind):
        return lambda _module, _args, output: recorded[kind].append(output[0] if isinstance(output, tuple) else output)

    handles = [
        layers[0].register_forward_pre_hook(
            lambda _module, args, kwargs: recorded["residual"].append(args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True,
        )
    ]
    for layer in layers:
        handles += [
            layer.register_forward_hook(keep("residual")),
            layer.self_attn.register_forward_hook(keep("attn")),
            layer.mlp.register_forward_hook(keep("mlp")),
        ]
    write_out_llama_rules(monkeypatch, "attnlrp")
    try:
        with torch.enable_grad():
            logits = model.hf_model(input_ids=corrupt).logits
            tensors = [tensor for kind in kinds for tensor in recorded[kind]]
            gradients = iter(torch.autograd.grad(runner.metric(logits).sum(), tensors))
    finally:
        for handle in handles:
            handle.remove()
        monkeypatch.undo()
    for kind in kinds:
        expected = np.stack(
            [
                ((source[kind][0, row] - base[kind][0, row]) * next(gradients)[0]).sum(dim=-1).double().numpy()
                for row in range(len(recorded[kind]))
            ]
        )  # [row, position]
        assert relp[kind].shape == expected.shape == (model.n_layers + (kind == "residual"), corrupt.shape[1])
        np.testing.assert_allclose(relp[kind], expected, rtol=1e-4, atol=1e-7 * np.abs(expected).max())
    plain = estimate("atp", runner, patched, kinds)
    assert not np.allclose(relp["attn"], plain["attn"], rtol=1e-3)  # the rules change the backward at every layer


def test_atp_ig_at_the_embeddings_is_complete_along_its_path(tiny_model_path):
    """Integrated gradients are complete: at the stream entering the first layer (the word
    embeddings plus GPT-2's positions) the estimates sum over positions to m(source) − m(base), up
    to the midpoint rule's error; AtP (the gradient at the base alone) does not."""
    from attnflow.causal.approximations import _integrated

    model = attnflow.load(str(tiny_model_path("gpt2")), device="cpu")
    model.model.double()
    runner, corrupt, source, base, patched = setup(model)
    clean_ids = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    path = BaseRun(corrupt, None, source, 1, BaseRun(clean_ids, None, {}, 1).embeddings(runner))
    with torch.no_grad():
        difference = float(runner.forward(clean_ids, 1)[0][0] - runner.forward(corrupt, 1)[0][0])
    integrated = _integrated(runner, path, ("residual",), steps=64)["residual"][0].sum()
    atp = estimate("atp", runner, patched, ("residual",))["residual"][0].sum()
    assert abs(difference) > 1e-3
    assert integrated == pytest.approx(difference, rel=1e-3)
    assert abs(atp - difference) > 10 * abs(integrated - difference)
    three = estimate("atp-ig", runner, path, SITE_KINDS)  # the default: IG_STEPS midpoints, every kind
    assert set(three) == set(SITE_KINDS) and all(np.isfinite(values).all() for values in three.values())
