"""``attnflow audit --versus MODEL`` and ``--versus-data DATA``: what changed between two *sides*,
each a (model, data) pair, on the audit's run engine (streamed, checkpointed, resumable, local or Ray):

- two classifiers over the same texts (a fine-tune and the model before it, two architectures
  with the same label set): **paired**, every text is read by both;
- one classifier over two domains (``--data A --versus-data B``): **unpaired**, each text is read
  once, on its side.

Each text is audited as `attnflow audit` does (each model explains its own prediction with the
same method; words from `attnflow.dataset_audit.words.word_relevance`, so tokenizers may differ),
into one `AuditStats` per side, plus what only two sides have (`VersusStats`). A quantity x is
summed per side as ``[Σa, Σa², Σb, Σb², Σd²]`` (a on the first side, b on the second, d = a − b
for a paired text; `add_sides`), so the mean change has a 95 % interval either way
(`side_change`: paired, the mean of d; unpaired, the difference of the two means with the
standard errors of both):

- **word changes**: per text and word, the word's share of the text's absolute relevance (0 where
  the text lacks the word), per group of texts (the label when labelled, else one group) and over
  all texts: ``[texts holding it, on the first side, on the second, Σa, Σa², Σb, Σb², Σd²]``;
- **term share**: per text the share of its relevance on the ``terms``;
- **predictions** (paired): texts by outcome of the two (both right, fixed errors, new errors,
  both wrong; predicted classes that changed), and the first `KEPT` fixed and new errors (by index)
  with both explanations; unpaired: each side's accuracy and predicted classes;
- **heads** (same number of layers and heads): per text and head, three statistics of the
  attention weights averaged over the text's query tokens: the row entropy
  (`attnflow.methods.diagnostics.row_entropy`), the share on special tokens and the share on the
  previous token (queries after the first), ``[layer][head]``;
- **maps** (same layers and heads): per text and word, the word's share of the attention rollout
  and of the value-aware (norm-based) rollout (`MAP_METHODS`), as for the word changes.

Everything merges by addition, so local, Ray and resumed runs end with the same numbers.
"""

from __future__ import annotations

import heapq
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from attnflow.dataset_audit.analysis import analyse, mean_interval, wilson_interval
from attnflow.dataset_audit.stats import AuditStats, ExampleResult, example_record, merge_words
from attnflow.dataset_audit.step import AuditOptions, Batch, audit_batch, with_scorer
from attnflow.dataset_audit.words import SwapTable, word_relevance
from attnflow.errors import ExplanationWarning, InputError
from attnflow.model_like import ModelLike
from attnflow.statistics import Z95

KEPT = 25  # fixed and new errors (and changed predictions) kept with both explanations
HEAD_STATISTICS = ("entropy", "special", "previous")
MAP_METHODS = ("rollout", "norm_rollout")  # the attention maps compared per word: raw and value-aware rollout
OUTCOMES = ("both_right", "fixed", "new_errors", "both_wrong")  # fixed: right now, wrong in --versus
TOP_CHANGES = 20
HEAD_TITLES = {  # what a head statistic of ``changes.heads`` is, in words (also `attnflow routes --versus`'s)
    "entropy": "attention entropy (nats)",
    "special": "share of attention on special tokens",
    "previous": "share of attention on the previous token",
    "heads": "importance for the prediction on the route",
    "heads_full": "importance for the prediction with every edge",
    "first_token": "share of attention on the first token",
    "previous_token": "share of attention on the previous token",
    "self": "share of attention on itself",
    "elsewhere": "share of attention on other tokens",
    "subword": "share of attention on the previous piece of its word",
}
SIDE_SUMS = 5  # [Σa, Σa², Σb, Σb², Σd²]
WORD_SUMS = 3 + SIDE_SUMS  # [texts holding the word, on the first side, on the second, *side sums]


