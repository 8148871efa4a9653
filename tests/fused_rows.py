"""Tiny models of families whose q, k and v are one fused projection laid out otherwise than GPT-2's,
with the rows a user would write for them (attnflow has no built-in row for either): GPT-NeoX
(``query_key_value`` per head: ``view(batch, token, head, 3 * d_head)``) and Phi-3 (``qkv_proj``:
n_heads query heads, then n_kv_heads key and value heads, side by side). Tests register a row for
the duration of a ``with registered(row):`` block."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from attnflow.rows import Adapter, Fused, Norms, Sites, Stack, Streams, Values, register_adapter, unregister_adapter
from attnflow.rows.tiny import randomise_constants, tiny_vocab

NEOX_ROW = Adapter(
    "test-gpt-neox",
    "decoder",
    ("gpt_neox",),
    Stack(r"layers\.(\d+)\.attention$", r"layers\.(\d+)\.attention\.dense$"),
    values=Values(None, r"layers\.(\d+)$"),
    sites=Sites(r"layers\.(\d+)$", r"layers\.(\d+)\.attention$", r"layers\.(\d+)\.mlp$"),
    streams=Streams(r"layers\.(\d+)\.post_attention_layernorm$", final_norm=r"final_layer_norm$"),
    norms=Norms(r"(layernorm|final_layer_norm)$", "layer"),
    fused=(Fused(r"layers\.(\d+)\.attention\.query_key_value$", ("query", "key", "value"), "per_head"),),
)
PHI3_ROW = Adapter(
    "test-phi3",
    "decoder",
    ("phi3",),
    Stack(r"layers\.(\d+)\.self_attn$", r"layers\.(\d+)\.self_attn\.o_proj$"),
    values=Values(None, r"layers\.(\d+)$"),
    sites=Sites(r"layers\.(\d+)$", r"layers\.(\d+)\.self_attn$", r"layers\.(\d+)\.mlp$"),
    norms=Norms(r"(layernorm|\bnorm)$", "rms"),
    fused=(Fused(r"layers\.(\d+)\.self_attn\.qkv_proj$", ("query", "key", "value")),),  # kv heads: 2 of 4
)


def with_layout(row: Adapter, layout: str) -> Adapter:
    """``row`` with its fused q/k/v declared in another layout (a wrong row, for the failure tests)."""
    (fused,) = row.fused
    return dataclasses.replace(row, family=f"{layout}-{row.family}", fused=(dataclasses.replace(fused, layout=layout),))


def tiny_fused_model(model_type: str):
    """A tiny random causal LM (2 layers, 4 heads, hidden 32), eager attention, every 1-D parameter
    (biases, norm weights) moved by 0.3·randn so that no bias or gain hides a wrong slice."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    ids = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)
    config = {
        # sequential residual (use_parallel_residual=False): the row's sites and streams hold
        "gpt_neox": lambda: T.GPTNeoXConfig(**common, **ids, max_position_embeddings=64, use_parallel_residual=False),
        "phi3": lambda: T.Phi3Config(**common, **ids, num_key_value_heads=2, max_position_embeddings=64),
    }[model_type]()
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomise_constants(model)
    return model.eval()


def save_fused_model(model_type: str, folder: Path) -> Path:
    """`tiny_fused_model` saved with the tiny WordPiece tokenizer, loadable by `attnflow.load`."""
    import transformers as T

    folder.mkdir(parents=True, exist_ok=True)
    tiny_fused_model(model_type).save_pretrained(folder)
    T.BertTokenizerFast(vocab=tiny_vocab(), model_max_length=60).save_pretrained(folder)
    return folder


@contextmanager
def registered(row: Adapter) -> Iterator[Adapter]:
    register_adapter(row)
    try:
        yield row
    finally:
        unregister_adapter(row.family)
