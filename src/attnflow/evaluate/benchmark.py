"""The benchmark loop: every method, the same examples, the same perturbations, batched.

For each method, examples are explained in chunks (one front-door call per chunk and target
class); all perturbed variants of a chunk (comprehensiveness and sufficiency bins, deletion-curve
points, for every example in the chunk) are deduplicated and scored in one batched forward pass.
Per-method results (per-sample values included) are written to ``DIR/methods/<method>.json`` as
soon as a method finishes, so ``resume=True`` skips what is done.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from attnflow.evaluate.attribute import attribute
from attnflow.evaluate.bounds import (
    BEAM_WIDTH,
    EXACT_LIMIT,
    LONG_INPUT_SEARCHES,
    AopcBounds,
    aopc_bounds,
    normalised_aopc,
)
from attnflow.evaluate.deletion import REPLACE_MODES, only_top, without_top
from attnflow.evaluate.metrics import BINS, aopc, content_ranking, deletion_auc, mean_se, rank_agreement, top_count
from attnflow.evaluate.sanity import FLAG_RHO, cascade, shown_stages
from attnflow.evaluate.scorer import ClassifierScorer, target_values
from attnflow.model_like import ModelLike
from attnflow.staging import atomic_file

log = logging.getLogger(__name__)

REFERENCE_METHOD = "leave_one_out"
METHODS_DIR = "methods"
RUN_FILE = "run.json"
BOUNDS_FILE = "bounds.json"


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
        exact_limit: inputs with at most this many content tokens get exact AOPC bounds (NAOPC);
            longer ones a beam search (`attnflow.evaluate.bounds`).
        beam_width: prefixes the beam search keeps; 0: no bounds for longer inputs (their NAOPC
            is undefined and left out).
        bounds_search: how longer inputs' bounds are searched: ``"beam"`` (width ``beam_width``)
            or ``"levels"`` (a bin at a time, about half the passes of width 1).
        sanity_layers: layer stages of the sanity cascade that are re-explained (evenly spaced,
            the last one — every layer random — always); None: all of them.
    """

    replace: str = "remove"
    bins: tuple[float, ...] = BINS
    curve_points: int = 11
    sanity_samples: int = 32
    chunk_size: int = 16
    seed: int = 0
    exact_limit: int = EXACT_LIMIT
    beam_width: int = BEAM_WIDTH
    bounds_search: str = "beam"
    sanity_layers: int | None = None

    def __post_init__(self) -> None:
        if self.replace not in REPLACE_MODES:
            raise ValueError(f"unknown replacement {self.replace!r}; choose one of {', '.join(REPLACE_MODES)}")
        if self.curve_points < 2:
            raise ValueError("the deletion curve needs at least 2 points")
        if self.beam_width < 0:
            raise ValueError(
                f"--beam-width must be 0 (no bounds beyond the exact limit) or more, got {self.beam_width}"
            )
        if self.bounds_search not in LONG_INPUT_SEARCHES:
            raise ValueError(
                f"--bounds-search must be one of {', '.join(LONG_INPUT_SEARCHES)}, got {self.bounds_search!r}"
            )
        if self.sanity_layers is not None and self.sanity_layers < 1:
            raise ValueError(f"--sanity-layers must be at least 1, got {self.sanity_layers}")


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
    fractions = np.linspace(0.0, 1.0, options.curve_points)
    groups = []  # per example: (comprehensiveness variants, sufficiency variants, curve variants)
    for example, ranking in zip(examples, rankings, strict=False):
        m = len(ranking)
        groups.append(
            (
                [without_top(example.ids, ranking, top_count(k, m), options.replace, mask_id) for k in options.bins],
                [only_top(example.ids, ranking, top_count(k, m), options.replace, mask_id) for k in options.bins],
                [without_top(example.ids, ranking, top_count(f, m), options.replace, mask_id) for f in fractions],
            )
        )
    pairs = [(variant, e) for e, g in zip(examples, groups, strict=True) for group in g for variant in group]
    values = target_values(scorer, pairs)
    n_bins = len(options.bins)
    per_example = values.reshape(len(examples), 2 * n_bins + len(fractions))  # [sample, variant]
    return per_example[:, :n_bins], per_example[:, n_bins : 2 * n_bins], per_example[:, 2 * n_bins :]


def content_agreement(
    scores: Sequence[np.ndarray], reference: Sequence[np.ndarray], examples: Sequence[Example]
) -> list[float]:
    """Spearman's rho of each sample's scores with the reference's on its content tokens."""
    return [
        rank_agreement(s[~e.special_mask], r[~e.special_mask])
        for s, r, e in zip(scores, reference, examples, strict=False)
    ]


