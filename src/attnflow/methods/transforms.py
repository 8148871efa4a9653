"""Shared building blocks of the attention methods: validation, head fusion, residual, pruning.

Every function here is pure and works on numpy arrays with any number of leading batch axes:
a single sample is ``[layer, head, query, key]``, a batch ``[batch, layer, head, query, key]``.
Definitions: docs/methods.md ("Head fusion", "Residual correction", "Pruning").
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Sequence, Union

import numpy as np

from attnflow.errors import ExplanationWarning, InputError

HeadFusion = Union[str, Sequence[float], np.ndarray]
Residual = Union[str, float]

HEAD_FUSIONS = ("mean", "max", "min", "none")
RESIDUALS = ("half", "renorm", "none")
PRUNE_PLACES = ("attention", "residual")


def accepts_torch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Let a numpy method take a torch tensor as first argument and return one like it."""

    @functools.wraps(fn)
    def wrapper(attentions: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(attentions, "detach") and hasattr(attentions, "cpu"):  # torch.Tensor
            import torch

            result = fn(attentions.detach().cpu().double().numpy(), *args, **kwargs)
            return torch.as_tensor(np.ascontiguousarray(result)).to(
                dtype=attentions.dtype if attentions.is_floating_point() else torch.float64,
                device=attentions.device,
            )
        return fn(attentions, *args, **kwargs)

    return wrapper


def validate_attentions(
    attentions: Any, *, row_stochastic: bool = True, atol: float = 1e-3, square: bool = True
) -> np.ndarray:
    """Check ``[..., layer, head, query, key]`` attention weights and return them as float64.

    Raises ValueError naming the problem: wrong rank, non-square maps, NaN/inf, negative
    weights, or (``row_stochastic``) rows that do not sum to 1 within ``atol``.
    """
    array = np.asarray(attentions)
    if array.ndim not in (4, 5):
        raise InputError(
            "attentions must be [layer, head, query, key] or [batch, layer, head, query, key]; "
            f"got an array of shape {array.shape}"
        )
    if square and array.shape[-1] != array.shape[-2]:
        raise InputError(f"attention maps must be square (query == key), got {array.shape[-2:]}")
    if array.shape[-1] == 0 or array.shape[-3] == 0 or array.shape[-4] == 0:
        raise InputError(f"attentions have an empty axis: shape {array.shape}")
    array = array.astype(np.float64, copy=False)
    # Two passes instead of one per check: the minimum is NaN with a NaN, -inf or negative with a
    # negative weight, and a +inf makes its row's sum infinite.
    smallest = array.min()
    row_sums = array.sum(axis=-1)
    if not np.isfinite(smallest) or not np.all(np.isfinite(row_sums)):
        if not np.all(np.isfinite(array)):
            raise InputError("attentions contain NaN or infinite values")
        raise InputError("attention rows sum to infinity (weights too large for float64)")
    if smallest < 0:
        raise InputError(f"attentions contain negative weights (min {smallest:.3g})")
    if row_stochastic:
        off = np.abs(row_sums - 1.0)
        worst = off.max()
        if worst > atol:
            worst_sum = float(row_sums.reshape(-1)[int(off.argmax())])
            raise InputError(
                f"attention rows must sum to 1 (softmax weights); the worst row sums to "
                f"{worst_sum:.4g} off by {worst:.3g}. Pass residual='renorm' or "
                "normalise the rows if the input is not a softmax."
            )
    return array


def choose_fusion(head_fusion: HeadFusion, weights: Any) -> HeadFusion:
    """The head fusion a method applies: ``weights`` (per-head weights) when given, else ``head_fusion``;
    both at once (weights and a fusion other than the default ``"mean"``) is a ValueError."""
    if weights is None:
        return head_fusion
    if not (isinstance(head_fusion, str) and head_fusion == "mean"):
        raise InputError("give either head weights or a head fusion, not both")
    return [float(w) for w in np.asarray(weights, dtype=np.float64).reshape(-1)]


def fuse_heads(attentions: np.ndarray, head_fusion: HeadFusion = "mean") -> np.ndarray:
    """Fuse the head axis: ``[..., layer, head, q, k]`` -> ``[..., layer, q, k]``.

    ``head_fusion`` is ``"mean"``, ``"max"``, ``"min"``, ``"none"`` (returned unchanged, heads
    kept) or a vector of per-head weights (normalised to sum 1). The element-wise ``max`` and
    ``min`` of softmax rows are not rows that sum to 1: they are renormalised, so that the fused
    map is row-stochastic like the others and the residual modes keep their meaning.
    """
    if isinstance(head_fusion, str):
        if head_fusion == "mean":
            return attentions.mean(axis=-3)
        if head_fusion in ("max", "min"):
            fused = attentions.max(axis=-3) if head_fusion == "max" else attentions.min(axis=-3)
            return normalise_rows(fused)
        if head_fusion == "none":
            return attentions
        raise InputError(f"unknown head_fusion {head_fusion!r}; choose one of {HEAD_FUSIONS} or weights")
    weights = np.asarray(head_fusion, dtype=np.float64).reshape(-1)
    n_heads = attentions.shape[-3]
    if weights.shape[0] != n_heads:
        raise InputError(f"head weights have {weights.shape[0]} entries but attentions have {n_heads} heads")
    if np.any(weights < 0) or not np.all(np.isfinite(weights)) or weights.sum() <= 0:
        raise InputError("head weights must be finite, non-negative and not all zero")
    weights = weights / weights.sum()
    return np.einsum("...hqk,h->...qk", attentions, weights)


def add_residual(attentions: np.ndarray, residual: Residual = "half") -> np.ndarray:
    """Account for the skip connection on ``[..., q, k]`` maps (docs/methods.md, "Residual correction").

    ``half``: (A + I) / 2; ``renorm``: (A + I) / rowsum; float alpha in [0, 1]:
    alpha * A + (1 - alpha) * I; ``none``: A unchanged.
    """
    n = attentions.shape[-1]
    identity = np.eye(n, dtype=attentions.dtype)
    if isinstance(residual, str):
        if residual == "half":
            mixed = attentions + identity
            mixed *= 0.5  # in place: one temporary of the maps' size, not two
            return mixed
        if residual == "renorm":
            mixed = attentions + identity
            return normalise_rows(mixed)
        if residual == "none":
            return attentions
        raise InputError(f"unknown residual {residual!r}; choose one of {RESIDUALS} or a float in [0, 1]")
    if isinstance(residual, bool) or not isinstance(residual, (int, float, np.floating)):
        raise InputError(f"residual must be one of {RESIDUALS} or a float in [0, 1], got {residual!r}")
    alpha = float(residual)
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"residual weight alpha must lie in [0, 1], got {alpha}")
    mixed = alpha * attentions
    mixed += (1.0 - alpha) * identity
    return mixed


