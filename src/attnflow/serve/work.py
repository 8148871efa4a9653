"""What each API request computes, through the library's front doors (run in a model's worker thread).

`explain_text` is `attnflow explain TEXT`'s flow (`attnflow.evaluate.per_input.plan_methods` and
`explain_planned`: the same methods, options, faithfulness and ``auto`` choice, so the numbers
equal the CLI's); `generate_text` is `attnflow explain TEXT --generate N`'s
(`attnflow.generation`); `compare_models` is `attnflow compare`'s (`attnflow.comparison.compare`);
`explore_text` is `attnflow explore`'s; `routes_text` is `attnflow routes`'s (`attnflow.routes`);
`why_text` is `attnflow why`'s (`attnflow.why`, its budget the time left to the request). A
body's ``target``, ``target_text`` and ``contrast`` become one `attnflow.targets.Target` here
(`request_target`). Each takes inputs already checked by its ``check_*`` function (on the event loop, before the
request waits for its model: a bad request is answered at once) and the request's `Job`, checked
between steps: a cancelled request stops at the next method boundary. Once the model is held, the
``estimate_*`` function counts the request's work (`attnflow.costs`) and refuses what cannot
finish within the time limit before anything expensive runs; the routes call the same functions
before queueing when the model is already loaded.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from attnflow.costs import (
    Parts,
    Shape,
    Work,
    count_tokens,
    explain_parts,
    explore_parts,
    position_limit,
    routes_parts,
)
from attnflow.errors import InputError
from attnflow.methods.registry import MethodSpec, get_method, method_names
from attnflow.model_like import ModelLike
from attnflow.serve.costs import Costs
from attnflow.serve.pool import Job, ModelPool

GENERATING = "generating"
ROUTING = "building the routes"
ASKING = "asking why"


def method_list(methods: Sequence[str] | None, also: Sequence[str] = ()) -> list[str] | None:
    """The requested method names, checked against the registry (InputError naming the available ones)."""
    if methods is None:
        return None
    try:
        return method_names(list(methods), also)
    except ValueError as error:
        raise InputError(str(error)) from None


def parsed_options(
    options: Mapping[str, Any], methods: Sequence[str], caps: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """JSON option values turned into what the methods take, with each option's own parser (the
    CLI's: ``{"discard_ratio": 0.5}`` is parsed like ``--discard-ratio 0.5``); a switch takes true/false.
    ``caps``: the largest value each capped option may take on this server (InputError above it)."""
    declared = {option.name: option for name in methods for option in _spec(name).options}
    parsed: dict[str, Any] = {}
    for name, value in options.items():
        option = declared.get(name)
        if option is None:
            takes = ", ".join(sorted(declared)) or "no options"
            raise InputError(f"option {name!r} is not taken by {', '.join(methods)} (they take: {takes})")
        if value is None:
            continue
        if option.parse is None:
            if not isinstance(value, bool):
                raise InputError(f"option {name!r} is a switch: give true or false, got {value!r}")
            if value:
                parsed[name] = True
            continue
        try:
            parsed[name] = option.parse(value if isinstance(value, str) else _option_text(value))
        except ValueError as error:
            raise InputError(f"option {name!r}: {error}") from None
        cap = (caps or {}).get(name)
        if cap is not None and parsed[name] > cap:
            raise InputError(f"option {name!r} ({option.flag}) is at most {cap} on this server, got {parsed[name]}")
    return parsed


# ----- checks before queueing (no model needed) ---------------------------------------------------


@dataclass(frozen=True)
class Asked:
    """A request's inputs, checked (what each ``check_*`` returns, what the work and its estimate read)."""

    text: str
    models: tuple[str, ...]  # its model (compare: A and B), as the pool loads it
    names: list[str] | None = None  # methods (None: the default)
    given: Mapping[str, Any] = field(default_factory=dict)  # their options, parsed
    row: Any = None
    target: str | None = None
    target_text: str | None = None
    max_length: int | None = None
    faithfulness: bool = True
    contrast: str | None = None
    generate: int | None = None
    continuation: str | None = None
    top_k: int = 5
    position: int | None = None  # routes: the top node's token
    threshold: float | None = None  # routes: the edges kept
    corrupt: str | None = None  # why: the counterfactual text

    @property
    def model(self) -> str:
        return self.models[0]

    def reading(self) -> dict[str, Any]:
        """How the text is read: the one ``target`` (`request_target`) and ``max_length`` (the library's keywords)."""
        return {"target": request_target(self.target, self.target_text, self.contrast), "max_length": self.max_length}


