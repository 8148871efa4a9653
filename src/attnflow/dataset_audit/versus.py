"""``attnflow audit --versus MODEL``: what changed between two classifiers over the same texts
(a fine-tune and the model before it, two architectures with the same label set), on the audit's
run engine (streamed, checkpointed, resumable, local or Ray).

Each text is audited by both models as `attnflow audit` does (each explains its own prediction
with the same method; words from `attnflow.dataset_audit.words.word_relevance`, so tokenizers may
differ), into one `AuditStats` per model, plus what only a pair has (`VersusStats`):

- **word changes**, paired: per text and word, d = |relevance|ₘₒ𝒹ₑₗ − |relevance|ᵥₑᵣₛᵤₛ (each the
  word's share of the text's absolute relevance, 0 where a model gives the word no token), summed
  per group of texts (the label when the texts are labelled, else one group) and over all texts:
  ``[texts holding the word, Σd, Σd², Σ|rel|ₘₒ𝒹ₑₗ, Σ|rel|ᵥₑᵣₛᵤₛ]``. The mean change per text of
  the group (texts without the word count 0) has a normal 95 % interval over those texts;
- **term share**, paired: per text the share of its relevance on the ``terms`` (Σ |relevance| of
  their words), in both models and the difference, ``[texts, Σa, Σa², Σb, Σb², Σd, Σd²]``;
- **predictions**: texts by outcome of the two (both right, fixed errors, new errors, both wrong;
  predicted classes that changed), and the first `KEPT` fixed and new errors (by index) with both
  explanations;
- **heads** (same number of layers and heads): per text and head, three statistics of the
  attention weights averaged over the text's query tokens: the row entropy
  (`attnflow.methods.diagnostics.row_entropy`), the share on special tokens and the share on the
  previous token (queries after the first), paired like the words: ``[Σa, Σb, Σd, Σd²]`` per
  statistic, ``[layer][head]``.

Everything merges by addition, so local, Ray and resumed runs end with the same numbers.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from attnflow.dataset_audit.analysis import analyse, mean_interval, wilson_interval
from attnflow.dataset_audit.stats import AuditStats, ExampleResult, example_record, merge_words
from attnflow.dataset_audit.step import AuditOptions, Batch, audit_batch, with_scorer
from attnflow.dataset_audit.words import SwapTable
from attnflow.errors import InputError
from attnflow.model_like import ModelLike

KEPT = 25  # fixed and new errors (and changed predictions) kept with both explanations
HEAD_STATISTICS = ("entropy", "special", "previous")
OUTCOMES = ("both_right", "fixed", "new_errors", "both_wrong")  # fixed: right now, wrong in --versus
TOP_CHANGES = 20


@dataclass
class VersusStats:
    """The accumulator of a two-model audit (see the module doc): ``model`` and ``versus`` are the
    two models' `AuditStats`; ``n_groups`` groups of texts (the classes, or 1 unlabelled);
    ``shape``: ``[layer, head]`` when the two models share it, else None (no head statistics)."""

    n_classes: int
    n_groups: int
    shape: list[int] | None = None
    model: AuditStats | None = None
    versus: AuditStats | None = None
    words: list[dict[str, list[float]]] = field(default_factory=list)  # [group] word -> 5 sums
    group_texts: list[int] = field(default_factory=list)  # [group]
    terms: list[float] = field(default_factory=lambda: [0.0] * 7)
    outcomes: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # OUTCOMES
    changed: int = 0  # texts whose predicted class differs
    kept: list[list[Any]] = field(default_factory=list)  # heap of [outcome rank, -index, record]
    heads: dict[str, list[list[list[float]]]] = field(default_factory=dict)  # stat -> [layer][head][4]

    def __post_init__(self) -> None:
        if self.model is None:
            self.model, self.versus = AuditStats(self.n_classes), AuditStats(self.n_classes)
        elif isinstance(self.model, dict):
            self.model = AuditStats.from_state_dict(self.model)
            self.versus = AuditStats.from_state_dict(self.versus)
        if not self.words:
            self.words = [{} for _ in range(self.n_groups)]
            self.group_texts = [0] * self.n_groups
        if self.shape is not None and not self.heads:
            layers, heads = self.shape
            self.heads = {name: [[[0.0] * 4 for _ in range(heads)] for _ in range(layers)] for name in HEAD_STATISTICS}
        heapq.heapify(self.kept)

    @property
    def n_samples(self) -> int:
        return sum(self.group_texts)

    def update(
        self,
        first: ExampleResult,
        second: ExampleResult,
        terms: Sequence[str],
        heads: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Add one text, audited by the model (``first``) and by ``--versus`` (``second``); ``heads``:
        each model's ``[statistic, layer, head]`` means over the text's query tokens (`head_means`)."""
        assert self.model is not None and self.versus is not None
        self.model.update(first)
        self.versus.update(second)
        group = 0 if first.label is None or self.n_groups == 1 else first.label
        self.group_texts[group] += 1
        table = self.words[group]
        for word in set(first.words) | set(second.words):
            a = abs(first.words[word][1]) if word in first.words else 0.0
            b = abs(second.words[word][1]) if word in second.words else 0.0
            d = a - b
            sums = table.setdefault(word, [0.0] * 5)
            for column, value in enumerate((1.0, d, d * d, a, b)):
                sums[column] += value
        a = sum(abs(first.words[term][1]) for term in terms if term in first.words)
        b = sum(abs(second.words[term][1]) for term in terms if term in second.words)
        for column, value in enumerate((1.0, a, a * a, b, b * b, a - b, (a - b) ** 2)):
            self.terms[column] += value
        changed = first.predicted != second.predicted
        self.changed += int(changed)
        outcome = None
        if first.label is not None:
            # 0 both right, 1 fixed (right now, wrong in --versus), 2 new error, 3 both wrong
            outcome = 2 * int(first.predicted != first.label) + int(second.predicted != second.label)
            self.outcomes[outcome] += 1
        if changed:
            rank = 2.0 if outcome in (1, 2) else 1.0  # fixed and new errors before other changes
            record = {"index": first.index, "outcome": OUTCOMES[outcome] if outcome is not None else "changed",
                      "model": example_record(first), "versus": example_record(second)}  # fmt: skip
            _keep(self.kept, [rank, -first.index, record])
        if heads is not None:
            for k, name in enumerate(HEAD_STATISTICS):
                d = heads[0][k] - heads[1][k]  # [layer, head]
                cells = self.heads[name]
                for layer, row in enumerate(cells):
                    for head, sums in enumerate(row):
                        for column, value in enumerate(
                            (heads[0][k][layer, head], heads[1][k][layer, head], d[layer, head], d[layer, head] ** 2)
                        ):
                            sums[column] += float(value)

    def merge(self, other: "VersusStats") -> "VersusStats":
        """Add ``other`` into this accumulator (in place) and return it."""
        assert self.model is not None and self.versus is not None
        self.model.merge(other.model)  # type: ignore[arg-type]
        self.versus.merge(other.versus)  # type: ignore[arg-type]
        for mine, theirs in zip(self.words, other.words, strict=True):
            merge_words(mine, theirs)
        self.group_texts = [a + b for a, b in zip(self.group_texts, other.group_texts, strict=True)]
        self.terms = [a + b for a, b in zip(self.terms, other.terms, strict=True)]
        self.outcomes = [a + b for a, b in zip(self.outcomes, other.outcomes, strict=True)]
        self.changed += other.changed
        for entry in other.kept:
            _keep(self.kept, entry)
        for name, cells in other.heads.items():
            for layer, layer_sums in enumerate(cells):
                for head, head_sums in enumerate(layer_sums):
                    cell = self.heads[name][layer][head]
                    for column, value in enumerate(head_sums):
                        cell[column] += value
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state."""
        assert self.model is not None and self.versus is not None
        return {
            "n_classes": self.n_classes,
            "n_groups": self.n_groups,
            "shape": self.shape,
            "model": self.model.state_dict(),
            "versus": self.versus.state_dict(),
            "words": self.words,
            "group_texts": self.group_texts,
            "terms": self.terms,
            "outcomes": self.outcomes,
            "changed": self.changed,
            "kept": sorted(self.kept, key=_order),
            "heads": self.heads,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "VersusStats":
        return cls(**state)

    def kept_changes(self) -> list[dict[str, Any]]:
        """The kept changed predictions: fixed and new errors first, then by index."""
        return [entry[2] for entry in sorted(self.kept, key=_order, reverse=True)]


def _order(entry: list[Any]) -> tuple[float, int]:
    return (entry[0], entry[1])


def _keep(heap: list[list[Any]], entry: list[Any]) -> None:
    if len(heap) < KEPT:
        heapq.heappush(heap, entry)
    elif _order(entry) > _order(heap[0]):
        heapq.heapreplace(heap, entry)


def head_means(attentions: np.ndarray, special_mask: np.ndarray) -> np.ndarray:
    """``[statistic, layer, head]``: `HEAD_STATISTICS` of ``attentions [layer, head, query, key]``
    averaged over the query tokens (the previous-token share over the queries after the first)."""
    from attnflow.methods.diagnostics import row_entropy

    weights = np.asarray(attentions, dtype=np.float64)
    special = np.asarray(special_mask, dtype=bool)
    entropy = row_entropy(weights).mean(-1)  # [layer, head]
    on_special = weights[..., special].sum(-1).mean(-1)  # [layer, head]
    n = weights.shape[-1]
    previous = (
        weights[..., np.arange(1, n), np.arange(n - 1)].mean(-1) if n > 1 else np.zeros(weights.shape[:2])
    )  # [layer, head]
    return np.stack([entropy, on_special, previous])


# -- the step ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersusStep:
    """The `attnflow.runs.engine.Step` of a two-model audit: both models (and scorers) per worker,
    a `VersusStats`, a batch audited by both (`versus_batch`)."""

    options: AuditOptions
    versus: str
    n_classes: int
    n_groups: int
    shape: list[int] | None
    swaps: SwapTable
    terms: tuple[str, ...]

    def load(self, device: str) -> tuple[Any, Any]:
        from attnflow.model import load

        first = load(self.options.model, device=device, dtype=self.options.dtype)
        second = load(self.versus, device=device, dtype=self.options.dtype)
        return with_scorer(first), with_scorer(second)

    def empty(self, context: Any) -> VersusStats:  # noqa: ARG002 - the Step protocol
        return VersusStats(self.n_classes, self.n_groups, self.shape)

    def run(self, context: tuple[Any, Any], stats: VersusStats, batch: Batch) -> VersusStats:
        for first, second, heads in versus_batch(context, self.options.method, batch, self.swaps, self.shape):
            stats.update(first, second, self.terms, heads)
        return stats


def versus_batch(
    context: tuple[Any, Any], method: str, batch: Batch, swaps: SwapTable, shape: list[int] | None
) -> list[tuple[ExampleResult, ExampleResult, tuple[np.ndarray, np.ndarray] | None]]:
    """One batch audited by both models (`attnflow.dataset_audit.step.audit_batch`), with each
    text's head statistics (`head_means`, one more forward pass per model) when ``shape`` is shared."""
    (first_model, first_scorer), (second_model, second_scorer) = context
    first = audit_batch(first_model, method, batch, swaps, first_scorer)
    second = audit_batch(second_model, method, batch, swaps, second_scorer)
    heads: list[Any] = [None] * len(batch)
    if shape is not None:
        per_model = []
        for model in (first_model, second_model):
            traces = model.trace(list(batch.texts), needs={"attentions"}, head_outputs=False, batch_size=len(batch))
            per_model.append([head_means(trace.attentions, trace.special_mask) for trace in traces])
        heads = list(zip(*per_model, strict=True))
    return list(zip(first, second, heads, strict=True))


