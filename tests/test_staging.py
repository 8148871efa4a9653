"""`attnflow.staging`: an occupied folder is replaced only with overwrite, whole, and a folder that
appears while a run works is refused at the final rename; folders get the user's umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from attnflow.errors import OutputError
from attnflow.staging import atomic_file, building, check_output, staged_output


def owned(name: str) -> bool:
    return name.startswith("result")


def names(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


def test_a_folder_written_meanwhile_is_refused_at_the_final_rename(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(FileExistsError, match="--overwrite"):
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