def request_target(target: str | None, target_text: str | None, contrast: str | None = None) -> Any:
    """A body's ``target``, ``target_text`` and ``contrast`` fields as one `attnflow.targets.Target`."""
    from attnflow.targets import as_target

    return as_target(target, text=target_text, contrast=contrast)


def check_explain(
    *,
    text: str,
    model: str,
    methods: Sequence[str] | None,
    options: Mapping[str, Any],
    row: str | int | None,
    caps: Mapping[str, int],
    **asked: Any,
) -> Asked:
    """``/api/explain``'s inputs (``asked``: target, target_text, contrast, max_length, faithfulness) checked."""
    from attnflow.capture.texts import check_row_fits, check_texts
    from attnflow.evaluate.per_input import AUTO, with_candidates

    check_texts(text)
    parsed_row = _row(row)
    check_row_fits(parsed_row, [text], asked.get("max_length"))
    names = method_list(methods, also=(AUTO,))
    given = parsed_options(options, with_candidates(names or [AUTO], None), caps)
    return Asked(text, (model,), names, given, parsed_row, **asked)


def check_generate(
    *,
    text: str,
    model: str,
    methods: Sequence[str] | None,
    options: Mapping[str, Any],
    caps: Mapping[str, int],
    **asked: Any,
) -> Asked:
    """``/api/generate``'s inputs (``asked``: generate or continuation, contrast, faithfulness) checked."""
    from attnflow.capture.texts import check_texts
    from attnflow.evaluate.per_input import AUTO, with_candidates

    check_texts(text)
    if (asked.get("generate") is None) == (asked.get("continuation") is None):
        raise InputError("give either generate (a number of new tokens) or continuation (a text), not both or none")
    names = method_list(methods, also=(AUTO,))
    return Asked(text, (model,), names, parsed_options(options, with_candidates(names or [AUTO], None), caps), **asked)


def check_compare(*, text: str, models: Sequence[str], method: str, row: str | int | None, **asked: Any) -> Asked:
    """``/api/compare``'s inputs (``asked``: top_k, target, target_text, contrast, max_length) checked."""
    from attnflow.capture.texts import check_texts

    check_texts(text)
    if len(models) != 2:
        raise InputError(f"give exactly two models (A and B), got {len(models)}")
    return Asked(text, tuple(models), method_list([method]), row=_row(row), **asked)


def check_explore(*, text: str, model: str, methods: Sequence[str] | None, **asked: Any) -> Asked:
    """``/api/explore``'s inputs (``asked``: target, target_text, contrast, max_length) checked."""
    from attnflow.capture.texts import check_texts

    check_texts(text)
    return Asked(text, (model,), method_list(methods), **asked)


def check_routes(*, text: str, model: str, **asked: Any) -> Asked:
    """``/api/routes``' inputs (``asked``: position, threshold, target, contrast) checked (the body
    checks the threshold's range; the position against the text's tokens and the target against the
    model's head are checked by the routes themselves, once the model is held)."""
    from attnflow.capture.texts import check_texts

    check_texts(text)
    return Asked(text, (model,), **asked)