# -- checks and the analysis -------------------------------------------------------------------


def check_pair(model: ModelLike, versus: ModelLike, model_labels: list[str], versus_labels: list[str]) -> None:
    """One InputError line when the two classifiers' label sets differ (nothing to compare per class)."""
    if list(model_labels) != list(versus_labels):
        raise InputError(
            f"{model.name} and {{versus}} {versus.name} have different label sets ({', '.join(model_labels)} "
            f"against {', '.join(versus_labels)}): the audit compares relevance per class, so give two "
            "classifiers of the same classes, in the same order",
            parameter="versus",
        )


def shared_shape(model: ModelLike, versus: ModelLike) -> list[int] | None:
    """``[layer, head]`` when both models have it (head statistics are compared), else None."""
    if (model.n_layers, model.n_heads) == (versus.n_layers, versus.n_heads):
        return [int(model.n_layers), int(model.n_heads)]
    return None


def word_changes(table: dict[str, list[float]], n_texts: int, min_count: int, top: int) -> list[dict[str, Any]]:
    """Words in at least ``min_count`` texts by how much their share of relevance per text moved
    (|mean change|, texts without the word counting 0), with the mean change's 95 % interval."""
    rows: list[dict[str, Any]] = []
    for word, (examples, total, squares, first, second) in table.items():
        if examples < min_count or n_texts == 0:
            continue
        mean, low, high = mean_interval(total, squares, n_texts)
        rows.append(
            {
                "word": word,
                "texts": int(examples),
                "change": mean,
                "ci": [low, high],
                "model_per_text": first / n_texts,
                "versus_per_text": second / n_texts,
                "change_where_present": total / examples,
            }
        )
    return sorted(rows, key=lambda row: (-abs(float(row["change"])), str(row["word"])))[:top]


