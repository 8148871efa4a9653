"""The audit run: examples → batches → explanations → words → `AuditStats`, on the run engine.

`run_audit` builds the audit's job and runs it (`attnflow.runs.engine.run`) into one output folder::

    examples ──batches──> AuditStep ──> model.explain + counterfactual scoring
             ──> word_relevance ──> AuditStats.update       every K batches: checkpoint.json (atomic)
    at the end: results.json, report.html (atomic)

The engine runs the step in this process or in model replicas as Ray actors (each with its own
`AuditStats`, merged on the driver). The checkpoint holds the state, the number of examples
consumed and the fields of what decides the accumulated numbers (model, data, samples, seed,
method, swap pairs); ``resume=True`` continues after the consumed examples on the same batch
boundaries, so a resumed local run ends with identical numbers. Term lists and ``min_count`` only
shape the final analysis and may change between runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from attnflow.dataset_audit.analysis import analyse
from attnflow.dataset_audit.stats import AuditStats
from attnflow.dataset_audit.step import AuditOptions, AuditStep, Batch, with_scorer
from attnflow.dataset_audit.words import ambiguous_words, find_words, parse_swaps, parse_terms, swap_table
from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.runs.checkpoint import RunFolder, versions
from attnflow.runs.engine import EngineOptions, Job, run
from attnflow.runs.options import check_counts
from attnflow.staging import atomic_file

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.json"
RESULTS = "results.json"
REPORT = "report.html"
OUTPUTS = (RESULTS, REPORT)
# 2: word sums hold |relevance| too; 3: and the positive part, unswapped texts; 4: the run engine's layout
CHECKPOINT_FORMAT = 4
# a two-side audit (--versus, --versus-data): 5, its sums per side ([Σa, Σa², Σb, Σb², Σd²]) and maps
VERSUS_CHECKPOINT_FORMAT = 5


# -- the data ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditData:
    """The texts of an audit, their labels (or None), where they come from and which split."""

    name: str
    texts: tuple[str, ...]
    labels: tuple[int, ...] | None
    split: str


def load_data(options: AuditOptions, model: ModelLike, label_names: list[str]) -> AuditData:
    """The audited examples: the task's held-out split, a labelled file, or unlabelled texts,
    then ``samples`` of them drawn with ``seed`` (capped at what there is, with a warning)."""
    from attnflow.datasets import TASKS
    from attnflow.evaluate.api import load_evaluation_task, select_samples

    if options.file is not None:
        texts = read_unlabelled(options.file, options.text_column)
        name, labels, split = options.file, None, "every text of the file (no labels)"
    else:
        data, name = load_evaluation_task(options.task, model, label_names, options.text_column, options.label_column)
        texts, labels = list(data.texts), [int(label) for label in data.labels]
        split = "held-out 20 % (stratified, seed 0)" if name in TASKS else "every row of the file"
    if options.samples is not None:
        chosen = select_samples(len(texts), options.samples, options.seed)
        texts = [texts[i] for i in chosen]
        labels = None if labels is None else [labels[i] for i in chosen]
    return AuditData(name, tuple(texts), None if labels is None else tuple(labels), split)


def read_unlabelled(file: str, text_column: str) -> list[str]:
    """The texts of a .txt (one a line), .jsonl (field ``text_column``), .csv or .parquet file."""
    from attnflow.capture.texts import check_texts
    from attnflow.runs.readers import KINDS, ReadOptions, open_corpus

    path = Path(file).expanduser()
    if not path.is_file() or path.suffix.lower() not in KINDS:
        raise InputError(f"{{file}} {file}: give an existing .txt, .jsonl, .csv or .parquet file", parameter="file")
    try:
        texts = list(open_corpus(str(path), ReadOptions(text_field=text_column, text_column=text_column)))
    except InputError as error:  # the reader's parameters as the audit's own
        raise error.renamed({"data": "file", "text_field": "text_column"}) from None
    if not texts:
        raise InputError(f"{{file}} {file} holds no text", parameter="file")
    check_texts(texts)  # undecodable characters: one line before any model runs
    return texts


def check_model(model: ModelLike, method: str) -> list[str]:
    """The class names of a classifier; one InputError line for anything else."""
    from attnflow.evaluate.scorer import check_classifier
    from attnflow.methods.registry import get_method

    spec = get_method(method)
    if not model.is_classifier:
        needs = f"{method} explains a target class, and " if spec.uses_target else ""
        raise InputError(
            f"model {model.name!r} has no classifier head: {needs}the audit groups texts by predicted class; "
            "audit a classifier such as minilm-sentiment, minilm-topics or mpnet-sentiment"
        )
    return check_classifier(model)


# -- the run -----------------------------------------------------------------------------------


def run_audit(
    options: AuditOptions,
    out: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    model: ModelLike | None = None,
    versus: ModelLike | None = None,
) -> dict[str, Any]:
    """Run (or continue) an audit into folder ``out``; returns the results written there.
    ``model`` / ``versus``: the models of ``options.model`` / ``options.versus``, already loaded
    (the local engine uses them; Ray's actors load them by name).

    Raises:
        InputError: bad options, data or output folder; a checkpoint of another configuration.
        KeyboardInterrupt: after Ctrl-C / SIGTERM, once a checkpoint is saved.
        OutputError: another run holds ``out`` (`attnflow.staging.folder_lock`).
    """
    from attnflow.methods.registry import get_method

    _check_options(options)
    get_method(options.method)
    terms = parse_terms(options.terms) if options.terms else []
    pairs = parse_swaps(options.swap) if options.swap else []
    for word, partners in ambiguous_words(swap_table(pairs)).items():
        log.warning(
            "--swap: %r has several partners (%s): texts holding it are reported as ambiguous, not swapped",
            word,
            ", ".join(partners),
        )
    engine = EngineOptions.of(options)
    two_sides = options.versus is not None or options.versus_data is not None
    layout = VERSUS_CHECKPOINT_FORMAT if two_sides else CHECKPOINT_FORMAT
    with RunFolder(
        out, kind="audit", checkpoint=CHECKPOINT, owned=OUTPUTS.__contains__, state_format=layout,
        resume=resume, overwrite=overwrite, fields=_option_fields(options, pairs),
    ) as folder:  # fmt: skip
        if model is None:
            from attnflow.model import load

            model = load(options.model, device=engine.driver_device, dtype=options.dtype)
        label_names = check_model(model, options.method)
        if two_sides:
            results = _run_versus(options, model, versus, label_names, terms, pairs, folder, engine)
            write_outputs(folder.out, results)
            return results
        data = load_data(options, model, label_names)
        finished = run(_job(options, model, data, label_names, pairs), folder, engine, context=with_scorer(model))
        results = build_results(
            options, model, data, label_names, finished.result, terms, pairs, finished.fingerprint, finished.elapsed_s
        )
        write_outputs(folder.out, results)
    return results


def _run_versus(
    options: AuditOptions,
    model: ModelLike,
    versus: ModelLike | None,
    label_names: list[str],
    terms: list[str],
    pairs: list,
    folder: RunFolder,
    engine: EngineOptions,
) -> dict[str, Any]:
    """The two-side audit (`attnflow.dataset_audit.versus`): with ``options.versus``, the second model
    loaded and checked, both run over the same texts; with ``options.versus_data``, the one model
    over its data and the second domain; on the run engine; returns results.json."""
    from attnflow.dataset_audit.versus import (
        VersusStats,
        VersusStep,
        analyse_versus,
        check_pair,
        lead,
        shared_shape,
    )
    from attnflow.errors import ModelLoadError
    from attnflow.model import load

    if options.versus is not None and versus is None:
        try:
            versus = load(options.versus, device=engine.driver_device, dtype=options.dtype)
        except ModelLoadError as error:
            raise InputError(f"{{versus}} {options.versus}: {error}", parameter="versus") from None
    if versus is not None:
        check_pair(model, versus, label_names, check_model(versus, options.method))
    sides = [load_data(options, model, label_names)]
    if options.versus_data is not None:
        sides.append(load_domain(options, model, label_names))
    for data in sides:
        if all(next(find_words(text), None) is None for text in data.texts):
            raise InputError(
                f"no text of {data.name} holds a word, so the two sides have no word to compare "
                "(words: letters and digits)",
                parameter="versus" if versus is not None else "versus_data",
            )
    shape = shared_shape(model, versus) if versus is not None else [int(model.n_layers), int(model.n_heads)]
    labelled = all(data.labels is not None for data in sides)
    groups = len(label_names) if labelled else 1
    step = VersusStep(options, options.versus, len(label_names), groups, shape, swap_table(pairs), tuple(terms))
    job = _job(options, model, sides, label_names, pairs)
    if versus is not None:
        second: dict[str, Any] = {"versus_shape": [versus.n_layers, versus.n_heads, versus.d_head]}
    else:
        second = {"versus_data_sha256": _content(sides[1]), "versus_examples": len(sides[1].texts)}
    job = replace(
        job,
        name=f"audit --versus{'' if versus is not None else '-data'} ({options.method})",
        fields={**job.fields, **second},
        step=step,
        result=VersusStats(len(label_names), groups, shape, paired=versus is not None),
    )
    context = (with_scorer(model),) + ((with_scorer(versus),) if versus is not None else ())
    finished = run(job, folder, engine, context=context)
    stats = finished.result
    results = build_results(
        options, model, sides[0], label_names, stats.model, terms, pairs, finished.fingerprint, finished.elapsed_s
    )
    run_info = {**results["run"], "samples": stats.n_samples, "head_statistics": shape is not None}
    if versus is not None:
        run_info.update({"versus": versus.name, "sides": [model.name, versus.name]})
    else:
        domain = sides[1]
        run_info.update(
            {"versus_data": domain.name, "versus_split": domain.split, "sides": [sides[0].name, domain.name]}
        )
    results = {"run": run_info}
    results.update(analyse_versus(stats, label_names, options.min_count, terms, bool(pairs), labelled))
    results["changes"]["lead"] = lead(results)
    return results


def load_domain(options: AuditOptions, model: ModelLike, label_names: list[str]) -> AuditData:
    """The second domain of ``--versus-data``: a built-in task (its held-out 20 %), a labelled file
    (as `load_data` reads them) or a domain of `attnflow.datasets.DOMAINS` (every text labelled with
    one of the classifier's classes), then ``samples`` of them drawn with ``seed``."""
    from attnflow.datasets import DOMAINS, TASKS
    from attnflow.evaluate.api import select_samples

    name = options.versus_data
    assert name is not None
    if name not in DOMAINS:
        if name not in TASKS and not Path(name).expanduser().is_file():
            raise InputError(
                f"{{versus_data}} {name}: no such data; give {', '.join([*TASKS, *DOMAINS])} or a labelled "
                "CSV/JSONL file",
                parameter="versus_data",
            )
        try:
            return load_data(replace(options, task=name, file=None), model, label_names)
        except InputError as error:
            if "task" in error.parameters:
                raise error.renamed({"task": "versus_data"}) from None
            raise InputError(f"{{versus_data}} {name}: {error}", parameter="versus_data") from None
    try:
        data = DOMAINS[name]().for_classes(label_names)
    except InputError as error:
        raise InputError(f"{{versus_data}} {name}: {error}", parameter="versus_data") from None
    if not data.texts:
        raise InputError(f"{{versus_data}} {name} holds no text of the classes {', '.join(label_names)}",
                         parameter="versus_data")  # fmt: skip
    texts, labels = list(data.texts), [int(label) for label in data.labels]
    if options.samples is not None:
        chosen = select_samples(len(texts), options.samples, options.seed)
        texts, labels = [texts[i] for i in chosen], [labels[i] for i in chosen]
    split = f"every text labelled {', '.join(label_names)}"
    return AuditData(name, tuple(texts), tuple(labels), split)


def _job(
    options: AuditOptions, model: ModelLike, data: AuditData | list[AuditData], label_names: list[str], pairs: list
) -> Job:
    """The audit's job over ``data``, or over several sides one after the other (each batch within
    one side: `Batch.side`, its ``first`` counted in that side)."""
    sides = data if isinstance(data, list) else [data]

    def batches(start: int) -> Iterator[Batch]:
        offset = 0
        for side, found in enumerate(sides):
            for first in range(max(start - offset, 0), len(found.texts), options.batch_size):
                last = min(first + options.batch_size, len(found.texts))
                labels = None if found.labels is None else found.labels[first:last]
                yield Batch(first, found.texts[first:last], labels, side)
            offset += len(found.texts)

    return Job(
        name=f"audit ({options.method})",
        unit="text",
        total=sum(len(found.texts) for found in sides),
        fields=_fingerprint_fields(options, model, sides[0], pairs),
        step=AuditStep(options, len(label_names), swap_table(pairs)),
        result=AuditStats(len(label_names)),
        batches=batches,
    )


def _check_options(options: AuditOptions) -> None:
    check_counts(
        required=(
            ("batch_size", options.batch_size),
            ("checkpoint_every", options.checkpoint_every),
            ("min_count", options.min_count),
        ),
        optional=(("samples", options.samples), ("workers", options.workers)),
        engine=options.engine,
    )
    if options.versus is not None and options.versus_data is not None:
        raise InputError(
            "give {versus} (a second model over the same texts) or {versus_data} (a second domain for the one "
            "model), not both",
            parameter=("versus", "versus_data"),
        )
    if options.task is not None and options.file is not None:
        raise InputError(
            "give {task} (labelled examples) or {file} (unlabelled texts), not both", parameter=("task", "file")
        )
    if options.file is not None and not Path(options.file).expanduser().is_file():
        raise InputError(
            f"{{file}} {options.file}: give an existing .txt, .jsonl, .csv or .parquet file", parameter="file"
        )


def _option_fields(options: AuditOptions, pairs: list) -> dict[str, Any]:
    """The fields of the configuration known before the model loads."""
    return {
        "model": options.model,
        "dtype": options.dtype,
        "task": options.task,
        "file": None if options.file is None else str(Path(options.file).expanduser().resolve()),
        "text_column": options.text_column,
        "label_column": options.label_column,
        "samples": options.samples,
        "seed": options.seed,
        "method": options.method,
        "swap": [list(pair) for pair in pairs],
        # a two-model audit: the second model, and the terms (their share is summed per text)
        **({"versus": options.versus, "versus_data": options.versus_data,
            "terms": sorted(parse_terms(options.terms)) if options.terms else []}
           if options.versus is not None or options.versus_data is not None else {}),
    }  # fmt: skip


def _fingerprint_fields(options: AuditOptions, model: ModelLike, data: AuditData, pairs: list) -> dict[str, Any]:
    """What must not change between a run and its resumption (not: terms, min count, batch
    size, engine, workers, device)."""
    return {
        **_option_fields(options, pairs),
        "model_shape": [model.n_layers, model.n_heads, model.d_head],
        "data": data.name,
        "data_sha256": _content(data),
        "examples": len(data.texts),
    }


def _content(data: AuditData) -> str:
    """The first 16 hex digits of the sha256 of the texts and labels."""
    return hashlib.sha256(json.dumps([data.texts, data.labels]).encode("utf-8")).hexdigest()[:16]


def build_results(
    options: AuditOptions,
    model: ModelLike,
    data: AuditData,
    label_names: list[str],
    stats: AuditStats,
    terms: list[str],
    pairs: list[tuple[str, str]],
    fingerprint: str,
    elapsed: float,
) -> dict[str, Any]:
    """results.json: the run, then `attnflow.dataset_audit.analysis.analyse`'s sections."""
    results: dict[str, Any] = {
        "run": {
            "model": model.name,
            "method": options.method,
            "data": data.name,
            "split": data.split,
            "labels": label_names,
            "samples": stats.n_samples,
            "samples_requested": options.samples,
            "seed": options.seed,
            "min_count": options.min_count,
            "terms": terms,
            "swap": [list(pair) for pair in pairs],
            "engine": options.engine,
            "workers": options.workers,
            "batch_size": options.batch_size,
            "elapsed_s": round(elapsed, 3),
            "fingerprint": fingerprint,
            "versions": versions(),
        }
    }
    results.update(
        analyse(stats, label_names, options.min_count, terms, swaps=bool(pairs), labelled=data.labels is not None)
    )
    if stats.noted:
        log.warning(
            "%d of %d explanations carry a note of %s (e.g. most relevance on one token); "
            "`attnflow explain` on a text shows it",
            stats.noted,
            stats.n_samples,
            options.method,
        )
    for term in results.get("terms", {}).get("missing", []):
        log.warning("--terms: %r occurs in no audited text", term)
    unswapped = results.get("swaps", {}).get("unswapped")
    if unswapped:
        words = ", ".join(f"{word} {texts}" for word, texts in results["swaps"]["ambiguous"].items())
        log.warning("--swap: %d texts not swapped: they hold a word with several partners (%s)", unswapped, words)
    return results


def write_outputs(out: Path, results: dict[str, Any]) -> None:
    """results.json and report.html, each written atomically."""
    from attnflow.dataset_audit.report import build_report

    with atomic_file(out / RESULTS) as handle:
        handle.write((json.dumps(finite(results), indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
    with atomic_file(out / REPORT) as handle:
        handle.write(build_report(results).encode("utf-8"))


def finite(value: Any) -> Any:
    """NaN and infinities as null (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return value


def audit(
    model: str | Any = "minilm-sentiment",
    out: str | os.PathLike = "out/audit",
    *,
    resume: bool = False,
    overwrite: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """`attnflow.dataset_audit`: what a classifier relies on across a dataset (docs/audit.md).

    ``model``: an alias/path or a loaded `AttentionModel`; ``options``: the fields of
    `AuditOptions` (task, file, method, samples, terms, swap, min_count, engine, workers, ...);
    ``versus``: a second classifier (alias, path or loaded model) compared with ``model`` over the
    same texts (`attnflow.dataset_audit.versus`; results gain ``model``, ``versus`` and ``changes``);
    ``versus_data``: a second domain the one model reads beside ``task`` (the same report, unpaired).
    Writes ``results.json`` and ``report.html`` into ``out``; returns the results.

        attnflow.audit("minilm-sentiment", "out/audit", task="rotten-tomatoes", samples=500,
                       terms="he,she", swap="he:she,him:her")
        attnflow.audit("minilm-sentiment-ft", "out/diff", versus="minilm-sentiment", samples=1000)
        attnflow.audit("minilm-sentiment", "out/shift", task="rotten-tomatoes", versus_data="tweets", samples=300)
    """
    loaded = None if isinstance(model, str) else model
    name = model if isinstance(model, str) else model.name
    from attnflow.notebook import Results

    second = options.pop("versus", None)
    second_loaded = None if second is None or isinstance(second, str) else second
    second_name = second if second is None or isinstance(second, str) else second.name
    results = run_audit(
        AuditOptions(model=name, versus=second_name, **options),
        out,
        resume=resume,
        overwrite=overwrite,
        model=loaded,
        versus=second_loaded,
    )
    return Results("audit", results)
