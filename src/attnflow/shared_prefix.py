"""Batches of token-id sequences for one forward pass each; on a causal LM, edited copies of an input
run only their tokens after the part they share with it.

A causal LM's keys and values at position t depend on tokens 0..t only, so a copy of an input with
tokens deleted or replaced (leave-one-out's variants, the faithfulness benchmark's deletions, SHAP's
coalitions) agrees with the input up to its first edit. `forward_batches` runs each input once,
keeps its key/value cache, and runs each copy's remaining tokens on that cache cropped to the shared
length, rounded down to a step (``longest // PREFIX_STEPS`` tokens) so that copies of many inputs
share one batch. Logits equal a full forward's up to float rounding (tested on every decoder
family); a model or transformers version without a usable cache runs every sequence whole.

Without inputs (``bases``) every sequence runs whole: right-padded, sorted by length into batches
of at most ``max_batch_tokens`` padded tokens (and ``max_rows`` sequences).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from attnflow.model_like import ModelLike

PREFIX_STEPS = 8  # shared lengths are rounded down to multiples of (longest sequence // PREFIX_STEPS) tokens


@dataclass
class ForwardBatch:
    """One forward pass: ``rows [batch]`` (indices of its sequences), ``input_ids [batch, token]``
    (each row's tokens after the cached prefix, right-padded), ``attention_mask [batch, prefix +
    token]``, and ``options``: the cached prefix as the model's forward takes it (empty without one)."""

    rows: np.ndarray
    input_ids: Any
    attention_mask: Any
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def last(self) -> Any:
        """``[batch]`` each row's last real token, as an index into ``input_ids``."""
        return last_positions(self.attention_mask, self.input_ids.shape[1])


def last_positions(attention_mask: Any, tokens: int) -> Any:
    """``[batch]`` each right-padded row's last real token, as an index into the ``tokens`` input
    positions of a forward whose ``attention_mask [batch, cached + tokens]`` also covers a key/value
    cache's tokens before them."""
    cached = attention_mask.shape[1] - tokens
    return attention_mask.sum(dim=1) - 1 - cached