def add_sides(sums: list[float], a: float | None, b: float | None, at: int = 0) -> None:
    """Add one text's value on the first side (``a``) and on the second (``b``; None: the text is not
    on that side) into ``sums[at : at + 5] = [Σa, Σa², Σb, Σb², Σd²]`` (d = a − b, paired texts only)."""
    if a is not None:
        sums[at] += a
        sums[at + 1] += a * a
    if b is not None:
        sums[at + 2] += b
        sums[at + 3] += b * b
    if a is not None and b is not None:
        sums[at + 4] += (a - b) ** 2


def side_change(sums: Sequence[float], n_first: int, n_second: int, paired: bool) -> dict[str, Any]:
    """``{model, versus, change, ci}`` of ``[Σa, Σa², Σb, Σb², Σd²]`` over ``n_first`` and ``n_second``
    texts: each side's mean, their difference and its 95 % interval: paired, the normal interval of
    the mean of d (`attnflow.dataset_audit.analysis.mean_interval`); unpaired, difference ± Z95 ×
    √(s²ₐ/nₐ + s²ᵦ/nᵦ) (sample variances); no interval under two texts a side."""
    total_a, squares_a, total_b, squares_b, squares_d = sums
    if not n_first or not n_second:
        return {"model": math.nan, "versus": math.nan, "change": math.nan, "ci": [None, None]}
    first, second = total_a / n_first, total_b / n_second
    if paired:
        change, low, high = mean_interval(total_a - total_b, squares_d, n_first)
    elif min(n_first, n_second) < 2:
        change, low, high = first - second, None, None
    else:
        variance_a = max(squares_a - n_first * first * first, 0.0) / (n_first - 1)
        variance_b = max(squares_b - n_second * second * second, 0.0) / (n_second - 1)
        change = first - second
        half = Z95 * math.sqrt(variance_a / n_first + variance_b / n_second)
        low, high = change - half, change + half
    return {"model": first, "versus": second, "change": change, "ci": [low, high]}


