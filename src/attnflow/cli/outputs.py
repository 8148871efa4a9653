"""Where `attnflow explain` writes: the output folder rule, the --overwrite check, safe writes.

The folder may already exist and hold other files: those are never touched. If it holds files
that explain writes (an earlier explanation, or an earlier --file run's numbered folders and
index), explain stops unless --overwrite is given, before the model loads and again at the final
rename (another run may have written the folder meanwhile); with --overwrite the earlier run's
entries are all replaced or removed, so the folder never mixes two runs. Everything is written
into a temporary folder beside the output folder and moved into place at the end
(`attnflow.staging`): a full disk or a read-only folder ends in one error line and leaves the
folder as it was.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from attnflow.errors import InputError
from attnflow.explanation import OUTPUT_FILES, Explanation
from attnflow.generation import OUTPUT_FILES as GENERATION_FILES
from attnflow.staging import check_output, staged_output

TRACE_FILE = "trace.npz"
INDEX_FILE = "index.html"
DEFAULT_OUT = Path("out/explain")
_TEXT_FOLDER = re.compile(r"^\d{3,}$")  # --file runs: one numbered folder per text (001, 002, ...)


COMPARISON_FILE = "comparison.html"  # several methods: DIR/METHOD/ and the side-by-side page


def owned(name: str) -> bool:
    """Whether an entry of the output folder is something `attnflow explain` writes: the
    explanation (or generation) files, a trace, an index or comparison page, a numbered text folder, or a
    folder named after a registered method."""
    from attnflow.methods.registry import available_methods

    return (
        name in OUTPUT_FILES
        or name in GENERATION_FILES
        or name in (TRACE_FILE, INDEX_FILE, COMPARISON_FILE)
        or bool(_TEXT_FOLDER.match(name))
        or name in available_methods()
    )


def output_folder(args: argparse.Namespace) -> Path | None:
    """``--out``, or the default folder; None with ``--json`` and no ``--out`` (stdout only)."""
    if args.out is not None:
        return Path(args.out)
    return None if args.json else DEFAULT_OUT


def prepare_output(args: argparse.Namespace) -> Path | None:
    """The output folder (None: stdout only), checked before any model loads: --save-trace needs
    a folder, and an earlier run's output is only replaced with --overwrite."""
    out = output_folder(args)
    if out is None and args.save_trace:
        raise InputError("--save-trace writes files: give --out DIR")
    if out is not None:
        check_output(out, owned, args.overwrite)
    return out


def save_explanation(folder: Path, explanation: Explanation, trace: Any = None) -> dict[str, Path]:
    """Write one explanation (and, given a trace, ``trace.npz``) into ``folder`` (a new folder)."""
    paths = explanation.write_files(folder)
    if trace is not None:
        paths["trace"] = folder / TRACE_FILE
        trace.save(str(paths["trace"]))
    return paths


def save_explanations(folder: Path, explanations: list[Explanation], trace: Any = None) -> dict[str, Path]:
    """One explanation: `save_explanation`. Several (methods of one text): each in
    ``folder/METHOD/``, the side-by-side ``comparison.html`` and the trace in ``folder``."""
    if len(explanations) == 1:
        return save_explanation(folder, explanations[0], trace)
    from attnflow.viz.html import methods_comparison_html

    paths: dict[str, Path] = {}
    for explanation in explanations:
        for kind, path in save_explanation(folder / explanation.method, explanation).items():
            paths[f"{explanation.method} {kind}"] = path
    paths["comparison"] = folder / COMPARISON_FILE
    paths["comparison"].write_text(methods_comparison_html(explanations), encoding="utf-8")
    if trace is not None:
        paths["trace"] = folder / TRACE_FILE
        trace.save(str(paths["trace"]))
    return paths


def write_explanations(
    out: Path, explanations: list[Explanation], trace: Any = None, overwrite: bool = False
) -> dict[str, Path]:
    """`save_explanations` into ``out`` through a temporary folder; returns the final paths. An
    earlier run's output (which may have appeared while this one worked) needs ``overwrite``."""
    with staged_output(out, owned, overwrite) as scratch:
        paths = save_explanations(scratch, explanations, trace)
    return {kind: out / path.relative_to(scratch) for kind, path in paths.items()}
