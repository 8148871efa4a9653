"""Tiny random models loaded through their inferred rows, and the oracle the value-aware tests share:
the parts the methods split an attention block into add up to the model's own output projection."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import attnflow
from attnflow.rows.adapters import find_layers
from attnflow.rows.infer import verified_row
from attnflow.rows.tiny import model_class, randomise_constants, tiny_config, tiny_tokenizer


def tiny_inferred(model_type: str, **config: Any) -> attnflow.AttentionModel:
    """A tiny ``model_type`` causal LM (seeded, constants perturbed; ``config`` overrides fields of its
    tiny config) with the verified row inferred from it."""
    torch.manual_seed(0)
    settings = tiny_config(model_type)
    for name, value in config.items():
        setattr(settings, name, value)
    model = model_class(model_type, "causal-lm")._from_config(settings, attn_implementation="eager")
    randomise_constants(model)
    model.eval()
    return attnflow.AttentionModel(
        model, tiny_tokenizer(), name=f"tiny {model_type}", adapter=verified_row(model, "decoder")
    )


def assert_parts_add_up(model: attnflow.AttentionModel, trace: Any) -> None:
    """Σ_j (what token j adds) + b_O is what the model's own output projection returns, in every layer."""
    from attnflow.methods.relevance import attention_parts

    outputs: dict[int, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(lambda _m, _i, out, layer=layer: outputs.__setitem__(layer, out.detach()))
        for layer, (_, module) in enumerate(find_layers(model.hf_model, model.adapter.stack.output_projection))
    ]
    try:
        with torch.no_grad():
            model.hf_model(input_ids=torch.tensor(trace.token_ids)[None])
    finally:
        for handle in handles:
            handle.remove()
    for layer in range(trace.n_layers):
        parts = attention_parts(trace, layer, slice(0, trace.n_tokens))  # [query, key, d_model]
        whole = parts.sum(axis=1) + trace.output_bias[layer]
        np.testing.assert_allclose(whole, outputs[layer][0].double().numpy(), atol=1e-5)


def recorded_outputs(model: attnflow.AttentionModel, ids: torch.Tensor, suffix: str) -> tuple[dict[str, Any], Any]:
    """``({name: output}, the model's output with its attention weights)`` of one forward pass over
    ``ids``, recording every module whose name ends with ``suffix``."""
    from attnflow.rows.hook_points import HookPoint, hooks

    recorded: dict[str, torch.Tensor] = {}
    watched = [
        (HookPoint(module), lambda tensor, name=name: recorded.__setitem__(name, tensor.clone()))
        for name, module in model.hf_model.named_modules()
        if name.endswith(suffix)
    ]
    with hooks(watched), torch.no_grad():
        out = model.hf_model(input_ids=ids, output_attentions=True)
    return recorded, out


def norm_by_loops(attention: torch.Tensor, values: torch.Tensor, weight: torch.Tensor, factor: Any = None) -> Any:
    """``[query, key]`` one layer's norm map written out: ‖Σ_h A[h,i,j] W_O^h (v_j^h ⊙ D_i^h)‖, rows
    normalised; ``attention [head, query, key]``, ``values [token, kv_head, d_head]``, ``weight
    [d_model, head * d_head]``, ``factor`` D ``[query, head, d_head]`` (None: 1)."""
    n_heads, n = attention.shape[0], values.shape[0]
    d, group = values.shape[-1], n_heads // values.shape[1]
    matrix = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            vector = sum(
                attention[h, i, j]
                * (weight[:, h * d : (h + 1) * d] @ (values[j, h // group] * (1 if factor is None else factor[i, h])))
                for h in range(n_heads)
            )
            matrix[i, j] = float(vector.norm())
    return matrix / matrix.sum(axis=1, keepdims=True)
