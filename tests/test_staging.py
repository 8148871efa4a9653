"""`attnflow.staging`: an occupied folder is replaced only with overwrite, whole, and a folder that
appears while a run works is refused at the final rename; folders get the user's umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from attnflow.errors import OutputError
from attnflow.staging import atomic_file, building, check_output, folder_lock, lock_path, staged_output


def owned(name: str) -> bool:
    return name.startswith("result")


def names(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


def test_a_folder_written_meanwhile_is_refused_at_the_final_rename(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(FileExistsError, match="pass overwrite to replace it"):
        with staged_output(out, owned) as scratch:
            (scratch / "result.json").write_text("second run")
            out.mkdir()  # another run finished first
            (out / "result.json").write_text("first run")
    assert (out / "result.json").read_text() == "first run"
    assert names(tmp_path) == {"out"}  # no temporary folder left


def test_overwrite_replaces_every_owned_entry_and_keeps_the_users_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "result-old.json").write_text("stale")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        check_output(out, owned, overwrite=False)
    with staged_output(out, owned, overwrite=True) as scratch:
        (scratch / "result.json").write_text("new")
    assert names(out) == {"result.json", "notes.txt"}
    assert (out / "notes.txt").read_text() == "mine" and names(tmp_path) == {"out"}


def test_a_folder_of_other_files_is_written_into_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    check_output(out, owned, overwrite=False)
    with staged_output(out, owned) as scratch:
        (scratch / "result.json").write_text("new")
    assert names(out) == {"result.json", "notes.txt"}


def test_the_working_folder_itself_can_be_the_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "result-old.json").write_text("old")
    with staged_output(Path("."), owned, overwrite=True) as scratch:
        (scratch / "result.json").write_text("new")
    assert names(tmp_path) == {"result.json"}


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_folders_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        with staged_output(tmp_path / "out", owned) as scratch:
            (scratch / "sub").mkdir()
        with building(tmp_path / "cache") as built:
            built.mkdir()
    finally:
        os.umask(previous)
    for folder in (tmp_path / "out", tmp_path / "out" / "sub", tmp_path / "cache"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask, folder


def test_an_unwritable_or_impossible_out_fails_before_any_work(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        check_output(blocker / "out", owned, overwrite=False)
    with pytest.raises(OutputError, match="cannot write /proc/attnflow-out"):
        check_output(Path("/proc/attnflow-out"), owned, overwrite=False)  # no one may create folders in /proc
    assert names(tmp_path) == {"file.txt"}  # the probe left nothing


def test_building_replaces_the_whole_folder_or_nothing(tmp_path):
    target = tmp_path / "cache"
    target.mkdir()
    (target / "old.bin").write_text("old")
    with pytest.raises(RuntimeError):
        with building(target) as built:
            built.mkdir()
            (built / "new.bin").write_text("half")
            raise RuntimeError("interrupted")
    assert names(target) == {"old.bin"} and names(tmp_path) == {"cache"}
    with building(target) as built:
        built.mkdir()
        (built / "new.bin").write_text("new")
    assert names(target) == {"new.bin"} and names(tmp_path) == {"cache"}


def test_atomic_file_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "stats.json"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as handle:
            handle.write(b"half")
            raise RuntimeError("killed")
    assert path.read_bytes() == b"old" and names(tmp_path) == {"stats.json"}
    with atomic_file(path) as handle:
        handle.write(b"new")
    assert path.read_bytes() == b"new" and names(tmp_path) == {"stats.json"}


# -- folder_lock: one run per output folder ------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from attnflow.staging import folder_lock
with folder_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()  # until the test closes stdin
"""


def hold_in_another_process(out: Path):
    """A Python process holding ``folder_lock(out)`` until its stdin is closed."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_folder_held_by_another_process_is_refused_with_its_pid(tmp_path):
    out = tmp_path / "new" / "out"
    holder = hold_in_another_process(out)
    try:
        assert lock_path(out).read_text().strip() == str(holder.pid)
        with pytest.raises(OutputError, match=rf"out is in use by another attnflow run \(process {holder.pid}\)"):
            with folder_lock(out):
                pass
        with folder_lock(tmp_path / "new" / "other"):  # another folder beside it is free
            pass
    finally:
        holder.stdin.close()  # type: ignore[union-attr]
        holder.wait(timeout=30)
    assert not lock_path(out).exists()  # deleted on release; out itself was never created
    with folder_lock(out):  # free again
        assert lock_path(out).is_file()


def test_a_killed_holders_lock_is_stale_and_taken_over(tmp_path):
    out = tmp_path / "out"
    holder = hold_in_another_process(out)
    holder.kill()
    holder.wait(timeout=30)
    assert lock_path(out).is_file()  # left behind by the killed process, no longer locked
    with folder_lock(out):
        assert lock_path(out).read_text().strip() == str(os.getpid())
    assert not lock_path(out).exists()


def test_nested_locks_of_one_process_and_folders_made_for_the_lock(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with folder_lock(out):
        with folder_lock(Path(os.path.relpath(out))):  # the same folder, spelled another way
            assert lock_path(out).is_file()
        assert lock_path(out).is_file()  # the outer hold continues
    assert not (tmp_path / "a").exists()  # created for the lock file, empty again: removed
    with folder_lock(out):
        out.mkdir()
    assert out.is_dir() and names(out.parent) == {"out"}


def test_a_lock_file_that_cannot_be_created_leaves_the_folder_unlocked(tmp_path, monkeypatch):
    """A read-only folder (simulated: root may write anywhere): no lock, no error from the lock,
    and no folder left behind; the command's own output check is what reports it."""
    import errno

    from attnflow import staging

    real_open = os.open

    def refuse_lock_files(path, *args, **kwargs):
        if Path(path).name.startswith(staging.LOCK_PREFIX):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(staging.os, "open", refuse_lock_files)
    with folder_lock(tmp_path / "new" / "out"):
        assert not lock_path(tmp_path / "new" / "out").exists()
    assert not (tmp_path / "new").exists()


def test_every_command_that_writes_a_folder_declares_it_for_the_lock():
    """The lock is taken in `attnflow.cli.main` for commands that name their output folder
    (``set_defaults(output_folder=...)``): a command with ``--out`` that does not would write
    unlocked, and two runs could interleave in one folder."""
    import argparse

    from attnflow.cli import build_parser

    def commands(parser, prefix="attnflow"):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield f"{prefix} {name}", child
                    yield from commands(child, f"{prefix} {name}")

    writing = {name: child for name, child in commands(build_parser()) if "--out" in child._option_string_actions}
    assert {"attnflow explain", "attnflow audit", "attnflow corpus", "attnflow patch"} <= set(writing)
    unlocked = [name for name, child in writing.items() if child.get_default("output_folder") is None]
    assert not unlocked, f"commands writing --out without the folder lock: {unlocked}"