@dataclass
class VersusStats:
    """The accumulator of a two-side audit (see the module doc): ``model`` and ``versus`` are the
    two sides' `AuditStats`; ``n_groups`` groups of texts (the classes, or 1 unlabelled);
    ``shape``: ``[layer, head]`` when the two sides share it, else None (no head or map statistics);
    ``paired``: both sides read every text (two models), else each text is on one side (two domains)."""

    n_classes: int
    n_groups: int
    shape: list[int] | None = None
    paired: bool = True
    model: AuditStats | None = None
    versus: AuditStats | None = None
    words: list[dict[str, list[float]]] = field(default_factory=list)  # [group] word -> WORD_SUMS
    group_texts: list[list[int]] = field(default_factory=list)  # [side][group]
    terms: list[float] = field(default_factory=lambda: [0.0] * SIDE_SUMS)
    outcomes: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # OUTCOMES
    changed: int = 0  # texts whose predicted class differs
    kept: list[list[Any]] = field(default_factory=list)  # heap of [outcome rank, -index, record]
    heads: dict[str, list[list[list[float]]]] = field(default_factory=dict)  # stat -> [layer][head][SIDE_SUMS]
    maps: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # method -> word -> WORD_SUMS

    def __post_init__(self) -> None:
        if self.model is None:
            self.model, self.versus = AuditStats(self.n_classes), AuditStats(self.n_classes)
        elif isinstance(self.model, dict):
            self.model = AuditStats.from_state_dict(self.model)
            self.versus = AuditStats.from_state_dict(self.versus)
        if not self.words:
            self.words = [{} for _ in range(self.n_groups)]
            self.group_texts = [[0] * self.n_groups, [0] * self.n_groups]
        if self.shape is not None and not self.heads:
            layers, heads = self.shape
            self.heads = {
                name: [[[0.0] * SIDE_SUMS for _ in range(heads)] for _ in range(layers)] for name in HEAD_STATISTICS
            }
            self.maps = {method: {} for method in MAP_METHODS}
        heapq.heapify(self.kept)

    @property
    def n_samples(self) -> int:
        """Texts read: paired, each once; unpaired, on both sides together."""
        first, second = (sum(texts) for texts in self.group_texts)
        return first if self.paired else first + second

    @property
    def side_texts(self) -> tuple[int, int]:
        return sum(self.group_texts[0]), sum(self.group_texts[1])

    def update(
        self,
        first: ExampleResult | None,
        second: ExampleResult | None,
        terms: Sequence[str],
        heads: tuple[np.ndarray | None, np.ndarray | None] | None = None,
        maps: dict[str, tuple[dict | None, dict | None]] | None = None,
    ) -> None:
        """Add one text: read by the first side (``first``) and by the second (``second``), or by one
        of them (the other None); ``heads``: each side's ``[statistic, layer, head]`` means over the
        text's query tokens (`head_means`); ``maps``: per `MAP_METHODS` method each side's words."""
        assert self.model is not None and self.versus is not None
        present = first if first is not None else second
        assert present is not None
        if first is not None:
            self.model.update(first)
        if second is not None:
            self.versus.update(second)
        group = 0 if present.label is None or self.n_groups == 1 else present.label
        for side, result in enumerate((first, second)):
            self.group_texts[side][group] += int(result is not None)
        words = (None if first is None else first.words, None if second is None else second.words)
        add_words(self.words[group], *words)
        a, b = (None if found is None else sum(abs(found[t][1]) for t in terms if t in found) for found in words)
        add_sides(self.terms, a, b)
        if first is not None and second is not None:
            self._compare_predictions(first, second)
        if heads is not None:
            for k, name in enumerate(HEAD_STATISTICS):
                for layer, row in enumerate(self.heads[name]):
                    for head, sums in enumerate(row):
                        add_sides(*_cell(sums, heads, k, layer, head))
        for method, (map_a, map_b) in (maps or {}).items():
            add_words(self.maps[method], map_a, map_b)

    def _compare_predictions(self, first: ExampleResult, second: ExampleResult) -> None:
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

    def merge(self, other: "VersusStats") -> "VersusStats":
        """Add ``other`` into this accumulator (in place) and return it."""
        assert self.model is not None and self.versus is not None
        self.model.merge(other.model)  # type: ignore[arg-type]
        self.versus.merge(other.versus)  # type: ignore[arg-type]
        for mine, theirs in zip(self.words, other.words, strict=True):
            merge_words(mine, theirs)
        self.group_texts = [
            [a + b for a, b in zip(mine, theirs, strict=True)]
            for mine, theirs in zip(self.group_texts, other.group_texts, strict=True)
        ]
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
        for method, table in other.maps.items():
            merge_words(self.maps[method], table)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state."""
        assert self.model is not None and self.versus is not None
        return {
            "n_classes": self.n_classes,
            "n_groups": self.n_groups,
            "shape": self.shape,
            "paired": self.paired,
            "model": self.model.state_dict(),
            "versus": self.versus.state_dict(),
            "words": self.words,
            "group_texts": self.group_texts,
            "terms": self.terms,
            "outcomes": self.outcomes,
            "changed": self.changed,
            "kept": sorted(self.kept, key=_order),
            "heads": self.heads,
            "maps": self.maps,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "VersusStats":
        return cls(**state)

    def kept_changes(self) -> list[dict[str, Any]]:
        """The kept changed predictions: fixed and new errors first, then by index."""
        return [entry[2] for entry in sorted(self.kept, key=_order, reverse=True)]


def add_words(table: dict[str, list[float]], first: dict | None, second: dict | None) -> None:
    """One text's words (``{word: (occurrences, share)}``, None: the text is not on that side) into
    ``table`` (word -> `WORD_SUMS`): a side that read the text gives 0 to a word it lacks."""
    for word in set(first or ()) | set(second or ()):
        a = None if first is None else abs(first[word][1]) if word in first else 0.0
        b = None if second is None else abs(second[word][1]) if word in second else 0.0
        sums = table.setdefault(word, [0.0] * WORD_SUMS)
        sums[0] += 1.0
        sums[1] += float(first is not None and word in first)
        sums[2] += float(second is not None and word in second)
        add_sides(sums, a, b, at=3)


def _cell(
    sums: list[float], heads: tuple[np.ndarray | None, np.ndarray | None], k: int, layer: int, head: int
) -> tuple[list[float], float | None, float | None]:
    a, b = (None if side is None else float(side[k][layer, head]) for side in heads)
    return sums, a, b


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
    """The `attnflow.runs.engine.Step` of a two-side audit: the models (and scorers) per worker, a
    `VersusStats`, a batch audited by both models (``versus`` a model: `versus_batch`) or, two
    domains (``versus`` None), by the one model on the batch's side (`side_batch`)."""

    options: AuditOptions
    versus: str | None
    n_classes: int
    n_groups: int
    shape: list[int] | None
    swaps: SwapTable
    terms: tuple[str, ...]

    def load(self, device: str) -> tuple[Any, ...]:
        from attnflow.model import load

        names = [self.options.model] + ([self.versus] if self.versus is not None else [])
        return tuple(with_scorer(load(name, device=device, dtype=self.options.dtype)) for name in names)

    def empty(self, context: Any) -> VersusStats:  # noqa: ARG002 - the Step protocol
        return VersusStats(self.n_classes, self.n_groups, self.shape, paired=self.versus is not None)

    def run(self, context: tuple[Any, ...], stats: VersusStats, batch: Batch) -> VersusStats:
        if self.versus is None:
            for first, second, heads, maps in side_batch(context[0], self.options.method, batch, self.swaps):
                stats.update(first, second, self.terms, heads, maps)
            return stats
        for first, second, heads, maps in versus_batch(context, self.options.method, batch, self.swaps, self.shape):
            stats.update(first, second, self.terms, heads, maps)
        return stats


