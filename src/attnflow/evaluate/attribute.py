"""The one place where the benchmark asks a method for scores: `attribute`.

Every registered method goes through the model's front door, so the benchmark never
special-cases a method: ``model.explain(texts, method, target=c)`` returns one `Explanation` per
text whose ``scores [n]`` cover the trace's tokens (special tokens included).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def attribute(model: Any, texts: Sequence[str], method: str, targets: Sequence[int], **options: Any) -> list[np.ndarray]:
    """Scores ``[n_tokens]`` of ``method`` for each text, explaining class ``targets[i]`` of text i.

    Texts are explained in one call per target class (the front door batches them).
    """
    if len(texts) != len(targets):
        raise ValueError(f"{len(texts)} texts but {len(targets)} targets")
    scores: list[np.ndarray | None] = [None] * len(texts)
    targets = np.asarray(targets, dtype=np.int64)
    for target in np.unique(targets):
        index = np.flatnonzero(targets == target)
        explanations = _explain(model, [texts[i] for i in index], method, int(target), options)
        for i, explanation in zip(index, explanations):
            scores[i] = np.asarray(explanation.scores, dtype=np.float64)
    return scores  # type: ignore[return-value]


def _explain(model: Any, texts: list[str], method: str, target: int, options: dict[str, Any]) -> list[Any]:
    if hasattr(model, "explain"):
        return list(model.explain(texts, method, target=target, **options))
    # Until the front door exists: attention-only methods on traces (they have no target).
    from attnflow.explanation import explain

    return [explain(trace, method, **options) for trace in model.trace(texts)]