def prune_rows(
    matrices: np.ndarray,
    *,
    threshold: float | None = None,
    top_k: int | None = None,
    discard_ratio: float | None = None,
    renormalise: bool = True,
) -> np.ndarray:
    """Drop small entries of each row of ``[..., q, k]`` maps (and, by default, renormalise rows).

    Pruning is per row and per sample: ``threshold`` (tau in [0, 1)) drops entries < tau;
    ``top_k`` keeps the k largest; ``discard_ratio`` (q in [0, 1)) drops the smallest
    ``floor(q * k)`` entries of each row. Every row keeps at least its largest entry (ties keep
    all equal maxima). Several options combine. ``renormalise=False`` returns the pruned rows
    as they are (their sums fall below 1).
    """
    check_pruning(threshold=threshold, top_k=top_k, discard_ratio=discard_ratio)
    if threshold is None and top_k is None and discard_ratio is None:
        return matrices
    n_keys = matrices.shape[-1]
    keep = np.ones(matrices.shape, dtype=bool)
    # Rank of every entry within its row: 0 = largest (stable, so ties keep the earlier key).
    order = np.argsort(-matrices, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(n_keys).reshape((1,) * (matrices.ndim - 1) + (n_keys,)), axis=-1)
    if threshold is not None:
        keep &= matrices >= threshold
    if top_k is not None:
        keep &= rank < int(top_k)
    if discard_ratio is not None:
        n_drop = int(np.floor(discard_ratio * n_keys))
        keep &= rank < n_keys - n_drop
    row_max = matrices.max(axis=-1, keepdims=True)
    keep |= matrices == row_max
    pruned = np.where(keep, matrices, 0.0)
    return normalise_rows(pruned) if renormalise else pruned


