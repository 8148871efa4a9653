"""The audit's options, a batch, and its step (`AuditStep`: a model replica, its `AuditStats`, one
batch of texts explained into them), which the run engine (`attnflow.runs.engine`) runs in this
process or in model replicas as Ray actors; `attnflow.dataset_audit.engine` builds the job.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from attnflow.dataset_audit.stats import AuditStats, ExampleResult
from attnflow.dataset_audit.words import SwapTable, swap_text, word_relevance
from attnflow.errors import ExplanationWarning
from attnflow.model_like import ModelLike

DEFAULT_METHOD = "attnlrp"  # the most faithful one-pass method of docs/faithfulness.md
DEFAULT_MIN_COUNT = 3  # words ranked only when in this many texts


@dataclass
class AuditOptions:
    """Everything an audit is given (the `attnflow audit` options, as a library object).

    ``task``: ``rotten-tomatoes``/``wiki-topics`` (their held-out 20 %) or a labelled CSV/JSONL
    path (``text_column``, ``label_column``); ``file``: unlabelled texts (.txt/.jsonl/.csv/.parquet);
    neither: the classifier's own task. ``samples``: examples drawn with ``seed`` (None: all).
    ``terms``/``swap``: a comma-separated list, a file, or a list (``swap`` pairs as ``a:b``).
    ``workers``: torch threads (local) or model replicas (ray). ``dtype``: the model's precision
    (``float32``, ``bfloat16``, ``float16``; `attnflow.load`). ``versus``: a second classifier audited
    over the same texts and compared with ``model`` (`attnflow.dataset_audit.versus`);
    ``versus_data``: a second domain (a task name, ``tweets`` or a labelled file) that ``model``
    reads beside ``task``, compared the same way.
    """

    model: str = "minilm-sentiment"
    versus: str | None = None
    versus_data: str | None = None
    task: str | None = None
    file: str | None = None
    method: str = DEFAULT_METHOD
    samples: int | None = None
    seed: int = 0
    terms: str | Sequence[str] | None = None
    swap: str | Sequence[str] | None = None
    min_count: int = DEFAULT_MIN_COUNT
    text_column: str = "text"
    label_column: str = "label"
    batch_size: int = 16
    checkpoint_every: int = 10
    engine: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    device: str = "auto"
    dtype: str = "float32"
    quiet: bool = False


@dataclass(frozen=True)
class Batch:
    """Consecutive examples: ``first`` is the index of the first in the audited set (of its side:
    ``side`` 1 is the second domain of ``--versus-data``)."""

    first: int
    texts: tuple[str, ...]
    labels: tuple[int, ...] | None
    side: int = 0

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class AuditStep:
    """The audit's `attnflow.runs.engine.Step`: a model replica and its scorer, an `AuditStats`,
    a batch of texts explained with ``options.method`` (`audit_batch`)."""

    options: AuditOptions
    n_classes: int
    swaps: SwapTable

    def load(self, device: str) -> tuple[ModelLike, Any]:
        from attnflow.model import load

        return with_scorer(load(self.options.model, device=device, dtype=self.options.dtype))

    def empty(self, context: Any) -> AuditStats:  # noqa: ARG002 - the Step protocol
        return AuditStats(self.n_classes)

    def run(self, context: tuple[ModelLike, Any], stats: AuditStats, batch: Batch) -> AuditStats:
        model, scorer = context
        for result in audit_batch(model, self.options.method, batch, self.swaps, scorer):
            stats.update(result)
        return stats


def with_scorer(model: ModelLike) -> tuple[ModelLike, Any]:
    """The step's context: the model and its batched classifier scorer (for the counterfactuals)."""
    from attnflow.evaluate.scorer import ClassifierScorer

    return model, ClassifierScorer(model)


def audit_batch(
    model: ModelLike, method: str, batch: Batch, swaps: SwapTable, scorer: Any = None
) -> list[ExampleResult]:
    """One batch: ``model.explain`` (the predicted class explained, one traced pass for the
    batch), words per example and, for texts holding a swap word, the class probabilities of the
    text and its counterfactual (one batched forward pass without gradients); a text holding a
    swap word with several partners (`attnflow.dataset_audit.words.swap_text`) is not swapped but
    marked ``ambiguous``."""
    with warnings.catch_warnings():  # kept as each explanation's notes and counted, not printed per text
        warnings.simplefilter("ignore", ExplanationWarning)
        explanations = model.explain(list(batch.texts), method, batch_size=len(batch.texts))
    swaps_found = {offset: swap_text(text, swaps) for offset, text in enumerate(batch.texts)} if swaps else {}
    made = {offset: swap.text for offset, swap in swaps_found.items() if swap is not None and swap.text is not None}
    counterfactuals = _counterfactuals(model, batch.texts, made, scorer)
    results = []
    for offset, (text, explanation) in enumerate(zip(batch.texts, explanations, strict=True)):
        swap = swaps_found.get(offset)
        prediction = explanation.prediction  # a classifier's trace always records it
        results.append(
            ExampleResult(
                index=batch.first + offset,
                text=text,
                predicted=int(prediction["index"]),
                probability=float(prediction["probability"]),
                label=None if batch.labels is None else int(batch.labels[offset]),
                words=word_relevance(text, explanation.offsets, explanation.special_mask, explanation.scores),
                tokens=list(explanation.tokens),
                offsets=explanation.offsets.tolist(),
                special_mask=explanation.special_mask.tolist(),
                scores=explanation.scores.tolist(),
                swapped=counterfactuals.get(offset),
                ambiguous=() if swap is None else swap.ambiguous,
                noted=bool(explanation.notes),
            )
        )
    return results


def _counterfactuals(model: ModelLike, texts: Sequence[str], swapped: dict[int, str], scorer: Any) -> dict[int, dict]:
    """``{offset: record}`` for the texts with a counterfactual (``swapped``: offset -> swapped text)."""
    from attnflow.evaluate.scorer import ClassifierScorer

    if not swapped:
        return {}
    scorer = scorer or ClassifierScorer(model)
    pairs = [text for offset in swapped for text in (texts[offset], swapped[offset])]
    encoded = model.tokenizer(pairs, truncation=True, max_length=model.max_length)["input_ids"]
    probabilities = scorer.probabilities(encoded)  # [2 * text, class]: original, swapped, ...
    found = {}
    for row, (offset, text) in enumerate(swapped.items()):
        before, after = probabilities[2 * row], probabilities[2 * row + 1]
        predicted = int(np.argmax(before))
        found[offset] = {
            "text": text,
            "predicted_before": predicted,
            "predicted_after": int(np.argmax(after)),
            "p_before": float(before[predicted]),
            "p_after": float(after[predicted]),
            "delta_p": float(after[predicted] - before[predicted]),
        }
    return found
