"""Value-aware capture on tiny vision models (ViT, DeiT, DINOv2 with a random LayerScale): the
trace's value vectors and output weights rebuild what each attention block adds to the residual."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import attnflow

from tiny_models import VISION_FAMILIES

NEEDS = ("attentions", "values", "output_weights", "layer_inputs")


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_values_rebuild_the_attention_block_output(family, tiny_model_path, tmp_path):
    model = attnflow.load(str(tiny_model_path(family)), device="cpu")
    torch.manual_seed(1)
    layers = model.model.encoder.layer if family == "dinov2" else model.model.layers
    if family == "dinov2":
        for layer in layers:  # random LayerScale, so that folding it into W_O is tested
            layer.layer_scale1.lambda1.data = torch.rand_like(layer.layer_scale1.lambda1) * 3
        model._output_weights_cache = None
    image = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(0).random((24, 20, 3)) * 255).astype("uint8")).save(image)
    trace = model.trace_image(image, needs=NEEDS)  # stops after the last attention layer
    added, inputs = {}, {}
    handles = []
    for index, layer in enumerate(layers):
        last = layer.layer_scale1 if family == "dinov2" else layer.attention.o_proj  # what joins the residual
        handles.append(
            last.register_forward_hook(lambda module, args, output, i=index: added.__setitem__(i, output[0]))
        )
        handles.append(layer.register_forward_pre_hook(lambda module, args, i=index: inputs.__setitem__(i, args[0][0])))
    try:
        with torch.no_grad():  # the whole model, as an independent pass
            model.model(pixel_values=model.image_processor(Image.open(image).convert("RGB"))[0])
    finally:
        for handle in handles:
            handle.remove()
    n = trace.n_tokens
    assert trace.values.shape == (model.n_layers, n, model.n_heads, model.d_head)
    for layer in range(model.n_layers):
        contributions = np.einsum(
            "jhd,hde->jhe", trace.values[layer], trace.output_weights[layer]
        )  # [key, head, d_model]
        rebuilt = np.einsum("hij,jhe->ie", trace.attentions[layer], contributions) + trace.output_bias[layer]
        np.testing.assert_allclose(rebuilt, added[layer].detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(trace.layer_inputs[layer], inputs[layer].detach().numpy(), atol=1e-6)
    for method in ("norm", "norm_rollout"):
        explanation = attnflow.explain(trace, method=method)
        assert explanation.patch_scores.shape == trace.grid and np.isclose(explanation.scores.sum(), 1.0)


def test_images_have_no_targets(tiny_model_path, tmp_path):
    model = attnflow.load(str(tiny_model_path("vit")), device="cpu")
    image = tmp_path / "image.png"
    Image.new("RGB", (16, 16)).save(image)
    with pytest.raises(attnflow.errors.CaptureError, match="not defined for images"):
        model.trace_image(image, needs=("attentions", "attention_grads"))
