"""Adapter rows for the architectural variants that have no built-in row (tiny models:
`tiny_models.VARIANT_FAMILIES`), registered by the tests around loading (`registered`).

Phi and GPT-J: parallel attention and feed-forward (`Streams.parallel`), both reading the block's
input through one LayerNorm. OLMo-2: post-norms only, each update normed before the residual
addition (`Values.output_norm`, `Sites` at the norms). Gemma 2: Gemma 3's row (sandwich norms) for
``model_type`` ``gemma2``. GPT-OSS: Llama's layout with attention sinks (`Stack.sinks`) and a
mixture of experts as its feed-forward block (read whole, as the `Sites.mlp` output).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator

from attnflow.rows import ADAPTERS, register_adapter, unregister_adapter
from attnflow.rows.adapters import Adapter, GatedMLP, Norms, Sites, Stack, Streams, Values

_LAYER = r"layers\.(\d+)"
_ATTENTION = Stack(rf"{_LAYER}\.self_attn$", rf"{_LAYER}\.self_attn\.(?:dense|o_proj)$")


def _projections(layer: str, attention: str, **extra) -> Values:
    return Values(
        rf"{layer}\.{attention}\.v_proj$",
        rf"{layer}$",
        query=rf"{layer}\.{attention}\.q_proj$",
        key=rf"{layer}\.{attention}\.k_proj$",
        **extra,
    )


ROWS: dict[str, Adapter] = {
    "phi": Adapter(
        "phi-variant",
        "decoder",
        ("phi",),
        _ATTENTION,
        values=_projections(_LAYER, "self_attn"),
        sites=Sites(rf"{_LAYER}$", rf"{_LAYER}\.self_attn$", rf"{_LAYER}\.mlp$"),
        streams=Streams(rf"{_LAYER}\.input_layernorm$", final_norm=r"model\.final_layernorm$", parallel=True),
        norms=Norms(r"(input_layernorm|final_layernorm)$", "layer"),
    ),
    "gptj": Adapter(
        "gptj-variant",
        "decoder",
        ("gptj",),
        Stack(r"\bh\.(\d+)\.attn$", r"\bh\.(\d+)\.attn\.out_proj$"),
        values=_projections(r"\bh\.(\d+)", "attn"),
        sites=Sites(r"\bh\.(\d+)$", r"\bh\.(\d+)\.attn$", r"\bh\.(\d+)\.mlp$"),
        streams=Streams(r"\bh\.(\d+)\.ln_1$", final_norm=r"\bln_f$", parallel=True),
        norms=Norms(r"\bln_(1|f)$", "layer"),
        head_count="n_head",
    ),
    "olmo2": Adapter(
        "olmo2-variant",
        "decoder",
        ("olmo2",),
        _ATTENTION,
        values=_projections(_LAYER, "self_attn", output_norm=rf"{_LAYER}\.post_attention_layernorm$"),
        sites=Sites(rf"{_LAYER}$", rf"{_LAYER}\.post_attention_layernorm$", rf"{_LAYER}\.post_feedforward_layernorm$"),
        gated_mlp=GatedMLP(rf"{_LAYER}\.mlp$"),
        streams=Streams(rf"{_LAYER}\.mlp$", final_norm=r"model\.norm$"),  # no pre-norm: the MLP reads the stream
        norms=Norms(r"(layernorm|\bnorm|\bq_norm|\bk_norm)$", "rms"),
    ),
    "gpt_oss": Adapter(
        "gpt_oss-variant",
        "decoder",
        ("gpt_oss",),
        dataclasses.replace(_ATTENTION, sinks=True),
        values=_projections(_LAYER, "self_attn"),
        sites=Sites(rf"{_LAYER}$", rf"{_LAYER}\.self_attn$", rf"{_LAYER}\.mlp$"),
        streams=Streams(rf"{_LAYER}\.post_attention_layernorm$", final_norm=r"model\.norm$"),
        norms=Norms(r"(layernorm|\bnorm)$", "rms"),
    ),
    "gemma2": dataclasses.replace(
        next(row for row in ADAPTERS if row.family == "gemma3"), family="gemma2-variant", model_types=("gemma2",)
    ),
}


@contextmanager
def registered(family: str) -> Iterator[Adapter]:
    """The family's row, registered inside the block (a loaded model keeps its row after it)."""
    row = ROWS[family]
    register_adapter(row)
    try:
        yield row
    finally:
        unregister_adapter(row.family)
