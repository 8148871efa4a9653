"""Heads that are A·V times a per-position factor before the output projection (`Values.head_factor`):
a sigmoid gate computed from the block input (MiniCPM5-MoE's ``q_gate_proj``, AFMoE's ``gate_proj``) or
a sink's rescaling of the weights after they are returned (Granite-SWA). Inference finds the values,
the conformance suite proves the factor by changing one token's values, and the value-aware methods
carry each head through it. The oracle is the model's own gate, read from its projection and put
through a sigmoid by hand, and loops over the definition (a norm between A·V and the output
projection, whose factor depends on the values, is `Values.head_norm`: tests/rows/test_head_norm.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import InputError
from attnflow.rows import check_adapter
from attnflow.rows.adapters import find_layers
from inferred_tiny import assert_parts_add_up, tiny_inferred

TEXT = "the movie was great but the acting"


_tiny = tiny_inferred


@pytest.fixture(scope="module")
def gated():
    """A tiny MiniCPM5-MoE: per head, q_gate_proj's output holds the query and then the gate's logits."""
    return _tiny("minicpm5_moe")


@pytest.mark.parametrize("model_type", ["minicpm5_moe", "afmoe", "granite_swa"])
def test_the_values_are_found_with_a_factor_and_proven(model_type):
    model = _tiny(model_type)
    row = model.adapter
    assert row.values.head_factor and row.values.value.endswith(r"self_attn\.v_proj$") and not row.unverified
    report = check_adapter(row, model.hf_model, strict=False)
    assert report.outcome("head_factor") == "pass" and report.outcome("head_slices") == "n/a"
    assert "values" in row.provides and not {"query_key", "streams"} & row.provides
    plain = dataclasses.replace(row, values=dataclasses.replace(row.values, head_factor=False))
    assert check_adapter(plain, model.hf_model, strict=False).outcome("head_slices") == "fail"  # A·V alone is not it


def _own_parts(model, text):
    """Per layer: the weights ``[head, q, k]``, the values ``[token, kv_head, d_head]`` and the gate
    sigmoid(q_gate_proj's second half per head) ``[token, head, d_head]``, as the attention computes them."""
    from attnflow.rows.hook_points import HookPoint, hooks

    recorded: dict[str, torch.Tensor] = {}
    watched = [
        (HookPoint(module), lambda tensor, name=name: recorded.__setitem__(name, tensor.clone()))
        for name, module in model.hf_model.named_modules()
        if name.endswith(("self_attn.q_gate_proj", "self_attn.v_proj"))
    ]
    ids = torch.tensor(model.trace(text)[0].token_ids)[None]
    with hooks(watched), torch.no_grad():
        out = model.hf_model(input_ids=ids, output_attentions=True)
    d = model.d_head
    layers = []
    for layer, weights in enumerate(out.attentions):
        prefix = f"model.layers.{layer}.self_attn"
        query_gate = recorded[f"{prefix}.q_gate_proj"][0].view(-1, model.n_heads, 2 * d)
        gate = torch.sigmoid(query_gate.chunk(2, dim=-1)[1]).double()  # [token, head, d_head]
        values = recorded[f"{prefix}.v_proj"][0].view(ids.shape[1], -1, d).double()  # [token, kv_head, d_head]
        layers.append((weights[0].double(), values, gate))
    return layers


def test_norm_equals_explicit_loops_through_the_models_own_gate(gated):
    projections = [module for _, module in find_layers(gated.hf_model, gated.adapter.stack.output_projection)]
    d, n_heads = gated.d_head, gated.n_heads
    expected = []
    for layer, (attention, values, gate) in enumerate(_own_parts(gated, TEXT)):
        weight = projections[layer].weight.detach().double()  # [d_model, head * d_head]
        group = n_heads // values.shape[1]
        n = values.shape[0]
        matrix = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                vector = sum(
                    attention[h, i, j] * (weight[:, h * d : (h + 1) * d] @ (values[j, h // group] * gate[i, h]))
                    for h in range(n_heads)
                )
                matrix[i, j] = float(vector.norm())
        expected.append(matrix / matrix.sum(axis=1, keepdims=True))
    from attnflow.methods.relevance import norm

    trace = gated.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    np.testing.assert_allclose(norm(trace, layerwise=True), np.stack(expected), atol=1e-5)  # [layer, query, key]
    np.testing.assert_allclose(gated.explain(TEXT, method="norm").scores, expected[-1][-1], atol=1e-5)


def test_the_parts_add_up_to_the_attention_output(gated):
    """Σ_j (what token j adds) + b_O is what the output projection returns, in every layer."""
    assert_parts_add_up(gated, gated.trace(TEXT, needs=("attentions", "values", "output_weights"))[0])


def test_the_backward_rules_and_routes_refuse_a_factor_in_one_line(gated):
    with pytest.raises(InputError, match=r"requires query_key .*per-position factor.*Values\.head_factor"):
        gated.explain(TEXT, method="attnlrp")
    with pytest.raises(InputError, match=r"routes do not support .*head vectors that do not depend on the query"):
        attnflow.routes(gated, TEXT)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_factor_of_ones_gives_the_gram_matrices_numbers(tiny_loaded, family):
    """The per-query path (`attention_parts`, the norm after the output projection, the residual
    vector) with D = 1 gives what the Gram-matrix path gives on a family without a factor
    (Gemma 3: a sandwich norm after the output projection; Llama: none)."""
    from attnflow.methods.relevance import norm_matrices

    model = tiny_loaded(family)
    trace = model.trace(TEXT, needs=("attentions", "values", "output_weights", "layer_inputs"))[0]
    assert trace.head_factors is None and (trace.output_norms is not None) == (family == "gemma3")
    expected = [norm_matrices(trace), norm_matrices(trace, residual_vector=True)]
    ones = dataclasses.replace(trace, head_factors=np.ones_like(trace.values))
    found = [norm_matrices(ones), norm_matrices(ones, residual_vector=True)]
    for got, want in zip(found, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    halves = dataclasses.replace(trace, head_factors=np.full_like(trace.values, 0.5))
    assert not np.allclose(norm_matrices(halves, residual_vector=True), expected[1])  # the factor is read


@pytest.mark.parametrize("model_type", ["hy_v4", "axk2"])
def test_latent_values_times_a_gate_are_found_and_their_parts_add_up(model_type):
    """Multi-head latent attention whose heads are then gated (HY-V4, with a sink, and AXK2): the
    values are kv_b_proj's value columns with a per-position factor, and Σ_j (what token j adds)
    + b_O is what the model's own output projection returns."""
    model = _tiny(model_type)
    row = model.adapter
    (fused,) = row.fused
    assert fused.module.endswith(r"kv_b_proj$") and "value" in fused.parts and row.values.head_factor
    assert "values" in row.provides and not any(failure.startswith("head_factor") for failure in row.unverified)
    trace = model.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    assert_parts_add_up(model, trace)


def test_layers_with_different_key_value_head_counts_give_every_head_its_values():
    """MiMo-V2-Flash: local layers have other key/value head counts than global ones, and V is
    scaled by a constant (a factor); each layer's values are shared out to the query heads on
    their own, and Σ_j (what token j adds) + b_O is the model's own output projection's output."""
    model = _tiny("mimo_v2_flash")
    widths = {module.out_features for _, module in find_layers(model.hf_model, model.adapter.values.value)}
    assert len(widths) > 1 and "values" in model.adapter.provides  # the tiny model has both kinds of layer
    trace = model.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    assert_parts_add_up(model, trace)
