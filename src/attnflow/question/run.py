"""`attnflow.why(model, text, ...)`: every kind of evidence attnflow has about one prediction, within
a budget, cross-checked, with a plain-language reading (`attnflow.question.wording`).

Nothing here computes an attribution, a route or a patching effect: the evidence comes from the
front doors that `attnflow explain`, `attnflow routes` and `attnflow patch` call
(`attnflow.evaluate.per_input.explain_planned`, `attnflow.routes`, `attnflow.patch`) with the same
options those commands would get, so each number can be recomputed from their JSON files.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.question import plan as planning
from attnflow.question.result import Why
from attnflow.targets import Target, as_target

SAMPLES = 3  # noise draws of the counterfactual built by noise on a word (`attnflow patch --samples`)
SEED = 0
ATTRIBUTION_METHODS = ["auto", "leave_one_out"]  # `attnflow explain --method auto,leave_one_out`


def why(
    model: ModelLike,
    text: str,
    target: Target | int | str | None = None,
    *,
    contrast: int | str | None = None,
    corrupt: str | None = None,
    budget: float | None = None,
    samples: int = SAMPLES,
    progress: Callable[[str], None] | None = None,
) -> Why:
    """Why ``model`` gives its answer on ``text``: the evidence that fits the model and the question,
    within ``budget`` seconds (the most expensive dropped first), their agreement and a reading.

    Args:
        target: the class or next token explained (default: the prediction); contrast: a second
            class or token: the question becomes why the target rather than the contrast
            (logit(target) − logit(contrast)).
        corrupt: a counterfactual text of the same token length for patching; without it a causal
            LM's counterfactual is noise on the most attributed word before the predicting position
            (``samples`` seeded draws); a classifier gets patching only with ``corrupt`` or ``contrast``.
        budget: seconds the evidence may take by the plan's estimates (None: no limit).
        progress: called with the plan's lines and each step's name before it runs.
    """
    say = progress or (lambda _line: None)
    wanted = as_target(target, contrast=contrast)
    budget = planning.check_budget(budget)
    checked = _check(model, text, wanted, corrupt, samples)
    plan = planning.fit(_steps(model, checked, corrupt, wanted, samples), budget)
    for line in plan.lines():
        say(line)
    found = Why(model=model.name, text=text, tokens=checked["tokens"], plan=plan)
    found.attribution = _timed(found, planning.ATTRIBUTION, say, lambda: _attribution(model, text, wanted))
    if plan.runs(planning.VALUE_ROLLOUT):
        rollout = _timed(found, planning.VALUE_ROLLOUT, say, lambda: model.explain(text, method="norm_rollout"))
        found.value_rollout = rollout.scores
    if plan.runs(planning.ROUTES):
        from attnflow.flow_routes.api import routes

        found.routes = _timed(found, planning.ROUTES, say, lambda: routes(model, text, target=wanted))
    _patching(model, found, wanted, corrupt, samples, say)
    found.finish()
    return found


def _timed(found: Why, name: str, say: Callable[[str], None], step: Callable[[], Any]) -> Any:
    """``step()``, announced by ``say`` and timed into ``found.seconds[name]``."""
    say(f"{name} …")
    began = time.perf_counter()
    result = step()
    found.seconds[name] = time.perf_counter() - began
    return result


def _check(model: ModelLike, text: str, wanted: Target, corrupt: str | None, samples: int) -> dict[str, Any]:
    """What every step would refuse, refused before any of them runs (one line each): the text,
    the model's kind, the target and contrast, the counterfactual's length, the noise draws."""
    from attnflow.causal.api import counterfactual_ids, resolve_metric
    from attnflow.flow_routes.api import tokenise

    if model.target_kind not in ("next_token", "class"):
        raise InputError(
            f"attnflow why explains a causal LM's next token or a classifier's class; {model.name} is neither "
            "(use attnflow explain or attnflow routes)"
        )
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InputError(f"{{samples}} must be a positive integer, got {samples!r}", parameter="samples")
    ids, tokens = tokenise(model, text)  # empty, or longer than the model reads: routes' own lines
    if corrupt is not None:
        counterfactual_ids(model, ids, corrupt)  # another token length: patching's own line
    resolve_metric(model, ids, wanted)  # an unknown class, a multi-token target or contrast: one line now
    return {"tokens": tokens, "n": int(ids.shape[1])}


def _steps(
    model: ModelLike, checked: dict[str, Any], corrupt: str | None, wanted: Target, samples: int
) -> list[planning.Step]:
    """The evidence that fits the model and the question, with each one's estimated seconds."""
    from attnflow.costs import Shape, calibrate, explain_parts, routes_parts
    from attnflow.methods.registry import methods_for

    n, shape = checked["n"], Shape.of(model)
    rates = calibrate(model)

    def seconds(parts: Any) -> float | None:
        works = parts.values() if isinstance(parts, dict) else [parts]
        return None if rates is None else sum(rates.seconds(work) for work in works)

    attribution = seconds(attribution_parts(model, n, wanted))
    steps = [planning.Step(planning.ATTRIBUTION, attribution, required=True)]
    causal = model.target_kind == "next_token"
    if not causal and "norm_rollout" in methods_for(model.adapter):
        steps.append(
            planning.Step(planning.VALUE_ROLLOUT, seconds(explain_parts({"norm_rollout": {}}, n, shape, False)))
        )
    hybrid = model.adapter.mixers is not None  # routes and knockout read attention as the only token mixer
    if causal and not hybrid:
        steps.append(planning.Step(planning.ROUTES, seconds(routes_parts(n))))
    if causal or corrupt is not None or wanted.contrast is not None:
        draws = 1 if corrupt is not None else samples
        fallback = planning.Step(planning.ESTIMATE, seconds(planning.estimate_work(n, draws)))
        exact = seconds(planning.patching_work(n, model.n_layers, draws))
        steps.append(planning.Step(planning.PATCHING, exact, fallback=fallback))
        if causal and not hybrid:
            knockout = seconds(planning.patching_work(n, model.n_layers, draws, sources=1))
            extra = None if knockout is None or exact is None else knockout - exact
            steps.append(planning.Step(planning.KNOCKOUT, extra))
    return steps


