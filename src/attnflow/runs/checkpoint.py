"""A streamed run's output folder and the checks that make ``--resume`` safe.

A run writes into one folder: its checkpoint (a file the run names) and its outputs. `prepare_out_dir`
refuses, cleans or accepts the folder; the checkpoint holds a `digest` of the fields that decide the
accumulated numbers, and `check_same_config` refuses to resume it under another configuration,
naming each field that differs. `versions` is what each run records about its software.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from attnflow.errors import InputError
from attnflow.staging import check_writable, is_scratch


def prepare_out_dir(
    out: Path, *, resume: bool, overwrite: bool, checkpoint: str, outputs: tuple[str, ...]
) -> Path | None:
    """Refuse, clean or accept the output folder; return the checkpoint to resume, if any. A folder
    that cannot be created or written is refused here too (`attnflow.staging.check_writable`).

    ``checkpoint`` and ``outputs``: the file names the run writes there (``--overwrite`` deletes them)."""
    if resume and overwrite:
        raise InputError("choose either --resume (continue the run in the folder) or --overwrite (start again)")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    check_writable(out)  # a read-only folder fails now, not at the first checkpoint after the work
    entries = sorted(out.iterdir()) if out.is_dir() else []
    for entry in entries:
        if is_scratch(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)  # left by a write that was killed half-way
    entries = [entry for entry in entries if entry.exists()]
    if resume and not (out / checkpoint).is_file():
        where = "does not exist" if not out.exists() else "is empty" if not entries else f"has no {checkpoint}"
        raise InputError(f"--resume: {out} {where}, so there is no run to continue; drop --resume to start one")
    if not entries:
        return None
    if overwrite:
        for name in (checkpoint, *outputs):
            (out / name).unlink(missing_ok=True)
        return None
    if resume:
        return out / checkpoint
    raise InputError(
        f"{out} exists and is not empty; pass --resume to continue the run saved there, or --overwrite to start again"
    )


def digest(fields: dict[str, Any]) -> str:
    """A short, stable fingerprint of a run's configuration (16 hex digits of a sha256)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def check_same_config(path: Path, meta: dict, fields: dict, fingerprint: str) -> None:
    """Refuse to resume the checkpoint at ``path`` with another configuration, naming what differs."""
    if meta.get("fingerprint") == fingerprint:
        return
    before = meta.get("fields", {})
    changes = [
        f"{key}: {json.dumps(before.get(key))} then, {json.dumps(fields.get(key))} now"
        for key in sorted(set(before) | set(fields))
        if before.get(key) != fields.get(key)
    ]
    raise InputError(
        f"--resume: {path} was written with a different configuration ({'; '.join(changes) or 'unknown'}); "
        "rerun with the original options, or use --overwrite to start again"
    )


def versions() -> dict[str, str]:
    """The versions of attnflow and the packages its numbers depend on (recorded with each run)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("attnflow", "torch", "transformers", "numpy", "pysbd", "ray"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found
