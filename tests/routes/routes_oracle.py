"""An independent oracle for information-flow routes: explicit Python loops over every part.

For each layer it reads the model's own attention weights (``output_attentions``) and the streams
entering each layer (``output_hidden_states``), recomputes the value vectors, the output
projection's slices and the norms from each module's weights with numpy formulas of its own, builds
every part vector one at a time — per query i, source j and head h — and computes its proximity to
the whole with the definition, then normalises. Nothing from attnflow.flow_routes is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

FAMILIES = ("llama", "qwen2", "gemma3", "gpt2", "bert", "roberta", "electra", "distilbert", "mpnet")
VARIANTS = ("phi", "gptj", "olmo2", "gemma2")  # rows registered by the tests (tests/variant_rows.py)


def numpy64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().double().cpu().numpy()


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * gain


def layer_norm(x: np.ndarray, gain: np.ndarray, shift: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps) * gain + shift


def module_call(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return numpy64(module(torch.from_numpy(x).float()[None])[0])


@dataclass
class LayerSpec:
    """One layer as the oracle sees it: the value vectors ``[T, KV, d_head]`` of the stream x,
    W_O per head ``[H, d_head, d]`` and its bias, where the attention norm acts (``"pre"``: none
    after the block; ``"sandwich"``: RMS norm on the block's output; ``"post"``: layer norm on
    residual + output) with its parameters, and the feed-forward block: ``ffn(mid)`` what it adds
    before any post-LN, and the post-LN parameters. ``parallel``: the feed-forward block reads x
    too and both updates add to it at once (one whole: x + attention + ffn(x))."""

    values: np.ndarray
    output_weights: np.ndarray
    output_bias: np.ndarray
    where: str
    attention_norm: tuple | None
    ffn: Callable[[np.ndarray], np.ndarray]
    ffn_norm: tuple | None
    parallel: bool = False


def _ln(module) -> tuple:
    return (numpy64(module.weight), numpy64(module.bias), float(module.eps))


def layer_spec(family: str, model: torch.nn.Module, layer: int, x: np.ndarray, n_heads: int) -> LayerSpec:
    """Read one layer of a tiny model of ``family`` from its modules' weights."""
    d = x.shape[-1]
    if family in ("phi", "gptj"):
        return _parallel_spec(family, model, layer, x, n_heads)
    if family in ("llama", "qwen2", "gemma3", "gemma2", "olmo2"):
        block = model.model.layers[layer]
        offset = 1.0 if family in ("gemma3", "gemma2") else 0.0
        norm_module = block.post_attention_layernorm
        eps = getattr(norm_module, "variance_epsilon", getattr(norm_module, "eps", None))

        def rms(module, y):
            return rms_norm(y, numpy64(module.weight) + offset, eps)

        attention = block.self_attn
        bias = 0.0 if attention.v_proj.bias is None else numpy64(attention.v_proj.bias)
        read = x if family == "olmo2" else rms(block.input_layernorm, x)  # OLMo-2: no pre-norm
        values = read @ numpy64(attention.v_proj.weight).T + bias
        output_weights = numpy64(attention.o_proj.weight).T
        if family == "olmo2":
            norm, where = (numpy64(block.post_attention_layernorm.weight), np.zeros(d), eps), "sandwich"

            def ffn(mid):
                return rms(block.post_feedforward_layernorm, module_call(block.mlp, mid))

        elif family in ("gemma3", "gemma2"):
            norm = (numpy64(block.post_attention_layernorm.weight) + 1.0, np.zeros(d), eps)

            def ffn(mid):
                raw = module_call(block.mlp, rms(block.pre_feedforward_layernorm, mid))
                return rms(block.post_feedforward_layernorm, raw)

            where = "sandwich"
        else:
            norm, where = None, "pre"

            def ffn(mid):
                return module_call(block.mlp, rms(block.post_attention_layernorm, mid))

        output_bias = np.zeros(d)
        return LayerSpec(
            _heads(values, output_weights.shape[0] // n_heads), _split(output_weights, n_heads), output_bias,
            where, norm, ffn, None,
        )  # fmt: skip
    if family == "gpt2":
        block = model.transformer.h[layer]
        ln_1, ln_2 = _ln(block.ln_1), _ln(block.ln_2)
        fused = layer_norm(x, *ln_1) @ numpy64(block.attn.c_attn.weight) + numpy64(block.attn.c_attn.bias)  # Conv1D
        values = fused[:, 2 * d :]
        return LayerSpec(
            _heads(values, d // n_heads), _split(numpy64(block.attn.c_proj.weight), n_heads),
            numpy64(block.attn.c_proj.bias), "pre", None,
            lambda mid: module_call(block.mlp, layer_norm(mid, *ln_2)), None,
        )  # fmt: skip
    return _encoder_spec(family, model, layer, x, n_heads)


def _parallel_spec(family: str, model: torch.nn.Module, layer: int, x: np.ndarray, n_heads: int) -> LayerSpec:
    """Phi (``model.layers``: ``input_layernorm``, ``self_attn.dense``) and GPT-J (``transformer.h``:
    ``ln_1``, ``attn.out_proj``, no biases): one LayerNorm read by both updates."""
    if family == "phi":
        block = model.model.layers[layer]
        norm, attention, output = _ln(block.input_layernorm), block.self_attn, block.self_attn.dense
    else:
        block = model.transformer.h[layer]
        norm, attention, output = _ln(block.ln_1), block.attn, block.attn.out_proj
    read = layer_norm(x, *norm)
    value_bias = 0.0 if attention.v_proj.bias is None else numpy64(attention.v_proj.bias)
    values = read @ numpy64(attention.v_proj.weight).T + value_bias
    output_bias = np.zeros(x.shape[-1]) if output.bias is None else numpy64(output.bias)
    return LayerSpec(
        _heads(values, x.shape[-1] // n_heads), _split(numpy64(output.weight).T, n_heads), output_bias,
        "pre", None, lambda stream: module_call(block.mlp, layer_norm(stream, *norm)), None, parallel=True,
    )  # fmt: skip


def _encoder_spec(family: str, model: torch.nn.Module, layer: int, x: np.ndarray, n_heads: int) -> LayerSpec:
    d = x.shape[-1]
    if family == "distilbert":
        block = model.transformer.layer[layer]
        value, output, norm = block.attention.v_lin, block.attention.out_lin, _ln(block.sa_layer_norm)

        def ffn(mid):
            return module_call(block.ffn, mid)

        ffn_norm = _ln(block.output_layer_norm)
    else:
        block = model.encoder.layer[layer]
        if family == "mpnet":
            value, output, norm = block.attention.attn.v, block.attention.attn.o, _ln(block.attention.LayerNorm)
        else:
            value, output = block.attention.self.value, block.attention.output.dense
            norm = _ln(block.attention.output.LayerNorm)

        def ffn(mid):
            return module_call(block.output.dense, module_call(block.intermediate, mid))

        ffn_norm = _ln(block.output.LayerNorm)
    values = x @ numpy64(value.weight).T + numpy64(value.bias)
    return LayerSpec(
        _heads(values, d // n_heads), _split(numpy64(output.weight).T, n_heads), numpy64(output.bias),
        "post", norm, ffn, ffn_norm,
    )  # fmt: skip


def _heads(values: np.ndarray, d_head: int) -> np.ndarray:
    return values.reshape(values.shape[0], -1, d_head)  # [T, KV, d_head]


def _split(output_weights: np.ndarray, n_heads: int) -> np.ndarray:
    """``[in, out]`` -> ``[H, d_head, out]``."""
    return output_weights.reshape(n_heads, output_weights.shape[0] // n_heads, output_weights.shape[1])


def proximity(whole: np.ndarray, part: np.ndarray) -> float:
    return max(np.abs(whole).sum() - np.abs(whole - part).sum(), 0.0)


@dataclass
class OracleLayer:
    """One layer's normalised shares and the vectors they came from."""

    heads: np.ndarray  # [H, T, T]
    attention_residual: np.ndarray  # [T]
    attention_bias: np.ndarray
    ffn: np.ndarray
    ffn_residual: np.ndarray
    ffn_bias: np.ndarray
    mid: np.ndarray  # [T, d] the stream after attention (parallel: the block's whole), from the oracle's own sum
    out: np.ndarray  # [T, d] the stream after the feed-forward block
    head_outputs: np.ndarray  # [T, H, d] each head's part summed over sources, as it reaches mid
    edge_parts: np.ndarray | None = None  # [T, T, H, d] query, source, head: each part as it reaches mid


def oracle_layer(spec: LayerSpec, x: np.ndarray, attention: np.ndarray) -> OracleLayer:
    """Every part, one at a time, for one layer (``x [T, d]`` entering it, ``attention [H, T, T]``)."""
    n_heads, n_tokens, _ = attention.shape
    group = n_heads // spec.values.shape[1]
    pairs = [(j, h) for j in range(n_tokens) for h in range(n_heads)]
    vector = {(j, h): spec.values[j, h // group] @ spec.output_weights[h] for j, h in pairs}
    raw = np.stack([sum(attention[h, i, j] * vector[j, h] for j in range(n_tokens) for h in range(n_heads))
                    for i in range(n_tokens)]) + spec.output_bias  # fmt: skip

    def as_reaching(part: np.ndarray, i: int) -> np.ndarray:
        if spec.where == "pre":
            return part
        gain, _, eps = spec.attention_norm
        if spec.where == "sandwich":
            return part * gain / np.sqrt((raw[i] ** 2).mean() + eps)
        y = x[i] + raw[i]
        return (part - part.mean()) * gain / np.sqrt(y.var() + eps)

    shift = 0.0 if spec.where != "post" else spec.attention_norm[1]
    heads = np.zeros((n_heads, n_tokens, n_tokens))
    residual, bias, through_ffn = np.zeros(n_tokens), np.zeros(n_tokens), np.zeros(n_tokens)
    mid = np.zeros_like(x)
    head_outputs = np.zeros((n_tokens, n_heads, x.shape[1]))
    edge_parts = np.zeros((n_tokens, n_tokens, n_heads, x.shape[1]))
    ffn_of_x = spec.ffn(x) if spec.parallel else np.zeros_like(x)  # parallel: a part of the same whole
    for i in range(n_tokens):
        the_residual = x[i] if spec.where != "post" else as_reaching(x[i], i)
        the_bias = as_reaching(np.broadcast_to(spec.output_bias, x[i].shape).copy(), i) + shift
        parts = {(j, h): as_reaching(attention[h, i, j] * vector[j, h], i) for j, h in pairs}
        mid[i] = the_residual + sum(parts.values()) + the_bias + ffn_of_x[i]
        for (j, h), part in parts.items():
            heads[h, i, j] = proximity(mid[i], part)
            head_outputs[i, h] += part
            edge_parts[i, j, h] = part
        residual[i], bias[i] = proximity(mid[i], the_residual), proximity(mid[i], the_bias)
        through_ffn[i] = proximity(mid[i], ffn_of_x[i]) if spec.parallel else 0.0
        total = residual[i] + heads[:, i].sum() + bias[i] + through_ffn[i]
        heads[:, i] /= total
        residual[i] /= total
        bias[i] /= total
        through_ffn[i] /= total
    layer = OracleLayer(heads, residual, bias, None, None, None, mid, None, head_outputs, edge_parts)
    if spec.parallel:  # one whole, the stream leaving the block: no feed-forward residual or bias part
        layer.ffn, layer.ffn_residual, layer.ffn_bias, layer.out = (
            through_ffn,
            np.zeros(n_tokens),
            np.zeros(n_tokens),
            mid,
        )
        return layer
    return _ffn(spec, layer)


def _ffn(spec: LayerSpec, layer: OracleLayer) -> OracleLayer:
    mid = layer.mid
    raw = spec.ffn(mid)
    n_tokens = mid.shape[0]
    ffn, residual, bias = np.zeros(n_tokens), np.zeros(n_tokens), np.zeros(n_tokens)
    out = np.zeros_like(mid)
    for i in range(n_tokens):
        if spec.ffn_norm is None:
            parts = (raw[i], mid[i], np.zeros_like(mid[i]))
        else:
            gain, shift, eps = spec.ffn_norm
            sigma = np.sqrt((mid[i] + raw[i]).var() + eps)
            parts = ((raw[i] - raw[i].mean()) * gain / sigma, (mid[i] - mid[i].mean()) * gain / sigma, shift)
        out[i] = sum(parts)
        shares = [proximity(out[i], part) for part in parts]
        ffn[i], residual[i], bias[i] = (share / sum(shares) for share in shares)
    layer.ffn, layer.ffn_residual, layer.ffn_bias, layer.out = ffn, residual, bias, out
    return layer


def oracle(family: str, model, text: str) -> tuple[list[OracleLayer], list[np.ndarray]]:
    """Every layer of a loaded tiny model (`attnflow.AttentionModel`) on ``text``, and the
    streams entering each layer as the model reports them."""
    input_ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        output = model.model(input_ids=input_ids, output_hidden_states=True, output_attentions=True)
    hidden = [numpy64(state[0]) for state in output.hidden_states]
    layers = []
    for layer in range(model.n_layers):
        spec = layer_spec(family, model.model, layer, hidden[layer], model.n_heads)
        layers.append(oracle_layer(spec, hidden[layer], numpy64(output.attentions[layer][0])))
    return layers, hidden


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def hooked_layers(model: torch.nn.Module, ids: torch.Tensor, layers, ffn_of: Callable) -> tuple[list, list, list, list]:
    """Per layer of ``layers`` (the decoder layers), by plain torch hooks on one forward pass of
    ``model`` (a transformers model): its input, its ``self_attn`` output, the output of the module
    ``ffn_of(layer)`` (as the model returns it, flattened ``[T, d]`` in some) and the layer's output,
    ``[T, d]`` each (batch row 0)."""
    inputs, attention, ffn, outputs = [], [], [], []
    handles = []
    for layer in layers:
        handles += [
            layer.register_forward_pre_hook(
                lambda _m, args, kwargs: inputs.append(_first(args or (kwargs["hidden_states"],))[0]), with_kwargs=True
            ),
            layer.self_attn.register_forward_hook(lambda _m, _a, output: attention.append(output[0][0])),
            ffn_of(layer).register_forward_hook(lambda _m, _a, output: ffn.append(_first(output).clone())),
            layer.register_forward_hook(lambda _m, _a, output: outputs.append(_first(output)[0])),
        ]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, attention, ffn, outputs
