"""Faithfulness of the explanations of one input: what `attnflow explain` shows next to each map.

For one traced input with a class or next-token target, each explanation's ranking of the content
tokens is scored as `attnflow evaluate` scores it — comprehensiveness and sufficiency at the bins
`BINS` (the same `content_ranking`, `top_count`, perturbations, `ClassifierScorer` and
`perturbation_probabilities`), so the numbers equal the benchmark's on that input — next to the
random-ranking expectation on the same input: the mean over `RANDOM_RANKINGS` seeded permutations
of the content tokens. The perturbed inputs of every explanation and of the random rankings are
deduplicated and scored in one batched call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from attnflow.evaluate.benchmark import BenchmarkOptions, Example, mask_token_id, perturbation_probabilities
from attnflow.evaluate.bounds import aopc_bounds, normalised_aopc
from attnflow.evaluate.metrics import aopc, content_ranking
from attnflow.evaluate.scorer import ClassifierScorer

if TYPE_CHECKING:
    from attnflow.methods.registry import Family

BINS: tuple[float, ...] = (0.10, 0.20, 0.50)
RANDOM_RANKINGS = 5
BOUNDS_BEAM_WIDTH = 1  # an explanation shown at once: a greedy search beyond 8 content tokens
TARGET_KINDS = ("class", "next_token")  # targets with a probability to drop


def input_faithfulness(
    model: Any,
    trace: Any,
    scores: Sequence[np.ndarray],
    bins: Sequence[float] = BINS,
    replace: str = "remove",
    random_rankings: int = RANDOM_RANKINGS,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One ``faithfulness`` record per ``[token]`` score vector of an explanation of ``trace`` (its
    target fixes the class or token p is read for; every ranking is scored for it, as the
    benchmark scores every method for the predicted class):

    ``{"target", "quantity" (what drops: ``p(A)``, or ``p(A) − p(B)`` for a contrastive target),
    "probability" (that quantity on the unaltered input), "replace", "bins", "comprehensiveness"
    [bin], "sufficiency" [bin], "aopc_comprehensiveness", "aopc_sufficiency",
    "naopc_comprehensiveness", "naopc_sufficiency", "bounds" (`attnflow.evaluate.bounds.AopcBounds`
    as a dict: exact up to 8 content tokens, a beam search of width 1 beyond), "random": {the
    AOPC figures for random rankings, "rankings"}}``; drops are p(x) − p(x perturbed). Raises
    ValueError for a trace without a class or next-token target.
    """
    target = trace.target
    if target is None or target.kind not in TARGET_KINDS:
        raise ValueError("per-input faithfulness needs a class or next-token target (a probability to drop)")
    special = np.asarray(trace.special_mask, dtype=bool)
    content = np.flatnonzero(~special)
    contrast = getattr(target, "contrast_index", None)
    example = Example(
        trace.text, -1, tuple(int(i) for i in trace.token_ids), special, int(target.index), np.nan, contrast
    )
    rankings = [content_ranking(vector, special) for vector in scores]
    rankings += [np.random.default_rng(seed + r).permutation(content) for r in range(random_rankings)]
    options = BenchmarkOptions(replace=replace, bins=tuple(bins), curve_points=2)  # curve point 0: the input itself
    mask_id = mask_token_id(model)
    scorer = ClassifierScorer(model)
    without, only, curve = perturbation_probabilities(scorer, [example] * len(rankings), rankings, options, mask_id)
    p_full = curve[:, 0]  # [ranking], all the same input
    comprehensiveness, sufficiency = aopc(p_full, without)[0], aopc(p_full, only)[0]  # [ranking, bin]
    bounds = aopc_bounds(
        scorer, replace_p_full(example, float(p_full[0])), tuple(bins), replace, mask_id, beam_width=BOUNDS_BEAM_WIDTH
    )

    def figures(comprehensive: np.ndarray, sufficient: np.ndarray) -> dict[str, Any]:
        return {
            "comprehensiveness": comprehensive.tolist(),
            "sufficiency": sufficient.tolist(),
            "aopc_comprehensiveness": float(comprehensive.mean()),
            "aopc_sufficiency": float(sufficient.mean()),
            "naopc_comprehensiveness": _finite(normalised_aopc(comprehensive.mean(), *bounds.comprehensiveness)),
            "naopc_sufficiency": _finite(normalised_aopc(sufficient.mean(), *bounds.sufficiency)),
        }

    chance = {
        **figures(comprehensiveness[len(scores) :].mean(axis=0), sufficiency[len(scores) :].mean(axis=0)),
        "rankings": int(random_rankings),
    }
    contrast_label = getattr(target, "contrast_label", None)
    shared = {
        "target": target.label,
        "quantity": f"p({target.label})" + ("" if contrast is None else f" − p({contrast_label})"),
        "probability": float(p_full[0]),
        "replace": replace,
        "bins": list(bins),
        "bounds": bounds.to_dict(),
    }
    return [{**shared, **figures(comprehensiveness[i], sufficiency[i]), "random": chance} for i in range(len(scores))]


