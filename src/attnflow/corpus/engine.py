"""The corpus study engine: windows → batches → capture → statistics, checkpointed and resumable.

`run_study` drives one study into one output folder::

    corpus ──WindowStream──> WindowBatch ──backend.process──> model.capture_batch ──> StudyStats.update
                                                   every K batches: checkpoint.npz (atomic)
    at the end: summary.json, stats.npz, heads.csv, report.html

The backend is the only part that differs between engines: `LocalBackend` runs the model in this
process; `attnflow.corpus.ray_engine.RayBackend` runs model replicas as Ray actors and merges their
accumulators here. No model math and no statistics live in this module.

Checkpoint and resume. ``checkpoint.npz`` holds the `StudyStats` state, the number of windows
consumed and a fingerprint of everything that decides which windows exist and what is counted
(model, corpus file and options, seq_len, stride, samples, statistics options). It is written
through a temporary file (`attnflow.staging.atomic_file`), every ``checkpoint_every`` batches, on
Ctrl-C / SIGTERM (after the batch in progress), and at the end. ``resume=True`` loads it, checks the fingerprint,
and restarts the deterministic window stream after the consumed windows, so no window is
counted twice and none is lost; checkpoints fall on the same batch boundaries as in an
uninterrupted run, which makes the resumed statistics identical to it.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from attnflow.corpus.stats import StudyStats
from attnflow.corpus.study import StudyOptions, new_stats, process_batch
from attnflow.corpus.windows import WindowBatch, WindowStream, batched
from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.runs.checkpoint import check_same_config, digest, prepare_out_dir, versions
from attnflow.runs.options import check_counts
from attnflow.runs.readers import Corpus, open_corpus
from attnflow.runs.signals import stop_requests
from attnflow.staging import atomic_file, folder_lock

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.npz"
SUMMARY = "summary.json"
STATS = "stats.npz"
HEADS = "heads.csv"
REPORT = "report.html"
OUTPUTS = (SUMMARY, STATS, HEADS, REPORT)
CHECKPOINT_FORMAT = 1
_STATE_PREFIX = "stats/"


class Backend(Protocol):
    """Where batches are computed. `collect` returns the statistics of every window processed so
    far (the resumed state included) once all submitted batches are done."""

    def process(self, batch: WindowBatch) -> None: ...

    def collect(self) -> StudyStats: ...

    def close(self) -> None: ...


class LocalBackend:
    """The model in this process: ``capture_batch`` then ``StudyStats.update``, one batch at a time."""

    def __init__(self, model: ModelLike, stats: StudyStats, threads: int | None = None) -> None:
        import torch

        self.model = model
        self.stats = stats
        self._threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(int(threads))

    def process(self, batch: WindowBatch) -> None:
        process_batch(self.model, self.stats, batch)

    def collect(self) -> StudyStats:
        return self.stats

    def close(self) -> None:
        import torch

        torch.set_num_threads(self._threads)


# -- the run -----------------------------------------------------------------------------------


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
        out: the output folder; an existing non-empty one is refused unless ``resume`` (continue
            its checkpoint) or ``overwrite`` (delete attnflow's files there first).
        model: an already loaded `attnflow.AttentionModel` (local engine only); default:
            ``attnflow.load(options.model, device=options.device)``.

    Raises:
        InputError: bad options, corpus or output folder; a checkpoint of another configuration.
        KeyboardInterrupt: after Ctrl-C / SIGTERM, once a checkpoint is saved.
        OutputError: another run holds ``out`` (`attnflow.staging.folder_lock`).
    """
    with folder_lock(Path(out)):
        return _run_study(options, Path(out), resume=resume, overwrite=overwrite, model=model)


