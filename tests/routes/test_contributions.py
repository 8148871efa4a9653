"""Routes' contributions against an independent oracle (explicit loops over every part, from the
modules' weights and the model's own hidden states), on the tiny model of every supported family;
and the decomposition identity: the parts and the bias terms add up to the model's own streams."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from routes_oracle import FAMILIES, VARIANTS, oracle

import attnflow
from attnflow.errors import CaptureError
from attnflow.flow_routes import contributions
from attnflow.flow_routes.api import linearised_blocks
from attnflow.flow_routes.forward import layer_view, read_weights, record
from attnflow.rows import register_adapter, unregister_adapter

TEXT = "the cat sat on the mat, and the dog ran"


@pytest.mark.parametrize("family", FAMILIES + VARIANTS)
def test_contributions_match_an_explicit_loop(family, any_loaded):
    model = any_loaded(family)
    routes = attnflow.routes(model, TEXT, lens="none")
    assert routes.graph.parallel == (family in ("phi", "gptj"))
    layers, hidden = oracle(family, model, TEXT)
    graph = routes.graph
    for layer, expected in enumerate(layers):
        np.testing.assert_allclose(graph.heads[layer], expected.heads, atol=1e-5)
        np.testing.assert_allclose(graph.attention[layer], expected.heads.sum(axis=0), atol=1e-5)
        for name in ("attention_residual", "attention_bias", "ffn", "ffn_residual", "ffn_bias"):
            np.testing.assert_allclose(getattr(graph, name)[layer], getattr(expected, name), atol=1e-5, err_msg=name)
        if layer + 1 < len(hidden) - 1 or model.adapter.streams.final_norm is None:  # decoders: the last is normed
            np.testing.assert_allclose(expected.out, hidden[layer + 1], atol=1e-4)  # the oracle is the model
    assert graph.heads.shape == (model.n_layers, model.n_heads, len(routes.tokens), len(routes.tokens))
    shares = graph.attention_residual + graph.heads.sum(axis=(1, 3)) + graph.attention_bias
    if graph.parallel:  # one whole per position, the feed-forward output among its parts
        np.testing.assert_allclose(shares + graph.ffn, 1.0, atol=1e-5)
        assert not graph.ffn_residual.any() and not graph.ffn_bias.any()
    else:
        np.testing.assert_allclose(shares, 1.0, atol=1e-5)
        np.testing.assert_allclose(graph.ffn + graph.ffn_residual + graph.ffn_bias, 1.0, atol=1e-5)


# GPT-OSS: attention sinks; GPT-NeoX: parallel blocks through an inferred row (q, k and v fused per head)
@pytest.mark.parametrize("family", FAMILIES + VARIANTS + ("gpt_oss", "gpt_neox"))
def test_parts_and_bias_terms_add_up_to_the_whole(family, any_loaded):
    """Both blocks (a parallel block: its one whole), every layer: residual + every (head, source)
    part + the bias terms (+ a parallel block's feed-forward output) = the model's own stream, the
    parts built one (query, source, head) at a time from the recording."""
    model = any_loaded(family)
    input_ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    recording, weights = record(model, input_ids), read_weights(model)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    for index in range(model.n_layers):
        layer = layer_view(recording, weights, index)
        block, ffn_block = linearised_blocks(layer)
        vectors = contributions.head_vectors(layer.values, layer.output_weights)  # [T, H, d]
        vectors = contributions.centre(vectors) if block.centres else vectors
        scale = torch.ones_like(block.residual) if block.scale is None else block.scale
        every_part = torch.einsum("hij,id,jhd->ijhd", layer.attention, scale, vectors)  # [query, key, head, d]
        whole = block.residual + every_part.sum(dim=(1, 2)) + block.bias
        if layer.parallel:  # one whole: the feed-forward block read the same stream
            torch.testing.assert_close(layer.mid, layer.inputs)
            out = whole + ffn_block.part(layer.ffn_output)
        else:
            torch.testing.assert_close(whole, layer.mid, atol=1e-5, rtol=1e-5)
            out = ffn_block.residual + ffn_block.part(layer.ffn_output) + ffn_block.bias
        torch.testing.assert_close(out, layer.out, atol=1e-5, rtol=1e-5)
        if index + 1 < model.n_layers or model.adapter.streams.final_norm is None:
            torch.testing.assert_close(out, hidden[index + 1][0].double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["phi", "llama"])
def test_a_row_declaring_the_wrong_topology_is_refused_by_the_self_check(family, any_loaded, tiny_model_path):
    """A parallel model read as sequential (and the reverse): the parts do not add up to the
    model's own stream, and routes stops with one line instead of returning a wrong route."""
    row = any_loaded(family).adapter
    flipped = dataclasses.replace(
        row, family=f"{family}-flipped", streams=dataclasses.replace(row.streams, parallel=not row.streams.parallel)
    )
    register_adapter(flipped)
    try:
        model = attnflow.load(str(tiny_model_path(family)), device="cpu", progress=False)
    finally:
        unregister_adapter(flipped.family)
    with pytest.raises(CaptureError, match=r"layer 0: the parts of the .* do not add up to the model's own") as e:
        attnflow.routes(model, TEXT, lens="none")
    assert str(e.value).endswith("): the adapter row does not match this model")  # float32: no word of precision
    assert "float32" not in str(e.value)


def test_the_second_norm_and_the_kernel_agree_with_a_direct_computation(tiny_loaded):
    model = tiny_loaded("llama")
    one, two = (attnflow.routes(model, TEXT, norm=p, lens="none") for p in (1, 2))
    assert not np.allclose(one.graph.heads, two.graph.heads)
    np.testing.assert_allclose(two.graph.attention_residual + two.graph.heads.sum(axis=(1, 3)), 1.0, atol=1e-5)
    whole, vectors = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 3, 7, dtype=torch.float64)
    attention = torch.rand(3, 5, 5, dtype=torch.float64).tril()
    block = contributions.Linearised(whole, torch.rand(5, 7, dtype=torch.float64), False, torch.zeros_like(whole))
    parts = torch.einsum("hij,id,jhd->ihjd", attention, block.scale, vectors)  # [query, head, key, d]
    for p in (1, 2):
        expected = contributions.proximity(whole[:, None, None], parts, p)
        torch.testing.assert_close(contributions.head_proximities(whole, block, vectors, attention, p), expected)
    with pytest.raises(ValueError, match="norm must be one of"):
        attnflow.routes(model, TEXT, norm=3)