def attention_statistics(model: ModelLike, texts: Sequence[str]) -> tuple[list[np.ndarray], list[dict[str, dict]]]:
    """Per text ``[statistic, layer, head]`` head means (`head_means`, one traced pass) and, per
    `MAP_METHODS` method, its words (``{method: word_relevance}``, one explanation pass each)."""
    traces = model.trace(list(texts), needs={"attentions"}, head_outputs=False, batch_size=len(texts))
    heads = [head_means(trace.attentions, trace.special_mask) for trace in traces]
    maps: list[dict[str, dict]] = [{} for _ in texts]
    with warnings.catch_warnings():  # a map's notes are not the audit's concern here
        warnings.simplefilter("ignore", ExplanationWarning)
        for method in MAP_METHODS:
            explained = model.explain(list(texts), method, batch_size=len(texts))
            for found, text, explanation in zip(maps, texts, explained, strict=True):
                found[method] = word_relevance(text, explanation.offsets, explanation.special_mask, explanation.scores)
    return heads, maps


def versus_batch(
    context: tuple[Any, ...], method: str, batch: Batch, swaps: SwapTable, shape: list[int] | None
) -> list[tuple[ExampleResult, ExampleResult, Any, Any]]:
    """One batch audited by both models (`attnflow.dataset_audit.step.audit_batch`), with each
    text's head and map statistics (`attention_statistics`) when ``shape`` is shared."""
    (first_model, first_scorer), (second_model, second_scorer) = context
    first = audit_batch(first_model, method, batch, swaps, first_scorer)
    second = audit_batch(second_model, method, batch, swaps, second_scorer)
    heads: list[Any] = [None] * len(batch)
    maps: list[Any] = [None] * len(batch)
    if shape is not None:
        (heads_a, maps_a), (heads_b, maps_b) = (
            attention_statistics(m, batch.texts) for m in (first_model, second_model)
        )
        heads = list(zip(heads_a, heads_b, strict=True))
        maps = [{name: (a[name], b[name]) for name in MAP_METHODS} for a, b in zip(maps_a, maps_b, strict=True)]
    return list(zip(first, second, heads, maps, strict=True))


