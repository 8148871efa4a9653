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
