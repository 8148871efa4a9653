"""The one place where the benchmark asks a method for scores: `attribute`.

Every registered method goes through the model's front door, so the benchmark never
special-cases a method: ``model.explain(texts, method)`` returns one `Explanation` per text whose
``scores [n]`` cover the trace's tokens (special tokens included).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from attnflow.methods.registry import get_method
from attnflow.model_like import ModelLike

BATCH_SIZE = 16  # texts per traced forward (and backward) pass of the front door


def attribute(
    model: ModelLike, texts: Sequence[str], method: str, targets: Sequence[int], **options: Any
) -> list[np.ndarray]:
    """Scores ``[n_tokens]`` of ``method`` for each text, explaining class (or token) ``targets[i]``
    of text i.

    Attention-only methods are called once for all texts. Target methods are called once for all
    texts with the model's own prediction as the target (the benchmark's targets are its
    predictions); a text whose traced prediction is not ``targets[i]`` (a near tie that padding
    tipped) is explained again with its target given, grouped by target.
    """
    if len(texts) != len(targets):
        raise ValueError(f"{len(texts)} texts but {len(targets)} targets")
    classes = np.asarray(targets, dtype=np.int64)
    if not get_method(method).uses_target:
        explanations = model.explain(list(texts), method, batch_size=BATCH_SIZE, **options)
        return [np.asarray(explanation.scores, dtype=np.float64) for explanation in explanations]
    explanations = model.explain(list(texts), method, batch_size=BATCH_SIZE, **options)
    scores = [np.asarray(explanation.scores, dtype=np.float64) for explanation in explanations]
    traced = np.array([-1 if e.target is None else int(e.target["index"]) for e in explanations])
    for target in np.unique(classes[traced != classes]):
        index = np.flatnonzero((classes == target) & (traced != classes))
        again = model.explain(
            [texts[int(i)] for i in index], method, target=int(target), batch_size=BATCH_SIZE, **options
        )
        for i, explanation in zip(index, again, strict=True):
            scores[i] = np.asarray(explanation.scores, dtype=np.float64)
    return scores