def side_batch(context: tuple[Any, Any], method: str, batch: Batch, swaps: SwapTable) -> list[tuple[Any, ...]]:
    """One batch of one domain (``batch.side``: 0 the first, 1 the second) audited by the one model,
    with its head and map statistics: each text as ``(first, second, heads, maps)`` with the other
    side None."""
    model, scorer = context
    results = audit_batch(model, method, batch, swaps, scorer)
    heads, maps = attention_statistics(model, batch.texts)

    def sided(value: Any) -> tuple[Any, Any]:
        return (value, None) if batch.side == 0 else (None, value)

    return [
        (*sided(result), sided(head), {name: sided(found[name]) for name in MAP_METHODS})
        for result, head, found in zip(results, heads, maps, strict=True)
    ]


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


def word_changes(
    table: dict[str, list[float]], n_texts: tuple[int, int], min_count: int, top: int, paired: bool = True
) -> list[dict[str, Any]]:
    """Words in at least ``min_count`` texts by how much their share of relevance per text moved
    (|mean change|, texts without the word counting 0; ``n_texts``: the texts of each side), with
    the change's 95 % interval (`side_change`)."""
    rows: list[dict[str, Any]] = []
    for word, sums in table.items():
        if sums[0] < min_count or not all(n_texts):
            continue
        found = side_change(sums[3:], *n_texts, paired)
        holding_first, holding_second = int(sums[1]), int(sums[2])
        rows.append(
            {
                "word": word,
                "texts": int(sums[0]),
                "texts_per_side": [holding_first, holding_second],
                "change": found["change"],
                "ci": found["ci"],
                "model_per_text": found["model"],
                "versus_per_text": found["versus"],
                # the mean share over the texts holding the word, on each side (None: no such text)
                "model_where_present": sums[3] / holding_first if holding_first else None,
                "versus_where_present": sums[5] / holding_second if holding_second else None,
                **({"change_where_present": (sums[3] - sums[5]) / sums[0]} if paired else {}),
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
    """The sections of a two-side audit's ``results.json``: each side's audit (``model``,
    ``versus``: `attnflow.dataset_audit.analysis.analyse`) and ``changes`` (see the module doc)."""
    assert stats.model is not None and stats.versus is not None
    sides = stats.side_texts
    groups = list(label_names) if stats.n_groups > 1 else ["all texts"]
    pooled: dict[str, list[float]] = {}
    for table in stats.words:
        merge_words(pooled, table)
    changes: dict[str, Any] = {
        "paired": stats.paired,
        "texts": list(sides),
        "words": word_changes(pooled, sides, min_count, top, stats.paired),
        "words_per_group": [
            {
                "group": name,
                "texts": [stats.group_texts[0][k], stats.group_texts[1][k]],
                "words": word_changes(
                    table, (stats.group_texts[0][k], stats.group_texts[1][k]), min_count, top, stats.paired
                ),
            }
            for k, (name, table) in enumerate(zip(groups, stats.words, strict=True))
        ],
        "predictions": _predictions(stats, labelled)
        if stats.paired
        else _side_predictions(stats, label_names, labelled),
    }
    if terms:
        found = side_change(stats.terms, *sides, stats.paired)
        changes["terms"] = {
            "terms": list(terms),
            "model_share": _interval_row(stats.terms[0], stats.terms[1], sides[0]),
            "versus_share": _interval_row(stats.terms[2], stats.terms[3], sides[1]),
            "change": {"mean": found["change"], "ci": found["ci"]},
        }
    if stats.shape is not None:
        changes["heads"] = _heads(stats, top)
        changes["maps"] = {
            method: word_changes(stats.maps[method], sides, min_count, top, stats.paired) for method in MAP_METHODS
        }
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


def _side_predictions(stats: VersusStats, label_names: Sequence[str], labelled: bool) -> dict[str, Any]:
    """Two domains: each side's predicted classes (shares) and, labelled, its accuracy and the
    difference with its unpaired interval (a right prediction counts 1, so Σx² = Σx)."""
    assert stats.model is not None and stats.versus is not None
    sides = stats.side_texts
    found: dict[str, Any] = {
        "texts": list(sides),
        "predicted": [
            {
                "class": name,
                "model": a / sides[0] if sides[0] else math.nan,
                "versus": b / sides[1] if sides[1] else math.nan,
            }
            for name, a, b in zip(label_names, stats.model.examples, stats.versus.examples, strict=True)
        ],
    }
    if labelled:
        right = [sum(side.confusion[k][k] for k in range(stats.n_classes)) for side in (stats.model, stats.versus)]
        accuracy = side_change([right[0], right[0], right[1], right[1], 0.0], *sides, paired=False)
        found.update(
            {
                "model_accuracy": accuracy["model"],
                "versus_accuracy": accuracy["versus"],
                "accuracy_change": {"mean": accuracy["change"], "ci": accuracy["ci"]},
            }
        )
    return found


def _heads(stats: VersusStats, top: int) -> dict[str, Any]:
    sides = stats.side_texts
    layers, heads = stats.shape or (0, 0)
    found: dict[str, Any] = {"layers": layers, "heads": heads}
    for name in HEAD_STATISTICS:
        cells = stats.heads[name]
        rows = [
            {"layer": layer, "head": head, **side_change(cells[layer][head], *sides, stats.paired)}
            for layer in range(layers)
            for head in range(heads)
        ]
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


# -- the lead: the largest changes in plain words -----------------------------------------------


class _Sentence:
    """One lead sentence being written: each number goes in through `number`, which formats it and
    records where in results.json it comes from (``path``), how it is shown and the format."""

    def __init__(self, results: dict[str, Any]) -> None:
        self.results = results
        self.numbers: list[dict[str, Any]] = []

    def number(self, path: str, spec: str, scale: float = 1.0) -> str:
        value: Any = self.results
        for key in path.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
        scaled = scale * float(value)
        shown = format(round(scaled), spec) if spec.endswith("d") else format(scaled, spec)
        self.numbers.append({"shown": shown, "path": path, "format": spec, "scale": scale})
        return shown

    def interval(self, path: str, spec: str = ".3g", scale: float = 1.0) -> str:
        return f"[{self.number(path + '.0', spec, scale)}, {self.number(path + '.1', spec, scale)}]"

    def done(self, kind: str, text: str, strength: float) -> dict[str, Any]:
        return {"kind": kind, "sentence": text, "numbers": self.numbers, "strength": strength}


def _strength(change: float, ci: Sequence[float | None]) -> float:
    """|change| over its standard error (the 95 % half-width / Z95); 0 without an interval."""
    low, high = ci
    if low is None or high is None or not math.isfinite(change):
        return 0.0
    half = (high - low) / 2
    return abs(change) / (half / Z95) if half > 0 else (math.inf if change else 0.0)


def lead(results: dict[str, Any], count: int = 3) -> list[dict[str, Any]]:
    """The ``count`` largest changes of a two-side audit in plain words, built from its numbers: the
    word whose share of relevance rose most and the one that fell most (the question of the audit:
    what the classifier relies on), then the other changes (accuracy, the terms' share, the head and
    the rollout word that moved most) by strength (|change| / standard error). Each sentence lists
    its numbers with their place in ``results`` (``numbers``: shown, path, format, scale)."""
    run, changes = results["run"], results["changes"]
    first, second = run["sides"]
    paired = changes["paired"]
    model = run["model"]
    who, than = (first, f"than {second}") if paired else (f"{model} on {first}", f"than on {second}")
    found: list[dict[str, Any]] = []
    words = changes["words"]
    for rising in (True, False):
        moved = [k for k, row in enumerate(words) if (row["change"] > 0) == rising and row["change"] != 0]
        if moved:
            k = max(moved, key=lambda index: abs(words[index]["change"]))
            s = _Sentence(results)
            path = f"changes.words.{k}"
            text = (
                f'{who} relies {"more" if rising else "less"} on "{words[k]["word"]}" {than}: its share of a '
                f"text's relevance moves by {s.number(path + '.change', '+.4f')} per text "
                f"(95 % CI {s.interval(path + '.ci')}; {s.number(path + '.texts', 'd')} texts hold it)."
            )
            found.append(s.done("word", text, math.inf))
    others = sorted(_other_changes(results, first, second), key=lambda entry: -entry["strength"])
    chosen = (found + others)[:count]
    for entry in chosen:
        entry.pop("strength")
    return chosen


def _other_changes(results: dict[str, Any], first: str, second: str) -> list[dict[str, Any]]:
    """The lead's candidates beyond the words: accuracy, the terms' share, per head statistic the
    head that moved most, per map method the word that moved most."""
    changes = results["changes"]
    others: list[dict[str, Any]] = []
    predictions = changes["predictions"]
    if "accuracy_change" in predictions:
        s = _Sentence(results)
        text = (
            f"Accuracy {s.number('changes.predictions.versus_accuracy', '.3f')} ({second}) → "
            f"{s.number('changes.predictions.model_accuracy', '.3f')} ({first}): "
            f"{s.number('changes.predictions.accuracy_change.mean', '+.3f')}, "
            f"95 % CI {s.interval('changes.predictions.accuracy_change.ci')}"
        )
        if changes["paired"]:
            text += (
                f"; {s.number('changes.predictions.fixed', 'd')} errors fixed, "
                f"{s.number('changes.predictions.new_errors', 'd')} new errors"
            )
        change = predictions["accuracy_change"]
        others.append(s.done("accuracy", text + ".", _strength(change["mean"], change["ci"])))
    elif "changed" in predictions:  # no labels: how many predictions differ (last, no strength to rank it by)
        s = _Sentence(results)
        what = "next tokens" if "next_tokens" in predictions else "classes"
        text = (
            f"{s.number('changes.predictions.changed', 'd')} of {s.number('changes.predictions.texts', 'd')} "
            f"predicted {what} differ between {first} and {second} (95 % CI of the rate "
            f"{s.interval('changes.predictions.changed_rate_ci', '.1f', 100)} %)."
        )
        others.append(s.done("predictions", text, 0.0))
    if "terms" in changes:
        terms = changes["terms"]
        s = _Sentence(results)
        shares = [s.number(f"changes.terms.{key}_share.mean", ".1f", 100) for key in ("model", "versus")]
        text = (
            f"The terms ({', '.join(terms['terms'])}) receive {shares[0]} % of the relevance on {first} against "
            f"{shares[1]} % on {second} (change {s.number('changes.terms.change.mean', '+.1f', 100)} points, 95 % CI "
            f"{s.interval('changes.terms.change.ci', '.3g', 100)} points)."
        )
        others.append(s.done("terms", text, _strength(terms["change"]["mean"], terms["change"]["ci"])))
    for name, block in changes.get("heads", {}).items():
        if not isinstance(block, dict):
            continue  # the numbers of layers and heads
        rows, title = block["moved"], HEAD_TITLES.get(name, name)
        if rows and rows[0]["change"]:
            s = _Sentence(results)
            path = f"changes.heads.{name}.moved.0"
            where = f"Layer {s.number(path + '.layer', 'd')} head {s.number(path + '.head', 'd')}"
            before, after = s.number(path + ".versus", ".3f"), s.number(path + ".model", ".3f")
            text = (
                f"{where}: {title} {before} on {second} → {after} on {first} "
                f"(95 % CI of the change {s.interval(path + '.ci')})."
            )
            others.append(s.done("head", text, _strength(rows[0]["change"], rows[0]["ci"])))
    for method, rows in changes.get("maps", {}).items():
        if rows and rows[0]["change"]:
            s = _Sentence(results)
            path = f"changes.maps.{method}.0"
            text = (
                f'"{rows[0]["word"]}" receives {s.number(path + ".model_per_text", ".4f")} of a text\'s {method} '
                f"on {first} against {s.number(path + '.versus_per_text', '.4f')} on {second} (change 95 % CI "
                f"{s.interval(path + '.ci')})."
            )
            others.append(s.done("map", text, _strength(rows[0]["change"], rows[0]["ci"])))
    return others
