"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash, ...): the values are, per
head, the second part of ``kv_b_proj``'s output (``[batch, 1, token, heads * (qk_nope + v)]``),
after the key's position-free half of another width. Inference finds them as a per-head `Fused`
with unequal widths, the conformance suite proves it, and the value-aware methods and routes read
them. The oracle is the model's own split (`torch.split` of each head's slice, as its attention
does) and loops over the definitions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import attnflow
from attnflow.rows import check_adapter
from attnflow.rows.adapters import Fused, find_layers
from attnflow.rows.infer import verified_row
from attnflow.rows.tiny import model_class, randomise_constants, tiny_config, tiny_tokenizer

TEXT = "the movie was great but the acting"


@pytest.fixture(scope="module")
def latent():
    """A tiny DeepSeek-V3 whose key halves and values differ in width (8 and 16 per head)."""
    config = tiny_config("deepseek_v3")
    config.qk_nope_head_dim, config.v_head_dim = 8, 16
    config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    torch.manual_seed(0)
    model = model_class("deepseek_v3", "causal-lm")._from_config(config, attn_implementation="eager")
    randomise_constants(model)
    model.eval()
    return attnflow.AttentionModel(model, tiny_tokenizer(), name="tiny latent", adapter=verified_row(model, "decoder"))


def test_the_values_are_found_as_a_per_head_part_of_their_own_width(latent):
    row, config = latent.adapter, latent.config
    assert not row.unverified and {"values", "streams", "sites"} <= row.provides
    (fused,) = row.fused
    assert fused.module.endswith(r"self_attn\.kv_b_proj$") and fused.layout == "per_head"
    assert fused.parts == ("other", "value") and fused.widths == (config.qk_nope_head_dim, config.v_head_dim)
    nope, width = config.qk_nope_head_dim, config.v_head_dim
    per_head = nope + width
    expected = [h * per_head + nope + k for h in range(latent.n_heads) for k in range(width)]
    assert row.part_columns("value", latent.n_heads * per_head, config).tolist() == expected


def test_values_of_the_wrong_order_fail_head_slices(latent):
    row = latent.adapter
    swapped = Fused(row.fused[0].module, ("value", "other"), "per_head", tuple(reversed(row.fused[0].widths)))
    report = check_adapter(dataclasses.replace(row, fused=(swapped,)), latent.hf_model, strict=False)
    assert report.outcome("head_slices") == "fail"


def _own_values(model, text):
    """Per layer ``[token, head, v]``: kv_b_proj's output split per head as the attention splits it."""
    config, recorded = model.config, {}
    layers = find_layers(model.hf_model, r"layers\.(\d+)\.self_attn\.kv_b_proj$")
    handles = [
        module.register_forward_hook(lambda _m, _i, out, name=name: recorded.__setitem__(name, out.detach()))
        for name, module in layers
    ]
    try:
        with torch.no_grad():
            out = model.hf_model(input_ids=torch.tensor(model.trace(text)[0].token_ids)[None], output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    values = []
    for name, _ in layers:
        per_head = recorded[name][0, 0].view(-1, model.n_heads, config.qk_nope_head_dim + config.v_head_dim)
        values.append(torch.split(per_head, [config.qk_nope_head_dim, config.v_head_dim], dim=-1)[1].double())
    return values, [weights[0].double() for weights in out.attentions]


def test_norm_equals_explicit_loops_and_routes_add_up(latent):
    values, attentions = _own_values(latent, TEXT)
    projections = [module for _, module in find_layers(latent.hf_model, latent.adapter.stack.output_projection)]
    d = latent.d_head
    expected = []
    for layer, (value, attention) in enumerate(zip(values, attentions, strict=True)):
        weight = projections[layer].weight.detach().double()  # [d_model, head * d_head]
        n = value.shape[0]
        matrix = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                vector = sum(
                    attention[h, i, j] * (weight[:, h * d : (h + 1) * d] @ value[j, h]) for h in range(latent.n_heads)
                )
                matrix[i, j] = float(vector.norm())
        expected.append(matrix / matrix.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(latent.explain(TEXT, method="norm").scores, expected[-1][-1], atol=1e-5)
    routes = attnflow.routes(latent, TEXT)  # routes check that the parts add up to every stream
    assert routes.edges and routes.graph.n_layers == latent.n_layers