def evaluate_method(
    model: ModelLike,
    scorer: ClassifierScorer,
    examples: Sequence[Example],
    method: str,
    options: BenchmarkOptions,
    reference: Sequence[np.ndarray] | None = None,
    advance: Callable[[int], None] = lambda _n: None,
    attribute_fn: Callable[..., list[np.ndarray]] = attribute,
    stage: Callable[[str], None] = lambda _label: None,
) -> MethodRecord:
    """All metrics of one method on ``examples`` (see `MethodRecord`). ``advance(n)``: n more
    examples explained and scored; ``stage(label)``: a sanity stage begins."""
    record = MethodRecord()
    mask_id = mask_token_id(model)
    for start in range(0, len(examples), options.chunk_size):
        chunk = examples[start : start + options.chunk_size]
        began = time.perf_counter()
        scores = attribute_fn(model, [e.text for e in chunk], method, [e.target for e in chunk])
        record.seconds.append((time.perf_counter() - began) / len(chunk))
        for example, example_scores in zip(chunk, scores, strict=False):
            if example_scores.shape != (len(example.ids),):
                raise ValueError(
                    f"method {method!r} gave {example_scores.shape} scores "
                    f"for {len(example.ids)} tokens of {example.text[:40]!r}"
                )
        rankings = [content_ranking(s, e.special_mask) for s, e in zip(scores, chunk, strict=False)]
        without, only, curve = perturbation_probabilities(scorer, chunk, rankings, options, mask_id)
        p_full = np.array([e.p_full for e in chunk])
        record.comprehensiveness += aopc(p_full, without)[0].tolist()
        record.sufficiency += aopc(p_full, only)[0].tolist()
        record.curve += curve.tolist()
        record.scores += [s.tolist() for s in scores]
        advance(len(chunk))
    original = [np.asarray(s) for s in record.scores]
    if reference is not None:
        record.agreement = content_agreement(original, reference, examples)
    sanity_examples = list(examples[: options.sanity_samples])
    if sanity_examples:
        for label, randomised in cascade(model, seed=options.seed, layers=options.sanity_layers):
            stage(label)
            rerun = attribute_fn(
                randomised, [e.text for e in sanity_examples], method, [e.target for e in sanity_examples]
            )
            record.sanity[label] = content_agreement(rerun, original, sanity_examples)
    return record


@dataclass
class Plan:
    """What a benchmark run will compute: ``examples`` × ``methods``, each method explaining every
    example once and ``sanity_examples`` again at each of ``stages`` randomisation stages, and
    ``seconds`` per method, estimated from one timed explanation of one example (None: not timed)."""

    examples: int
    methods: list[str]
    sanity_examples: int
    stages: int
    seconds: dict[str, float] | None = None

    @property
    def explanations_per_method(self) -> int:
        return self.examples + self.sanity_examples * self.stages

    def describe(self) -> list[str]:
        """The plan in a few lines: the sizes, the estimate, and which methods dominate it."""
        lines = [
            f"plan: {self.examples} examples × {len(self.methods)} methods, and {self.sanity_examples} examples "
            f"× {self.stages} sanity stages per method: {self.explanations_per_method * len(self.methods):,} "
            "explanations"
        ]
        if self.seconds:
            total = sum(self.seconds.values())
            lines.append(f"estimate: {_duration(total)} (one example timed per method; perturbations add to it)")
            ranked = sorted(self.seconds.items(), key=lambda item: -item[1])
            heavy = [(name, t) for name, t in ranked[:3] if total > 0 and t / total >= 0.1]
            if len(self.methods) > 1 and heavy:
                shares = ", ".join(f"{name} {100 * t / total:.0f} % ({_duration(t)})" for name, t in heavy)
                lines.append(f"most of the time goes to {shares}; --methods without them runs faster")
        return lines


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"~{seconds:.0f} s"
    if seconds < 5400:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


def plan_run(
    model: ModelLike,
    examples: Sequence[Example],
    methods: Sequence[str],
    options: BenchmarkOptions,
    attribute_fn: Callable[..., list[np.ndarray]] = attribute,
    timed: bool = True,
) -> Plan:
    """The `Plan` of evaluating ``methods`` on ``examples``; ``timed``: explain the first example
    once with each method to estimate each method's time (its explanations × that time)."""
    from attnflow.evaluate.sanity import randomisation_stages

    plan = Plan(len(examples), list(methods), min(options.sanity_samples, len(examples)), 0)
    if plan.sanity_examples:
        plan.stages = len(shown_stages(len(randomisation_stages(model)), options.sanity_layers))
    if timed and examples:
        plan.seconds = {}
        for method in methods:
            began = time.perf_counter()
            attribute_fn(model, [examples[0].text], method, [examples[0].target])
            plan.seconds[method] = (time.perf_counter() - began) * plan.explanations_per_method
    return plan


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


