"""The one place where the benchmark asks a method for scores: `attribute`.

Every registered method goes through the model's front door, so the benchmark never
special-cases a method: ``model.explain(texts, method, target=c)`` returns one `Explanation` per
text whose ``scores [n]`` cover the trace's tokens (special tokens included).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from attnflow.methods.registry import get_method

BATCH_SIZE = 16  # texts per traced forward (and backward) pass of the front door


def attribute(
    model: Any, texts: Sequence[str], method: str, targets: Sequence[int], **options: Any
) -> list[np.ndarray]:
    """Scores ``[n_tokens]`` of ``method`` for each text, explaining class ``targets[i]`` of text i.

    Methods that depend on a target are called once per target class present; the others
    (attention-only methods) once for all texts.
    """
    if len(texts) != len(targets):
        raise ValueError(f"{len(texts)} texts but {len(targets)} targets")
    classes = np.asarray(targets, dtype=np.int64)
    if not get_method(method).uses_target:
        explanations = model.explain(list(texts), method, batch_size=BATCH_SIZE, **options)
        return [np.asarray(explanation.scores, dtype=np.float64) for explanation in explanations]
    scores: list[np.ndarray] = [np.empty(0)] * len(texts)
    for target in np.unique(classes):
        index = np.flatnonzero(classes == target)
        explanations = model.explain(
            [texts[int(i)] for i in index], method, target=int(target), batch_size=BATCH_SIZE, **options
        )
        for i, explanation in zip(index, explanations, strict=False):
            scores[i] = np.asarray(explanation.scores, dtype=np.float64)
    return scores
