"""Patching over a file of prompt pairs: each pair's result is appended to a checkpoint
(``pairs.jsonl``, one line per pair, so an interrupted run continues with ``resume``), then the
effects are averaged with 95 % confidence intervals (``summary.json``, ``summary.html``).

A pairs file is JSON lines: ``{"clean": ..., "corrupt": ...}`` or ``{"clean": ..., "noise":
"word,word"}``, with optional ``"target"`` and ``"contrast"``. Position arrays of prompts of
different lengths are aligned on the last position (the one that predicts): column j of a
summary's ``residual``/``attn``/``mlp`` array is position T − n + j of each prompt of T tokens, n the
longest prompt, missing cells left out of the mean (every kind whose columns are positions, as
the table of site kinds says; heads are aligned on their first column).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from attnflow.causal.api import correlation, patch
from attnflow.causal.sites import site_kind
from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.staging import atomic_file

CHECKPOINT = "pairs.jsonl"
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95 % interval


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
    model: ModelLike,
    path: Path,
    out: Path,
    *,
    resume: bool = False,
    on_pair: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Patch every pair of ``path`` (`read_pairs`) with ``options`` (`attnflow.causal.patch`'s
    keywords), checkpointing into ``out``; ``on_pair(line)`` after each pair. Returns the summary
    (also written to ``out``)."""
    pairs = read_pairs(Path(path))
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / CHECKPOINT
    if checkpoint.exists() and not resume:
        raise InputError(f"{checkpoint} holds an earlier run: pass --resume to continue it, or choose another --out")
    done = {row["index"]: row for row in _checkpointed(checkpoint)}
    with open(checkpoint, "a", encoding="utf-8") as handle:
        for index, pair in enumerate(pairs):
            if index in done:
                continue
            try:
                result = patch(
                    model,
                    pair["clean"],
                    pair.get("corrupt"),
                    noise=pair.get("noise"),
                    target=pair.get("target"),
                    contrast=pair.get("contrast"),
                    **options,
                )
                row = {"index": index, **result.to_dict()}
            except InputError as error:
                row = {"index": index, "clean_text": pair["clean"], "error": str(error)}
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            done[index] = row
            if on_pair is not None:
                on_pair(f"pair {index + 1}/{len(pairs)}: {row.get('error') or row['metric']}")
    summary = summarise([done[index] for index in sorted(done)])
    with atomic_file(out / "summary.json") as file:
        file.write(json.dumps(summary, indent=1).encode("utf-8"))
    from attnflow.causal.report import summary_html

    with atomic_file(out / "summary.html") as file:
        file.write(summary_html(summary).encode("utf-8"))
    return summary


def _checkpointed(checkpoint: Path) -> Iterator[dict[str, Any]]:
    if not checkpoint.exists():
        return
    with open(checkpoint, encoding="utf-8") as handle:
        for line in handle:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # a line cut short by an interruption: that pair runs again
                continue


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