def example_bounds(
    model: ModelLike,
    scorer: ClassifierScorer,
    examples: Sequence[Example],
    options: BenchmarkOptions,
    path: Path,
    resume: bool,
    progress: bool,
) -> list[AopcBounds]:
    """Each example's AOPC bounds (`attnflow.evaluate.bounds.aopc_bounds`), written to ``path``
    after every example (the search is the longest step of a run on long inputs); with ``resume``
    the examples already in ``path`` are read back and the search goes on from the next one."""
    from tqdm.auto import tqdm

    bounds: list[AopcBounds] = []
    if resume and path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        bounds = [AopcBounds.from_dict(entry) for entry in saved[: len(examples)]]
    mask_id = mask_token_id(model)
    rest = examples[len(bounds) :]
    for example in tqdm(rest, desc="AOPC bounds", unit="sample", disable=not progress or not rest):
        bounds.append(
            aopc_bounds(
                scorer,
                example,
                options.bins,
                options.replace,
                mask_id,
                options.exact_limit,
                options.beam_width,
                options.bounds_search,
            )
        )
        with atomic_file(path) as handle:
            handle.write(json.dumps([b.to_dict() for b in bounds]).encode("utf-8"))
    return bounds


def _finished_record(path: Path) -> MethodRecord | None:
    try:
        return MethodRecord(**json.loads(path.read_text(encoding="utf-8"))["record"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_run(out_dir: Path, run: dict[str, Any], resume: bool) -> None:
    """Write ``DIR/run.json``; with ``resume``, first refuse a folder that holds another run."""
    run_path = out_dir / RUN_FILE
    if resume and run_path.exists():
        previous = json.loads(run_path.read_text(encoding="utf-8"))
        if previous != json.loads(json.dumps(run)):
            raise ValueError(f"--resume: {run_path} describes a different run (model, task, samples or options differ)")
    (out_dir / METHODS_DIR).mkdir(parents=True, exist_ok=True)
    run_path.write_text(json.dumps(run, indent=2), encoding="utf-8")


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
) -> dict[str, Any]:
    """Evaluate ``methods`` on the given texts; returns (and writes ``DIR/methods/*.json``) the
    results: ``{"run": run_info + options, "methods": {name: summary}}``.

    ``reference_method`` (leave-one-out) is run first, as a method when it is in ``methods`` and
    only for its scores otherwise (then only when some method still has to run); None skips the
    agreement column. With ``resume``, the bounds already searched and the methods whose file
    exists for the same run (same ``run_info`` and options) are read instead of recomputed.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    method_dir = out_dir / METHODS_DIR
    run = {**run_info, "agreement_reference": reference_method, "options": asdict(options)}
    _record_run(out_dir, run, resume)

    scorer = ClassifierScorer(model)
    examples = prepare_examples(model, scorer, texts, labels)
    ordered = sorted(methods, key=lambda name: name != reference_method)
    bounds = example_bounds(model, scorer, examples, options, out_dir / BOUNDS_FILE, resume, progress)
    run["bounds_search"] = dict(sorted(Counter(b.search for b in bounds).items()))
    if progress:
        to_run = [m for m in ordered if not (resume and _finished_record(method_dir / f"{m}.json") is not None)]
        for line in plan_run(model, examples, to_run, options, attribute_fn).describe():
            print(f"attnflow: {line}", file=sys.stderr, flush=True)
    reference: list[np.ndarray] | None = None
    # counts examples (each method's pass over them); the sanity stages show in the bar's postfix
    bar = tqdm(total=len(examples) * len(ordered), desc="evaluate", unit="example", disable=not progress)
    summaries: dict[str, Any] = {}
    try:
        for method in ordered:
            bar.set_description(method)
            path = method_dir / f"{method}.json"
            record = _finished_record(path) if resume else None
            if record is None and reference is None and reference_method not in (None, *ordered):
                # only for the agreement column of methods still to run (a resumed run may have none)
                bar.set_postfix_str(f"{reference_method} (agreement reference)")
                targets = [e.target for e in examples]
                reference = attribute_fn(model, [e.text for e in examples], reference_method, targets)
            if record is None:
                bar.set_postfix_str("")
                record = evaluate_method(
                    model,
                    scorer,
                    examples,
                    method,
                    options,
                    reference,
                    bar.update,
                    attribute_fn,
                    stage=lambda label: bar.set_postfix_str(f"sanity: {label}"),
                )
                summary = summarise(record, options, bounds)
                path.write_text(json.dumps({"summary": summary, "record": asdict(record)}), encoding="utf-8")
            else:
                bar.update(len(examples))
                summary = summarise(record, options, bounds)
            if method == reference_method:
                reference = [np.asarray(s) for s in record.scores]
            summaries[method] = summary
    finally:
        bar.close()
    predictions = np.array([e.target for e in examples])
    run["accuracy_on_samples"] = float(np.mean(predictions == np.array([e.label for e in examples])))
    run["mean_content_tokens"] = float(np.mean([np.sum(~e.special_mask) for e in examples]))
    return {"run": run, "methods": summaries}