def analyse_versus(
    stats: VersusStats,
    label_names: Sequence[str],
    min_count: int,
    terms: Sequence[str],
    swaps: bool,
    labelled: bool,
    top: int = TOP_CHANGES,
) -> dict[str, Any]:
    """The sections of a two-model audit's ``results.json``: each model's audit (``model``,
    ``versus``: `attnflow.dataset_audit.analysis.analyse`) and ``changes`` (see the module doc)."""
    assert stats.model is not None and stats.versus is not None
    n = stats.n_samples
    groups = list(label_names) if stats.n_groups > 1 else ["all texts"]
    pooled: dict[str, list[float]] = {}
    for table in stats.words:
        merge_words(pooled, table)
    changes: dict[str, Any] = {
        "words": word_changes(pooled, n, min_count, top),
        "words_per_group": [
            {
                "group": name,
                "texts": stats.group_texts[k],
                "words": word_changes(table, stats.group_texts[k], min_count, top),
            }
            for k, (name, table) in enumerate(zip(groups, stats.words, strict=True))
        ],
        "predictions": _predictions(stats, labelled),
    }
    if terms:
        texts, a, a2, b, b2, d, d2 = stats.terms
        changes["terms"] = {
            "terms": list(terms),
            "model_share": _interval_row(a, a2, texts),
            "versus_share": _interval_row(b, b2, texts),
            "change": _interval_row(d, d2, texts),
        }
    if stats.shape is not None:
        changes["heads"] = _heads(stats, top)
    return {
        "model": analyse(stats.model, label_names, min_count, terms, swaps=swaps, labelled=labelled),
        "versus": analyse(stats.versus, label_names, min_count, terms, swaps=swaps, labelled=labelled),
        "changes": changes,
    }


