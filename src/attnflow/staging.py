"""Writing files and folders that are never half-written, and never replaced by accident.

Every file or folder attnflow writes goes through this module (results, explanations, caches):
the work is done in a temporary entry beside the target, then renamed into place (a rename needs
no free space and is atomic on one file system).

- `staged_output(out, owned, overwrite)`: an output folder the user names (``--out``). Entries of
  ``out`` that belong to the kind of output written (``owned(name)``) are an earlier run's: they
  are replaced only with ``overwrite`` (``--overwrite``), all of them, so that ``out`` never
  mixes two runs; the user's other files are kept. The check is made again at the final rename,
  so a run that finishes after another one wrote the same folder fails instead of replacing it.
- `check_output(out, owned, overwrite)`: the same refusal, and whether ``out`` can be written at
  all, before any work (before a model loads).
- `building(target)`: a folder built from scratch (a model cache) that replaces ``target`` whole.
- `atomic_file(path)`: one file (a checkpoint, a report).

Folders are created with the user's umask (not a temporary folder's 0700). Operating-system errors
(read-only file system, full disk, no permission) become `OutputError`: one line that names the
folder and the reason.

    with staged_output(Path("out/movie"), owned=lambda name: name in OUTPUT_FILES) as scratch:
        write_files(scratch)       # any failure here leaves out/movie as it was
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from attnflow.errors import OutputError

SCRATCH_PREFIX = ".attnflow-tmp-"


def check_output(out: Path, owned: Callable[[str], bool], overwrite: bool) -> None:
    """Fail now, before any work, when ``out`` holds an earlier run's output (``owned`` entries)
    and ``overwrite`` is False, or when ``out`` cannot be created or written."""
    out = Path(out)
    refuse_occupied(out, owned, overwrite)
    existing = next(folder for folder in (out, *out.parents) if folder.exists() or folder == folder.parent)
    if not existing.is_dir():
        raise NotADirectoryError(f"cannot write {out}: {existing} is a file, not a folder")
    # The temporary folder goes beside out, and entries are renamed into out when it exists.
    try:
        for folder in dict.fromkeys((existing, out.parent if existing == out else existing)):
            _scratch_folder(folder, "probe").rmdir()
    except OSError as error:
        raise output_error(out, error) from None


def refuse_occupied(out: Path, owned: Callable[[str], bool], overwrite: bool) -> None:
    """FileExistsError when ``out`` holds entries ``owned`` says are an earlier run's output and
    ``overwrite`` is False; NotADirectoryError when ``out`` is a file."""
    previous = owned_entries(out, owned)
    if previous and not overwrite:
        raise FileExistsError(
            f"{out} already holds an earlier run's output ({previous[0]}); pass --overwrite (overwrite=True) to "
            "replace it, or choose another folder"
        )


def owned_entries(out: Path, owned: Callable[[str], bool]) -> list[str]:
    """The sorted names of ``out``'s entries that ``owned`` claims ([] when ``out`` does not exist);
    NotADirectoryError when ``out`` is a file."""
    if not out.exists():
        return []
    if not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a folder")
    return sorted(entry.name for entry in out.iterdir() if owned(entry.name))


@contextmanager
def staged_output(out: Path, owned: Callable[[str], bool], overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on success move its entries into ``out``.

    ``out`` absent: the temporary folder is renamed onto it. ``out`` present: its ``owned``
    entries (an earlier run's) are replaced if ``overwrite``, else FileExistsError (checked at
    this final step too: the folder may have been written meanwhile); its other entries stay.
    On any exception the temporary folder is deleted and ``out`` is left exactly as it was.
    """
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = _scratch_folder(out.parent, out.name)
    except OSError as error:
        raise output_error(out, error) from None
    try:
        try:
            yield scratch
        except OSError as error:
            raise output_error(out, error) from None
        try:
            _move_into_place(scratch, out, owned, overwrite)
        except (FileExistsError, NotADirectoryError):
            raise
        except OSError as error:
            raise output_error(out, error) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def building(target: Path) -> Iterator[Path]:
    """Yield a path (not yet created) in a temporary folder beside ``target``, named like it; once
    the block has built a folder there, it replaces ``target`` whole. A failed or interrupted build
    leaves ``target`` as it was and nothing behind. OS errors propagate (callers of caches decide)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = _scratch_folder(target.parent, target.name)
    try:
        built = scratch / target.name
        yield built
        _replace_folder(built, target, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def atomic_file(path: Path) -> Iterator[io.BufferedWriter]:
    """Write ``path`` through a temporary file in the same folder, then rename it in (binary)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{SCRATCH_PREFIX}{path.name}-{secrets.token_hex(4)}")
    try:
        with open(temporary, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def is_scratch(name: str) -> bool:
    """Whether a folder entry is a temporary one of this module (left by a killed process)."""
    return name.startswith(SCRATCH_PREFIX)


def output_error(out: Path, error: OSError) -> OutputError:
    """One line: which folder could not be written and why (``ENOSPC: No space left on device``)."""
    code = errno.errorcode.get(error.errno, "") if error.errno is not None else ""
    reason = error.strerror or str(error)
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(out) else ""
    return OutputError(f"cannot write {out}: {code + ': ' if code else ''}{reason}{where}; nothing was written there")


def _scratch_folder(parent: Path, name: str) -> Path:
    """A new, empty folder ``parent/.attnflow-tmp-NAME-RANDOM``, created with the user's umask."""
    while True:
        folder = parent / f"{SCRATCH_PREFIX}{name}-{secrets.token_hex(4)}"
        try:
            folder.mkdir()  # mode 0o777 & ~umask, like any folder the user creates
            return folder
        except FileExistsError:
            continue


def _replace_folder(built: Path, target: Path, scratch: Path) -> None:
    """Rename ``built`` onto ``target``; an existing ``target`` is first renamed into ``scratch``
    (deleted with it), so ``target`` is missing for one rename only, never half-written."""
    try:
        os.rename(built, target)  # target absent, or an empty folder
        return
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
    os.rename(target, scratch / f"{SCRATCH_PREFIX}replaced")
    os.rename(built, target)


def _move_into_place(scratch: Path, out: Path, owned: Callable[[str], bool], overwrite: bool) -> None:
    try:
        os.rename(scratch, out)  # out absent (or an empty folder): one atomic step
        return
    except OSError as error:  # out holds files, is a file, or is the working folder (EBUSY)
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EBUSY, errno.EINVAL):
            raise
    new = {entry.name for entry in scratch.iterdir()}
    refuse_occupied(out, lambda name: owned(name) or name in new, overwrite)
    trash = scratch / (SCRATCH_PREFIX + "replaced")
    trash.mkdir()
    for entry in list(out.iterdir()):
        if entry.name in new or owned(entry.name):
            os.rename(entry, trash / entry.name)  # same file system: no copy, no space needed
    for name in new:
        os.rename(scratch / name, out / name)
