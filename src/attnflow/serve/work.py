"""What each API request computes, through the library's front doors (run in a worker thread).

`explain_text` is `attnflow explain TEXT`'s flow (`attnflow.evaluate.per_input.plan_methods` and
`explain_planned`: the same methods, options, faithfulness and ``auto`` choice, so the numbers
equal the CLI's); a body's ``target``, ``target_text`` and ``contrast`` become one
`attnflow.targets.Target` here (`request_target`); `generate_text` is `attnflow explain TEXT --generate N`'s
(`attnflow.generation`); `compare_models` is `attnflow compare`'s (`attnflow.comparison.compare`).
Each takes the request's `Job` and checks it between steps: a cancelled request stops at the next
method boundary.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from attnflow.errors import InputError
from attnflow.methods.registry import MethodSpec, get_method, method_names
from attnflow.serve.pool import Job, ModelPool


def method_list(methods: Sequence[str] | None, also: Sequence[str] = ()) -> list[str] | None:
    """The requested method names, checked against the registry (InputError naming the available ones)."""
    if methods is None:
        return None
    try:
        return method_names(list(methods), also)
    except ValueError as error:
        raise InputError(str(error)) from None


def parsed_options(options: Mapping[str, Any], methods: Sequence[str]) -> dict[str, Any]:
    """JSON option values turned into what the methods take, with each option's own parser (the
    CLI's: ``{"discard_ratio": 0.5}`` is parsed like ``--discard-ratio 0.5``); a switch takes true/false."""
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
    return parsed


def request_target(target: str | None, target_text: str | None, contrast: str | None = None) -> Any:
    """A body's ``target``, ``target_text`` and ``contrast`` fields as one `attnflow.targets.Target`."""
    from attnflow.targets import as_target

    return as_target(target, text=target_text, contrast=contrast)


def explain_text(
    pool: ModelPool,
    job: Job,
    *,
    text: str,
    model: str,
    methods: Sequence[str] | None,
    options: Mapping[str, Any],
    target: str | None,
    target_text: str | None,
    row: str | int | None,
    max_length: int | None,
    faithfulness: bool = True,
    contrast: str | None = None,
) -> list[Any]:
    """`attnflow explain TEXT --model M --method ...`: one `Explanation` per method asked for
    (``faithfulness=False``: ``--no-faithfulness``)."""
    from attnflow.capture.texts import check_row_fits, check_texts
    from attnflow.evaluate.per_input import AUTO, explain_planned, plan_methods, with_candidates

    check_texts(text)
    parsed_row = _row(row)
    check_row_fits(parsed_row, [text], max_length)
    names = method_list(methods, also=(AUTO,))
    given = parsed_options(options, with_candidates(names or [AUTO], None))
    with pool.using(model, job) as loaded:
        job.step("planning")
        plan = plan_methods(loaded, names, given, target_text)
        job.step("tracing")
        wanted = request_target(target, target_text, contrast)
        trace = loaded.trace_for(list(plan.per_method), [text], target=wanted, max_length=max_length)[0]
        return explain_planned(loaded, trace, plan, parsed_row, job.step, faithfulness)


def generate_text(
    pool: ModelPool,
    job: Job,
    *,
    text: str,
    model: str,
    methods: Sequence[str] | None,
    options: Mapping[str, Any],
    generate: int | None,
    continuation: str | None,
    faithfulness: bool,
    contrast: str | None = None,
) -> list[Any]:
    """`attnflow explain PROMPT --generate N` (or ``--continuation TEXT``): one `GenerationExplanation`
    per method asked for (None: auto, as the CLI), auto's choice in its place (`attnflow.generation`'s
    `plan_generation` and `explain_planned_generation`, the CLI's code); a cancel stops before the
    generation or before the explanations."""
    from attnflow.capture.texts import check_texts
    from attnflow.evaluate.per_input import AUTO, with_candidates
    from attnflow.generation import (
        DEFAULT_STEPS_PER_PASS,
        explain_planned_generation,
        plan_generation,
        prepare_continuation,
    )

    check_texts(text)
    if (generate is None) == (continuation is None):
        raise InputError("give either generate (a number of new tokens) or continuation (a text), not both or none")
    names = method_list(methods, also=(AUTO,))
    given = parsed_options(options, with_candidates(names or [AUTO], None))
    with pool.using(model, job) as loaded:
        plan = plan_generation(loaded, names, given)
        job.step("generating" if generate is not None else "tokenizing the continuation")
        sequence = prepare_continuation(loaded, text, max_new_tokens=generate, continuation=continuation)
        job.step(", ".join(plan.per_method))  # all at once, as the CLI: the steps' log p come from one pass
        return explain_planned_generation(loaded, sequence, plan, faithfulness, DEFAULT_STEPS_PER_PASS, contrast)


def compare_models(
    pool: ModelPool,
    job: Job,
    *,
    text: str,
    models: Sequence[str],
    method: str,
    row: str | int | None,
    top_k: int,
    target: str | None,
    target_text: str | None,
    max_length: int | None,
    contrast: str | None = None,
) -> Any:
    """`attnflow compare TEXT --model A --model B --method M`: the `Comparison`."""
    from attnflow.capture.texts import check_texts
    from attnflow.comparison import compare

    check_texts(text)
    if len(models) != 2:
        raise InputError(f"give exactly two models (A and B), got {len(models)}")
    (name,) = method_list([method]) or [method]
    with pool.using_both(models[0], models[1], job) as (model_a, model_b):
        job.step(name)
        return compare(
            model_a,
            model_b,
            text,
            method=name,
            row=_row(row),
            k=top_k,
            max_length=max_length,
            target=request_target(target, target_text, contrast),
        )


def explore_text(
    pool: ModelPool,
    job: Job,
    *,
    text: str,
    model: str,
    methods: Sequence[str] | None,
    target: str | None,
    target_text: str | None,
    max_length: int | None,
    contrast: str | None = None,
) -> str:
    """`attnflow explore TEXT`: the explorer's page (every layer and head of each method), as HTML."""
    from attnflow.capture.texts import check_texts
    from attnflow.exploration import explore

    check_texts(text)
    names = method_list(methods)
    with pool.using(model, job) as loaded:
        job.step("exploring")
        wanted = request_target(target, target_text, contrast)
        exploration = explore(loaded, text, methods=names, target=wanted, max_length=max_length)
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
