"""Faithfulness metrics as pure functions on arrays (no model, no method).

Notation: an example has ``n`` tokens, ``m`` of them content tokens (special tokens are never
ranked, removed or kept-only). ``p_c`` is the probability of the class c that the model predicts
for the untouched input; every perturbed input is scored on that same class.

- comprehensiveness at k: ``p_c(x) - p_c(x without its top-ceil(k*m) tokens)`` (higher is better);
- sufficiency at k: ``p_c(x) - p_c(x with only its top-ceil(k*m) content tokens)`` (lower is better);
- AOPC: the mean over the bins `BINS` (ERASER's definition);
- deletion curve: ``p_c`` after removing the top ``ceil(f*m)`` tokens for ``f`` on a regular grid of
  [0, 1]; its area under the curve by the trapezoid rule (lower is better);
- agreement: Spearman's rho between two score vectors on the content tokens.
"""

from __future__ import annotations

import math

import numpy as np

from attnflow.methods.agreement import spearman

BINS: tuple[float, ...] = (0.01, 0.05, 0.10, 0.20, 0.50)


def top_count(fraction: float, n_content: int) -> int:
    """``ceil(fraction * n_content)``, robust to float noise (0.1 * 30 is 3, not 4)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"a fraction must lie in [0, 1], got {fraction}")
    return min(n_content, math.ceil(round(fraction * n_content, 9)))


def content_ranking(scores: np.ndarray, special_mask: np.ndarray) -> np.ndarray:
    """Positions of the content tokens, most relevant first (``[m]``). Ties keep text order, so a
    constant attribution ranks left to right. Non-finite scores are an error, not a rank."""
    scores = np.asarray(scores, dtype=np.float64)
    special_mask = np.asarray(special_mask, dtype=bool)
    if scores.shape != special_mask.shape:
        raise ValueError(f"scores {scores.shape} and special_mask {special_mask.shape} differ in shape")
    content = np.flatnonzero(~special_mask)
    if not np.all(np.isfinite(scores[content])):
        raise ValueError("attribution scores contain NaN or infinity")
    return content[np.argsort(-scores[content], kind="stable")]


def aopc(p_full: np.ndarray, p_perturbed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-bin drops and their mean: ``p_full [sample]``, ``p_perturbed [sample, bin]`` ->
    ``(drops [sample, bin], aopc [sample])``."""
    p_full = np.asarray(p_full, dtype=np.float64)
    drops = p_full[:, None] - np.asarray(p_perturbed, dtype=np.float64)
    return drops, drops.mean(axis=1)


def deletion_auc(curve: np.ndarray) -> np.ndarray:
    """Area under deletion curves ``[sample, point]`` sampled at equally spaced fractions of
    [0, 1] (first point: nothing removed; last: every content token removed) -> ``[sample]``."""
    curve = np.asarray(curve, dtype=np.float64)
    if curve.shape[-1] < 2:
        raise ValueError("a deletion curve needs at least two points")
    step = 1.0 / (curve.shape[-1] - 1)
    return step * (curve[..., 1:] + curve[..., :-1]).sum(axis=-1) / 2.0


def rank_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho of two ``[m]`` vectors (`attnflow.methods.agreement.spearman`), where a
    constant vector, which carries no ranking, counts as agreeing with another constant one (1.0:
    nothing differs) and not with a varying one (0.0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"cannot correlate shapes {a.shape} and {b.shape}")
    constant_a, constant_b = np.ptp(a) == 0 if a.size else True, np.ptp(b) == 0 if b.size else True
    if constant_a or constant_b:
        return 1.0 if constant_a and constant_b else 0.0
    return spearman(a, b)


def key_rank(scores: np.ndarray, special_mask: np.ndarray, key_mask: np.ndarray) -> int:
    """The 1-based rank, among the content tokens ranked by ``scores`` (`content_ranking`), of the
    first token of ``key_mask [token]`` (the token the answer depends on, in a probe): 1 when the
    map ranks it first."""
    ranking = content_ranking(np.asarray(scores), np.asarray(special_mask, dtype=bool))
    hits = np.flatnonzero(np.asarray(key_mask, dtype=bool)[ranking])
    if not len(hits):
        raise ValueError("no content token lies in the key span")
    return int(hits[0]) + 1
