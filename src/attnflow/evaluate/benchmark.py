"""The benchmark: every method, the same examples, the same perturbations, batched, on the run engine.

The work is a list of units (`Unit`), each one batch of the run engine (`attnflow.runs.engine`):
each example chunk's AOPC bounds (with ``--bounds``), the agreement reference's scores of each chunk
(when it is not itself evaluated), and for each method each chunk's metrics (one front-door call per
chunk and target class; all perturbed variants of the chunk — comprehensiveness and sufficiency bins,
deletion-curve points — deduplicated and scored in one batched forward pass) and the sanity
check's re-explanations at each randomisation stage. `BenchmarkStep` computes a unit into a row of
`attnflow.runs.engine.Rows`, in this process or in model replicas as Ray actors; the engine
checkpoints the rows (``DIR/checkpoint.json``), so ``resume=True`` computes only the units not yet
done. At the end the rows are assembled into one `MethodRecord` per method (agreement and sanity
correlations computed from the stored scores), summarised, and written to ``DIR/methods/<method>.json``,
``DIR/bounds.json`` and ``DIR/run.json``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from attnflow.errors import InputError
from attnflow.evaluate.attribute import attribute
from attnflow.evaluate.bounds import (
    BEAM_WIDTH,
    BOUND_SEARCHES,
    EXACT_LIMIT,
    AopcBounds,
    normalised_aopc,
    search_bounds,
)
from attnflow.evaluate.deletion import REPLACE_MODES, metric_inputs
from attnflow.evaluate.metrics import BINS, aopc, content_ranking, deletion_auc, rank_agreement
from attnflow.evaluate.sanity import FLAG_RHO, cascade, randomisation_stages, shown_stages
from attnflow.evaluate.scorer import ClassifierScorer, target_values
from attnflow.model_like import ModelLike, model_dtype
from attnflow.runs.checkpoint import RunFolder, digest
from attnflow.runs.engine import EngineOptions, Job, Rows, run
from attnflow.staging import atomic_file
from attnflow.statistics import mean_se

log = logging.getLogger(__name__)

REFERENCE_METHOD = "leave_one_out"
METHODS_DIR = "methods"
RUN_FILE = "run.json"
BOUNDS_FILE = "bounds.json"
CHECKPOINT = "checkpoint.json"
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class BenchmarkOptions:
    """How the benchmark perturbs and summarises (saved with the results).

    Attributes:
        replace: ``remove`` (drop tokens from the id sequence) or ``mask`` (mask token in place).
        bins: fractions k of the content tokens for comprehensiveness and sufficiency.
        curve_points: points of the deletion curve, equally spaced over [0, 1] of the content tokens.
        sanity_samples: examples (the first ones) re-explained at each randomisation stage; 0 skips.
        chunk_size: examples explained and perturbed together.
        seed: seeds the sample choice and the randomised weights.
        bounds: the AOPC bounds behind the NAOPC columns (`attnflow.evaluate.bounds`): ``"none"``
            (default: no NAOPC), ``"exact"`` (inputs of at most ``exact_limit`` content tokens
            only), or exact up to it and beyond ``"singles"`` (each token's own drop: m passes),
            ``"levels"`` (a bin at a time) or ``"beam"`` (width ``beam_width``), dearest last.
        exact_limit: inputs with at most this many content tokens get exact AOPC bounds.
        beam_width: prefixes the beam search keeps.
        sanity_layers: layer stages of the sanity cascade that are re-explained (evenly spaced,
            the last one — every layer random — always); None: all of them.
        sanity_all: the sanity check re-explains the expensive methods too (`sanity_checked`).
    """

    replace: str = "remove"
    bins: tuple[float, ...] = BINS
    curve_points: int = 11
    sanity_samples: int = 8
    chunk_size: int = 16
    seed: int = 0
    bounds: str = "none"
    exact_limit: int = EXACT_LIMIT
    beam_width: int = BEAM_WIDTH
    sanity_layers: int | None = 2
    sanity_all: bool = False

    def __post_init__(self) -> None:
        if self.replace not in REPLACE_MODES:
            raise ValueError(f"unknown replacement {self.replace!r}; choose one of {', '.join(REPLACE_MODES)}")
        if self.curve_points < 2:
            raise ValueError("the deletion curve needs at least 2 points")
        if self.beam_width < 1:
            raise InputError(f"{{beam_width}} must be at least 1, got {self.beam_width}", parameter="beam_width")
        if self.bounds not in BOUND_SEARCHES:
            raise InputError(
                f"{{bounds}} must be one of {', '.join(BOUND_SEARCHES)}, got {self.bounds!r}", parameter="bounds"
            )
        if self.sanity_layers is not None and self.sanity_layers < 1:  # the CLI's 0 (all) arrives as None
            raise InputError(
                f"{{sanity_layers}} must be at least 1, got {self.sanity_layers}", parameter="sanity_layers"
            )


@dataclass(frozen=True)
class Example:
    """One input as the benchmark sees it: ``ids [n]`` as the model's tokenizer makes them
    (truncated to its maximum), ``special_mask [n]``, the predicted class (or next token) and its
    probability. With a ``contrast`` class, the quantity every perturbation drops is
    p(target) − p(contrast), and ``p_full`` is that difference on the untouched input."""

    text: str
    label: int
    ids: tuple[int, ...]
    special_mask: np.ndarray
    target: int
    p_full: float
    contrast: int | None = None


@dataclass
class MethodRecord:
    """Per-sample values of one method: ``comprehensiveness``/``sufficiency`` ``[sample, bin]``,
    ``curve [sample, point]``, ``agreement [sample]`` (NaN without reference), ``sanity``
    ``{stage: [sanity sample]}``, ``seconds`` per sample of each chunk, ``scores`` per sample."""

    comprehensiveness: list[list[float]] = field(default_factory=list)
    sufficiency: list[list[float]] = field(default_factory=list)
    curve: list[list[float]] = field(default_factory=list)
    agreement: list[float] = field(default_factory=list)
    sanity: dict[str, list[float]] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)


def prepare_examples(
    model: ModelLike, scorer: ClassifierScorer, texts: Sequence[str], labels: Sequence[int] | np.ndarray
) -> list[Example]:
    """Tokenise (as the front door does), predict, and drop nothing silently: a text without
    content tokens is an error."""
    tokenizer = model.tokenizer
    encoded = tokenizer(list(texts), truncation=True, max_length=model.max_length)["input_ids"]
    probabilities = scorer.probabilities(encoded)  # [text, class]
    examples = []
    for text, label, ids, row in zip(texts, labels, encoded, probabilities, strict=False):
        special = np.asarray(tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True), dtype=bool)
        if special.all():
            raise ValueError(f"text {text[:40]!r} has no content tokens")
        target = int(np.argmax(row))
        examples.append(Example(text, int(label), tuple(int(i) for i in ids), special, target, float(row[target])))
    return examples


def perturbation_probabilities(
    scorer: ClassifierScorer,
    examples: Sequence[Example],
    rankings: Sequence[np.ndarray],
    options: BenchmarkOptions,
    mask_id: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``p_c`` of every perturbed variant (p_c − p_contrast for a contrastive example):
    ``(without top [sample, bin], only top [sample, bin], deletion curve [sample, point])``;
    identical variants are scored once, all in one call (`target_values`)."""
    pairs = [
        (variant, example)
        for example, ranking in zip(examples, rankings, strict=True)
        for variant in metric_inputs(example.ids, ranking, options.bins, options.curve_points, options.replace, mask_id)
    ]
    values = target_values(scorer, pairs)
    n_bins = len(options.bins)
    per_example = values.reshape(len(examples), 2 * n_bins + options.curve_points)  # [sample, variant]
    return per_example[:, :n_bins], per_example[:, n_bins : 2 * n_bins], per_example[:, 2 * n_bins :]


def content_agreement(
    scores: Sequence[np.ndarray], reference: Sequence[np.ndarray], examples: Sequence[Example]
) -> list[float]:
    """Spearman's rho of each sample's scores with the reference's on its content tokens."""
    return [
        rank_agreement(s[~e.special_mask], r[~e.special_mask])
        for s, r, e in zip(scores, reference, examples, strict=False)
    ]


def score_chunk(
    context: "BenchmarkContext",
    chunk: Sequence[Example],
    method: str,
    options: BenchmarkOptions,
    attribute_fn: Callable[..., list[np.ndarray]] = attribute,
) -> dict[str, Any]:
    """One chunk of one method: its scores and, per example, AOPC comprehensiveness and
    sufficiency per bin and the deletion curve (the fields of `MethodRecord`; ``seconds``: the
    explaining time per example)."""
    began = time.perf_counter()
    scores = attribute_fn(context.model, [e.text for e in chunk], method, [e.target for e in chunk])
    seconds = (time.perf_counter() - began) / len(chunk)
    for example, example_scores in zip(chunk, scores, strict=False):
        if example_scores.shape != (len(example.ids),):
            raise ValueError(
                f"method {method!r} gave {example_scores.shape} scores "
                f"for {len(example.ids)} tokens of {example.text[:40]!r}"
            )
    rankings = [content_ranking(s, e.special_mask) for s, e in zip(scores, chunk, strict=False)]
    without, only, curve = perturbation_probabilities(context.scorer, chunk, rankings, options, context.mask_id)
    p_full = np.array([e.p_full for e in chunk])
    return {
        "comprehensiveness": aopc(p_full, without)[0].tolist(),
        "sufficiency": aopc(p_full, only)[0].tolist(),
        "curve": curve.tolist(),
        "scores": [np.asarray(s).tolist() for s in scores],
        "seconds": [seconds],
    }


def evaluate_method(
    model: ModelLike,
    scorer: ClassifierScorer,
    examples: Sequence[Example],
    method: str,
    options: BenchmarkOptions,
    reference: Sequence[np.ndarray] | None = None,
    attribute_fn: Callable[..., list[np.ndarray]] = attribute,
) -> MethodRecord:
    """All metrics of one method on ``examples`` (see `MethodRecord`), in this process: the
    benchmark's units of that method, one after the other."""
    step, context = BenchmarkStep(model.name, options, attribute_fn), BenchmarkContext(model, scorer)
    rows = Rows()
    for unit in method_units(model, examples, method, options):
        rows = step.run(context, rows, unit)
    return method_record(rows.rows, examples, method, options, reference, sanity_labels(model, options))


# ----- the work: units, their step, the records assembled from their rows --------------------


@dataclass(frozen=True)
class Unit:
    """One batch of the benchmark's run: ``kind`` ``bounds`` (the chunk's AOPC bounds),
    ``reference`` (the agreement reference's scores of the chunk), ``method`` (the chunk's
    metrics) or ``sanity`` (the sanity examples explained again at randomisation stage ``stage``);
    ``start``: the index of the chunk's first example. Its length (for the engine and the progress
    bar) is the examples it explains or searches."""

    kind: str
    start: int
    examples: tuple[Example, ...]
    method: str | None = None
    stage: str | None = None

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def key(self) -> str:
        """The unit's row in `Rows`: ``kind/method/stage or start``."""
        return "/".join(str(part) for part in (self.kind, self.method, self.stage or self.start) if part is not None)

    def describe(self) -> str:
        """What the progress bar shows while the unit runs."""
        return {
            "bounds": "AOPC bounds",
            "reference": f"{self.method} (agreement reference)",
            "method": str(self.method),
            "sanity": f"{self.method} sanity: {self.stage}",
        }[self.kind]


def chunks(examples: Sequence[Example], options: BenchmarkOptions) -> list[tuple[int, tuple[Example, ...]]]:
    """``(start, examples)`` of every chunk of ``options.chunk_size`` examples."""
    size = options.chunk_size
    return [(start, tuple(examples[start : start + size])) for start in range(0, len(examples), size)]


def sanity_labels(model: ModelLike, options: BenchmarkOptions) -> list[str]:
    """The labels of the randomisation stages the sanity check re-explains (none without samples)."""
    if options.sanity_samples < 1:
        return []
    stages = randomisation_stages(model)
    return [stages[number][0] for number in shown_stages(len(stages), options.sanity_layers)]


def sanity_checked(method: str, options: BenchmarkOptions) -> bool:
    """Whether the sanity check re-explains ``method``: every method with ``options.sanity_all``,
    else every one but those declared ``cost="expensive"`` (leave-one-out, SHAP, integrated
    gradients, value zeroing, attention flow: re-explaining them at each stage costs most of a run,
    and the perturbation methods read the model's outputs, so randomising it changes them anyway)."""
    from attnflow.methods.registry import available_methods, get_method

    return options.sanity_all or method not in available_methods() or get_method(method).cost != "expensive"


def method_units(model: ModelLike, examples: Sequence[Example], method: str, options: BenchmarkOptions) -> list[Unit]:
    """One method's units: its chunks, then the sanity examples at each stage (`sanity_checked`)."""
    units = [Unit("method", start, chunk, method) for start, chunk in chunks(examples, options)]
    sanity = tuple(examples[: options.sanity_samples]) if sanity_checked(method, options) else ()
    if sanity:
        units += [Unit("sanity", 0, sanity, method, label) for label in sanity_labels(model, options)]
    return units


def benchmark_units(
    model: ModelLike,
    examples: Sequence[Example],
    methods: Sequence[str],
    options: BenchmarkOptions,
    reference_method: str | None,
) -> list[Unit]:
    """Every unit of a run, in the order they run: the bounds, the agreement reference (when it
    is not one of ``methods``), then each method's units (`method_units`)."""
    units = []
    if options.bounds != "none":
        units += [Unit("bounds", start, chunk) for start, chunk in chunks(examples, options)]
    if reference_method is not None and reference_method not in methods and methods:
        units += [Unit("reference", start, chunk, reference_method) for start, chunk in chunks(examples, options)]
    for method in methods:
        units += method_units(model, examples, method, options)
    return units


class BenchmarkContext:
    """A worker's model, its scorer and mask token, and the sanity check's randomised copies (the
    live cascade: consecutive stages of one method randomise one copy step by step)."""

    def __init__(self, model: ModelLike, scorer: ClassifierScorer | None = None) -> None:
        self.model = model
        self.scorer = scorer or ClassifierScorer(model)
        self.mask_id = mask_token_id(model)
        self._cascade: Iterator[tuple[str, Any]] | None = None
        self._passed: list[str] = []  # the stages of the live cascade so far, its current one last
        self._current: Any = None

    def randomised(self, label: str, options: BenchmarkOptions) -> Any:
        """The model with stage ``label`` and every stage before it randomised (`cascade`)."""
        if self._cascade is None or label in self._passed[:-1]:
            self._cascade = cascade(self.model, seed=options.seed, layers=options.sanity_layers)
            self._passed, self._current = [], None
        while not self._passed or self._passed[-1] != label:
            stage, self._current = next(self._cascade)
            self._passed.append(stage)
        return self._current


@dataclass(frozen=True)
class BenchmarkStep:
    """The benchmark's `attnflow.runs.engine.Step`: a unit into its row (see `Unit`). ``model``:
    the name each Ray actor loads; ``attribute_fn``: where scores come from (`attribute`)."""

    model: str
    options: BenchmarkOptions
    attribute_fn: Callable[..., list[np.ndarray]] = attribute
    dtype: str = "float32"

    def load(self, device: str) -> BenchmarkContext:
        from attnflow.model import load

        return BenchmarkContext(load(self.model, device=device, dtype=self.dtype))

    def empty(self, context: BenchmarkContext) -> Rows:  # noqa: ARG002 - the Step protocol
        return Rows()

    def run(self, context: BenchmarkContext, rows: Rows, unit: Unit) -> Rows:
        rows.rows[unit.key] = self._row(context, unit)
        return rows

    def _row(self, context: BenchmarkContext, unit: Unit) -> Any:
        options, examples = self.options, list(unit.examples)
        if unit.kind == "bounds":
            found = search_bounds(
                context.scorer, examples, options.bins, options.replace, context.mask_id, options.bounds,
                options.exact_limit, options.beam_width,
            )  # fmt: skip
            return [bounds.to_dict() for bounds in found]
        if unit.kind == "method":
            return score_chunk(context, examples, str(unit.method), options, self.attribute_fn)
        model = context.model if unit.stage is None else context.randomised(unit.stage, options)
        scores = self.attribute_fn(model, [e.text for e in examples], unit.method, [e.target for e in examples])
        return [np.asarray(s).tolist() for s in scores]


def method_record(
    rows: dict[str, Any],
    examples: Sequence[Example],
    method: str,
    options: BenchmarkOptions,
    reference: Sequence[np.ndarray] | None,
    labels: Sequence[str],
) -> MethodRecord:
    """The `MethodRecord` of ``method`` from the rows of its units: the chunks' values in order,
    the agreement with ``reference`` (scores per example; None: none), the sanity correlations at
    the stages ``labels``."""
    record = MethodRecord()
    for start, _ in chunks(examples, options):
        chunk = rows[Unit("method", start, (), method).key]
        for name in ("comprehensiveness", "sufficiency", "curve", "scores", "seconds"):
            getattr(record, name).extend(chunk[name])
    original = [np.asarray(s) for s in record.scores]
    if reference is not None:
        record.agreement = content_agreement(original, reference, examples)
    sanity = list(examples[: options.sanity_samples]) if sanity_checked(method, options) else []
    for label in labels if sanity else []:
        rerun = rows[Unit("sanity", 0, (), method, label).key]
        record.sanity[label] = content_agreement([np.asarray(s) for s in rerun], original, sanity)
    return record


def summarise(
    record: MethodRecord, options: BenchmarkOptions, bounds: Sequence[AopcBounds] | None = None
) -> dict[str, Any]:
    """Means with standard errors (over samples) of a method's per-sample values; with the
    samples' AOPC ``bounds``, NAOPC too (`attnflow.evaluate.bounds.normalised_aopc`)."""
    comprehensiveness, sufficiency = np.asarray(record.comprehensiveness), np.asarray(record.sufficiency)
    curve = np.asarray(record.curve)

    def figure(values: np.ndarray) -> dict[str, float]:
        mean, se = mean_se(values)
        return {"mean": mean, "se": se}

    def aopc_figure(drops: np.ndarray) -> dict[str, Any]:
        bins_mean, bins_se = mean_se(drops)
        return {
            **figure(drops.mean(axis=1)),
            "bins": {
                f"{k:g}": {"mean": float(m), "se": float(s)}
                for k, m, s in zip(options.bins, bins_mean, bins_se, strict=False)
            },
        }

    curve_mean, curve_se = mean_se(curve)
    summary: dict[str, Any] = {
        "n": len(record.comprehensiveness),
        "comprehensiveness": aopc_figure(comprehensiveness),
        "sufficiency": aopc_figure(sufficiency),
        "deletion_auc": figure(deletion_auc(curve)),
        "deletion_curve": {
            "x": np.linspace(0.0, 1.0, options.curve_points).tolist(),
            "mean": curve_mean.tolist(),
            "se": curve_se.tolist(),
        },
        "agreement_loo": figure(np.asarray(record.agreement)) if record.agreement else None,
        "seconds_per_sample": figure(np.asarray(record.seconds)),
        "sanity": None,
    }
    if bounds is not None:
        for metric, drops in (("comprehensiveness", comprehensiveness), ("sufficiency", sufficiency)):
            lower, upper = (np.array([getattr(b, metric)[side] for b in bounds]) for side in (0, 1))
            normalised = normalised_aopc(drops.mean(axis=1), lower, upper)
            undefined = int(np.isnan(normalised).sum())  # bounds that coincide, or none searched
            summary[f"naopc_{metric}"] = (
                None if undefined == len(normalised) else {**figure(normalised), "undefined": undefined}
            )
    if record.sanity:
        stages: list[dict[str, Any]] = [
            {"stage": label, "n": len(rhos), **figure(np.asarray(rhos))} for label, rhos in record.sanity.items()
        ]
        final = stages[-1]["mean"]
        summary["sanity"] = {
            "stages": stages,
            "final_rho": final,
            "flagged": bool(final >= FLAG_RHO),
            "threshold": FLAG_RHO,
        }
    return summary


def mask_token_id(model: ModelLike) -> int | None:
    """The token ``--replace mask`` puts in place: the tokenizer's mask token, else its pad token."""
    tokenizer = model.tokenizer
    return tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.pad_token_id


def is_benchmark_output(name: str) -> bool:
    """Whether a folder entry is something `run_benchmark` writes (its checkpoint aside)."""
    return name in (RUN_FILE, BOUNDS_FILE, METHODS_DIR)


def run_benchmark(
    model: ModelLike,
    texts: Sequence[str],
    labels: Sequence[int] | np.ndarray,
    methods: Sequence[str],
    options: BenchmarkOptions,
    out_dir: str | Path,
    run_info: dict[str, Any],
    resume: bool = False,
    progress: bool = True,
    attribute_fn: Callable[..., list[np.ndarray]] = attribute,
    reference_method: str | None = REFERENCE_METHOD,
    *,
    engine: EngineOptions | None = None,
    config: dict[str, Any] | None = None,
    owned: Callable[[str], bool] = is_benchmark_output,
) -> dict[str, Any]:
    """Evaluate ``methods`` on the given texts; returns (and writes ``DIR/methods/*.json``,
    ``DIR/bounds.json``, ``DIR/run.json``) the results: ``{"run": run_info + options, "methods":
    {name: summary}}``.

    ``reference_method`` (leave-one-out) gives the agreement column: its scores are those of the
    method when it is in ``methods``, else computed for that purpose; None skips the column. The
    units run on the run engine (``engine``: local by default, quiet without ``progress``); with
    ``resume`` the run checkpointed in ``out_dir`` continues (the same run only: ``run_info``,
    options, methods, examples and ``config``, the caller's own fields, are checked), computing
    only the units not yet done. ``owned``: the entries of ``out_dir`` an earlier run left there.
    """
    engine = engine or EngineOptions(quiet=not progress)
    run_record = {**run_info, "agreement_reference": reference_method, "options": asdict(options)}
    ordered = sorted(methods, key=lambda name: name != reference_method)
    with RunFolder(
        out_dir, kind="evaluate", checkpoint=CHECKPOINT, owned=owned, state_format=CHECKPOINT_FORMAT, resume=resume,
        fields=config,
    ) as folder:  # fmt: skip
        context = BenchmarkContext(model)
        examples = prepare_examples(model, context.scorer, texts, labels)
        units = benchmark_units(model, examples, ordered, options, reference_method)
        if progress:  # before any work: what the run will cost
            _print_plan(model, context, examples, units, folder.done, options, attribute_fn)
        job = Job(
            name="evaluate",
            unit="example",
            total=sum(map(len, units)),
            fields={
                **(config or {}),
                "run": run_record,
                "method_order": ordered,
                "examples": digest([list(texts), np.asarray(labels).tolist()]),
            },
            step=BenchmarkStep(model.name, options, attribute_fn, model_dtype(model)),
            result=Rows(),
            batches=lambda start: _units_from(units, start),
            label=Unit.describe,
        )
        rows = run(job, folder, engine, context=context).result.rows
        summaries, bounds = _summaries(model, rows, examples, ordered, options, reference_method)
        _write_records(folder.out, run_record, bounds, summaries)
    result_run = dict(run_record)
    if bounds:
        result_run["bounds_search"] = dict(sorted(Counter(b.search for b in bounds).items()))
    predictions = np.array([e.target for e in examples])
    result_run["accuracy_on_samples"] = float(np.mean(predictions == np.array([e.label for e in examples])))
    result_run["mean_content_tokens"] = float(np.mean([np.sum(~e.special_mask) for e in examples]))
    return {"run": result_run, "methods": {name: summary for name, (summary, _) in summaries.items()}}


def _units_from(units: Sequence[Unit], start: int) -> Iterator[Unit]:
    """The units after the first ``start`` examples' worth (a checkpoint falls between units)."""
    done = 0
    for unit in units:
        if done >= start:
            yield unit
        done += len(unit)


def explanations_left(units: Sequence[Unit], done: int) -> dict[str, int]:
    """The explanations each method (and the agreement reference, ``"NAME (agreement reference)"``)
    still has to run after the first ``done`` examples' worth of ``units``."""
    explanations: dict[str, int] = {}
    for unit in _units_from(units, done):
        if unit.kind in ("reference", "method", "sanity"):
            name = f"{unit.method} (agreement reference)" if unit.kind == "reference" else str(unit.method)
            explanations[name] = explanations.get(name, 0) + len(unit)
    return explanations


def _print_plan(
    model: ModelLike,
    context: BenchmarkContext,
    examples: Sequence[Example],
    units: Sequence[Unit],
    done: int,
    options: BenchmarkOptions,
    attribute_fn: Callable[..., list[np.ndarray]],
) -> None:
    """The plan of the methods with work left (`attnflow.evaluate.plan`), on stderr."""
    from attnflow.evaluate.plan import plan_run

    explanations = explanations_left(units, done)
    methods = dict.fromkeys(str(unit.method) for unit in units if unit.kind == "method")
    to_run = [name for name in methods if name in explanations]
    plan = plan_run(
        model, context.scorer, examples, to_run, explanations, options, attribute_fn, mask_id=context.mask_id
    )
    for line in plan.describe():
        print(f"attnflow: {line}", file=sys.stderr, flush=True)


def _summaries(
    model: ModelLike,
    rows: dict[str, Any],
    examples: Sequence[Example],
    methods: Sequence[str],
    options: BenchmarkOptions,
    reference_method: str | None,
) -> tuple[dict[str, tuple[dict[str, Any], MethodRecord]], list[AopcBounds]]:
    """``({method: (summary, record)}, bounds)`` from the rows of every unit."""
    parts = chunks(examples, options)
    bounds = [
        AopcBounds.from_dict(b) for start, _ in parts if options.bounds != "none" for b in rows[f"bounds/{start}"]
    ]
    reference = None
    if reference_method is not None and reference_method not in methods and methods:
        scores = [s for start, _ in parts for s in rows[Unit("reference", start, (), reference_method).key]]
        reference = [np.asarray(s) for s in scores]
    labels = sanity_labels(model, options)
    summaries = {}
    for method in methods:
        record = method_record(rows, examples, method, options, reference, labels)
        summaries[method] = summarise(record, options, bounds or None), record
        if method == reference_method:
            reference = [np.asarray(s) for s in record.scores]
    return summaries, bounds


def _write_records(
    out: Path, run_record: dict[str, Any], bounds: list[AopcBounds], summaries: dict[str, tuple[dict, MethodRecord]]
) -> None:
    """``run.json``, ``bounds.json`` (with bounds) and ``methods/<method>.json``, each atomically."""
    with atomic_file(out / RUN_FILE) as handle:
        handle.write(json.dumps(run_record, indent=2).encode("utf-8"))
    if bounds:
        with atomic_file(out / BOUNDS_FILE) as handle:
            handle.write(json.dumps([b.to_dict() for b in bounds]).encode("utf-8"))
    for method, (summary, record) in summaries.items():
        with atomic_file(out / METHODS_DIR / f"{method}.json") as handle:
            handle.write(json.dumps({"summary": summary, "record": asdict(record)}).encode("utf-8"))
