"""Fused q/k/v projections (`attnflow.rows.Fused`): the columns of each layout against the families'
own reshapes of the fused output; the value vectors of GPT-2 (its built-in row, side by side), a
tiny GPT-NeoX (per head) and a tiny Phi-3 (grouped-query, side by side) against the values
recomputed from the weights by explicit slicing; the norm method on those values against an
explicit loop."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import numpy as np
import pytest
import torch

import attnflow
from attnflow.methods.relevance import norm_matrices
from attnflow.rows import Fused
from attnflow.rows.tiny import randomise_constants
from fused_rows import NEOX_ROW, PHI3_ROW, registered, save_fused_model
from value_zeroing_oracle import value_zeroing_matrices

TEXT = "the cat sat on the mat and ran"
QKV = ("query", "key", "value")


def test_the_columns_of_each_layout_are_the_families_own_slices():
    heads, kv_heads, d_head = 4, 2, 3
    features = torch.arange((heads + 2 * kv_heads) * d_head)  # one token's fused output, its own index
    # Falcon's new architecture: view(kv_heads, heads // kv_heads + 2, d_head), q the first of each group
    grouped = features.view(kv_heads, heads // kv_heads + 2, d_head)
    falcon = {"query": grouped[:, :-2], "key": grouped[:, -2], "value": grouped[:, -1]}
    # Phi-3's qkv_proj: q of all heads, then k, then v of the kv heads
    phi3 = dict(zip(QKV, features.split([heads * d_head, kv_heads * d_head, kv_heads * d_head]), strict=True))
    for layout, expected in (("per_group", falcon), ("side_by_side", phi3)):
        fused = Fused("qkv", QKV, layout)
        for part in QKV:
            torch.testing.assert_close(fused.columns(part, len(features), heads, kv_heads), expected[part].reshape(-1))
    equal = torch.arange(3 * heads * d_head)
    neox = equal.view(heads, 3 * d_head).chunk(3, dim=-1)  # GPT-NeoX: view(..., head, 3 * d_head)
    bloom = equal.view(heads, 3, d_head)  # Bloom: view(..., head, 3, d_head)
    for index, part in enumerate(QKV):
        columns = Fused("qkv", QKV, "per_head").columns(part, len(equal), heads, heads)
        torch.testing.assert_close(columns, neox[index].reshape(-1))
        torch.testing.assert_close(columns, bloom[:, index].reshape(-1))
    torch.testing.assert_close(Fused("gate_up", ("gate", "up")).columns("up", 10, heads, kv_heads), torch.arange(5, 10))


def test_a_layout_that_cannot_hold_the_heads_is_refused():
    with pytest.raises(ValueError, match="unknown fused layout"):
        Fused("qkv", QKV, "interleaved")
    with pytest.raises(ValueError, match="side_by_side"):
        Fused("gate_up", ("gate", "up"), "per_head")
    with pytest.raises(attnflow.errors.CaptureError, match="do not hold"):
        Fused("qkv", QKV, "per_head").columns("value", 32, 4, 2)  # 4 query heads but 2 kv heads


def test_the_key_value_heads_and_a_part_named_twice():
    from types import SimpleNamespace

    from attnflow.rows import ADAPTERS, Values

    gpt2 = next(row for row in ADAPTERS if row.family == "gpt2")
    assert gpt2.kv_heads(SimpleNamespace(n_head=4)) == 4  # no key/value head count: every head has its own
    assert gpt2.kv_heads(SimpleNamespace(n_head=4, num_key_value_heads=2)) == 2
    assert gpt2.kv_heads(SimpleNamespace(n_head=4, multi_query=True)) == 1  # GPT-BigCode's multi-query attention
    with pytest.raises(ValueError, match=r"names \['value'\] twice"):
        dataclasses.replace(gpt2, values=Values(r"h\.(\d+)\.attn\.v$", r"h\.(\d+)$"))


def _randomised(model: attnflow.AttentionModel) -> attnflow.AttentionModel:
    """Every 1-D parameter moved by 0.3·randn: GPT-2 starts its biases at 0, which would hide a
    value vector read without its bias or from the wrong columns' bias."""
    torch.manual_seed(1)
    randomise_constants(model.hf_model)
    return model


