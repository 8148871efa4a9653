"""Routes through gated blocks (`Streams.gated`): each update joins the stream through per-channel
constants, mid = c + r ⊙ x + g ⊙ attention and out = c′ + r′ ⊙ mid + g′ ⊙ MLP. The constants routes
fit on a seeded run are the model's own parameters (Doge's learned residual gates, MiniCPM3's
branch scale), and the parts with them add up to the model's own streams, read by plain torch hooks."""

from __future__ import annotations

import pytest
import torch
from routes_oracle import hooked_layers

import attnflow
from attnflow.flow_routes.forward import read_weights, record

TEXT = "the cat sat on the mat"


def own_constants(model_type: str, layer: torch.nn.Module, width: int) -> list[torch.Tensor]:
    """The six ``[d]`` constants as the model's code writes them (shift, r, g, shift′, r′, g′)."""
    ones, zeros = torch.ones(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
    if model_type == "doge":  # input_residual ⊙ x + attention, post_attention_residual ⊙ mid + MLP
        return [
            zeros,
            layer.input_residual.detach().double(),
            ones,
            zeros,
            layer.post_attention_residual.detach().double(),
            ones,
        ]
    scale = layer.residual_scale  # MiniCPM3: x + attention · scale, mid + MLP · scale
    return [zeros, ones, ones * scale, zeros, ones, ones * scale]


@pytest.mark.parametrize("model_type", ["doge", "minicpm3"])
def test_the_fitted_gates_are_the_models_own_constants(inferred_loaded, model_type):
    model = inferred_loaded(model_type)
    assert model.adapter.streams is not None and model.adapter.streams.gated
    gates = read_weights(model).gates
    assert gates is not None
    for index, layer in enumerate(model.hf_model.model.layers):
        expected = own_constants(model_type, layer, model.d_model)
        gate = expected[1] if model_type == "doge" else expected[2]  # not 1: a sum without it would fail
        assert float((gate - 1).abs().max()) > 1e-3
        for found, want in zip(gates.layer(index, torch.float64), expected, strict=True):
            torch.testing.assert_close(found, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["doge", "minicpm3"])
def test_the_parts_add_up_to_each_layers_own_streams(inferred_loaded, model_type):
    model = inferred_loaded(model_type)
    ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    layers = model.hf_model.model.layers
    _, attention, _, outputs = hooked_layers(model.hf_model, ids, layers, lambda layer: layer.mlp)
    recording, gates = record(model, ids), read_weights(model).gates
    assert gates is not None
    for index in range(model.n_layers):
        shift, residual, branch, ffn_shift, ffn_residual, ffn_branch = gates.layer(index, torch.float64)
        x, mid = recording.inputs[index].double(), recording.mids[index].double()
        torch.testing.assert_close(mid, shift + residual * x + branch * attention[index].double(), rtol=0, atol=1e-5)
        whole = ffn_shift + ffn_residual * mid + ffn_branch * recording.ffn_outputs[index].double()
        torch.testing.assert_close(whole, outputs[index].double(), rtol=0, atol=1e-5)
    routes = attnflow.routes(model, TEXT, lens="none")  # every layer's parts checked against its streams
    assert routes.edges