def check_pruning(
    *, threshold: float | None = None, top_k: int | None = None, discard_ratio: float | None = None
) -> None:
    """Raise ValueError unless ``threshold`` and ``discard_ratio`` lie in [0, 1) and ``top_k`` >= 1."""
    for name, value in (("threshold", threshold), ("discard_ratio", discard_ratio)):
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float, np.integer, np.floating))
            or not 0.0 <= value < 1.0
        ):
            raise InputError(f"{name} must lie in [0, 1) (a share of a row that sums to 1), got {value!r}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise InputError(f"top_k must be a positive integer, got {top_k}")


def normalise_rows(matrices: np.ndarray) -> np.ndarray:
    """Divide each row of ``[..., q, k]`` by its sum (``keepdims``: rows, never columns); a row
    that sums to 0 stays 0 (no NaN)."""
    sums = matrices.sum(axis=-1, keepdims=True)
    return np.divide(matrices, sums, out=np.zeros_like(matrices), where=sums != 0)


def sink_on_diagonal(attentions: np.ndarray) -> tuple[np.ndarray, float]:
    """Weights of a stack with attention sinks (`attnflow.rows.Stack` ``sinks``: a learned logit
    per head in the softmax with no value, so a row ``[..., q, k]`` over the real keys sums to 1 − s)
    made row-stochastic by counting each row's sink share s on its diagonal: attending to the sink
    adds nothing to the query's stream, so that share of the row moves no information between
    tokens and the query keeps it, as it keeps its residual stream. Returns the weights (float64,
    rows summing to 1) and the largest sink share. Definition: docs/methods.md ("Attention sinks")."""
    array = np.asarray(attentions, dtype=np.float64)
    share = np.clip(1.0 - array.sum(axis=-1), 0.0, None)  # [..., q] the sink's share of each row
    moved = array.copy()
    index = np.arange(array.shape[-1])
    moved[..., index, index] += share
    return moved, float(share.max(initial=0.0))


class PruningCollapseWarning(ExplanationWarning):
    """Pruning left every row of a layer with its diagonal alone: the layer passes nothing on."""


def diagonal_only_layers(layers: np.ndarray, *, batched: bool, heads_kept: bool) -> np.ndarray:
    """Which layers keep nothing but their diagonal, from Ã ``[(batch,) layer, (head,) q, k]``.

    Returns a bool ``[layer]``: True where, in at least one sample (and in every head when
    heads are kept apart), every row's only non-zero entry is its diagonal one.
    """
    n = layers.shape[-1]
    off_diagonal = layers * (1.0 - np.eye(n))
    collapsed = ~np.any(off_diagonal > 0, axis=(-2, -1))  # [(batch,) layer, (head,)]
    if heads_kept:
        collapsed = collapsed.all(axis=-1)
    return collapsed.any(axis=0) if batched else collapsed


def prepare_layers(
    attentions: Any,
    *,
    head_fusion: HeadFusion = "mean",
    residual: Residual = "half",
    threshold: float | None = None,
    top_k: int | None = None,
    discard_ratio: float | None = None,
    prune_on: str = "attention",
    row_stochastic: bool = True,
) -> np.ndarray:
    """Validate, fuse heads, prune and add the residual: the per-layer matrices Ã.

    ``prune_on="attention"`` (default) prunes each row of the head-fused attention, adds the
    residual and renormalises the rows; ``prune_on="residual"`` adds the residual first and
    prunes (and renormalises) Ã itself. With ½(A + I) the diagonal of Ã is at least ½, so strong
    pruning on Ã keeps only the diagonal: whenever pruning leaves every row of a layer with its
    diagonal alone, a `PruningCollapseWarning` names those layers (rollout through them is the
    identity). See docs/methods.md ("Pruning").

    ``[..., layer, head, q, k]`` -> ``[..., layer, q, k]`` (or ``[..., layer, head, q, k]`` with
    ``head_fusion="none"``), float64, every row summing to 1.
    """
    if prune_on not in PRUNE_PLACES:
        raise InputError(f"prune_on must be one of {', '.join(PRUNE_PLACES)}, got {prune_on!r}")
    check_pruning(threshold=threshold, top_k=top_k, discard_ratio=discard_ratio)
    array = validate_attentions(attentions, row_stochastic=row_stochastic and residual != "renorm")
    batched = array.ndim == 5
    fused = fuse_heads(array, head_fusion)
    del array  # the float64 copy of every head: not held beside the fused maps (long inputs)
    pruning: dict[str, Any] = {"threshold": threshold, "top_k": top_k, "discard_ratio": discard_ratio}
    if all(value is None for value in pruning.values()):
        return add_residual(fused, residual)
    if prune_on == "attention":
        layers = normalise_rows(add_residual(prune_rows(fused, renormalise=False, **pruning), residual))
    else:
        layers = prune_rows(add_residual(fused, residual), **pruning)
    heads_kept = isinstance(head_fusion, str) and head_fusion == "none"
    collapsed = diagonal_only_layers(layers, batched=batched, heads_kept=heads_kept)
    if layers.shape[-1] > 1 and collapsed.any():
        chosen = ", ".join(f"{name}={value}" for name, value in pruning.items() if value is not None)
        warnings.warn(
            f"pruning ({chosen}, prune_on={prune_on!r}) left every row of layer(s) "
            f"{', '.join(str(i) for i in np.flatnonzero(collapsed))} of {collapsed.size} with its diagonal "
            "alone: those layers pass nothing between tokens and rollout through them is the identity"
            + ("; prune_on='attention' or a gentler setting avoids this" if prune_on == "residual" else ""),
            PruningCollapseWarning,
            stacklevel=2,
        )
    return layers
