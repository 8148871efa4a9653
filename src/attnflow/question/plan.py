"""The plan of `attnflow.why`: which evidence fits the model and the question, what each piece is
estimated to cost, and what a budget drops (the most expensive first).

Costs are the serve layer's estimates (`attnflow.costs`: forward passes and the tokens they
hold, timed on the model itself by `calibrate`), never a second cost model: the attribution is
`explain_parts` of auto's candidates and leave-one-out with their faithfulness, the routes
`routes_parts`, and a patching sweep its rows of ``n`` tokens, `PATCH_BATCH` per forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from attnflow.errors import InputError

ATTRIBUTION = "attribution"
ROUTES = "routes"
PATCHING = "patching"  # exact residual patching
ESTIMATE = "patching estimate"  # AtP's estimate of the same sweep: what replaces exact patching over budget
KNOCKOUT = "knockout"
VALUE_ROLLOUT = "value-aware rollout"
PATCH_BATCH = 32  # rows per forward pass of the exact sweep (`attnflow.causal.patch`'s default)
# What each piece of evidence is, in the plan's words.
WHAT = {
    ATTRIBUTION: "input attribution: auto's method and leave-one-out, each with its per-input faithfulness",
    ROUTES: "information flow routes with the logit lens down the predicting position",
    PATCHING: "exact residual patching: where restoring the clean stream restores the answer",
    ESTIMATE: "AtP's estimate of residual patching (one backward pass; an estimate)",
    KNOCKOUT: "attention knockout of the route's strongest edge into the predicting position",
    VALUE_ROLLOUT: "value-aware rollout (norm_rollout: attention weighed by what the tokens carry)",
}


@dataclass
class Step:
    """One piece of evidence: its ``name``, estimated ``seconds`` (None: no estimate for this model),
    its ``status`` (``"planned"``, ``"dropped"``: over the budget, ``"replaced"``: over the budget
    and replaced by ``fallback``) and ``reason`` (why dropped). A ``required`` step is never
    dropped: the attribution, which names the answer and chooses the word a built counterfactual
    noises."""

    name: str
    seconds: float | None
    status: str = "planned"
    reason: str = ""
    fallback: Step | None = None
    required: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The step as why.json's ``plan.steps`` holds it."""
        return {
            "evidence": self.name,
            "what": WHAT[self.name],
            "estimated_seconds": None if self.seconds is None else round(self.seconds, 2),
            "status": self.status,
            "reason": self.reason,
        }


@dataclass
class Plan:
    """The steps, in the order they run, and the ``budget`` (seconds, None: none) they were fitted to."""

    steps: list[Step]
    budget: float | None = None
    dropped: list[str] = field(default_factory=list)

    def runs(self, name: str) -> bool:
        """Whether the evidence ``name`` is planned (after the budget)."""
        return any(step.name == name and step.status == "planned" for step in self.steps)

    @property
    def seconds(self) -> float:
        """The planned steps' estimated seconds (steps without an estimate count 0)."""
        return sum(step.seconds or 0.0 for step in self.steps if step.status == "planned")

    def lines(self) -> list[str]:
        """The plan as console lines: each step with its estimate, what the budget dropped and why."""
        lines = [f"plan ({'no budget' if self.budget is None else f'budget {self.budget:g} s'}):"]
        for step in self.steps:
            estimate = "no estimate" if step.seconds is None else f"~{step.seconds:.1f} s"
            mark = "" if step.status == "planned" else f" — {step.status.upper()}: {step.reason}"
            lines.append(f"  {step.name:<20} {estimate:>12}  {WHAT[step.name]}{mark}")
        lines.append(f"  estimated total: ~{self.seconds:.1f} s (the model's loading not counted)")
        if self.budget is not None and self.seconds > self.budget:
            lines.append("  over the budget: the attribution is always kept (it names the answer and the noised word)")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """why.json's ``plan``: the budget, each step, what was dropped, the estimated total."""
        return {
            "budget": self.budget,
            "steps": [step.to_dict() for step in self.steps],
            "dropped": list(self.dropped),
            "estimated_seconds": round(self.seconds, 2),
        }


def check_budget(budget: Any) -> float | None:
    """``budget`` as positive seconds (None: no budget); one line for anything else."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise InputError(f"{{budget}} must be a positive number of seconds, got {budget!r}", parameter="budget")
    return float(budget)


def fit(steps: Sequence[Step], budget: float | None) -> Plan:
    """The plan of ``steps`` within ``budget``: while the planned estimate exceeds it, the most
    expensive planned step is dropped (or replaced by its cheaper ``fallback``, which may be dropped
    in turn), each drop named with the numbers that caused it."""
    plan = Plan(list(steps), budget)
    if budget is None:
        return plan
    while plan.seconds > budget:
        planned = [step for step in plan.steps if step.status == "planned" and step.seconds and not step.required]
        if not planned:
            break
        costliest = max(planned, key=lambda step: step.seconds or 0.0)
        over = f"~{costliest.seconds:.1f} s of ~{plan.seconds:.1f} s planned, budget {budget:g} s"
        if costliest.fallback is not None:
            costliest.status, costliest.reason = "replaced", f"{over}; replaced by {costliest.fallback.name}"
            at = plan.steps.index(costliest)
            plan.steps.insert(at + 1, costliest.fallback)
        else:
            costliest.status, costliest.reason = "dropped", over
        plan.dropped.append(costliest.name)
        if costliest.name == PATCHING:  # the knockout runs in exact patching's sweep: it goes with it
            for step in plan.steps:
                if step.name == KNOCKOUT and step.status == "planned":
                    step.status, step.reason = "dropped", "it runs in exact patching's sweep, which the budget left out"
                    plan.dropped.append(KNOCKOUT)
    return plan


def patching_work(n_tokens: int, n_layers: int, samples: int, sources: int = 0) -> Any:
    """The `attnflow.costs.Work` of an exact residual sweep over ``n_tokens`` (``n_layers`` + 1
    rows of streams, each position, each of ``samples`` corruptions) and of ``sources`` knockout
    columns (``n_layers`` rows each), `PATCH_BATCH` rows per pass, with the two cached runs."""
    from attnflow.costs import Work

    rows = ((n_layers + 1) * n_tokens + n_layers * sources) * samples
    return Work(math.ceil(rows / PATCH_BATCH) + 2, (rows + 2 * samples) * n_tokens)


def estimate_work(n_tokens: int, samples: int) -> Any:
    """The `Work` of AtP's estimate: the clean and corrupted runs, forward and backward, per sample."""
    from attnflow.costs import Work

    return Work(6 * samples, 6 * samples * n_tokens)
