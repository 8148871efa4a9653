"""Faithfulness of the explanations of one input: what `attnflow explain` shows next to each map.

For one traced input with a class or next-token target, each explanation's ranking of the content
tokens is scored as `attnflow evaluate` scores it — comprehensiveness and sufficiency at the bins
`BINS` (the same `content_ranking`, `top_count`, perturbations, `ClassifierScorer` and
`perturbation_probabilities`), so the numbers equal the benchmark's on that input — next to the
random-ranking expectation on the same input: the mean over `RANDOM_RANKINGS` seeded permutations
of the content tokens. The perturbed inputs of every explanation and of the random rankings are
deduplicated and scored in one batched call.

Its cost is bounded (`FaithfulnessBudget`): the NAOPC bounds are exact up to 8 content tokens and
beyond come from the tightest search whose perturbed inputs fit a budget of tokens (a beam of width
1, the bin-level search, the single-token orders); when none fits, NAOPC is "not computed" and
only AOPC against random is shown; over ``scored`` content tokens no faithfulness is computed at
all (a note says why). The random rankings' figures and
the bounds depend on the input alone (not on the methods): both are kept per model for the last
`BASELINES_KEPT` inputs, so asking again about an input (other methods, the server's next request)
scores only the methods' rankings.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from attnflow.errors import InputError
from attnflow.evaluate.benchmark import BenchmarkOptions, Example, mask_token_id, perturbation_probabilities
from attnflow.evaluate.bounds import EXACT_LIMIT, AopcBounds, normalised_aopc, search_bounds, search_cost
from attnflow.evaluate.metrics import aopc, content_ranking, top_count
from attnflow.evaluate.scorer import ClassifierScorer, target_values
from attnflow.methods.registry import AUTO
from attnflow.model_like import ModelLike

if TYPE_CHECKING:
    from attnflow.methods.registry import Family
    from attnflow.targets import Target

BINS: tuple[float, ...] = (0.10, 0.20, 0.50)
RANDOM_RANKINGS = 5
TARGET_KINDS = ("class", "next_token")  # targets with a probability to drop
BASELINES_KEPT = 64  # inputs whose random-ranking figures are kept, per model
_BASELINES: weakref.WeakKeyDictionary[Any, OrderedDict[tuple, Any]] = weakref.WeakKeyDictionary()
_BASELINES_LOCK = threading.Lock()


@dataclass(frozen=True)
class FaithfulnessBudget:
    """How far per-input faithfulness goes on an input of m content tokens.

    Attributes:
        bounds_tokens: the most tokens the NAOPC bounds' perturbed inputs may hold in all (a
            perturbed input of n tokens counts n; 3,000 is about a second of minilm on one CPU
            thread: an unseen 80-token text's request took 3.9 s with 10,000, 1.2 s with 3,000).
            The tightest search that fits is used — a beam of width 1, the bin-level search, the
            single-token orders — and none when even the last does not fit; inputs of
            at most 8 content tokens always get exact bounds.
        scored: m up to this: the maps' AOPC beside random rankings (6 perturbed inputs per
            ranking); beyond, no faithfulness at all (and ``auto`` chooses without it).
    """

    bounds_tokens: int = 3_000
    scored: int = 256

    def bounds_search(self, m: int, n_tokens: int, bins: Sequence[float] = BINS) -> str:
        """The bounds search for ``m`` content tokens of ``n_tokens`` (`BOUND_SEARCHES`; beam: width 1)."""
        counts = [top_count(k, m) for k in bins]
        for search in ("beam", "levels", "singles"):  # tightest first; exact up to 8 content tokens in each
            if m <= EXACT_LIMIT or search_cost(m, counts, search, beam_width=1) * n_tokens <= self.bounds_tokens:
                return search
        return "none"

    def skipped(self, m: int) -> str | None:
        """Why an input of ``m`` content tokens gets no faithfulness at all, or None."""
        if m > self.scored:
            return f"faithfulness not computed: {m} content tokens, over the per-input budget of {self.scored}"
        return None


BUDGET = FaithfulnessBudget()


def input_faithfulness(
    model: ModelLike,
    trace: Any,
    scores: Sequence[np.ndarray],
    bins: Sequence[float] = BINS,
    replace: str = "remove",
    random_rankings: int = RANDOM_RANKINGS,
    seed: int = 0,
    budget: FaithfulnessBudget | None = None,
) -> list[dict[str, Any]]:
    """One ``faithfulness`` record per ``[token]`` score vector of an explanation of ``trace`` (its
    target fixes the class or token p is read for; every ranking is scored for it, as the
    benchmark scores every method for the predicted class):

    ``{"target", "quantity" (what drops: ``p(A)``, or ``p(A) − p(B)`` for a contrastive target),
    "probability" (that quantity on the unaltered input), "replace", "bins", "comprehensiveness"
    [bin], "sufficiency" [bin], "aopc_comprehensiveness", "aopc_sufficiency",
    "naopc_comprehensiveness", "naopc_sufficiency" (None where the bounds were not computed),
    "bounds" (`attnflow.evaluate.bounds.AopcBounds` as a dict, the search chosen by ``budget``, and
    "note" when none was), "random": {the AOPC figures for random rankings, "rankings", "draws" (each
    random ranking's AOPC comprehensiveness)}}``; drops
    are p(x) − p(x perturbed). Raises ValueError for a trace without a class or next-token target,
    or with more content tokens than ``budget.scored`` (None: `BUDGET`).
    """
    budget = budget or BUDGET
    target = trace.target
    if target is None or target.kind not in TARGET_KINDS:
        raise ValueError("per-input faithfulness needs a class or next-token target (a probability to drop)")
    special = np.asarray(trace.special_mask, dtype=bool)
    content = np.flatnonzero(~special)
    if budget.skipped(len(content)):
        raise ValueError(budget.skipped(len(content)))
    contrast = getattr(target, "contrast_index", None)
    example = Example(
        trace.text, -1, tuple(int(i) for i in trace.token_ids), special, int(target.index), np.nan, contrast
    )
    key: tuple = (example.ids, tuple(special.tolist()), target.kind, example.target, contrast)
    key = (*key, replace, tuple(bins), random_rankings, seed)  # what the random rankings' figures depend on
    chance = _kept(model, key) if len(scores) else None
    rankings = [content_ranking(vector, special) for vector in scores]
    if chance is None:
        rankings += [np.random.default_rng(seed + r).permutation(content) for r in range(random_rankings)]
    options = BenchmarkOptions(replace=replace, bins=tuple(bins), curve_points=2)  # curve point 0: the input itself
    mask_id = mask_token_id(model)
    scorer = ClassifierScorer(model)
    without, only, curve = perturbation_probabilities(scorer, [example] * len(rankings), rankings, options, mask_id)
    p_full = curve[:, 0]  # [ranking], all the same input
    comprehensiveness, sufficiency = aopc(p_full, without)[0], aopc(p_full, only)[0]  # [ranking, bin]
    search = budget.bounds_search(len(content), len(example.ids), bins)
    bounds = _input_bounds(model, example, ("bounds", search, *key[:-2]), bins, replace, search)

    def figures(comprehensive: np.ndarray, sufficient: np.ndarray) -> dict[str, Any]:
        return {
            "comprehensiveness": comprehensive.tolist(),
            "sufficiency": sufficient.tolist(),
            "aopc_comprehensiveness": float(comprehensive.mean()),
            "aopc_sufficiency": float(sufficient.mean()),
            "naopc_comprehensiveness": _finite(normalised_aopc(comprehensive.mean(), *bounds.comprehensiveness)),
            "naopc_sufficiency": _finite(normalised_aopc(sufficient.mean(), *bounds.sufficiency)),
        }

    if chance is None:
        drawn = comprehensiveness[len(scores) :]  # [random ranking, bin]
        chance = {
            **figures(drawn.mean(axis=0), sufficiency[len(scores) :].mean(axis=0)),
            "rankings": int(random_rankings),
            "draws": drawn.mean(axis=1).tolist(),  # each random ranking's AOPC comprehensiveness: their spread
        }
        _keep(model, key, chance)
    contrast_label = getattr(target, "contrast_label", None)
    shared = {
        "target": target.label,
        "quantity": f"p({target.label})" + ("" if contrast is None else f" − p({contrast_label})"),
        "probability": float(p_full[0]),
        "replace": replace,
        "bins": list(bins),
        "bounds": _bounds_record(bounds, len(content), budget),
    }
    return [{**shared, **figures(comprehensiveness[i], sufficiency[i]), "random": chance} for i in range(len(scores))]


def _bounds_record(bounds: AopcBounds, m: int, budget: FaithfulnessBudget) -> dict[str, Any]:
    """The bounds as the record shows them, with why there are none when none was searched."""
    record = bounds.to_dict()
    if bounds.search == "none":
        record["note"] = (
            f"NAOPC not computed: the bounds of {m} content tokens would score more than the per-input "
            f"budget of {budget.bounds_tokens:,} tokens"
        )
    return record


def _input_bounds(
    model: ModelLike, example: Example, key: tuple, bins: Sequence[float], replace: str, search: str
) -> AopcBounds:
    """The AOPC bounds of one input by ``search`` (a beam of width 1 where it is ``"beam"``), kept per
    model under ``key`` (they depend on the input, its target, ``replace``, ``bins`` and the search)."""
    bounds = _kept(model, key)
    if bounds is None:
        # a scorer of their own: their numbers never depend on which rankings were scored beside them
        scorer = ClassifierScorer(model)
        p_input = float(target_values(scorer, [(example.ids, example)])[0])
        mask_id = mask_token_id(model)
        bounds = search_bounds(
            scorer, [replace_p_full(example, p_input)], tuple(bins), replace, mask_id, search, beam_width=1
        )[0]
        _keep(model, key, bounds)
    return bounds


def replace_p_full(example: Example, p_full: float) -> Example:
    """``example`` with its unaltered-input quantity set."""
    from dataclasses import replace

    return replace(example, p_full=p_full)


def _finite(value: Any) -> float | None:
    """A float, None for NaN (JSON has no NaN)."""
    number = float(value)
    return None if np.isnan(number) else number


def _kept(model: ModelLike, key: tuple) -> Any:
    """What is kept for ``model`` and this input (``key``): the random rankings' figures (a copy)
    or the `AopcBounds` (frozen); None when nothing is."""
    with _BASELINES_LOCK:
        try:
            kept = _BASELINES.get(model)
        except TypeError:  # a model that cannot be weakly referenced: nothing is kept
            return None
        if kept is None or key not in kept:
            return None
        kept.move_to_end(key)
        value = kept[key]
        return {**value} if isinstance(value, dict) else value


def _keep(model: ModelLike, key: tuple, value: Any) -> None:
    with _BASELINES_LOCK:
        try:
            kept = _BASELINES.setdefault(model, OrderedDict())
        except TypeError:
            return
        kept[key] = {**value} if isinstance(value, dict) else value
        while len(kept) > 2 * BASELINES_KEPT:  # the random figures and the bounds of each input
            kept.popitem(last=False)


def add_faithfulness(
    model: ModelLike, trace: Any, explanations: Sequence[Any], budget: FaithfulnessBudget | None = None
) -> None:
    """Set each explanation's ``faithfulness`` (`input_faithfulness`, one batched call) when the
    trace has a class or next-token target; leave them None otherwise, and with a note when the
    input is over ``budget.scored`` (None: `BUDGET`)."""
    if trace.target is None or trace.target.kind not in TARGET_KINDS or not explanations:
        return
    budget = budget or BUDGET
    skipped = budget.skipped(int(np.sum(~np.asarray(trace.special_mask, dtype=bool))))
    if skipped:
        for explanation in explanations:
            explanation.notes.append(skipped)
        return
    records = input_faithfulness(model, trace, [explanation.scores for explanation in explanations], budget=budget)
    for explanation, record in zip(explanations, records, strict=True):
        explanation.faithfulness = record


def add_view_faithfulness(
    model: ModelLike, exploration: Any, target: Any = None, max_length: int | None = None
) -> None:
    """Set each explorer view's ``faithfulness`` (its `MethodView.saliency` at the exploration's
    row) when the model has a class or next-token target: one forward pass traces the target
    (``target`` as `attnflow.targets.Objective` takes it), one batched call scores the rankings.
    The page then opens on auto's choice among the views (``opens_on``, ``opened_why``)."""
    if model.target_kind not in ("next_token", "class"):
        return
    trace = model.trace([exploration.text], needs=("target",), target=target, max_length=max_length)[0]
    if BUDGET.skipped(int(np.sum(~np.asarray(trace.special_mask, dtype=bool)))):
        return  # the page opens on its default view, without badges
    scores = [view.saliency(exploration.row) for view in exploration.methods]
    for view, record in zip(exploration.methods, input_faithfulness(model, trace, scores), strict=True):
        view.faithfulness = record
    auto = auto_methods(model.adapter, model.target_kind)
    candidates = [view for view in exploration.methods if view.name in auto]
    if candidates:
        best = max(candidates, key=lambda view: view.faithfulness["aopc_comprehensiveness"])
        others = ", ".join(
            f"{view.name} {view.faithfulness['aopc_comprehensiveness']:.3f}" for view in candidates if view is not best
        )
        exploration.opens_on = best.name
        exploration.opened_why = (
            f"opens on auto's choice, {best.name}: the highest comprehensiveness on this input "
            f"({best.faithfulness['aopc_comprehensiveness']:.3f}" + (f"; {others})" if others else ")")
        )


# ----- --method auto ------------------------------------------------------------------------------


def has_target(model: ModelLike, target: Target | None = None) -> bool:
    """Whether the model's output gives target methods something to explain on a text: a class,
    a next token, or (a sentence encoder given ``target``, a `attnflow.targets.Target` with a text)
    a similarity."""
    if model.target_kind in ("next_token", "class"):
        return True
    text = None if target is None else target.text
    return model.target_kind == "similarity" and text is not None and model.default_row == "mean"


def no_target_error(model: ModelLike, image: bool) -> InputError:
    """Why ``method="auto"`` cannot run on this model (or on an image), and what to do instead."""
    if image:
        return InputError(
            "{method} auto compares target methods, and images have no target: choose a method such as rollout",
            parameter="method",
        )
    if model.target_kind == "similarity" and model.default_row == "mean":
        return InputError(
            f"{{method}} auto compares target methods, and {model.name} is a sentence encoder without a classifier: "
            "give {target_text} (it explains the similarity to that text), or choose a method such as rollout",
            parameter=("method", "target_text"),
        )
    return InputError(
        f"{{method}} auto compares target methods, and {model.name} has no target: choose a method such as rollout",
        parameter="method",
    )


def default_methods(target: bool) -> list[str]:
    """What runs when no method is named: auto wherever there is a target (``target``), rollout
    only where nothing has one (a bare encoder without --target-text, an image)."""
    return [AUTO] if target else ["rollout"]


def with_candidates(
    methods: Sequence[str],
    family: Family | None,
    among: Sequence[str] | None = None,
    target_kind: str | None = None,
) -> list[str]:
    """``methods`` with ``auto`` replaced by its candidates for ``family`` and ``target_kind`` (None:
    for any family; ``among``: only those, e.g. the methods that explain generations), without repeats."""
    expanded: list[str] = []
    for name in methods:
        if name == AUTO:
            expanded += [m for m in auto_methods(family, target_kind) if among is None or m in among]
        else:
            expanded.append(name)
    return list(dict.fromkeys(expanded))


def choose_by_step_aopc(candidates: Sequence[Any]) -> tuple[Any, str]:
    """Of generation explanations with per-step faithfulness, the one whose top sources' removal
    drops p(t_k) most on average over the steps (the first of equals), and a line that says why."""
    best = max(candidates, key=lambda e: e.faithfulness["mean_aopc"])
    others = ", ".join(f"{e.method} {e.faithfulness['mean_aopc']:.3f}" for e in candidates if e is not best)
    return best, (
        f"--method auto chose {best.method}: the highest mean comprehensiveness over the generated tokens "
        f"({best.faithfulness['mean_aopc']:.3f}" + (f"; {others})" if others else ")")
    )


# What the measured tables (docs/faithfulness.md) say, per target kind: the one-pass target methods
# that beat `random` on a normalised AOPC there, best NAOPC comprehensiveness first. A kind without
# a table keeps every one-pass target method as a candidate.
MEASURED_RANKING: dict[str, tuple[str, ...]] = {
    # smollm2, --task next-token (32-token windows), 60 windows, --bounds singles: NAOPC comprehensiveness
    # attnlrp 0.928, gim 0.902 (grad_x_input 0.787, grad_rollout 0.786, cp_lrp 0.723; random 0.546),
    # sufficiency attnlrp 0.308, gim 0.418 (random 0.858); gemma3-270m, the same: attnlrp 0.931, gim
    # 0.901 (grad_rollout 0.909, grad_x_input 0.846; random 0.446); --task next-token-probes on
    # smollm2, 55 probes: the key token ranked first by attnlrp 0.71, gim 0.44 (grad_x_input 0.47,
    # random 0)
    "next_token": ("attnlrp", "gim"),
}


def auto_methods(family: Family | None = None, target_kind: str | None = None) -> list[str]:
    """`--method auto`'s candidates: the registered target methods that cost one forward and one
    backward pass (declaration ``cost="backward"``), for ``family`` (None: for any family); for a
    ``target_kind`` with a measured table (`MEASURED_RANKING`), only those that beat `random` there,
    in the table's order (the first of equally comprehensive candidates wins)."""
    from attnflow.methods.registry import available_methods, get_method, methods_for

    names = available_methods() if family is None else methods_for(family)
    candidates = [name for name in names if get_method(name).cost == "backward" and get_method(name).uses_target]
    ranked = [name for name in MEASURED_RANKING.get(target_kind or "", ()) if name in candidates]
    return ranked or candidates


def choose_most_comprehensive(candidates: Sequence[Any]) -> Any:
    """The candidate explanation with the highest per-input comprehensiveness (the first of equals),
    its ``chosen_by`` set to why: its number, the others' and random rankings'. Without any
    per-input faithfulness (not asked for, or the input over the budget), the first candidate (the
    measured tables' order), and ``chosen_by`` says so."""
    scored = [e for e in candidates if e.faithfulness is not None]
    if not scored:
        if not candidates:
            raise InputError("{method} auto has no candidate method for this model", parameter="method")
        first = candidates[0]
        why = next((note for note in first.notes if note.startswith("faithfulness not computed")), None)
        first.chosen_by = (
            f"--method auto chose {first.method} without a per-input test ("
            + (why or "faithfulness turned off")
            + f"): the first of its candidates {', '.join(e.method for e in candidates)}"
        )
        return first
    best = max(scored, key=lambda e: e.faithfulness["aopc_comprehensiveness"])
    _warn_if_no_better_than_random(best)
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


def _warn_if_no_better_than_random(chosen: Any) -> None:
    """A note (and an `ExplanationWarning`) on auto's choice when the badge beside it does not show
    it clearly above random rankings (`attnflow.explanation.faithfulness_level`, which colours the
    badge): no candidate is a map to trust there. Where deletion cannot tell rankings apart on this
    input (``"indistinct"``: a short input whose prediction falls whichever token is removed), the
    note says that instead: the choice is untested there, not refuted."""
    import warnings

    from attnflow.errors import ExplanationWarning
    from attnflow.explanation import Separation, faithfulness_level

    faithfulness = chosen.faithfulness
    level = faithfulness_level(faithfulness)
    if level == "clear":
        return
    mine, separation = faithfulness["aopc_comprehensiveness"], Separation.of(faithfulness)
    chance = separation.chance
    spread = f" ± {separation.spread:.3f}" if separation.spread else ""
    reach = "" if separation.bounds is None else f"; the best ranking of this input reaches {separation.bounds[1]:.3f}"
    if level == "indistinct":
        assert separation.bounds is not None  # indistinct needs the bounds
        lower, upper = separation.bounds
        note = (
            f"deletion cannot tell rankings apart on this input: every ranking of its tokens drops "
            f"{faithfulness.get('quantity', 'p')} by between {lower:.3f} and {upper:.3f} (random rankings "
            f"{chance:.3f}{spread}), so auto's choice, {chosen.method} ({mine:.3f}), is neither confirmed nor "
            "refuted by it here"
        )
    else:
        how = "no better than" if level == "weak" else "barely above"
        note = (
            f"auto's choice, {chosen.method}, is {how} random rankings on this input (comprehensiveness {mine:.3f} "
            f"against their {chance:.3f}{spread}{reach}): none of its candidates finds the tokens this prediction "
            "depends on; do not read this map as the reason"
        )
    chosen.notes.append(note)
    warnings.warn(note, ExplanationWarning, stacklevel=3)


@dataclass(frozen=True)
class Plan:
    """What `attnflow explain` computes for one input: the methods asked for (``auto`` among them
    or not), ``auto``'s candidates, and every method to run with its checked options."""

    requested: list[str]
    candidates: list[str]
    per_method: dict[str, dict[str, Any]]


def plan_methods(
    model: ModelLike,
    methods: Sequence[str] | None,
    options: Mapping[str, Any],
    target: Target | None = None,
    image: bool = False,
) -> Plan:
    """The `Plan` for ``methods`` (None: ``auto`` when the model has a target on this input,
    rollout otherwise) with the user's ``options`` (name -> value; each method gets its share,
    `attnflow.methods.registry.options_per_method`). InputError when ``auto`` has nothing to explain."""
    from attnflow.methods.registry import options_per_method

    has = not image and has_target(model, target)
    requested = list(methods) if methods else default_methods(has)
    if AUTO in requested and not has:
        raise no_target_error(model, image)
    family = model.adapter if AUTO in requested else None
    candidates = auto_methods(family, model.target_kind) if AUTO in requested else []
    per_method = options_per_method(with_candidates(requested, family, target_kind=model.target_kind), dict(options))
    return Plan(requested, candidates, per_method)


def explain_planned(
    model: ModelLike,
    trace: Any,
    plan: Plan,
    row: Any = None,
    before: Callable[[str], None] | None = None,
    faithfulness: bool = True,
) -> list[Any]:
    """Run every method of ``plan`` on ``trace`` (`attnflow.explain`), add each map's faithfulness
    on this input (a class or next-token target; ``faithfulness=False`` skips it, and `BUDGET`
    bounds it) and resolve ``auto``: one `Explanation` per method asked for, ``auto``'s choice in
    its place, each explanation once. ``before(step)`` is called before each method (``step``: its
    name) and before the faithfulness batch (``"faithfulness"``): for progress, and to stop between
    steps by raising."""
    from attnflow.explanation import explain

    step = before or (lambda _name: None)
    row = row if row is not None else getattr(model, "default_row", None)
    computed = {}
    for method, options in plan.per_method.items():
        step(method)
        computed[method] = explain(trace, method=method, row=row, model=model, **options)
    if faithfulness and trace.target is not None:
        step("faithfulness")
        add_faithfulness(model, trace, list(computed.values()))
    if plan.candidates:
        computed[AUTO] = choose_most_comprehensive([computed[name] for name in plan.candidates])
    return list({id(computed[name]): computed[name] for name in plan.requested}.values())
