"""The corpus study: windows → batches → capture → statistics, on the run engine.

`run_study` builds the study's job and runs it (`attnflow.runs.engine.run`) into one output folder::

    corpus ──WindowStream──> WindowBatch ──StudyStep──> model.capture_batch ──> StudyStats.update
                                                   every K batches: checkpoint.npz (atomic)
    at the end: summary.json, stats.npz, heads.csv, report.html

The engine runs the step in this process or in model replicas as Ray actors (``--engine ray``),
checkpoints, resumes and stops on Ctrl-C; no model math and no statistics live in this module.

Resume. ``checkpoint.npz`` holds the `StudyStats` state, the number of windows consumed and the
fields of everything that decides which windows exist and what is counted (model, corpus file and
options, seq_len, stride, samples, statistics options; not the batch size, engine or device).
``resume=True`` checks them, and restarts the deterministic window stream after the consumed
windows, so no window is counted twice and none is lost; checkpoints fall on the same batch
boundaries as in an uninterrupted run, which makes the resumed statistics identical to it.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from attnflow.corpus.stats import StudyStats
from attnflow.corpus.study import StudyOptions, StudyStep, new_stats
from attnflow.corpus.windows import WindowStream, batched
from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.notebook import Results
from attnflow.runs.checkpoint import RunFolder, versions
from attnflow.runs.engine import EngineOptions, Job, run
from attnflow.runs.options import check_counts
from attnflow.runs.readers import Corpus, open_corpus
from attnflow.staging import atomic_file

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.npz"
SUMMARY = "summary.json"
STATS = "stats.npz"
HEADS = "heads.csv"
REPORT = "report.html"
OUTPUTS = (SUMMARY, STATS, HEADS, REPORT)
CHECKPOINT_FORMAT = 2  # 2: the run engine's layout


def run_study(
    options: StudyOptions,
    out: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    model: ModelLike | None = None,
) -> dict[str, Any]:
    """Run (or continue) a corpus study into folder ``out``; returns the summary written there.

    Args:
        options: what to study and how (see `StudyOptions`).
        out: the output folder; one holding an earlier study is refused unless ``resume``
            (continue its checkpoint) or ``overwrite`` (delete attnflow's files there first).
        model: an already loaded `attnflow.AttentionModel` (local engine only); default:
            ``attnflow.load(options.model, device=options.device, dtype=options.dtype)``.

    Raises:
        InputError: bad options, corpus or output folder; a checkpoint of another configuration.
        KeyboardInterrupt: after Ctrl-C / SIGTERM, once a checkpoint is saved.
        OutputError: another run holds ``out`` (`attnflow.staging.folder_lock`).
    """
    _check_options(options)
    engine = EngineOptions.of(options)
    corpus = open_corpus(options.data, options.reading)
    with RunFolder(
        out, kind="corpus study", checkpoint=CHECKPOINT, owned=OUTPUTS.__contains__, state_format=CHECKPOINT_FORMAT,
        resume=resume, overwrite=overwrite, fields=option_fields(options, corpus),
    ) as folder:  # fmt: skip
        corpus.validate()
        if model is None:
            from attnflow.model import load

            # Ray: replicas load their own copy
            model = load(options.model, device=engine.driver_device, dtype=options.dtype)
        if options.seq_len > model.max_length:
            raise InputError(
                f"{{seq_len}} {options.seq_len} exceeds the maximum of {options.model} ({model.max_length} tokens)",
                parameter="seq_len",
            )
        stream = WindowStream(
            corpus, model.tokenizer, seq_len=options.seq_len, stride=options.stride, samples=options.samples
        )

        def batches(start: int) -> Any:
            stream.start = start
            return batched(stream, options.batch_size)

        job = Job(
            name="corpus study",
            unit="window",
            total=options.samples,
            fields=fingerprint_fields(options, model, corpus, stream),
            step=StudyStep(options),
            result=new_stats(model, options),
            batches=batches,
        )
        finished = run(job, folder, engine, context=model)
        if stream.shortfall():
            log.warning("%s", stream.shortfall())
        summary = build_summary(
            options, model, corpus, stream, finished.result, finished.fingerprint, finished.elapsed_s
        )
        write_outputs(folder.out, summary, finished.result, model.tokenizer)
    return Results("corpus", summary)


def _check_options(options: StudyOptions) -> None:
    check_counts(
        required=(
            ("batch_size", options.batch_size),
            ("seq_len", options.seq_len),
            ("checkpoint_every", options.checkpoint_every),
        ),
        optional=(("samples", options.samples), ("stride", options.stride), ("workers", options.workers)),
        engine=options.engine,
    )


def option_fields(options: StudyOptions, corpus: Corpus) -> dict[str, Any]:
    """The fields of the configuration known before the model loads (see `fingerprint_fields`)."""
    return {
        "model": options.model,
        "dtype": options.dtype,
        "corpus": corpus.identity(),
        "seq_len": options.seq_len,
        "stride": options.stride,
        "samples": options.samples,
        "study": asdict(options.statistics),
    }


def fingerprint_fields(options: StudyOptions, model: ModelLike, corpus: Corpus, stream: WindowStream) -> dict[str, Any]:
    """What must not change between a run and its resumption (not: batch size, engine, device)."""
    return {
        **option_fields(options, corpus),
        "model_shape": [model.n_layers, model.n_heads, model.d_head],
        "window_stride": stream.stride,
        "special_tokens": [stream.prefix, stream.suffix],
    }


# -- outputs -----------------------------------------------------------------------------------


def build_summary(
    options: StudyOptions,
    model: ModelLike,
    corpus: Corpus,
    stream: WindowStream,
    stats: StudyStats,
    fingerprint: str,
    elapsed: float,
) -> dict[str, Any]:
    """summary.json: the statistics' summary plus what produced it."""
    results = stats.summary(lambda token_id: model.tokenizer.convert_ids_to_tokens(int(token_id)))
    summary: dict[str, Any] = {
        "model": {
            "name": options.model,
            "n_layers": model.n_layers,
            "n_heads": model.n_heads,
            "d_head": model.d_head,
            "max_length": model.max_length,
        },
        "samples": stats.n_samples,
        "seq_len": options.seq_len,
        "config": {
            **results.pop("config"),
            "seq_len": options.seq_len,
            "stride": stream.stride,
            "samples_requested": options.samples,
            "batch_size": options.batch_size,
            "engine": options.engine,
            "workers": options.workers,
            "device": options.device,
            "dtype": options.dtype,
        },
        "corpus": {
            **corpus.info(),
            "documents_read": stream.documents_read,
            "wordpieces_read": stream.tokens_read,
            "exhausted": stream.exhausted,
        },
        "counts": {
            "windows": stats.n_samples,
            "tokens": stats.n_samples * options.seq_len,
            "content_tokens_per_window": stream.content_len,
        },
        "versions": versions(),
        "elapsed_s": round(elapsed, 3),
        "fingerprint": fingerprint,
    }
    results.pop("samples", None)
    results.pop("seq_len", None)
    summary.update(results)
    return summary


def write_outputs(out: Path, summary: dict[str, Any], stats: StudyStats, tokenizer: Any) -> None:
    """summary.json, stats.npz, heads.csv and report.html, each written atomically."""
    from attnflow.corpus.report import build_report

    arrays: dict[str, Any] = stats.arrays()  # Any: numpy's stubs would match an array against allow_pickle
    with atomic_file(out / STATS) as handle:
        np.savez_compressed(handle, **arrays)
    rows = stats.head_table(lambda token_id: tokenizer.convert_ids_to_tokens(int(token_id)))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with atomic_file(out / HEADS) as handle:
        handle.write(text.getvalue().encode("utf-8"))
    with atomic_file(out / SUMMARY) as handle:
        handle.write((json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8"))
    with atomic_file(out / REPORT) as handle:
        handle.write(build_report(summary, arrays).encode("utf-8"))


def rebuild_report(out: str | os.PathLike, png_dir: str | os.PathLike | None = None) -> Path:
    """`attnflow report DIR`: report.html again from DIR/summary.json and DIR/stats.npz.

    ``png_dir``: also save each figure there as a PNG file (named after the figure).
    """
    from attnflow.corpus.report import build_report, save_figures

    out = Path(out)
    if not out.is_dir():
        raise InputError(f"{out}: no such folder" if not out.exists() else f"{out} is a file, not a study's folder")
    missing = [name for name in (SUMMARY, STATS) if not (out / name).is_file()]
    if missing:
        raise InputError(f"{out}: no {' or '.join(missing)} (is this the output folder of a corpus study?)")
    summary = json.loads((out / SUMMARY).read_text(encoding="utf-8"))
    with np.load(out / STATS, allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    with atomic_file(out / REPORT) as handle:
        handle.write(build_report(summary, arrays).encode("utf-8"))
    if png_dir is not None:
        save_figures(summary, arrays, Path(png_dir))
    return out / REPORT
