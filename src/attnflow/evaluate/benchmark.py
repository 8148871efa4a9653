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
    BOUND_SEARCHES,
    EXACT_LIMIT,
    AopcBounds,
    normalised_aopc,
    search_bounds,
    search_cost,
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
        bounds: the AOPC bounds behind the NAOPC columns (`attnflow.evaluate.bounds`): ``"none"``
            (default: no NAOPC), ``"exact"`` (inputs of at most ``exact_limit`` content tokens
            only), or exact up to it and beyond ``"singles"`` (each token's own drop: m passes),
            ``"levels"`` (a bin at a time) or ``"beam"`` (width ``beam_width``), dearest last.
        exact_limit: inputs with at most this many content tokens get exact AOPC bounds.
        beam_width: prefixes the beam search keeps.
        sanity_layers: layer stages of the sanity cascade that are re-explained (evenly spaced,
            the last one — every layer random — always); None: all of them.
    """

    replace: str = "remove"
    bins: tuple[float, ...] = BINS
    curve_points: int = 11
    sanity_samples: int = 32
    chunk_size: int = 16
    seed: int = 0
    bounds: str = "none"
    exact_limit: int = EXACT_LIMIT
    beam_width: int = BEAM_WIDTH
    sanity_layers: int | None = None

    def __post_init__(self) -> None:
        if self.replace not in REPLACE_MODES:
            raise ValueError(f"unknown replacement {self.replace!r}; choose one of {', '.join(REPLACE_MODES)}")
        if self.curve_points < 2:
            raise ValueError("the deletion curve needs at least 2 points")
        if self.beam_width < 1:
            raise ValueError(f"--beam-width must be at least 1, got {self.beam_width}")
        if self.bounds not in BOUND_SEARCHES:
            raise ValueError(f"--bounds must be one of {', '.join(BOUND_SEARCHES)}, got {self.bounds!r}")
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
    example once and ``sanity_examples`` again at each of ``stages`` randomisation stages; and, when
    timed, the estimate: ``seconds`` per method (one timed explanation of one example × its
    explanations), ``perturbation_seconds`` (every method's perturbed inputs) and ``bounds_seconds``
    per bounds search (what each would add; ``bounds`` is the one asked for)."""

    examples: int
    methods: list[str]
    sanity_examples: int
    stages: int
    bounds: str = "none"
    seconds: dict[str, float] | None = None
    perturbation_seconds: float = 0.0
    bounds_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def explanations_per_method(self) -> int:
        return self.examples + self.sanity_examples * self.stages

    def describe(self) -> list[str]:
        """The plan in a few lines: the sizes, the estimate, and what dominates it."""
        lines = [
            f"plan: {self.examples} examples × {len(self.methods)} methods, and {self.sanity_examples} examples "
            f"× {self.stages} sanity stages per method: {self.explanations_per_method * len(self.methods):,} "
            "explanations"
        ]
        if self.seconds is None:
            return lines
        explaining = sum(self.seconds.values())
        bounds = self.bounds_seconds.get(self.bounds, 0.0)
        total = explaining + self.perturbation_seconds + bounds
        parts = [f"explanations {_duration(explaining)}", f"perturbed inputs {_duration(self.perturbation_seconds)}"]
        if self.bounds not in ("none",):
            parts.append(f"NAOPC bounds ({self.bounds}) {_duration(bounds)}")
        lines.append(f"estimate: {_duration(total)} ({', '.join(parts)}; one example timed per method)")
        ranked = sorted(self.seconds.items(), key=lambda item: -item[1])
        heavy = [(name, t) for name, t in ranked[:3] if total > 0 and t / total >= 0.1]
        if len(self.methods) > 1 and heavy:
            shares = ", ".join(f"{name} {100 * t / total:.0f} % ({_duration(t)})" for name, t in heavy)
            lines.append(f"most of the time goes to {shares}; --methods without them runs faster")
        others = [f"{search} {_duration(t)}" for search, t in self.bounds_seconds.items() if search != self.bounds]
        if self.bounds == "none":
            lines.append("NAOPC: not computed; --bounds adds it, at about: " + ", ".join(others))
        elif bounds > 0.5 * total:
            lines.append(f"the NAOPC bounds are most of it; other --bounds: {', '.join(others)}")
        return lines


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"~{seconds:.0f} s"
    if seconds < 5400:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


def plan_run(
    model: ModelLike,
    scorer: ClassifierScorer,
    examples: Sequence[Example],
    methods: Sequence[str],
    options: BenchmarkOptions,
    attribute_fn: Callable[..., list[np.ndarray]] = attribute,
    timed: bool = True,
) -> Plan:
    """The `Plan` of evaluating ``methods`` on ``examples``; ``timed``: explain the first example
    once with each method (its explanations × that time), and score a few unaltered examples to
    price a perturbed input per token (the perturbations' and each bounds search's estimate)."""
    from attnflow.evaluate.sanity import randomisation_stages

    plan = Plan(len(examples), list(methods), min(options.sanity_samples, len(examples)), 0, options.bounds)
    if plan.sanity_examples:
        plan.stages = len(shown_stages(len(randomisation_stages(model)), options.sanity_layers))
    if not timed or not examples:
        return plan
    plan.seconds = {}
    for method in methods:
        began = time.perf_counter()
        attribute_fn(model, [examples[0].text], method, [examples[0].target])
        plan.seconds[method] = (time.perf_counter() - began) * plan.explanations_per_method
    timed_examples = examples[:16]
    began = time.perf_counter()
    ClassifierScorer(model, scorer.max_batch_tokens).probabilities([e.ids for e in timed_examples])
    per_token = (time.perf_counter() - began) / sum(len(e.ids) for e in timed_examples)
    lengths = [len(e.ids) for e in examples]
    per_ranking = 2 * len(options.bins) + options.curve_points - 1  # curve point 0 is the input itself
    plan.perturbation_seconds = per_token * sum(lengths) * per_ranking * len(methods)
    for search in BOUND_SEARCHES[1:]:
        priced = 0.0
        for example, length in zip(examples, lengths, strict=True):
            m = int(np.sum(~example.special_mask))
            counts = [top_count(k, m) for k in options.bins]
            priced += length * search_cost(m, counts, search, options.exact_limit, options.beam_width)
        plan.bounds_seconds[search] = per_token * priced
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
    scorer: ClassifierScorer,
    examples: Sequence[Example],
    options: BenchmarkOptions,
    mask_id: int | None,
    path: Path,
    resume: bool,
    progress: bool,
) -> list[AopcBounds]:
    """Each example's AOPC bounds (`attnflow.evaluate.bounds.search_bounds`, ``options.bounds``),
    searched ``options.chunk_size`` examples at a time (one batched forward per search step) and
    written to ``path`` after every chunk; with ``resume`` the examples already in ``path`` are read
    back and the search goes on from the next one. Nothing is written with ``bounds="none"``."""
    from tqdm.auto import tqdm

    if options.bounds == "none":
        return []
    bounds: list[AopcBounds] = []
    if resume and path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        bounds = [AopcBounds.from_dict(entry) for entry in saved[: len(examples)]]
    rest = examples[len(bounds) :]
    with tqdm(total=len(rest), desc="AOPC bounds", unit="sample", disable=not progress or not rest) as bar:
        for start in range(0, len(rest), options.chunk_size):
            chunk = rest[start : start + options.chunk_size]
            bounds += search_bounds(
                scorer,
                chunk,
                options.bins,
                options.replace,
                mask_id,
                options.bounds,
                options.exact_limit,
                options.beam_width,
            )
            with atomic_file(path) as handle:
                handle.write(json.dumps([b.to_dict() for b in bounds]).encode("utf-8"))
            bar.update(len(chunk))
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
    if progress:  # before any work: what the run will cost
        to_run = [m for m in ordered if not (resume and _finished_record(method_dir / f"{m}.json") is not None)]
        for line in plan_run(model, scorer, examples, to_run, options, attribute_fn).describe():
            print(f"attnflow: {line}", file=sys.stderr, flush=True)
    bounds = example_bounds(scorer, examples, options, mask_token_id(model), out_dir / BOUNDS_FILE, resume, progress)
    if bounds:
        run["bounds_search"] = dict(sorted(Counter(b.search for b in bounds).items()))
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
                summary = summarise(record, options, bounds or None)
                path.write_text(json.dumps({"summary": summary, "record": asdict(record)}), encoding="utf-8")
            else:
                bar.update(len(examples))
                summary = summarise(record, options, bounds or None)
            if method == reference_method:
                reference = [np.asarray(s) for s in record.scores]
            summaries[method] = summary
    finally:
        bar.close()
    predictions = np.array([e.target for e in examples])
    run["accuracy_on_samples"] = float(np.mean(predictions == np.array([e.label for e in examples])))
    run["mean_content_tokens"] = float(np.mean([np.sum(~e.special_mask) for e in examples]))
    return {"run": run, "methods": summaries}
