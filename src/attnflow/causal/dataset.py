"""Patching over a file of prompt pairs, on the run engine (`attnflow.runs.engine`): each pair is
one work item (`PairStep`: `attnflow.causal.patch` on it, its result a row), checkpointed in
``checkpoint.json`` with the options that decide the numbers (a resume under other options is
refused, naming them), in this process or on model replicas as Ray actors. At the end every pair's
row is written to ``pairs.jsonl`` (one line per pair, in file order) and the effects are averaged
with 95 % confidence intervals (``summary.json``, ``summary.html``).

A pairs file is JSON lines: ``{"clean": ..., "corrupt": ...}`` or ``{"clean": ..., "noise":
"word,word"}``, with optional ``"target"`` and ``"contrast"``. Position arrays of prompts of
different lengths are aligned on the last position (the one that predicts): column j of a
summary's ``residual``/``attn``/``mlp`` array is position T − n + j of each prompt of T tokens, n the
longest prompt, missing cells left out of the mean (every kind whose columns are positions, as
the table of site kinds says; heads are aligned on their first column).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from attnflow.causal.api import correlation, patch
from attnflow.causal.sites import site_kind
from attnflow.errors import InputError
from attnflow.model_like import ModelLike, model_dtype
from attnflow.runs.checkpoint import RunFolder, digest
from attnflow.runs.engine import EngineOptions, Job, Rows, run
from attnflow.staging import atomic_file
from attnflow.statistics import Z95
from attnflow.targets import as_target

CHECKPOINT = "checkpoint.json"
CHECKPOINT_FORMAT = 1
ROWS = "pairs.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_HTML = "summary.html"
OUTPUTS = (ROWS, SUMMARY_JSON, SUMMARY_HTML)


def read_pairs(path: Path) -> list[dict[str, Any]]:
    """The pairs of a JSON-lines file (one clear line for a bad row)."""
    pairs = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}, line {number}: not JSON ({error.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("clean"), str):
                raise InputError(f'{path}, line {number}: a pair needs a "clean" text')
            if ("corrupt" in row) == ("noise" in row):
                raise InputError(f'{path}, line {number}: give either "corrupt" or "noise"')
            pairs.append(row)
    if not pairs:
        raise InputError(f"{path} holds no prompt pairs")
    return pairs


def patch_file(
    model: ModelLike | str,
    path: Path,
    out: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    engine: EngineOptions | None = None,
    owned: Callable[[str], bool] = OUTPUTS.__contains__,
    dtype: str = "float32",
    **options: Any,
) -> dict[str, Any]:
    """Patch every pair of ``path`` (`read_pairs`) with ``options`` (`attnflow.causal.patch`'s
    keywords; ``batch_size`` and ``progress`` aside, every one is part of the checkpoint's
    configuration), into folder ``out``; returns the summary (also written there).

    ``model``: a loaded model, or a name (loaded only by the local engine: Ray's actors load their
    own), in ``dtype`` (`attnflow.load`; a loaded model keeps its own). ``out`` holding an earlier
    run (an entry ``owned`` claims, the checkpoint included): ``resume`` continues it, ``overwrite``
    deletes those entries and starts again. The pairs file must not be one of the files the run
    writes in ``out``.
    """
    path, out = Path(path), Path(out)
    pairs = read_pairs(path)
    if out.resolve() == path.resolve().parent and (path.name == CHECKPOINT or owned(path.name)):
        raise InputError(
            f"{{path}} {path} is named like a file this run writes in {{out}} {out} "
            f"({', '.join((*OUTPUTS, CHECKPOINT))}): rename it or choose another {{out}}",
            parameter=("path", "out"),
        )
    engine = engine or EngineOptions(quiet=not options.get("progress", True))
    options = {**options, "progress": False}  # the engine's bar counts the pairs
    fields = {
        "model": model if isinstance(model, str) else model.name,
        "dtype": dtype if isinstance(model, str) else model_dtype(model),
        "pairs": digest(pairs),
        **{key: value for key, value in options.items() if key not in ("batch_size", "progress")},
    }
    with RunFolder(
        out, kind="patch", checkpoint=CHECKPOINT, owned=owned, state_format=CHECKPOINT_FORMAT,
        resume=resume, overwrite=overwrite, fields=fields,
    ) as folder:  # fmt: skip
        if isinstance(model, str) and engine.engine == "local":
            from attnflow.model import load

            model = load(model, device=engine.device, progress=not engine.quiet, dtype=dtype)
        one_pair_a_batch = [[(index, pair)] for index, pair in enumerate(pairs)]
        step = PairStep(fields["model"], options, fields["dtype"])
        job = Job("patch", "pair", len(pairs), fields, step, Rows(), lambda start: one_pair_a_batch[start:])
        rows = run(job, folder, engine, context=None if isinstance(model, str) else model).result.rows
        done = [rows[str(index)] for index in range(len(pairs))]
        summary = summarise(done)
        write_outputs(folder.out, done, summary)
    return summary


@dataclass(frozen=True)
class PairStep:
    """`patch --file`'s `attnflow.runs.engine.Step`: a model replica, one row per pair (its
    `attnflow.causal.patch` result, or the reason it was left out)."""

    model: str
    options: dict[str, Any]
    dtype: str = "float32"

    def load(self, device: str) -> ModelLike:
        from attnflow.model import load

        return load(self.model, device=device, dtype=self.dtype)

    def empty(self, model: ModelLike) -> Rows:  # noqa: ARG002 - the Step protocol
        return Rows()

    def run(self, model: ModelLike, rows: Rows, batch: list[tuple[int, dict[str, Any]]]) -> Rows:
        for index, pair in batch:
            try:
                result = patch(
                    model,
                    pair["clean"],
                    pair.get("corrupt"),
                    noise=pair.get("noise"),
                    target=as_target(pair.get("target"), contrast=pair.get("contrast")),  # the file's two fields
                    **self.options,
                )
                row = {"index": index, **result.to_dict()}
            except InputError as error:
                row = {"index": index, "clean_text": pair["clean"], "error": str(error)}
            rows.rows[str(index)] = row
        return rows


def write_outputs(out: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """``pairs.jsonl`` (every pair's row), ``summary.json`` and ``summary.html``, each atomically."""
    from attnflow.causal.report import summary_html

    with atomic_file(out / ROWS) as file:
        file.write("".join(json.dumps(row) + "\n" for row in rows).encode("utf-8"))
    with atomic_file(out / SUMMARY_JSON) as file:
        file.write(json.dumps(summary, indent=1).encode("utf-8"))
    with atomic_file(out / SUMMARY_HTML) as file:
        file.write(summary_html(summary).encode("utf-8"))


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means and 95 % intervals over pairs of each method's effects per site kind (position kinds
    aligned on the last position), each approximation's correlation with exact patching (the mean
    over pairs and over every site of every pair pooled), the seconds per method, and the pairs
    themselves (``pair_list``: texts, metric and its value on both inputs)."""
    results = [row for row in rows if "error" not in row]
    failed = [
        {"index": row["index"], "clean_text": row["clean_text"], "error": row["error"]}
        for row in rows
        if "error" in row
    ]
    summary: dict[str, Any] = {
        "pairs": len(results),
        "pair_list": [
            {
                "index": row["index"],
                "clean_text": row["clean_text"],
                "corrupt_text": row["corrupt_text"],
                "noise_words": row["noise_words"],
                "metric": row["metric"],
                "clean_metric": row["clean_metric"],
                "corrupt_metric": row["corrupt_metric"],
            }
            for row in results
        ],
        "failed": failed,
        "effects": {},
        "correlations": {},
        "seconds": {},
    }
    if not results:
        return summary
    for method in results[0]["effects"]:
        summary["effects"][method] = {}
        for kind in results[0]["effects"][method]:
            arrays = [np.asarray(row["effects"][method][kind], dtype=float) for row in results]
            stacked = _aligned(arrays, right=site_kind(kind).column == "position")
            count = np.sum(np.isfinite(stacked), axis=0)
            mean = np.nanmean(stacked, axis=0)
            spread = np.nanstd(stacked, axis=0, ddof=1) if len(arrays) > 1 else np.full(mean.shape, np.nan)
            summary["effects"][method][kind] = {
                "mean": mean.tolist(),
                "ci95": (Z95 * spread / np.sqrt(np.maximum(count, 1))).tolist(),
                "count": count.tolist(),
            }
    for method in results[0]["correlations"]:
        summary["correlations"][method] = {}
        for kind in results[0]["correlations"][method]:
            per_pair = np.array([row["correlations"][method][kind]["pearson"] for row in results], dtype=float)
            pooled = correlation(
                np.concatenate([np.ravel(row["effects"][method][kind]) for row in results]),
                np.concatenate([np.ravel(row["effects"]["exact"][kind]) for row in results]),
            )
            finite = per_pair[np.isfinite(per_pair)]
            summary["correlations"][method][kind] = {
                "pearson_mean": float(finite.mean()) if finite.size else float("nan"),
                "pearson_ci95": float(Z95 * finite.std(ddof=1) / np.sqrt(finite.size)) if finite.size > 1 else None,
                "pooled_pearson": pooled["pearson"],
                "pooled_spearman": pooled["spearman"],
            }
    for method in results[0]["seconds"]:
        summary["seconds"][method] = float(sum(row["seconds"][method] for row in results))
    return summary


def _aligned(arrays: list[np.ndarray], right: bool) -> np.ndarray:
    """``[pair, layer, column]``: arrays padded with NaN to the widest, aligned on their last
    column when ``right`` (positions), else on their first (heads: all the same width)."""
    width = max(array.shape[1] for array in arrays)
    stacked = np.full((len(arrays), arrays[0].shape[0], width), np.nan)
    for number, array in enumerate(arrays):
        if right:
            stacked[number, :, width - array.shape[1] :] = array
        else:
            stacked[number, :, : array.shape[1]] = array
    return stacked
