"""Feed-forward blocks that run on the tokens flattened, ``[batch * token, d]`` (OPT's fc1/fc2 and
the norm before them; Llama 4's mixture of experts returns its output so): their rows are inferred
(`attnflow.rows.adapters.as_tokens`), routes' parts add up to each layer's own output, recorded by
plain torch hooks, and patching the MLP site equals a hand-written hook on the flattened output."""

from __future__ import annotations

import pytest
import torch
from routes_oracle import hooked_layers

import attnflow
from attnflow.causal.patching import Metric, Patches, PatchRunner, site_value, stacked
from attnflow.causal.sites import Site
from attnflow.flow_routes.forward import record

CLEAN, CORRUPT = "the cat sat on the mat", "the dog ran on the mat"
# model type -> (the decoder layers, the module whose output is what the feed-forward block adds)
FAMILIES = {
    "opt": (lambda hf: hf.model.decoder.layers, lambda layer: layer.fc2),
    "llama4_text": (lambda hf: hf.model.layers, lambda layer: layer.feed_forward),
}


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def hooked(model, ids: torch.Tensor) -> tuple[list, list, list, list]:
    """Per layer, by plain torch hooks: its input, its attention module's output, the feed-forward
    block's output (flattened ``[T, d]``) and the layer's output, ``[T, d]`` each."""
    layers_of, ffn_of = FAMILIES[model.hf_model.config.model_type]
    return hooked_layers(model.hf_model, ids, layers_of(model.hf_model), ffn_of)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_routes_parts_add_up_to_each_layers_own_output(inferred_loaded, model_type):
    model = inferred_loaded(model_type)
    ids = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    inputs, attention, ffn, outputs = hooked(model, ids)
    assert ffn[0].dim() == 2  # the model's own feed-forward output is flattened [T, d]
    recording = record(model, ids)
    for layer in range(model.n_layers):
        torch.testing.assert_close(recording.mids[layer], inputs[layer] + attention[layer], rtol=0, atol=1e-5)
        torch.testing.assert_close(recording.ffn_outputs[layer], ffn[layer], rtol=0, atol=1e-5)
        whole = recording.mids[layer] + recording.ffn_outputs[layer]  # residual + parts
        torch.testing.assert_close(whole, outputs[layer], rtol=0, atol=1e-5)
    routes = attnflow.routes(model, CLEAN, lens="none")
    assert routes.edges


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_patching_the_mlp_site_equals_a_hand_written_hook(inferred_loaded, model_type):
    model = inferred_loaded(model_type)
    tokenise = lambda text: model.tokenizer(text, return_tensors="pt")["input_ids"]  # noqa: E731
    clean, corrupt = tokenise(CLEAN), tokenise(CORRUPT)
    target, layer, position = int(clean[0, -1]), 0, 2  # layer 0: the last layer carries it on
    runner = PatchRunner(model, Metric("next_token", target))
    _, recorded = runner.forward(clean, 1, record=True)
    value = site_value(stacked(recorded), 0, Site("mlp", layer, position), model.n_heads)  # [d]
    assert torch.equal(value, hooked(model, clean)[2][layer][position])
    patches = Patches()
    patches.add(0, Site("mlp", layer, position), value)
    with torch.no_grad():
        metric, _ = runner.forward(corrupt, 1, patches=patches)
        unpatched, _ = runner.forward(corrupt, 1)
    assert abs(float(metric[0] - unpatched[0])) > 1e-6  # the patch changes the run
    layers_of, ffn_of = FAMILIES[model_type]

    def replace(_module, _args, output):
        flat = _first(output).clone()  # [T, d]: one batch row
        flat[position] = value
        return (flat, *output[1:]) if isinstance(output, tuple) else flat

    handle = ffn_of(layers_of(model.hf_model)[layer]).register_forward_hook(replace)
    try:
        with torch.no_grad():
            logits = model.hf_model(input_ids=corrupt).logits
    finally:
        handle.remove()
    expected = torch.log_softmax(logits[0, -1], dim=-1)[target]
    assert float(metric[0]) == pytest.approx(float(expected), abs=1e-5)