def test_the_self_check_allows_a_16_bit_rounding_step_and_names_precision_beyond_it():
    """Hand-made wholes: an error of 0.01 on entries up to 2 is over float32's tolerance (1e-3 of 2),
    called an adapter mismatch, and within bfloat16's (4 rounding steps, 4 · 2⁻⁷ of 2 = 0.0625);
    0.1 is over even that, and the message names the precision (run in float32) before the adapter."""
    whole = torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64)
    off_by_a_rounding_step = whole + torch.tensor([[0.01, 0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(CaptureError, match=r"allowed 0.002\): the adapter row does not match this model"):
        contributions.check_whole("attention block", 0, whole, off_by_a_rounding_step)
    contributions.check_whole("attention block", 0, whole, off_by_a_rounding_step, torch.bfloat16)
    contributions.check_whole("attention block", 0, whole, whole + 0.003, torch.float16)  # 4 · 2⁻¹⁰ · 2 = 0.0078
    with pytest.raises(CaptureError) as raised:
        contributions.check_whole("attention block", 3, whole, whole + 0.1, torch.bfloat16)
    message = str(raised.value)
    assert message.startswith("layer 3: the parts of the attention block do not add up")
    assert "in bfloat16): more than bfloat16's rounding explains; load the model with dtype float32" in message
    assert raised.value.parameter == "dtype"
    assert contributions.tolerance(torch.float32) == contributions.TOLERANCE
    assert contributions.tolerance(torch.bfloat16) == 4 * 2**-7


def test_a_wrong_row_in_bfloat16_is_refused_naming_precision(any_loaded, tiny_model_path):
    """The wrong topology of the test above, loaded in bfloat16: still refused (its error is far
    over 16-bit rounding), the message pointing at float32 first; the right row runs in bfloat16."""
    row = any_loaded("llama").adapter
    flipped = dataclasses.replace(
        row, family="llama-flipped-bf16", streams=dataclasses.replace(row.streams, parallel=True)
    )
    attnflow.routes(attnflow.load(str(tiny_model_path("llama")), device="cpu", dtype="bfloat16", progress=False), TEXT)
    register_adapter(flipped)
    try:
        model = attnflow.load(str(tiny_model_path("llama")), device="cpu", dtype="bfloat16", progress=False)
    finally:
        unregister_adapter(flipped.family)
    with pytest.raises(CaptureError, match=r"in bfloat16\): more than bfloat16's rounding explains; load the model"):
        attnflow.routes(model, TEXT, lens="none")
