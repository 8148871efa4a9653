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
