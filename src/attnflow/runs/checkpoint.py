"""A run's output folder, its checkpoint, and the checks that make ``--resume`` safe.

`RunFolder` holds one output folder for one run (``with RunFolder(...) as folder``: it takes the
folder's lock, `attnflow.staging.folder_lock`, for the block). On entry it applies the one rule of
every dataset command:

- ``resume`` and ``overwrite`` together are refused;
- temporary entries a killed write left behind (`attnflow.staging.is_scratch`) are deleted;
- a folder holding an earlier run (an entry the command ``owned``, its checkpoint included) is
  refused unless ``resume`` (continue the run saved there) or ``overwrite`` (delete those entries
  and start again); the user's other files are never touched;
- ``resume`` without a checkpoint is refused; with one, the checkpoint is read at once (a damaged
  or older checkpoint is refused in one line), before any model loads.

`RunFolder.check` compares a configuration with the one the checkpoint was written with and
refuses, in one line that names each differing field, to continue it under another: on entry with
the ``fields`` a command knows before any model loads (its options), and again, in the run engine,
with all of them (what it derived from the model and the data). `RunFolder.save` writes the checkpoint
through a temporary file renamed into place: ``.npz`` for array states (the meta as JSON bytes),
``.json`` otherwise. `versions` is what each run records about its software.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import numpy as np

from attnflow.errors import InputError
from attnflow.staging import atomic_file, check_writable, folder_lock, is_scratch

_STATE_PREFIX = "state/"


# Configuration fields added after checkpoints were first written, with the value every run had
# before: a checkpoint without one was written under it (``dtype``: models ran in float32).
ADDED_FIELDS: dict[str, Any] = {"dtype": "float32"}


class RunFolder:
    """The output folder of one run and its checkpoint (see the module doc).

    Args:
        out: the folder (``--out``).
        kind: what runs there, for messages (``"audit"``: "not a readable audit checkpoint").
        checkpoint: the checkpoint's file name in ``out`` (``.npz`` or ``.json``).
        owned: whether an entry of ``out`` is this command's (an earlier run's output).
        state_format: the version of the checkpoint's layout; another one is refused.
        resume / overwrite: ``--resume`` / ``--overwrite``.
        fields: the configuration's fields known before any model loads: a checkpoint written under
            others is refused on entry (`check`).
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        kind: str,
        checkpoint: str,
        owned: Callable[[str], bool],
        state_format: int,
        resume: bool = False,
        overwrite: bool = False,
        fields: dict[str, Any] | None = None,
    ) -> None:
        if resume and overwrite:
            raise InputError(
                "choose either {resume} (continue the run in the folder) or {overwrite} (start again), not both",
                parameter=("resume", "overwrite"),
            )
        self.out = Path(out)
        self.kind, self.checkpoint, self.state_format = kind, self.out / checkpoint, state_format
        self.owned = lambda name: name == checkpoint or owned(name)
        self.resume, self.overwrite, self.fields = resume, overwrite, fields or {}
        self.saved: dict[str, Any] | None = None  # the checkpoint's meta, once read
        self.state: Any = None  # the checkpoint's state, once read
        self._stack = ExitStack()

    def __enter__(self) -> "RunFolder":
        self._stack.enter_context(folder_lock(self.out))
        try:
            self._prepare()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()

    @property
    def done(self) -> int:
        """Work items the checkpoint covers (0 for a new run)."""
        return int(self.saved["done"]) if self.saved else 0

    def _prepare(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise InputError(f"{{out}} {out} exists and is not a folder", parameter="out")
        for entry in sorted(out.iterdir()) if out.is_dir() else []:
            if is_scratch(entry.name):  # left by a write that was killed half-way
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        earlier = sorted(entry.name for entry in out.iterdir() if self.owned(entry.name)) if out.is_dir() else []
        if self.resume and not self.checkpoint.is_file():
            where = f"has no {self.checkpoint.name}"
            if not out.exists() or not any(out.iterdir()):
                where = "does not exist" if not out.exists() else "is empty"
            raise InputError(
                f"{{resume}}: {out} {where}, so there is no run to continue; drop {{resume}} to start one",
                parameter="resume",
            )
        if earlier and not (self.resume or self.overwrite):
            raise InputError(
                f"{out} holds an earlier run ({', '.join(earlier[:3])}); pass {{resume}} to continue the run saved "
                "there, or {overwrite} to start again",
                parameter=("resume", "overwrite"),
            )
        check_writable(out)  # a read-only folder fails now, not at the first checkpoint after the work
        if self.overwrite:
            for name in earlier:
                entry = out / name
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
        if self.resume:
            self.saved, self.state = self._read()
            self.check(self.fields)

    def _read(self) -> tuple[dict[str, Any], Any]:
        return read_checkpoint(self.checkpoint, self.kind, self.state_format)

    def check(self, fields: dict[str, Any]) -> None:
        """Refuse to continue the checkpoint under a configuration that differs in any of ``fields``
        (each differing field named, nested ones by their path: ``options.replace``, in one line);
        nothing to check for a new run."""
        if self.saved is None:
            return
        before = _leaves({**ADDED_FIELDS, **self.saved["fields"]})
        now = _leaves(json.loads(json.dumps({key: fields[key] for key in fields})))  # tuples as lists
        before = {key: value for key, value in before.items() if key.split(".")[0] in fields}
        changes = [
            f"{key}: {json.dumps(before.get(key))} then, {json.dumps(now.get(key))} now"
            for key in sorted(set(before) | set(now))
            if before.get(key) != now.get(key)
        ]
        if changes:
            raise InputError(
                f"{{resume}}: {self.checkpoint} was written with a different configuration ({'; '.join(changes)}); "
                "rerun with the original options, or use {overwrite} to start again",
                parameter=("resume", "overwrite"),
            )

    def save(self, state: Any, meta: dict[str, Any]) -> None:
        """Write the checkpoint (``meta`` and the result's ``state``) atomically."""
        meta = {"format": self.state_format, **meta}
        with atomic_file(self.checkpoint) as handle:
            if self.checkpoint.suffix == ".npz":
                # dict[str, Any]: numpy's stubs would otherwise match an array against savez's allow_pickle flag.
                arrays: dict[str, Any] = {_STATE_PREFIX + name: np.asarray(value) for name, value in state.items()}
                arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
                np.savez(handle, **arrays)
            else:
                handle.write(json.dumps({**meta, "state": state}).encode("utf-8"))


def _leaves(fields: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: every value of nested dictionaries by its path."""
    found: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, dict) and value:
            found.update(_leaves(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def read_checkpoint(path: Path, kind: str = "attnflow", state_format: int | None = None) -> tuple[dict[str, Any], Any]:
    """``(meta, state)`` of the checkpoint at ``path`` (`RunFolder.save`'s layout); one line when it
    cannot be read, or when its format is not ``state_format`` (any format for None)."""
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as saved:
                meta = json.loads(saved["meta"].tobytes().decode("utf-8"))
                state: Any = {
                    name[len(_STATE_PREFIX) :]: saved[name] for name in saved.files if name.startswith(_STATE_PREFIX)
                }
        else:
            meta = json.loads(path.read_text(encoding="utf-8"))
            state = meta.pop("state", None) if isinstance(meta, dict) else None
        missing = [key for key in ("format", "done", "fields", "fingerprint") if key not in meta]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        meta, missing = {}, [str(error) or type(error).__name__]
    if state_format is not None and "format" in meta and meta["format"] != state_format:
        raise InputError(
            f"{path}: checkpoint format {meta['format']} is not {state_format} (written by another version of "
            "attnflow); use {overwrite} to start again",
            parameter="overwrite",
        )
    if missing:
        raise InputError(
            f"{path}: not a readable {kind} checkpoint ({missing[0]}); use {{overwrite}} to start again",
            parameter="overwrite",
        )
    return meta, state


def digest(fields: Any) -> str:
    """A short, stable fingerprint of a run's configuration or data (16 hex digits of a sha256)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()[:16]


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
