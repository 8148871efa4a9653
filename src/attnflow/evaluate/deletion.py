"""Perturbed inputs, rebuilt from token ids, as the faithfulness metrics build them: the functions of
`attnflow.methods.deletion` (they live below the methods that re-run the model, which perturb inputs
too; evaluate sits above the methods and imports them from there), and `metric_inputs`, every input
one ranking's metrics score."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from attnflow.evaluate.metrics import top_count
from attnflow.methods.deletion import REPLACE_MODES, only_top, perturb, without_top

__all__ = ["REPLACE_MODES", "metric_inputs", "only_top", "perturb", "without_top"]


def metric_inputs(
    ids: Sequence[int],
    ranking: np.ndarray,
    bins: Sequence[float],
    curve_points: int,
    replace: str,
    mask_id: int | None,
) -> list[tuple[int, ...]]:
    """The ``2 * len(bins) + curve_points`` inputs one content ranking's metrics score, in order:
    without its top k of the ``m`` content tokens for each bin (comprehensiveness), with only them
    (sufficiency), and without its top fraction f at each deletion-curve point (f on [0, 1])."""
    m = len(ranking)
    fractions = np.linspace(0.0, 1.0, curve_points)
    return (
        [without_top(ids, ranking, top_count(k, m), replace, mask_id) for k in bins]
        + [only_top(ids, ranking, top_count(k, m), replace, mask_id) for k in bins]
        + [without_top(ids, ranking, top_count(f, m), replace, mask_id) for f in fractions]
    )