def _interval_row(total: float, squares: float, n: float) -> dict[str, Any]:
    mean, low, high = mean_interval(total, squares, n) if n else (math.nan, None, None)
    return {"mean": mean, "ci": [low, high]}


def _predictions(stats: VersusStats, labelled: bool) -> dict[str, Any]:
    n = stats.n_samples
    rate, low, high = wilson_interval(stats.changed, n)
    found: dict[str, Any] = {"texts": n, "changed": stats.changed, "changed_rate": rate, "changed_rate_ci": [low, high]}
    if labelled:
        both_right, fixed, new, _ = stats.outcomes
        # paired accuracy difference: per text right_model - right_versus is +1 (fixed), -1 (new error) or 0
        found.update(
            {
                **dict(zip(OUTCOMES, stats.outcomes, strict=True)),
                "model_accuracy": (both_right + fixed) / n if n else math.nan,
                "versus_accuracy": (both_right + new) / n if n else math.nan,
                "accuracy_change": _interval_row(fixed - new, fixed + new, n),
            }
        )
    found["examples"] = stats.kept_changes()
    return found


def _heads(stats: VersusStats, top: int) -> dict[str, Any]:
    n = stats.n_samples
    layers, heads = stats.shape or (0, 0)
    found: dict[str, Any] = {"layers": layers, "heads": heads}
    for name in HEAD_STATISTICS:
        cells = stats.heads[name]
        rows: list[dict[str, Any]] = []
        for layer in range(layers):
            for head in range(heads):
                a, b, d, d2 = cells[layer][head]
                mean, low, high = mean_interval(d, d2, n) if n else (math.nan, None, None)
                rows.append({"layer": layer, "head": head, "model": a / n if n else math.nan,
                             "versus": b / n if n else math.nan, "change": mean, "ci": [low, high]})  # fmt: skip
        per_layer = [
            {"layer": layer, "model": float(np.mean([r["model"] for r in rows if r["layer"] == layer])),
             "versus": float(np.mean([r["versus"] for r in rows if r["layer"] == layer]))}
            for layer in range(layers)
        ]  # fmt: skip
        found[name] = {
            "per_layer": per_layer,
            "moved": sorted(rows, key=lambda row: (-abs(row["change"]), row["layer"], row["head"]))[:top],
        }
    return found