def _run_study(
    options: StudyOptions, out: Path, *, resume: bool, overwrite: bool, model: ModelLike | None
) -> dict[str, Any]:
    _check_options(options)
    out = Path(out)
    checkpoint = prepare_out_dir(out, resume=resume, overwrite=overwrite, checkpoint=CHECKPOINT, outputs=OUTPUTS)
    corpus = open_corpus(options.data, options.reading)
    if model is None:
        from attnflow.model import load

        # The Ray driver only needs the tokenizer and shapes; replicas load their own copy.
        model = load(options.model, device="cpu" if options.engine == "ray" else options.device)
    if options.seq_len > model.max_length:
        raise InputError(
            f"--seq-len {options.seq_len} exceeds the maximum of {options.model} ({model.max_length} tokens)"
        )
    corpus.validate()
    stream = WindowStream(
        corpus, model.tokenizer, seq_len=options.seq_len, stride=options.stride, samples=options.samples
    )
    fields = fingerprint_fields(options, model, corpus, stream)
    fingerprint = digest(fields)

    stats = new_stats(model, options)
    consumed, elapsed_before = 0, 0.0
    if checkpoint is not None:
        state, meta = load_checkpoint(checkpoint)
        check_same_config(checkpoint, meta, fields, fingerprint)
        stats = StudyStats.from_state_dict(state)
        consumed, elapsed_before = int(meta["windows"]), float(meta.get("elapsed_s", 0.0))
        if stats.n_samples != consumed:
            raise InputError(f"{checkpoint}: holds {stats.n_samples} samples but records {consumed} windows")
        log.info("resuming %s after %d windows", out, consumed)
    stream.start = consumed

    backend = _backend(options, model, stats)
    started = time.perf_counter()
    progress = _progress(options, consumed)
    batches_done = consumed // options.batch_size
    try:
        with stop_requests() as stop:
            for batch in batched(stream, options.batch_size):
                backend.process(batch)
                consumed += len(batch)
                batches_done += 1
                progress.update(len(batch))
                if stop.is_set() or batches_done % options.checkpoint_every == 0:
                    stats = backend.collect()
                    _save(
                        checkpoint_path(out),
                        stats,
                        consumed,
                        fields,
                        fingerprint,
                        elapsed_before + time.perf_counter() - started,
                    )
                if stop.is_set():
                    log.warning(
                        "stopped: checkpoint saved after %d windows; continue with the same command and --resume",
                        consumed,
                    )
                    raise KeyboardInterrupt
            stats = backend.collect()
    finally:
        progress.close()
        backend.close()
    elapsed = elapsed_before + time.perf_counter() - started
    _save(checkpoint_path(out), stats, consumed, fields, fingerprint, elapsed, complete=True)
    if stream.shortfall():
        log.warning("%s", stream.shortfall())

    summary = build_summary(options, model, corpus, stream, stats, fingerprint, elapsed)
    write_outputs(out, summary, stats, model.tokenizer)
    return summary


def _check_options(options: StudyOptions) -> None:
    check_counts(
        required=(
            ("--batch-size", options.batch_size),
            ("--seq-len", options.seq_len),
            ("--checkpoint-every", options.checkpoint_every),
        ),
        optional=(("--samples", options.samples), ("--stride", options.stride), ("--workers", options.workers)),
        engine=options.engine,
    )


def _backend(options: StudyOptions, model: ModelLike, stats: StudyStats) -> Backend:
    if options.engine == "ray":
        from attnflow.corpus.ray_engine import RayBackend

        return RayBackend(options, stats)
    return LocalBackend(model, stats, threads=options.workers)


def _progress(options: StudyOptions, initial: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=options.samples,
        initial=initial,
        unit="window",
        desc="corpus study",
        file=sys.stderr,
        disable=options.quiet,
        dynamic_ncols=True,
        smoothing=0.1,
    )


# -- output folder and checkpoint --------------------------------------------------------------


def checkpoint_path(out: Path) -> Path:
    """Where a run writing to ``out`` keeps its checkpoint."""
    return out / CHECKPOINT


def _save(
    path: Path,
    stats: StudyStats,
    windows: int,
    fields: dict,
    fingerprint: str,
    elapsed: float,
    complete: bool = False,
) -> None:
    meta = {
        "format": CHECKPOINT_FORMAT,
        "windows": windows,
        "fingerprint": fingerprint,
        "fields": fields,
        "elapsed_s": elapsed,
        "complete": complete,
    }
    # dict[str, Any]: numpy's stubs would otherwise match an array value against savez's allow_pickle flag.
    arrays: dict[str, Any] = {_STATE_PREFIX + name: np.asarray(value) for name, value in stats.state_dict().items()}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    with atomic_file(path) as handle:
        np.savez(handle, **arrays)


def load_checkpoint(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(StudyStats state, meta) of a checkpoint file."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            meta = json.loads(saved["meta"].tobytes().decode("utf-8"))
            state = {name[len(_STATE_PREFIX) :]: saved[name] for name in saved.files if name.startswith(_STATE_PREFIX)}
    except (OSError, ValueError, KeyError) as error:
        raise InputError(
            f"{path}: not a readable attnflow checkpoint ({error}); use --overwrite to start again"
        ) from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise InputError(f"{path}: checkpoint format {meta.get('format')} is not {CHECKPOINT_FORMAT}")
    return state, meta


def fingerprint_fields(options: StudyOptions, model: ModelLike, corpus: Corpus, stream: WindowStream) -> dict[str, Any]:
    """What must not change between a run and its resumption (not: batch size, engine, device)."""
    return {
        "model": options.model,
        "model_shape": [model.n_layers, model.n_heads, model.d_head],
        "corpus": corpus.identity(),
        "seq_len": options.seq_len,
        "stride": stream.stride,
        "samples": options.samples,
        "special_tokens": [stream.prefix, stream.suffix],
        "study": asdict(options.statistics),
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

    arrays: dict[str, Any] = stats.arrays()  # Any: see _save
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
        raise InputError(f"{out}: no {' or '.join(missing)} (is this the --out folder of `attnflow corpus`?)")
    summary = json.loads((out / SUMMARY).read_text(encoding="utf-8"))
    with np.load(out / STATS, allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    with atomic_file(out / REPORT) as handle:
        handle.write(build_report(summary, arrays).encode("utf-8"))
    if png_dir is not None:
        save_figures(summary, arrays, Path(png_dir))
    return out / REPORT