def check_why(*, text: str, model: str, corrupt: str | None, **asked: Any) -> Asked:
    """``/api/why``'s inputs (``asked``: target, contrast) checked (the target, the contrast and the
    counterfactual's length against the model are checked by `attnflow.why` once the model is held)."""
    from attnflow.capture.texts import check_texts

    check_texts(text)
    if corrupt is not None:
        check_texts(corrupt)
    return Asked(text, (model,), corrupt=corrupt, **asked)


# ----- estimates (the models loaded; on the event loop, with a copy of the tokenizer) ---------------------

Loaded = list[tuple[str, Any]]  # (name, loaded model) for each model of a request


@dataclass(frozen=True)
class Explained:
    """What `explain_text` and `generate_text` give: an explanation per method run (auto's choice in
    its place), and the methods asked for that the model's family does not support, each with why
    (`supported`: skipped, the others answered)."""

    explanations: list[Any]
    skipped: dict[str, str] = field(default_factory=dict)


def supported(model: ModelLike, asked: Asked) -> tuple[Asked, dict[str, str]]:
    """``asked`` without the methods that ``model``'s family does not support, and those methods
    with the reason (`attnflow.methods.registry.unsupported_reason`: the rule the library refuses
    by); the library's own refusal (InputError) when none of the methods asked for is left. Options
    that only a skipped method takes go with it."""
    from attnflow.evaluate.per_input import AUTO, with_candidates
    from attnflow.methods.registry import check_family, unsupported_reason

    family = getattr(model, "adapter", None)
    if not asked.names or family is None:
        return asked, {}
    skipped = {}
    for name in asked.names:
        reason = None if name == AUTO else unsupported_reason(get_method(name), family)
        if reason is not None:
            skipped[name] = reason
    if not skipped:
        return asked, {}
    kept = [name for name in asked.names if name not in skipped]
    if not kept:
        check_family(get_method(next(iter(skipped))), family)  # raises, naming the methods that work
    run = with_candidates(kept, family, target_kind=getattr(model, "target_kind", None))
    taken = {option for name in run for option in get_method(name).option_names}
    given = {option: value for option, value in asked.given.items() if option in taken}
    return replace(asked, names=kept, given=given), skipped


def estimate_explain(
    costs: Costs, job: Job, loaded: Loaded, tokenizer: Any, asked: Asked
) -> tuple[Any, Parts, dict[str, str]]:
    """`explain_text`'s plan and its work on this text (`Costs.check`: `TooExpensive` past the time
    limit), and the methods it skips (`supported`)."""
    from attnflow.evaluate.per_input import has_target, plan_methods

    ((name, model),) = loaded
    asked, skipped = supported(model, asked)
    target = asked.reading()["target"]
    plan = plan_methods(model, asked.names, asked.given, target)
    n = count_tokens(tokenizer, asked.text, asked.max_length, position_limit(model))
    faithful = asked.faithfulness and has_target(model, target)
    shape = Shape.of(model)
    costs.check(job, [(name, lambda tokens: explain_parts(plan.per_method, tokens, shape, faithful))], n, "max_length")
    return plan, explain_parts(plan.per_method, n, shape, faithful), skipped


def estimate_generate(
    costs: Costs, job: Job, loaded: Loaded, tokenizer: Any, asked: Asked
) -> tuple[Any, Parts, dict[str, str]]:
    """`generate_text`'s plan and its work: the generation, then each method per generated token;
    and the methods it skips (`supported`)."""
    from attnflow.generation import plan_generation

    ((name, model),) = loaded
    asked, skipped = supported(model, asked)
    plan = plan_generation(model, asked.names, asked.given)
    prompt = count_tokens(tokenizer, asked.text)
    steps = asked.generate if asked.generate is not None else count_tokens(tokenizer, asked.continuation or "")
    shape = Shape.of(model)
    faithful = asked.faithfulness or bool(plan.candidates)

    def parts(tokens: int) -> Parts:
        generated = {GENERATING: Work(steps, steps * tokens)} if asked.generate is not None else {}
        return {**generated, **explain_parts(plan.per_method, tokens, shape, faithful, steps=steps)}

    costs.check(job, [(name, parts)], prompt + steps, "a shorter prompt, or fewer tokens generated")
    return plan, parts(prompt + steps), skipped


