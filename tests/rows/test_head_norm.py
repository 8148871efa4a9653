"""A norm between A·V and the output projection (`Values.head_norm`): BitNet's ``attn_sub_norm``,
an RMS norm over all heads of a query together. Inference finds it, the conformance suite's
``head_norm`` check proves it, and the value-aware methods carry each head through it with the
query's statistic fixed from the run. The oracle is the model's own A·V, divided by its RMS and
scaled by the norm's weight by hand, and loops over the definition."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attnflow.errors import InputError
from attnflow.rows import check_adapter
from inferred_tiny import assert_parts_add_up, norm_by_loops, recorded_outputs, tiny_inferred

TEXT = "the movie was great but the acting"


_tiny = tiny_inferred


@pytest.fixture(scope="module")
def bitnet():
    """A tiny BitNet: o_proj reads attn_sub_norm(A·V)."""
    return _tiny("bitnet")


def test_the_head_norm_is_found_and_proven_where_a_plain_factor_fails(bitnet):
    row = bitnet.adapter
    assert row.values.head_norm.endswith(r"self_attn\.attn_sub_norm$") and row.values.head_factor
    assert {"values", "streams"} <= row.provides and "query_key" not in row.provides and not row.unverified
    report = check_adapter(row, bitnet.hf_model, strict=False)
    assert report.outcome("head_norm") == "pass" and report.outcome("head_factor") == "pass"
    plain = dataclasses.replace(row, values=dataclasses.replace(row.values, head_norm=None))
    assert check_adapter(plain, bitnet.hf_model, strict=False).outcome("head_factor") == "fail"  # D moves with V
    wrong = dataclasses.replace(
        row, values=dataclasses.replace(row.values, head_norm=r"layers\.(\d+)\.input_layernorm$")
    )
    assert check_adapter(wrong, bitnet.hf_model, strict=False).outcome("head_norm") == "fail"


def test_a_gate_before_an_l2_head_norm_is_proven_at_the_norms_input():
    """Dory: o_proj reads L2norm(A·V ⊙ sigmoid(gate)), a weightless norm to norm 1 (not RMS 1)."""
    model = _tiny("dory")
    row = model.adapter
    assert row.values.head_norm.endswith(r"self_attn\.attn_sub_norm$") and "values" in row.provides
    report = check_adapter(row, model.hf_model, strict=False)
    assert report.outcome("head_norm") == "pass" and report.outcome("head_factor") == "pass"
    assert np.isfinite(model.explain(TEXT, method="norm").scores).all()


def test_norm_equals_explicit_loops_through_the_hand_computed_sub_norm(bitnet):
    from attnflow.methods.relevance import norm

    trace = bitnet.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    ids = torch.tensor(trace.token_ids)[None]
    recorded, out = recorded_outputs(bitnet, ids, "self_attn.v_proj")
    d, n_heads, n = bitnet.d_head, bitnet.n_heads, ids.shape[1]
    eps = bitnet.hf_model.config.rms_norm_eps
    expected = []
    for layer, weights in enumerate(out.attentions):
        attention = weights[0].double()  # [head, q, k]
        prefix = f"model.layers.{layer}.self_attn"
        values = recorded[f"{prefix}.v_proj"][0].double().view(n, -1, d)  # [token, kv_head, d_head]
        group = n_heads // values.shape[1]
        products = torch.stack([attention[h] @ values[:, h // group] for h in range(n_heads)], dim=1)  # [q, head, d]
        gain = bitnet.hf_model.get_submodule(f"{prefix}.attn_sub_norm").weight.detach().double().view(n_heads, d)
        rms = torch.sqrt(products.pow(2).mean(dim=(-2, -1)) + eps)  # [query]: over every head together
        weight = bitnet.hf_model.get_submodule(f"{prefix}.o_proj").weight.detach().double()
        expected.append(norm_by_loops(attention, values, weight, gain / rms[:, None, None]))
    np.testing.assert_allclose(norm(trace, layerwise=True), np.stack(expected), atol=1e-5)  # [layer, query, key]


def test_the_parts_add_up_to_the_attention_output(bitnet):
    """Σ_j (what token j adds) + b_O is what the output projection returns, in every layer."""
    assert_parts_add_up(bitnet, bitnet.trace(TEXT, needs=("attentions", "values", "output_weights"))[0])


def test_the_backward_rules_refuse_the_head_norm_in_one_line(bitnet):
    with pytest.raises(InputError, match=r"requires query_key .*norm before the output projection \(Values\.head_norm\)"):
        bitnet.explain(TEXT, method="attnlrp")
