"""Output folders that are never half-written: build everything in a temporary folder beside the
target, then move it into place with renames (which need no free space).

    with staged_output(Path("out/movie"), owned=OUTPUT_NAMES) as scratch:
        explanation.save(scratch)          # any failure here leaves out/movie as it was
    # out/movie now holds the new files; its other files are untouched

When the target does not exist, the whole temporary folder is renamed onto it (one atomic step).
When it exists (it may hold the user's own files), the entries named in ``owned`` that the new
run did not write are removed and each new entry is renamed in; a replaced folder entry is first
renamed aside. Operating-system errors (read-only file system, full disk, no permission) become
`OutputError` with one line that names the folder and the reason.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from attnflow.errors import OutputError

SCRATCH_PREFIX = ".attnflow-tmp-"


@contextmanager
def staged_output(out: Path, owned: Callable[[str], bool]) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on success move its entries into ``out``.

    ``owned(name)`` says whether an entry of ``out`` belongs to the kind of output being written
    (an earlier run's file or folder): such entries that the new run did not write are removed,
    so that ``out`` never mixes two runs. On any exception the temporary folder is deleted and
    ``out`` is left exactly as it was.
    """
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX + out.name + "-", dir=out.parent))
    except OSError as error:
        raise output_error(out, error) from None
    try:
        try:
            yield scratch
        except OSError as error:
            raise output_error(out, error) from None
        try:
            _move_into_place(scratch, out, owned)
        except OSError as error:
            raise output_error(out, error) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def output_error(out: Path, error: OSError) -> OutputError:
    """One line: which folder could not be written and why (``ENOSPC: No space left on device``)."""
    code = errno.errorcode.get(error.errno, "") if error.errno is not None else ""
    reason = error.strerror or str(error)
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(out) else ""
    return OutputError(f"cannot write {out}: {code + ': ' if code else ''}{reason}{where}; nothing was written there")


def _move_into_place(scratch: Path, out: Path, owned: Callable[[str], bool]) -> None:
    if not out.exists():
        os.rename(scratch, out)
        return
    if not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a folder")
    new = {entry.name for entry in scratch.iterdir()}
    trash = scratch / (SCRATCH_PREFIX + "replaced")
    trash.mkdir()
    for entry in list(out.iterdir()):
        if entry.name in new or owned(entry.name):
            os.rename(entry, trash / entry.name)  # same file system: no copy, no space needed
    for name in new:
        os.rename(scratch / name, out / name)