def estimate_compare(costs: Costs, job: Job, loaded: Loaded, tokenizer: Any, asked: Asked) -> None:
    """`compare_models`' work: the method on each model (`TooExpensive` past the time limit)."""
    n = count_tokens(tokenizer, asked.text, asked.max_length, position_limit(loaded[0][1]))
    per_method: dict[str, dict[str, Any]] = {name: {} for name in asked.names or []}
    estimates = [
        (alias, lambda tokens, model=model: explain_parts(per_method, tokens, Shape.of(model), False))
        for alias, model in loaded
    ]
    costs.check(job, estimates, n, "max_length")


def estimate_explore(costs: Costs, job: Job, loaded: Loaded, tokenizer: Any, asked: Asked) -> None:
    """`explore_text`'s work (`explore_parts`: each method, every per-head one again per head, the
    views' layers and heads, the per-input faithfulness and the page), as the explorer leaves out the
    expensive ones it was not asked for on long texts (`TooExpensive` past the time limit)."""
    from attnflow.evaluate.per_input import has_target
    from attnflow.exploration import EXPENSIVE_ABOVE
    from attnflow.methods.registry import methods_for

    ((name, model),) = loaded
    n = count_tokens(tokenizer, asked.text, asked.max_length, position_limit(model))
    chosen = list(asked.names or methods_for(model.adapter))
    shape = Shape.of(model)
    faithful = has_target(model, asked.reading()["target"])

    def parts(tokens: int) -> Parts:
        kept = [m for m in chosen if asked.names or tokens <= EXPENSIVE_ABOVE or get_method(m).cost != "expensive"]
        return explore_parts(kept, tokens, shape, faithful)

    costs.check(job, [(name, parts)], n, "max_length")


def estimate_routes(costs: Costs, job: Job, loaded: Loaded, tokenizer: Any, asked: Asked) -> None:
    """`routes_text`'s work: one forward pass and the contribution graph (`routes_parts`; no
    truncation: a text longer than the model reads is refused by the routes themselves)."""
    ((name, _model),) = loaded
    n = count_tokens(tokenizer, asked.text)
    costs.check(job, [(name, routes_parts)], n, "a shorter text")


def estimate_why(costs: Costs, job: Job, loaded: Loaded, tokenizer: Any, asked: Asked) -> None:
    """`why_text`'s work that its budget cannot drop: the attribution with its faithfulness
    (`attnflow.question.run.attribution_parts`); the rest fits the time left or is dropped by why itself."""
    from attnflow.question.run import attribution_parts

    ((name, model),) = loaded
    target = request_target(asked.target, None, asked.contrast)
    n = count_tokens(tokenizer, asked.text)
    costs.check(job, [(name, lambda tokens: attribution_parts(model, tokens, target))], n, "a shorter text")


# ----- the work (in the model's worker thread) -------------------------------------------------------


def load_model(pool: ModelPool, job: Job, costs: Costs, asked: Asked) -> None:
    """Load ``asked.model`` (``--preload``) and measure its rates, as its first request would."""
    with pool.using(asked.model, job) as model:
        costs.ready(asked.model, model)