def _explicit_values(family: str, hf_model, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [token, head, d_head]`` (grouped-query heads repeated) and ``W_O [head, d_head, d_model]``
    of one layer, sliced out of the fused weights by hand as the family's code lays them out."""
    heads, d_model = 4, 32
    d_head = d_model // heads
    if family == "gpt2":  # Conv1D [in, out]: q | k | v side by side
        block = hf_model.transformer.h[layer]
        w, b = block.attn.c_attn.weight, block.attn.c_attn.bias
        values = block.ln_1(hidden) @ w[:, 2 * d_model :] + b[2 * d_model :]
        return values.reshape(-1, heads, d_head), block.attn.c_proj.weight.reshape(heads, d_head, d_model)
    if family == "gpt_neox":  # Linear [out, in]: per head q, k, v
        block = hf_model.gpt_neox.layers[layer]
        w = block.attention.query_key_value.weight.view(heads, 3, d_head, d_model)
        b = block.attention.query_key_value.bias.view(heads, 3, d_head)
        values = torch.einsum("td,hed->the", block.input_layernorm(hidden), w[:, 2]) + b[:, 2]
        return values, block.attention.dense.weight.T.reshape(heads, d_head, d_model)
    kv_heads = 2  # Phi-3: q (4 heads) | k (2) | v (2), side by side, no bias
    block = hf_model.model.layers[layer]
    w = block.self_attn.qkv_proj.weight[(heads + kv_heads) * d_head :]  # [kv_head * d_head, d_model]
    values = (block.input_layernorm(hidden) @ w.T).reshape(-1, kv_heads, d_head)
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    return values, block.self_attn.o_proj.weight.T.reshape(heads, d_head, d_model)


def _load(family: str, tiny_model_path, tmp_path) -> attnflow.AttentionModel:
    if family == "gpt2":
        return _randomised(attnflow.load(str(tiny_model_path("gpt2")), device="cpu"))
    return attnflow.load(str(save_fused_model(family, tmp_path / family)), device="cpu")


@pytest.mark.parametrize(("family", "row"), [("gpt2", None), ("gpt_neox", NEOX_ROW), ("phi3", PHI3_ROW)])
def test_fused_values_and_norms_equal_the_weights_sliced_by_hand(family, row, tiny_model_path, tmp_path):
    with registered(row) if row is not None else nullcontext():
        model = _load(family, tiny_model_path, tmp_path)
        assert {"values", "query_key"} <= model.adapter.provides
        trace = model.trace(TEXT, needs=("attentions", "values", "layer_inputs", "output_weights"))[0]
        ids = torch.as_tensor(trace.token_ids)[None]
        with torch.no_grad():
            hidden = model.hf_model(input_ids=ids, output_hidden_states=True).hidden_states  # [layer][1, token, d]
            matrices = norm_matrices(trace)  # [layer, query, key]
            for layer in range(trace.n_layers):
                values, w_o = _explicit_values(family, model.hf_model, layer, hidden[layer][0])
                np.testing.assert_allclose(trace.values[layer], values.numpy(), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(trace.output_weights[layer], w_o.numpy(), rtol=1e-6, atol=1e-7)
                attention = torch.as_tensor(trace.attentions[layer]).double()  # [head, query, key]
                heads = torch.einsum("jhe,hed->hjd", values.double(), w_o.double())  # f_h(x_j) [head, key, d]
                expected = [
                    [
                        float(torch.linalg.norm((attention[:, i, j, None] * heads[:, j]).sum(0)))
                        for j in range(len(ids[0]))
                    ]
                    for i in range(len(ids[0]))
                ]  # an explicit loop over query and key
                np.testing.assert_allclose(matrices[layer], np.array(expected), rtol=1e-4, atol=1e-6)
        explanation = model.explain(TEXT, method="norm")
        np.testing.assert_allclose(explanation.matrix, matrices[-1] / matrices[-1].sum(-1, keepdims=True), atol=1e-6)


def test_value_zeroing_zeroes_only_the_value_columns_of_a_fused_projection(tiny_model_path):
    """Each rerun of value zeroing (called directly: GPT-2, pre-LN, is not offered it) against full
    forward passes with token j's value columns of ``c_attn``, sliced by hand (the last third), zeroed."""
    from attnflow.methods.model.perturbation import value_zeroing

    model = _randomised(attnflow.load(str(tiny_model_path("gpt2")), device="cpu"))
    model.hf_model.config.use_cache = False  # a layer rerun on a batch of variants would update the cache
    trace = model.trace(TEXT, needs=("attentions",))[0]
    ids = torch.as_tensor(trace.token_ids)[None]
    blocks = model.hf_model.transformer.h
    values = [block.attn.c_attn for block in blocks]  # [batch, token, q | k | v]: the value columns are the last third
    expected = value_zeroing_matrices(model.hf_model, ids, blocks, values, slice(2 * model.d_model, None))
    np.testing.assert_allclose(value_zeroing(model, trace, batch_size=3), expected[1] @ expected[0], atol=1e-6)
