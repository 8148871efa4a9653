"""Means with standard errors and their 95 % intervals, shared by every report that averages over
samples (the faithfulness benchmark, the audit, patching and routes over a dataset)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95 % interval: mean ± Z95 · se


def mean_se(values: Sequence[float] | np.ndarray) -> tuple[Any, Any]:
    """Mean and standard error of the mean (``std(ddof=1) / sqrt(count)``, 0 for a single sample)
    over the first axis of ``[sample]`` or ``[sample, point]`` values. NaN samples (a quantity
    undefined for that sample) are left out of 1-D values; 2-D values must be finite. Floats for
    1-D values, ``[point]`` arrays for 2-D ones."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim == 1:
        array = array[~np.isnan(array)]
    if array.shape[0] == 0:
        raise ValueError("no samples to average")
    mean = array.mean(axis=0)
    se = array.std(axis=0, ddof=1) / math.sqrt(array.shape[0]) if array.shape[0] > 1 else np.zeros_like(mean)
    if array.ndim == 1:
        return float(mean), float(se)
    return mean, se


def weighted_pearson(a: Any, b: Any, weights: Any) -> float:
    """Pearson r of ``[point]`` values ``a`` and ``b`` with each point counted ``weights`` times
    (weighted means, covariance and variances; NaN when either is constant). With weights the
    inverse of each point's chance of being sampled, it estimates the r of the whole population
    the sample was drawn from (a Horvitz–Thompson ratio estimate)."""
    x, y, w = (np.ravel(np.asarray(values, dtype=np.float64)) for values in (a, b, weights))
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    w = w / w.sum()
    dx, dy = x - w @ x, y - w @ y
    return float((w @ (dx * dy)) / math.sqrt((w @ (dx * dx)) * (w @ (dy * dy))))


def weighted_ranks(values: Any, weights: Any) -> np.ndarray:
    """``[point]`` mid-ranks of ``values`` in the population the weights stand for: a point's rank
    is the total weight of the points below it plus half the weight of its ties (itself included);
    with unit weights, scipy's average ranks minus ½."""
    x, w = np.ravel(np.asarray(values, dtype=np.float64)), np.ravel(np.asarray(weights, dtype=np.float64))
    unique, group = np.unique(x, return_inverse=True)  # [distinct value], [point] -> its value's index
    per_value = np.bincount(group, weights=w, minlength=unique.size)
    below = np.cumsum(per_value) - per_value
    return (below + per_value / 2)[group]


def weighted_spearman(a: Any, b: Any, weights: Any) -> float:
    """Spearman ρ of ``a`` and ``b`` with each point counted ``weights`` times: the weighted Pearson
    r of their weighted mid-ranks (`weighted_ranks`)."""
    return weighted_pearson(weighted_ranks(a, weights), weighted_ranks(b, weights), weights)
