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
  all, before any work (before a model loads); `check_writable(out)`: the second check alone (runs
  that checkpoint into ``out`` and decide themselves what an earlier run's files mean).
- `building(target)`: a folder built from scratch (a model cache) that replaces ``target`` whole.
- `atomic_file(path)`: one file (a checkpoint, a report).
- `folder_lock(out)`: hold ``out`` for one run: a second run (another process) into the same
  folder refuses at once, before it loads a model, instead of replacing the first one's output.
- `interruptible(check)` and `checkpoint()`: long writes (a model's first load: joining, hashing,
  converting and caching its weights) call `checkpoint()` between blocks; inside an
  `interruptible` block ``check`` runs there and stops the work by raising (a server whose request
  was cancelled): the temporary entry is deleted and the target is left as it was.

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
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from attnflow.errors import OccupiedError, OutputError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, folders are not held
    fcntl = None  # type: ignore[assignment]

SCRATCH_PREFIX = ".attnflow-tmp-"
LOCK_PREFIX = ".attnflow-lock-"
_held: dict[Path, int] = {}  # lock file -> how many nested `folder_lock`s of this process hold it
_held_guard = threading.Lock()
_interruption = threading.local()  # .check: the enclosing `interruptible` block's check, in this thread


def check_output(out: Path, owned: Callable[[str], bool], overwrite: bool) -> None:
    """Fail now, before any work, when ``out`` holds an earlier run's output (``owned`` entries)
    and ``overwrite`` is False, or when ``out`` cannot be created or written."""
    out = Path(out)
    refuse_occupied(out, owned, overwrite)
    check_writable(out)


def check_writable(out: Path) -> None:
    """Fail now, before any work, when the output folder ``out`` cannot be created or written
    (`OutputError`, one line: a read-only file system, no permission; NotADirectoryError: a file
    is in the way)."""
    out = Path(out)
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
    """`OccupiedError` (a FileExistsError) when ``out`` holds entries ``owned`` says are an earlier
    run's output and ``overwrite`` is False; NotADirectoryError when ``out`` is a file."""
    previous = owned_entries(out, owned)
    if previous and not overwrite:
        raise OccupiedError(
            f"{out} already holds an earlier run's output ({previous[0]}); pass {{overwrite}} to replace it, "
            "or choose another folder",
            parameter="overwrite",
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
        checkpoint()  # a build stopped at its end is not put in place either
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


@contextmanager
def interruptible(check: Callable[[], None]) -> Iterator[None]:
    """Within the block, every `checkpoint()` of this thread calls ``check``, which stops the work
    by raising (blocks nest: the innermost check applies)."""
    previous = getattr(_interruption, "check", None)
    _interruption.check = check
    try:
        yield
    finally:
        _interruption.check = previous


def checkpoint() -> None:
    """A place where long work may stop: calls the check of the enclosing `interruptible` block of
    this thread (nothing outside one)."""
    check = getattr(_interruption, "check", None)
    if check is not None:
        check()


@contextmanager
def folder_lock(out: Path) -> Iterator[None]:
    """Hold the output folder ``out`` until the block ends: another process asking for it meanwhile
    gets `OutputError` at once ("in use by another attnflow run"), one line.

    The lock is an ``flock`` on ``.attnflow-lock-NAME`` beside ``out`` (``out`` itself may not
    exist yet, and its content stays the run's own). The kernel drops the lock when its process
    ends, however it ends, so a lock left by a killed run is stale and taken over silently; the
    file is deleted on release. Nested calls for one folder in one process hold it once. A parent
    folder that cannot be created (a file in the way, no permission) is not locked: the command's
    own output check reports it, as it does for a folder where the lock file cannot be created.
    Folders created for the lock file are removed again if empty.
    """
    path = lock_path(out)
    if fcntl is None:
        yield
        return
    with _held_guard:
        nested = _held.get(path, 0)
        if nested:
            _held[path] = nested + 1
    if nested:
        try:
            yield
        finally:
            with _held_guard:
                _held[path] -= 1
        return
    created = _missing_folders(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        yield  # nothing can be written there; the output check says why
        return
    try:
        descriptor = _acquire(path, out)
    except BaseException:
        _remove_empty(created)
        raise
    if descriptor is None:  # the lock file cannot be created (a read-only folder): the output check says why
        _remove_empty(created)
        yield
        return
    with _held_guard:
        _held[path] = 1
    try:
        yield
    finally:
        with _held_guard:
            del _held[path]
        path.unlink(missing_ok=True)  # while still held: a waiting opener sees a replaced file and retries
        os.close(descriptor)
        _remove_empty(created)


def lock_path(out: Path) -> Path:
    """The lock file of output folder ``out`` (absolute): ``.attnflow-lock-NAME`` beside it."""
    folder = Path(os.path.abspath(out))
    return folder.parent / f"{LOCK_PREFIX}{folder.name or 'root'}"


def _acquire(path: Path, out: Path) -> int | None:
    """An open descriptor of ``path`` holding its exclusive flock; OutputError when another process
    holds it; None when the file cannot be opened (nothing can be written there). Retries when the
    file was deleted or replaced between open and lock (its holder released it)."""
    assert fcntl is not None
    while True:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.read(descriptor, 64).decode("ascii", "replace").strip()
            os.close(descriptor)
            if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise output_error(out, error) from None
            process = f" (process {holder})" if holder.isdigit() else ""
            raise OutputError(
                f"{out} is in use by another attnflow run{process}; wait for it to finish or choose another folder"
            ) from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        opened = os.fstat(descriptor)
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            os.ftruncate(descriptor, 0)
            os.write(descriptor, f"{os.getpid()}\n".encode("ascii"))
            return descriptor
        os.close(descriptor)  # released and deleted by its holder between our open and our lock


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, innermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # innermost first
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (the run wrote there) or gone


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