def explain_text(pool: ModelPool, job: Job, costs: Costs, asked: Asked) -> Explained:
    """`attnflow explain TEXT --model M --method ...` (`check_explain`'s inputs): one `Explanation`
    per method asked for (``faithfulness=False``: ``--no-faithfulness``), but those the model's
    family does not support (skipped, with why)."""
    from attnflow.evaluate.per_input import explain_planned

    with pool.using(asked.model, job) as model:
        costs.ready(asked.model, model)
        job.step("planning")
        plan, parts, skipped = estimate_explain(costs, job, [(asked.model, model)], model.tokenizer, asked)
        began = time.perf_counter()
        job.step("tracing")
        trace = model.trace_for(list(plan.per_method), [asked.text], **asked.reading())[0]
        explained = explain_planned(model, trace, plan, asked.row, job.step, asked.faithfulness)
        costs.observe(asked.model, parts, time.perf_counter() - began, job.timings())
        return Explained(explained, skipped)


def generate_text(pool: ModelPool, job: Job, costs: Costs, asked: Asked) -> Explained:
    """`attnflow explain PROMPT --generate N` (or ``--continuation TEXT``): one `GenerationExplanation`
    per method asked for (None: auto, as the CLI), auto's choice in its place (`attnflow.generation`'s
    `plan_generation` and `explain_planned_generation`, the CLI's code); a cancel stops before the
    generation or before the explanations."""
    from attnflow.generation import DEFAULT_STEPS_PER_PASS, explain_planned_generation, prepare_continuation

    with pool.using(asked.model, job) as model:
        costs.ready(asked.model, model)
        plan, parts, skipped = estimate_generate(costs, job, [(asked.model, model)], model.tokenizer, asked)
        began = time.perf_counter()
        job.step(GENERATING if asked.generate is not None else "tokenizing the continuation")
        sequence = prepare_continuation(
            model, asked.text, max_new_tokens=asked.generate, continuation=asked.continuation
        )
        job.step(", ".join(plan.per_method))  # all at once, as the CLI: the steps' log p come from one pass
        explained = explain_planned_generation(
            model, sequence, plan, asked.faithfulness, DEFAULT_STEPS_PER_PASS, asked.contrast
        )
        costs.observe(asked.model, parts, time.perf_counter() - began, job.timings())
        return Explained(explained, skipped)


def compare_models(pool: ModelPool, job: Job, costs: Costs, asked: Asked) -> Any:
    """`attnflow compare TEXT --model A --model B --method M`: the `Comparison`."""
    from attnflow.comparison import compare

    (name,) = asked.names or ["rollout"]
    first, second = asked.models
    with pool.using_both(first, second, job) as (model_a, model_b):
        loaded = [(first, model_a), (second, model_b)]
        for alias, model in loaded:
            costs.ready(alias, model)
        estimate_compare(costs, job, loaded, model_a.tokenizer, asked)
        job.step(name)
        return compare(model_a, model_b, asked.text, method=name, row=asked.row, k=asked.top_k, **asked.reading())


def explore_text(pool: ModelPool, job: Job, costs: Costs, asked: Asked) -> str:
    """`attnflow explore TEXT`: the explorer's page (every layer and head of each method), as HTML."""
    from attnflow.exploration import explore

    with pool.using(asked.model, job) as model:
        costs.ready(asked.model, model)
        estimate_explore(costs, job, [(asked.model, model)], model.tokenizer, asked)
        job.step("exploring")
        exploration = explore(model, asked.text, methods=asked.names, **asked.reading())
        return str(exploration.to_html())


def answer_record(explanation: Any) -> dict[str, Any]:
    """An explanation's JSON as ``/api/explain`` and ``/api/generate`` answer it: the file's content
    (raw token strings) and the strings a reader sees (`attnflow.tokens.display_token`), which the
    page shows: ``display_tokens``, or for a generation ``display_sources`` and ``display_generated``."""
    from attnflow.tokens import display_token

    data = explanation.to_dict()
    if "generated" in data:
        data["display_sources"] = [display_token(token) for token in data["sources"]]
        data["display_generated"] = [display_token(token) for token in data["generated"]]
    else:
        data["display_tokens"] = [display_token(token) for token in data["tokens"]]
    return data