def cache_argument(model: ModelLike) -> str:
    """The name of the forward's key/value cache argument: ``cache`` in transformers 5,
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.hf_model.forward).parameters else "past_key_values"


def length_batches(lengths: Sequence[int], max_batch_tokens: int, max_rows: int | None = None) -> list[np.ndarray]:
    """Index batches of sequences sorted by length, each with ``batch * longest <= max_batch_tokens``
    and at most ``max_rows`` sequences (a single sequence longer than that forms its own batch)."""
    order = np.argsort(lengths, kind="stable")
    rows = max_rows or len(order)
    batches, start = [], 0
    while start < len(order):
        stop = start + 1
        while (
            stop < len(order)
            and stop - start < rows
            and (stop - start + 1) * max(lengths[order[stop]], 1) <= max_batch_tokens
        ):
            stop += 1
        batches.append(order[start:stop])
        start = stop
    return batches


def forward_batches(
    model: ModelLike,
    sequences: Sequence[Sequence[int]],
    max_batch_tokens: int,
    max_rows: int | None = None,
    bases: Sequence[Sequence[int]] | None = None,
    owners: Sequence[int] | np.ndarray | None = None,
) -> Iterator[ForwardBatch]:
    """Every sequence in exactly one `ForwardBatch`. With ``bases`` (the unedited inputs of a causal
    LM; ``owners[i]``: the base of sequence i, default the first), the tokens a sequence shares
    with its base come from the base's key/value cache (one forward per base, here)."""
    import torch

    lengths = np.array([len(sequence) for sequence in sequences], dtype=np.int64)
    prefix = np.zeros(len(sequences), dtype=np.int64)
    caches: dict[int, list[tuple[Any, Any]]] = {}
    cache_name = _cache_argument(model) if bases else None
    owner = np.zeros(len(sequences), dtype=np.int64) if owners is None else np.asarray(owners, dtype=np.int64)
    if cache_name is not None and bases and len(sequences):
        step = max(1, int(lengths.max()) // PREFIX_STEPS)
        for i, sequence in enumerate(sequences):
            common = min(_common_length(sequence, bases[owner[i]]), len(sequence) - 1)
            prefix[i] = max(common, 0) // step * step
        used = {int(o): bases[o] for o in np.unique(owner[prefix > 0])}
        caches = _base_caches(model, used, cache_name, max_batch_tokens) if used else {}
    pad_id = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    for shared in np.unique(prefix):
        members = np.flatnonzero(prefix == shared)
        for index in length_batches(lengths[members].tolist(), max_batch_tokens, max_rows):
            rows = members[index]
            longest = int(lengths[rows].max()) - int(shared)
            input_ids = torch.full((len(rows), max(longest, 1)), pad_id, dtype=torch.long)  # [batch, token]
            attention_mask = torch.zeros((len(rows), int(shared) + input_ids.shape[1]), dtype=torch.long)
            attention_mask[:, :shared] = 1
            for row, i in enumerate(rows):
                tail = sequences[i][shared:]
                input_ids[row, : len(tail)] = torch.as_tensor(list(tail), dtype=torch.long)
                attention_mask[row, shared : shared + len(tail)] = 1
            options: dict[str, Any] = {}
            if shared and cache_name is not None:
                options = {cache_name: _cropped(caches, owner[rows], int(shared)), "use_cache": True}
            yield ForwardBatch(rows, input_ids.to(model.device), attention_mask.to(model.device), options)


def _common_length(sequence: Sequence[int], base: Sequence[int]) -> int:
    """How many leading tokens ``sequence`` and ``base`` share."""
    shared = 0
    for a, b in zip(sequence, base, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def _cache_argument(model: ModelLike) -> str | None:
    """`cache_argument`, or None where a prefix cannot be reused: not a causal LM, a hybrid stack
    (its recurrent or state-space layers keep one state of the whole input, not per-token keys and
    values a prefix can be cut from), or a cache class without per-layer data."""
    from transformers import DynamicCache

    if model.target_kind != "next_token" or "ddp_cache_data" not in inspect.signature(DynamicCache).parameters:
        return None
    if model.adapter.mixers is not None:
        return None
    if not hasattr(DynamicCache(), "layers"):  # transformers before the per-layer cache
        return None
    return cache_argument(model)


def _base_caches(
    model: ModelLike, bases: dict[int, Sequence[int]], cache_name: str, max_batch_tokens: int
) -> dict[int, list[tuple[Any, Any]]]:
    """Per base (by its number), per layer, its keys and values ``([1, kv head, token, d], ...)``;
    the bases run right-padded in batches (padding comes after every real token, so it changes no
    real token's keys or values)."""
    import torch
    from transformers import DynamicCache

    numbers = list(bases)
    keeps = "logits_to_keep" in inspect.signature(model.hf_model.forward).parameters
    last_only = {"logits_to_keep": 1} if keeps else {}
    caches = {}
    for batch in forward_batches(model, [bases[n] for n in numbers], max_batch_tokens):
        with torch.no_grad():
            output = model.hf_model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True,
                **{cache_name: DynamicCache(), **last_only},
            )  # fmt: skip
        layers = getattr(output, cache_name).layers
        for row, i in enumerate(batch.rows):
            n = len(bases[numbers[i]])
            caches[numbers[i]] = [
                (layer.keys[row : row + 1, :, :n], layer.values[row : row + 1, :, :n]) for layer in layers
            ]
    return caches


def _cropped(caches: dict[int, list[tuple[Any, Any]]], owners: np.ndarray, length: int) -> Any:
    """A cache of ``length`` tokens per row, each row's from its own base."""
    import torch
    from transformers import DynamicCache

    layers = []
    for layer in range(len(caches[int(owners[0])])):
        keys = torch.cat([caches[o][layer][0][:, :, :length] for o in owners])  # [batch, kv head, token, d]
        values = torch.cat([caches[o][layer][1][:, :, :length] for o in owners])
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)
