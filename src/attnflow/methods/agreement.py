"""Agreement between two score vectors over the same tokens (used by `attnflow compare`).

* Spearman ρ: the Pearson correlation of the two rank vectors (tied scores share their average
  rank); undefined (NaN) when either vector is constant or fewer than two tokens are compared.
* top-k overlap: |top_k(a) ∩ top_k(b)| / k, the share of one's k highest-scoring tokens that are
  also among the other's; ties at the k-th place are broken by position (the earlier token wins).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnflow.errors import InputError


def _pair(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise InputError(f"score vectors differ in length: {a.size} and {b.size}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise InputError("scores contain NaN or infinite values")
    return a, b


def spearman(a: Any, b: Any) -> float:
    """Spearman rank correlation of two ``[token]`` score vectors (NaN when undefined)."""
    a, b = _pair(a, b)
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    from scipy.stats import rankdata  # scipy.stats takes ~0.5 s to import: only when ranking

    rank_a, rank_b = rankdata(a), rankdata(b)
    return float(np.corrcoef(rank_a, rank_b)[0, 1])


def top_k(scores: Any, k: int) -> np.ndarray:
    """Indices of the ``k`` highest scores, best first (earlier position first among ties)."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    return np.argsort(-scores, kind="stable")[: max(0, int(k))]


def top_k_overlap(a: Any, b: Any, k: int) -> float:
    """|top_k(a) ∩ top_k(b)| / k for ``1 <= k <= len(a)``."""
    a, b = _pair(a, b)
    if isinstance(k, bool) or int(k) != k or not 1 <= k <= a.size:
        raise InputError(f"k must be an integer in [1, {a.size}], got {k}")
    return len(set(top_k(a, k).tolist()) & set(top_k(b, k).tolist())) / k