def routes_text(pool: ModelPool, job: Job, costs: Costs, asked: Asked) -> tuple[dict[str, Any], str]:
    """`attnflow routes TEXT` (`check_routes`' inputs): the content of routes.json and the routes
    page (``routes.html``)."""
    from attnflow.flow_routes.api import DEFAULT_THRESHOLD, routes
    from attnflow.viz.routes import routes_html

    threshold = DEFAULT_THRESHOLD if asked.threshold is None else asked.threshold
    with pool.using(asked.model, job) as model:
        costs.ready(asked.model, model)
        estimate_routes(costs, job, [(asked.model, model)], model.tokenizer, asked)
        began = time.perf_counter()
        job.step(ROUTING)
        found = routes(
            model,
            asked.text,
            position=asked.position,
            threshold=threshold,
            target=request_target(asked.target, None, asked.contrast),
        )
        costs.observe(asked.model, routes_parts(len(found.tokens)), time.perf_counter() - began, job.timings())
        return found.to_dict(), routes_html(found)


def explanation_file(explanation: Any, kind: str) -> bytes:
    """The bytes of ``explanation.{json,html,png}`` (``kind``) exactly as `attnflow explain` writes
    them (`Explanation.write_files`, or `GenerationExplanation.save`)."""
    with tempfile.TemporaryDirectory(prefix="attnflow-serve-") as folder:
        writer = getattr(explanation, "write_files", None) or explanation.save
        paths = writer(Path(folder))
        if kind not in paths:
            raise InputError(f"no {kind!r} file for this explanation; there are: {', '.join(paths)}")
        return Path(paths[kind]).read_bytes()


def method_record(name: str) -> dict[str, Any]:
    """A registered method's declaration as JSON (what ``/api/methods`` lists)."""
    spec = get_method(name)
    return {
        "name": spec.name,
        "summary": spec.summary,
        "uses_target": spec.uses_target,
        "signed": spec.signed,
        "cost": spec.cost,
        "scores_only": spec.scores_only,
        "layerwise": spec.layerwise,
        "per_head": spec.per_head,
        "requires": sorted(spec.requires),
        "options": [
            {
                "name": option.name,
                "flag": option.flag,
                "help": option.help,
                "switch": option.parse is None,
                "choices": list(option.choices) if option.choices else None,
                "metavar": option.metavar,
            }
            for option in spec.options
        ],
    }


def _spec(name: str) -> MethodSpec:
    try:
        return get_method(name)
    except ValueError as error:
        raise InputError(str(error)) from None


def _row(row: str | int | None) -> Any:
    if row is None:
        return None
    from attnflow.methods.saliency import parse_row

    try:
        return parse_row(str(row))
    except ValueError as error:
        raise InputError(str(error)) from None


def _option_text(value: Any) -> str:
    """A JSON number or list as the command line would spell it (lists comma-separated)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def why_text(pool: ModelPool, job: Job, costs: Costs, asked: Asked) -> tuple[dict[str, Any], str, str]:
    """`attnflow why TEXT` (`check_why`'s inputs) within the time left to the request (its budget:
    the most expensive evidence dropped rather than the request stopped): the content of why.json,
    the page's evidence sections (`attnflow.viz.why.why_fragment`) and the whole page."""
    from attnflow.question.run import why
    from attnflow.viz.why import why_fragment, why_html

    with pool.using(asked.model, job) as model:
        costs.ready(asked.model, model)
        estimate_why(costs, job, [(asked.model, model)], model.tokenizer, asked)
        job.step(ASKING)
        left = job.remaining_s()
        found = why(
            model,
            asked.text,
            request_target(asked.target, None, asked.contrast),
            corrupt=asked.corrupt,
            budget=costs.time_limit_s if left is None else max(left, 1e-3),
            progress=lambda line: job.step(line.removesuffix(" …")) if line.endswith(" …") else None,
        )
        data = found.to_dict()
        return data, why_fragment(data), why_html(data)
