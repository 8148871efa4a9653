"""`AuditStats`: what the audit accumulates, mergeable and saved as plain JSON.

Memory is flat in the number of examples: per word and predicted class seven sums, per word and
outcome (correct / error) the same seven, and three bounded lists (the most confident errors, the
largest counterfactual changes, the first texts left unswapped as ambiguous). Nothing is kept per
example beyond those lists.

Word sums, per (group, word): ``[examples, occurrences, relevance, relevance², |relevance|,
relevance⁺, (relevance⁺)²]`` where ``examples`` counts examples holding the word, ``relevance``
sums the word's per-example relevance (`attnflow.dataset_audit.words.word_relevance`; signed for
signed methods), ``relevance²`` its square (for the confidence interval over examples),
``|relevance|`` its magnitude (what the term audit compares: a word the model relies on against
its prediction is relied on too) and ``relevance⁺ = max(relevance, 0)`` its positive part, the
relevance *for* the explained (predicted) class, with its square (what the word tables rank; for
non-negative methods it is the relevance). Everything merges by addition, so the local engine, Ray
workers and a resumed run all end with the same numbers (up to float rounding between engines).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

EXAMPLES, OCCURRENCES, RELEVANCE, SQUARES, MAGNITUDE, POSITIVE, POSITIVE_SQUARES = range(7)
KEPT = 25  # errors and counterfactual examples kept for the report
KEPT_AMBIGUOUS = 5  # texts kept as examples of a swap that cannot be made


@dataclass
class ExampleResult:
    """One audited example: its index in the audited set, prediction, label (or None), words,
    the token map (tokens, offsets, scores) and its counterfactual (or None)."""

    index: int
    text: str
    predicted: int
    probability: float
    label: int | None
    words: dict[str, tuple[int, float]]
    tokens: list[str]
    offsets: list[list[int]]
    special_mask: list[bool]
    scores: list[float]
    swapped: dict[str, Any] | None = None  # {"text", "predicted_before/after", "p_before/after", "delta_p"}
    ambiguous: tuple[str, ...] = ()  # swap words with several partners: the text was not swapped
    noted: bool = False  # the method attached a note (an ExplanationWarning, e.g. a collapsed row)


@dataclass
class AuditStats:
    """The accumulator (see the module doc). ``n_classes``: the classifier's classes."""

    n_classes: int
    examples: list[int] = field(default_factory=list)  # [class] examples predicted as it
    words: list[dict[str, list[float]]] = field(default_factory=list)  # [class] word -> sums
    outcome_examples: list[int] = field(default_factory=lambda: [0, 0])  # [correct, error]
    outcome_words: list[dict[str, list[float]]] = field(default_factory=lambda: [{}, {}])
    confusion: list[list[int]] = field(default_factory=list)  # [label, predicted]
    swaps: list[float] = field(default_factory=lambda: [0, 0, 0.0, 0.0])  # [texts, flips, Σ Δp, Σ Δp²]
    errors: list[list[Any]] = field(default_factory=list)  # heap of [probability, -index, record]
    changes: list[list[Any]] = field(default_factory=list)  # heap of [|Δp|, -index, record]
    unswapped: int = 0  # texts not swapped: they hold a swap word with several partners
    ambiguous: dict[str, int] = field(default_factory=dict)  # such a word -> texts holding it
    ambiguous_texts: list[list[Any]] = field(default_factory=list)  # heap of [0, -index, {index, text, words}]
    noted: int = 0  # examples whose explanation carries a note of the method

    def __post_init__(self) -> None:
        if not self.examples:
            self.examples = [0] * self.n_classes
            self.words = [{} for _ in range(self.n_classes)]
            self.confusion = [[0] * self.n_classes for _ in range(self.n_classes)]

    @property
    def n_samples(self) -> int:
        return sum(self.examples)

    def update(self, result: ExampleResult) -> None:
        self.examples[result.predicted] += 1
        self.noted += int(result.noted)
        _add_words(self.words[result.predicted], result.words)
        if result.label is not None:
            wrong = int(result.label != result.predicted)
            self.outcome_examples[wrong] += 1
            _add_words(self.outcome_words[wrong], result.words)
            self.confusion[result.label][result.predicted] += 1
            if wrong:
                _keep(self.errors, [result.probability, -result.index, example_record(result)])
        if result.swapped is not None:
            delta = result.swapped["delta_p"]
            flipped = result.swapped["predicted_after"] != result.swapped["predicted_before"]
            self.swaps[0] += 1
            self.swaps[1] += int(flipped)
            self.swaps[2] += delta
            self.swaps[3] += delta * delta
            if flipped:
                _keep(self.changes, [abs(delta), -result.index, example_record(result)])
        if result.ambiguous:
            self.unswapped += 1
            for word in result.ambiguous:
                self.ambiguous[word] = self.ambiguous.get(word, 0) + 1
            record = {"index": result.index, "text": result.text, "words": list(result.ambiguous)}
            _keep(self.ambiguous_texts, [0.0, -result.index, record], KEPT_AMBIGUOUS)

    def merge(self, other: "AuditStats") -> "AuditStats":
        """Add ``other`` into this accumulator (in place) and return it."""
        for mine, theirs in zip(self.words, other.words, strict=True):
            merge_words(mine, theirs)
        for mine, theirs in zip(self.outcome_words, other.outcome_words, strict=True):
            merge_words(mine, theirs)
        self.examples = [a + b for a, b in zip(self.examples, other.examples, strict=True)]
        self.outcome_examples = [a + b for a, b in zip(self.outcome_examples, other.outcome_examples, strict=True)]
        self.confusion = [
            [a + b for a, b in zip(row, other_row, strict=True)]
            for row, other_row in zip(self.confusion, other.confusion, strict=True)
        ]
        self.swaps = [a + b for a, b in zip(self.swaps, other.swaps, strict=True)]
        self.noted += other.noted
        for entry in other.errors:
            _keep(self.errors, entry)
        for entry in other.changes:
            _keep(self.changes, entry)
        self.unswapped += other.unswapped
        for word, texts in other.ambiguous.items():
            self.ambiguous[word] = self.ambiguous.get(word, 0) + texts
        for entry in other.ambiguous_texts:
            _keep(self.ambiguous_texts, entry, KEPT_AMBIGUOUS)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state (floats survive a JSON round trip exactly)."""
        return {
            "n_classes": self.n_classes,
            "examples": self.examples,
            "words": self.words,
            "outcome_examples": self.outcome_examples,
            "outcome_words": self.outcome_words,
            "confusion": self.confusion,
            "swaps": self.swaps,
            "errors": sorted(self.errors, key=_order),
            "changes": sorted(self.changes, key=_order),
            "noted": self.noted,
            "unswapped": self.unswapped,
            "ambiguous": self.ambiguous,
            "ambiguous_texts": sorted(self.ambiguous_texts, key=_order),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "AuditStats":
        stats = cls(**state)
        heapq.heapify(stats.errors)
        heapq.heapify(stats.changes)
        heapq.heapify(stats.ambiguous_texts)
        return stats

    def kept_errors(self) -> list[dict[str, Any]]:
        """The kept misclassified examples, most confident first."""
        return [entry[2] for entry in sorted(self.errors, key=_order, reverse=True)]

    def kept_changes(self) -> list[dict[str, Any]]:
        """The kept flipping counterfactuals, largest |Δp| first."""
        return [entry[2] for entry in sorted(self.changes, key=_order, reverse=True)]

    def kept_ambiguous(self) -> list[dict[str, Any]]:
        """The first texts (by index) left unswapped because a swap word has several partners."""
        return [entry[2] for entry in sorted(self.ambiguous_texts, key=_order, reverse=True)]


def _order(entry: list[Any]) -> tuple[float, int]:
    return (entry[0], entry[1])


def _keep(heap: list[list[Any]], entry: list[Any], kept: int = KEPT) -> None:
    """Keep the ``kept`` largest entries by (key, -index): ties go to the earlier example, so the
    kept set does not depend on the order in which entries arrive."""
    if len(heap) < kept:
        heapq.heappush(heap, entry)
    elif _order(entry) > _order(heap[0]):
        heapq.heapreplace(heap, entry)


def _add_words(table: dict[str, list[float]], words: dict[str, tuple[int, float]]) -> None:
    for word, (occurrences, relevance) in words.items():
        positive = max(relevance, 0.0)
        row = [1, occurrences, relevance, relevance * relevance, abs(relevance), positive, positive * positive]
        sums = table.get(word)
        if sums is None:
            table[word] = row
        else:
            for column, value in enumerate(row):
                sums[column] += value


def merge_words(table: dict[str, list[float]], other: dict[str, list[float]]) -> None:
    """Add the word sums of ``other`` into ``table`` (in place)."""
    for word, sums in other.items():
        mine = table.get(word)
        table[word] = list(sums) if mine is None else [a + b for a, b in zip(mine, sums, strict=True)]


def example_record(result: ExampleResult) -> dict[str, Any]:
    """What the audit keeps of one example it shows: its prediction, label, text and map."""
    return {
        "index": result.index,
        "text": result.text,
        "predicted": result.predicted,
        "probability": result.probability,
        "label": result.label,
        "tokens": result.tokens,
        "offsets": result.offsets,
        "special_mask": result.special_mask,
        "scores": result.scores,
        "swapped": result.swapped,
    }