def replace_p_full(example: Example, p_full: float) -> Example:
    """``example`` with its unaltered-input quantity set."""
    from dataclasses import replace

    return replace(example, p_full=p_full)


def _finite(value: Any) -> float | None:
    """A float, None for NaN (JSON has no NaN)."""
    number = float(value)
    return None if np.isnan(number) else number


def add_faithfulness(model: Any, trace: Any, explanations: Sequence[Any]) -> None:
    """Set each explanation's ``faithfulness`` (`input_faithfulness`, one batched call) when the
    trace has a class or next-token target; leave them None otherwise."""
    if trace.target is None or trace.target.kind not in TARGET_KINDS or not explanations:
        return
    records = input_faithfulness(model, trace, [explanation.scores for explanation in explanations])
    for explanation, record in zip(explanations, records, strict=True):
        explanation.faithfulness = record


def add_view_faithfulness(model: Any, exploration: Any, target: Any = None, max_length: int | None = None) -> None:
    """Set each explorer view's ``faithfulness`` (its `MethodView.saliency` at the exploration's
    row) when the model has a class or next-token target: one forward pass traces the target
    (``target`` as `attnflow.targets.Objective` takes it), one batched call scores the rankings."""
    if model.target_kind not in ("next_token", "class"):
        return
    trace = model.trace([exploration.text], needs=("target",), target=target, max_length=max_length)[0]
    scores = [view.saliency(exploration.row) for view in exploration.methods]
    for view, record in zip(exploration.methods, input_faithfulness(model, trace, scores), strict=True):
        view.faithfulness = record


# ----- --method auto ------------------------------------------------------------------------------


# What the measured tables (docs/faithfulness.md) say, per target kind: the one-pass target methods
# that beat `random` on NAOPC comprehensiveness there, best first. A kind without a table keeps
# every one-pass target method as a candidate.
MEASURED_RANKING: dict[str, tuple[str, ...]] = {
    # smollm2, --task next-token --window 6, 200 windows
    "next_token": (),
}


def auto_methods(family: Family | None = None, target_kind: str | None = None) -> list[str]:
    """`--method auto`'s candidates: the registered target methods that cost one forward and one
    backward pass (declaration ``cost="backward"``), for ``family`` (None: for any family); for a
    ``target_kind`` with a measured table (`MEASURED_RANKING`), only those the table ranks above
    `random`, in the table's order (the first of equally comprehensive candidates wins)."""
    from attnflow.methods.registry import available_methods, get_method, methods_for

    names = available_methods() if family is None else methods_for(family)
    candidates = [name for name in names if get_method(name).cost == "backward" and get_method(name).uses_target]
    ranked = [name for name in MEASURED_RANKING.get(target_kind or "", ()) if name in candidates]
    return ranked or candidates


def choose_most_comprehensive(candidates: Sequence[Any]) -> Any:
    """The candidate explanation with the highest per-input comprehensiveness (the first of equals),
    its ``chosen_by`` set to why: its number, the others' and random rankings'."""
    scored = [e for e in candidates if e.faithfulness is not None]
    if not scored:
        raise ValueError("--method auto needs its candidates' per-input faithfulness (a class or next-token target)")
    best = max(scored, key=lambda e: e.faithfulness["aopc_comprehensiveness"])
    others = ", ".join(f"{e.method} {e.faithfulness['aopc_comprehensiveness']:.3f}" for e in scored if e is not best)
    bins = "/".join(f"{100 * k:g}" for k in best.faithfulness["bins"])
    best.chosen_by = (
        f"--method auto chose {best.method}: the highest comprehensiveness on this input "
        f"(mean drop of p({best.faithfulness['target']}) with the top {bins} % of the tokens removed: "
        f"{best.faithfulness['aopc_comprehensiveness']:.3f}"
        + (f"; {others}" if others else "")
        + f"; random rankings {best.faithfulness['random']['aopc_comprehensiveness']:.3f})"
    )
    return best
