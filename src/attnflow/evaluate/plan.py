"""The plan of a benchmark run, printed before any work: its sizes and, timed on one example per
method, its estimate (explanations, perturbed inputs, each ``--bounds`` search) and what dominates it.

It reads the benchmark's examples and options (`attnflow.evaluate.benchmark.Example`,
`BenchmarkOptions`) without importing that module, which imports this one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from attnflow.evaluate.attribute import attribute
from attnflow.evaluate.bounds import BOUND_SEARCHES, search_cost
from attnflow.evaluate.deletion import metric_inputs
from attnflow.evaluate.metrics import content_ranking, top_count
from attnflow.evaluate.sanity import shown_stages
from attnflow.evaluate.scorer import ClassifierScorer, target_values
from attnflow.model_like import ModelLike

Example = Any  # attnflow.evaluate.benchmark.Example
BenchmarkOptions = Any  # attnflow.evaluate.benchmark.BenchmarkOptions


@dataclass
class Plan:
    """What a benchmark run will compute: ``examples`` × ``methods``, and ``explanations`` (each
    method's explanations still to run: every example once, ``sanity_examples`` again at each of
    ``stages`` randomisation stages for the methods the sanity check re-explains; the agreement
    reference, when it is not one of the methods, is a key of its own); and, when timed, the
    estimate: ``seconds`` per entry of ``explanations`` (one timed explanation of one example × its
    count), ``perturbation_seconds`` (every method's perturbed inputs) and ``bounds_seconds`` per
    bounds search (what each would add; ``bounds`` is the one asked for)."""

    examples: int
    methods: list[str]
    explanations: dict[str, int]
    sanity_examples: int
    stages: int
    bounds: str = "none"
    seconds: dict[str, float] | None = None
    perturbation_seconds: float = 0.0
    bounds_seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> list[str]:
        """The plan in a few lines: the sizes, the estimate, and what dominates it."""
        checked = [name for name in self.methods if self.explanations.get(name, 0) > self.examples]
        sanity = (
            f"{self.sanity_examples} examples × {self.stages} sanity stages for "
            + ("each method" if len(checked) == len(self.methods) else f"{len(checked)} of them")
            if checked
            else "no sanity check"
        )
        extra = [name for name in self.explanations if name not in self.methods]
        reference = f", {', '.join(extra)}" if extra else ""
        lines = [
            f"plan: {self.examples} examples × {len(self.methods)} methods{reference}, and {sanity}: "
            f"{sum(self.explanations.values()):,} explanations"
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
        if len(self.seconds) > 1 and heavy:
            shares = ", ".join(f"{name} {100 * t / total:.0f} % ({_duration(t)})" for name, t in heavy)
            droppable = [name for name, _ in heavy if name in self.methods]  # not the agreement reference
            advice = f"; --methods without {', '.join(droppable)} runs faster" if droppable else ""
            lines.append(f"most of the time goes to {shares}{advice}")
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
    explanations: dict[str, int],
    options: BenchmarkOptions,
    attribute_fn: Callable[..., list[np.ndarray]] = attribute,
    timed: bool = True,
    mask_id: int | None = None,
) -> Plan:
    """The `Plan` of evaluating ``methods`` on ``examples`` with ``explanations`` still to run (per
    method, and per agreement reference: `Plan.explanations`); ``timed``: explain the first example
    once with each of them (their explanations × that time) and score each method's perturbed
    inputs of it (``mask_id``: what ``replace="mask"`` puts in; the perturbations' estimate, scaled
    by the examples' tokens), and score a few unaltered examples to price a token (each bounds
    search's estimate)."""
    from attnflow.evaluate.sanity import randomisation_stages

    sanity_examples = min(options.sanity_samples, len(examples))
    plan = Plan(len(examples), list(methods), dict(explanations), sanity_examples, 0, options.bounds)
    if plan.sanity_examples:
        plan.stages = len(shown_stages(len(randomisation_stages(model)), options.sanity_layers))
    if not timed or not examples:
        return plan
    plan.seconds = {}
    first, lengths = examples[0], [len(e.ids) for e in examples]
    for name, count in explanations.items():
        method = name.split(" ")[0]  # "leave_one_out (agreement reference)" runs leave_one_out
        began = time.perf_counter()
        (scores,) = attribute_fn(model, [first.text], method, [first.target])
        plan.seconds[name] = (time.perf_counter() - began) * count
        if name in methods:  # its perturbed inputs, scored by the run's scorer: the run reads them back
            ranking = content_ranking(np.asarray(scores), first.special_mask)
            inputs = metric_inputs(first.ids, ranking, options.bins, options.curve_points, options.replace, mask_id)
            began = time.perf_counter()
            target_values(scorer, [(ids, first) for ids in inputs])
            plan.perturbation_seconds += (time.perf_counter() - began) * sum(lengths) / len(first.ids)
    timed_examples = examples[:16]
    began = time.perf_counter()
    ClassifierScorer(model, scorer.max_batch_tokens).probabilities([e.ids for e in timed_examples])
    per_token = (time.perf_counter() - began) / sum(len(e.ids) for e in timed_examples)
    for search in BOUND_SEARCHES[1:]:
        priced = 0.0
        for example, length in zip(examples, lengths, strict=True):
            m = int(np.sum(~example.special_mask))
            counts = [top_count(k, m) for k in options.bins]
            priced += length * search_cost(m, counts, search, options.exact_limit, options.beam_width)
        plan.bounds_seconds[search] = per_token * priced
    return plan
