"""Agreement between two kinds of evidence that speak of the same thing, measured, never averaged.

Which input tokens matter (each a ``[token]`` score vector over the same tokens, special tokens
left out): Spearman ρ of the two rankings and the share of their top-k tokens they have in common
(`attnflow.methods.agreement`, what `attnflow compare` measures). Which layer (each an index of the
stream leaving a layer, or None): whether they name the same layer, and how far apart they are.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from attnflow.methods.agreement import spearman, top_k_overlap

TOP_K = 3  # tokens compared by the top-k overlap (fewer when the text has fewer content tokens)


def token_agreement(scores: Mapping[str, Any], keep: Any, k: int = TOP_K) -> list[dict]:
    """For each pair of evidence in ``scores`` (name -> ``[token]`` scores, in the order given): ρ
    and the top-k overlap over the tokens ``keep`` marks (``k``: at most their count), with ``k``."""
    kept = np.flatnonzero(np.asarray(keep, dtype=bool))
    names = list(scores)
    k = max(1, min(k, kept.size))
    pairs = []
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a = np.asarray(scores[first], dtype=np.float64)[kept]
            b = np.asarray(scores[second], dtype=np.float64)[kept]
            rho = spearman(a, b)
            pairs.append(
                {
                    "first": first,
                    "second": second,
                    "spearman": None if math.isnan(rho) else rho,
                    "top_k_overlap": top_k_overlap(a, b, k) if kept.size else None,
                    "k": k,
                }
            )
    return pairs


def layer_agreement(layers: Mapping[str, int | None]) -> dict[str, Any]:
    """Whether the evidence in ``layers`` (name -> the layer it names, None: it names none) names
    one layer: ``same`` (True, False, or None when fewer than two name a layer), ``spread`` (the
    largest layer minus the smallest) and each pair's difference."""
    named = {name: layer for name, layer in layers.items() if layer is not None}
    values = list(named.values())
    pairs = [
        {"first": a, "second": b, "difference": named[b] - named[a]}
        for i, a in enumerate(named)
        for b in list(named)[i + 1 :]
    ]
    return {
        "layers": dict(layers),
        "same": None if len(values) < 2 else len(set(values)) == 1,
        "spread": None if len(values) < 2 else max(values) - min(values),
        "pairs": pairs,
    }
