"""Per-layer diagnostics of relevance matrices: is a layer's rollout diffuse or collapsed?

Rollout degenerates in two ways, and both show in its rows (each row i of R⁽ˡ⁾ is a distribution
over the input tokens j):

* **diffusion**: rows drift towards the uniform distribution; their Shannon entropy approaches its
  maximum log n (log(i + 1) for row i of a causal decoder, which can only reach keys 0 … i);
* **collapse**: the rows pile their mass on one token (often [CLS] or [SEP]).

Definitions (every row is first divided by its sum; all-zero rows and, for the entropy ratio, rows
with a single reachable key are left out of the means):

* row entropy Hᵢ = −Σⱼ pᵢⱼ log pᵢⱼ (natural log, 0 log 0 = 0);
* normalised entropy: mean over rows of Hᵢ / log(keys reachable by row i), in [0, 1];
* special share: mean over rows of Σ_{j special} pᵢⱼ (mass on [CLS], [SEP], <s>, ...);
* top token: the key j with the largest column mean cⱼ = meanᵢ pᵢⱼ, and its share cⱼ;
* flags: ``diffuse`` when the normalised entropy ≥ ``diffusion`` (default 0.9), ``collapsed``
  when the top token's share ≥ ``collapse`` (default 0.5).

Pure numpy functions; shapes are ``[..., query, key]`` with any leading axes (layers, heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attnflow.errors import InputError
from attnflow.methods.transforms import normalise_rows

DIFFUSION_THRESHOLD = 0.9
COLLAPSE_THRESHOLD = 0.5


def row_distributions(matrices: Any) -> np.ndarray:
    """``[..., query, key]`` non-negative matrices with every row divided by its sum (zero rows stay 0)."""
    array = np.asarray(matrices, dtype=np.float64)
    if array.ndim < 2 or array.shape[-1] != array.shape[-2]:
        raise InputError(f"expected square [..., query, key] matrices, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise InputError("matrices contain NaN or infinite values")
    if np.any(array < 0):
        raise InputError("row diagnostics need non-negative matrices (a distribution per row)")
    return normalise_rows(array)  # an all-zero row stays 0


def collapse_note(
    scores: Any,
    tokens: list[str],
    own: int | None = None,
    special_mask: Any = None,
    threshold: float = COLLAPSE_THRESHOLD,
    family: Any = None,
) -> str | None:
    """A note when one word token holds at least ``threshold`` of a saliency row (``[key]``
    non-negative scores), the collapse the per-layer diagnostics flag; on the first token it names
    the attention sink (a decoder without a BOS token parks attention on its first word, and rollout
    compounds it through the layers). None when the row is spread out, has negative scores (a
    gradient attribution), or its top token is the row's ``own`` position (the residual's share) or
    a special token (``special_mask``: the summary line reports the special tokens' share). The
    note recommends only methods that support ``family`` (the model's adapter row; None: any)."""
    from attnflow.tokens import display_token

    values = np.asarray(scores, dtype=np.float64)
    total = values.sum()
    if values.size < 2 or np.any(values < 0) or not total > 0:
        return None
    top = int(np.argmax(values))
    share = values[top] / total
    if share < threshold or top == own or (special_mask is not None and bool(np.asarray(special_mask)[top])):
        return None
    if top == 0:
        return (
            f"{share:.0%} of the relevance is on the first token {display_token(tokens[0])!r}: the attention-sink "
            "collapse (models park attention on their first token, and composing layers piles it up there); "
            + _sink_remedy(family)
        )
    return f"{share:.0%} of the relevance is on one token, {display_token(tokens[top])!r} (a collapsed row)"


VALUE_AWARE = ("norm_rollout", "alti")  # methods that weigh attention by what the tokens carry


def _sink_remedy(family: Any) -> str:
    """What to run instead of a collapsed attention method: the value-aware methods the model's
    family supports, else its target methods (--method auto)."""
    from attnflow.methods.registry import methods_for

    usable = [name for name in VALUE_AWARE if family is None or name in methods_for(family)]
    if usable:
        return f"a value-aware method ({', '.join(usable)}) shows what the other tokens carry"
    return "a target method (--method auto) shows what the prediction rests on"


def row_entropy(matrices: Any) -> np.ndarray:
    """Shannon entropy (nats) of each row, normalised to sum 1: ``[..., query, key]`` -> ``[..., query]``."""
    return _entropy(row_distributions(matrices))


def _entropy(distributions: np.ndarray) -> np.ndarray:
    from scipy.special import xlogy  # scipy loads on first use, not with attnflow

    return -xlogy(distributions, distributions).sum(axis=-1)  # xlogy(0, 0) = 0


def max_row_entropy(n: int, causal: bool = False) -> np.ndarray:
    """``[query]`` the largest possible entropy of each row: log n, or log(i + 1) for causal row i."""
    reachable = np.arange(1, n + 1) if causal else np.full(n, n)
    return np.log(reachable.astype(np.float64))


def is_causal(attentions: Any, tolerance: float = 1e-6) -> bool:
    """True when no query attends to a later key (``[..., query, key]`` lower-triangular)."""
    array = np.asarray(attentions)
    return array.shape[-1] > 1 and not np.any(np.triu(array, k=1) > tolerance)


@dataclass
class LayerDiagnostics:
    """Row diagnostics of a stack of matrices ``[..., layer, query, key]``; every field is ``[..., layer]``.

    Attributes:
        entropy: mean row entropy in nats.
        max_entropy: the uniform maximum, log n (the mean over rows of log(i + 1) when causal).
        normalized_entropy: mean over rows of entropy / its row's maximum, in [0, 1].
        special_share: mean over rows of the mass on special tokens (0 without a special mask).
        top_token: index of the key with the largest mean mass.
        top_share: that key's mean mass, in [0, 1].
        diffuse / collapsed: the flags (see the module docstring for the thresholds).
    """

    entropy: np.ndarray
    max_entropy: np.ndarray
    normalized_entropy: np.ndarray
    special_share: np.ndarray
    top_token: np.ndarray
    top_share: np.ndarray
    diffuse: np.ndarray
    collapsed: np.ndarray

    def to_dict(self) -> dict[str, list]:
        return {name: np.asarray(value).tolist() for name, value in vars(self).items()}


def layer_diagnostics(
    matrices: Any,
    special_mask: Any = None,
    causal: bool = False,
    diffusion: float = DIFFUSION_THRESHOLD,
    collapse: float = COLLAPSE_THRESHOLD,
) -> LayerDiagnostics:
    """Entropy, special-token share, top token and flags of each matrix in ``[..., query, key]``.

    Args:
        matrices: ``[..., query, key]`` non-negative (e.g. layerwise rollout ``[layer, q, k]`` or
            per-head ``[layer, head, q, k]``); rows are normalised to sum 1 first.
        special_mask: ``[key]`` bool, True for special tokens; None: no special tokens.
        causal: row i can only reach keys 0 … i, so its maximum entropy is log(i + 1).
        diffusion / collapse: flag thresholds on the normalised entropy and the top share.

    Returns:
        `LayerDiagnostics` whose fields have the leading shape ``[...]`` of ``matrices``.
    """
    if not 0.0 < diffusion <= 1.0 or not 0.0 < collapse <= 1.0:
        raise InputError(f"thresholds must lie in (0, 1], got diffusion={diffusion}, collapse={collapse}")
    p = row_distributions(matrices)
    n = p.shape[-1]
    live = p.sum(axis=-1) > 0  # [..., query]: rows that hold any mass
    entropy = _entropy(p)
    row_max = np.broadcast_to(max_row_entropy(n, causal), entropy.shape)
    informative = live & (row_max > 0)
    ratio = np.divide(entropy, row_max, out=np.zeros_like(entropy), where=informative)
    special = np.zeros(n, dtype=bool) if special_mask is None else np.asarray(special_mask, dtype=bool).reshape(n)
    special_per_row = p[..., special].sum(axis=-1)
    live_rows = np.maximum(live.sum(axis=-1), 1)[..., None]
    column_mass = p.sum(axis=-2) / live_rows  # [..., key]: mean over live rows (dead rows are 0)
    top_token = column_mass.argmax(axis=-1)
    top_share = np.take_along_axis(column_mass, top_token[..., None], axis=-1)[..., 0]
    normalized = _masked_mean(ratio, informative, axis=-1)
    return LayerDiagnostics(
        entropy=_masked_mean(entropy, live, axis=-1),
        max_entropy=_masked_mean(np.asarray(row_max), live, axis=-1),
        normalized_entropy=normalized,
        special_share=_masked_mean(special_per_row, live, axis=-1),
        top_token=top_token,
        top_share=top_share,
        diffuse=normalized >= diffusion,
        collapsed=top_share >= collapse,
    )


def _masked_mean(values: np.ndarray, mask: np.ndarray, axis: int) -> np.ndarray:
    """Mean of ``values`` over ``axis`` where ``mask`` (broadcast) is True; 0 where nothing is."""
    weights = np.broadcast_to(mask, values.shape).astype(np.float64)
    counts = weights.sum(axis=axis)
    totals = (values * weights).sum(axis=axis)
    return np.divide(totals, counts, out=np.zeros_like(totals), where=counts > 0)