def attribution_parts(model: ModelLike, n: int, wanted: Target) -> Any:
    """The `attnflow.costs.Parts` of the evidence `why` never drops (auto's and leave-one-out's
    explanations with their faithfulness) on a text of ``n`` tokens: what `attnflow serve` holds a
    why request to before it runs."""
    from attnflow.costs import Shape, explain_parts
    from attnflow.evaluate.per_input import plan_methods

    methods = plan_methods(model, ATTRIBUTION_METHODS, {}, wanted).per_method
    return explain_parts(methods, n, Shape.of(model), True)


def _attribution(model: ModelLike, text: str, wanted: Target) -> list[Any]:
    """auto's explanation and leave-one-out's, each with its per-input faithfulness: exactly what
    `attnflow explain TEXT --method auto,leave_one_out` computes."""
    from attnflow.evaluate.per_input import explain_planned, plan_methods

    chosen = plan_methods(model, ATTRIBUTION_METHODS, {}, wanted)
    trace = model.trace_for(list(chosen.per_method), [text], target=wanted)[0]
    return explain_planned(model, trace, chosen)


def noise_word(found: Why, model: ModelLike) -> str:
    """The counterfactual built when none is given: the word of the most attributed token (by auto's
    map; a causal LM's predicting position left out, as noise there would change the question),
    the whole word as the text spells it."""
    from attnflow.methods.summary import words

    explanation = found.attribution[0]
    last = len(found.tokens) - 1 if model.target_kind == "next_token" else None
    if explanation.offsets is not None:  # token index -> the whole word it belongs to ('Eiffel', not 'iffel')
        grouped = words(found.tokens, explanation.special_mask, found.text, explanation.offsets)
        spans = [(int(begin), int(end)) for begin, end in explanation.offsets]
        word_of = {
            index: word.strip() for word, indices in grouped for index in indices if spans[index][1] > spans[index][0]
        }
        for index, _token, _score in explanation.top(len(found.tokens)):  # a token the text spells, in order
            if index != last and word_of.get(index):
                return word_of[index]
    raise InputError(
        "no word of the text can carry the noise of the counterfactual: give {corrupt}, a text of the same length",
        parameter="corrupt",
    )


def _patching(
    model: ModelLike, found: Why, wanted: Target, corrupt: str | None, samples: int, say: Callable[[str], None]
) -> None:
    """Exact residual patching (or AtP's estimate over the budget), with the knockout of the route's
    strongest edge into the predicting position in the same sweep: `attnflow patch`'s options."""
    from attnflow.causal import patch

    plan = found.plan
    method = "exact" if plan.runs(planning.PATCHING) else "atp" if plan.runs(planning.ESTIMATE) else None
    if method is None:
        return
    noise = None if corrupt is not None else noise_word(found, model)
    sites: list[str] = ["residual"]
    knockout: dict[str, Any] = {}
    edge = found.strongest_move()
    if plan.runs(planning.KNOCKOUT) and method == "exact" and edge is not None:
        sites.append("knockout")
        knockout = {"knockout_target": int(edge.target[2]), "knockout_sources": [int(edge.source[2])]}
    name = planning.PATCHING if method == "exact" else planning.ESTIMATE
    found.patching = _timed(
        found, name, say,
        lambda: patch(
            model, found.text, corrupt, noise=noise, target=wanted, sites=sites, methods=(method,),
            samples=samples, seed=SEED, progress=False, **knockout,
        ),
    )  # fmt: skip
    found.noise = noise
