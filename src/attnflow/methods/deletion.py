"""Perturbed inputs, rebuilt from token ids (never from text, which would re-tokenise differently).

``remove`` drops the chosen tokens from the id sequence (the sequence gets shorter, positions
shift); ``mask`` puts the tokenizer's mask token (its pad token when it has none) in their place.
Special tokens ([CLS], [SEP], <s>, ...) are never chosen: they stay in every variant. Shapley values
(`attnflow.methods.model.perturbation`) and the faithfulness metrics (`attnflow.evaluate`, which
imports these through `attnflow.evaluate.deletion`) build their inputs with them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from attnflow.errors import InputError

REPLACE_MODES = ("remove", "mask")


def perturb(ids: Sequence[int], positions: np.ndarray, replace: str, mask_id: int | None) -> tuple[int, ...]:
    """``ids`` with the tokens at ``positions`` removed or replaced by ``mask_id``."""
    chosen = np.zeros(len(ids), dtype=bool)
    chosen[np.asarray(positions, dtype=np.int64)] = True
    if replace == "remove":
        return tuple(int(token) for token, drop in zip(ids, chosen, strict=False) if not drop)
    if replace == "mask":
        if mask_id is None:
            raise InputError("{replace} mask needs a tokenizer with a mask or pad token", parameter="replace")
        return tuple(int(mask_id) if drop else int(token) for token, drop in zip(ids, chosen, strict=False))
    raise InputError(
        f"unknown replacement {replace!r} ({{replace}}); choose one of {', '.join(REPLACE_MODES)}", parameter="replace"
    )


def without_top(
    ids: Sequence[int], ranking: np.ndarray, count: int, replace: str, mask_id: int | None
) -> tuple[int, ...]:
    """The input without its ``count`` most relevant content tokens (comprehensiveness, deletion)."""
    return perturb(ids, ranking[:count], replace, mask_id)


def only_top(ids: Sequence[int], ranking: np.ndarray, count: int, replace: str, mask_id: int | None) -> tuple[int, ...]:
    """The input keeping only its ``count`` most relevant content tokens plus every special token
    (sufficiency)."""
    return perturb(ids, ranking[count:], replace, mask_id)
