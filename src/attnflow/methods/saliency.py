"""Saliency rows (which output position to explain) and the ViT patch-grid reshape."""

from __future__ import annotations

from typing import Union

import numpy as np

from attnflow.errors import InputError

Row = Union[str, int]
ROWS = ("cls", "mean", "last")


def saliency_row(matrix: np.ndarray, row: Row = "cls") -> np.ndarray:
    """Pick the saliency scores from a ``[..., query, key]`` relevance matrix -> ``[..., key]``.

    ``cls``: row 0; ``mean``: the mean of all rows (mean-pooled models such as sentence
    encoders); ``last``: the last row (decoders); an int: that row (negative counts from the end).
    """
    matrix = np.asarray(matrix)
    n = matrix.shape[-2]
    row = parse_row(row)
    if row == "mean":
        return matrix.mean(axis=-2)
    index = {"cls": 0, "last": n - 1}[row] if isinstance(row, str) else row
    if not -n <= index < n:
        raise InputError(f"row index {row} is out of range for {n} tokens")
    return matrix[..., index, :]


def parse_row(row: Row) -> Row:
    """``"cls"``/``"mean"``/``"last"`` stay names; ``"3"`` or ``3`` become the index 3."""
    if isinstance(row, str):
        if row in ROWS:
            return row
        try:
            return int(row)
        except ValueError:
            raise InputError(f"row must be one of {', '.join(ROWS)} or a token index, got {row!r}") from None
    if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)):
        raise InputError(f"row must be one of {', '.join(ROWS)} or a token index, got {row!r}")
    return int(row)


def to_patch_grid(scores: np.ndarray, grid: tuple[int, int], n_prefix_tokens: int = 1) -> np.ndarray:
    """Drop the prefix tokens (CLS, distillation, registers) of ``[..., n]`` scores and reshape
    the patches to ``[..., rows, cols]``. ``grid`` comes from the model config, never from sqrt(n)."""
    scores = np.asarray(scores)
    rows, cols = grid
    patches = scores[..., n_prefix_tokens:]
    if patches.shape[-1] != rows * cols:
        raise InputError(
            f"{patches.shape[-1]} patch scores after {n_prefix_tokens} prefix tokens do not fill a {rows}x{cols} grid"
        )
    return patches.reshape((*patches.shape[:-1], rows, cols))
