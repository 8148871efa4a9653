"""`attnflow patch` on the command line: the output folder (occupied, read-only) checked before the
model loads, flags a mode would ignore refused in one line, --quiet, the lines said while it works,
and the pages of --versus and --edges."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from causal_texts import CLEAN, CORRUPT

import attnflow.cli.patch as patch_command
from attnflow.cli import main


@pytest.fixture
def loads(monkeypatch, tiny_model_path, capsys):
    """The names `attnflow patch` loads (the tiny Llama, built before the test's output is read)."""
    tiny_model_path("llama")
    capsys.readouterr()
    names: list[str] = []
    real = patch_command.load_model

    def load(name, device, quiet, dtype="float32"):
        names.append(name)
        return real(name, device, quiet, dtype)

    monkeypatch.setattr(patch_command, "load_model", load)
    return names


# A target the corruption makes less likely on the tiny Llama (its prediction, a token that decodes
# to nothing, is a hair more likely corrupted: a metric `attnflow patch` warns about).
TARGET = "mat"


def patch(tiny_model_path, out: Path, *extra: str) -> int:
    llama = str(tiny_model_path("llama"))
    argv = ["patch", CLEAN, "--corrupt", CORRUPT, "--target", TARGET, "--model", llama, "--device", "cpu"]
    return main([*argv, "--out", str(out), *extra])


def write_pairs(folder: Path) -> Path:
    pairs = folder / "pairs-in.jsonl"
    pairs.write_text(json.dumps({"clean": CLEAN, "corrupt": CORRUPT, "target": TARGET}) + "\n")
    return pairs


def patch_file(tiny_model_path, pairs: Path, out: Path, *extra: str) -> int:
    llama = str(tiny_model_path("llama"))
    command = ["patch", "--file", str(pairs), "--model", llama, "--device", "cpu", "--out", str(out), *extra]
    return main(command)


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("mode", [[], ["--versus", "rollout"], ["--edges", "eap"]], ids=["sweep", "versus", "edges"])
def test_an_occupied_out_needs_overwrite_and_is_refused_before_the_model_loads(
    tiny_model_path, tmp_path, capsys, loads, mode
):
    out = tmp_path / "out"
    sweep = [] if mode else ["--sites", "heads"]
    assert patch(tiny_model_path, out, "-q", *mode, *sweep) == 0
    before = {entry.name: entry.read_bytes() for entry in out.iterdir()}
    loads.clear()
    assert patch(tiny_model_path, out, "-q", *mode, *sweep) == 2
    error = one_error_line(capsys)
    assert "--overwrite" in error and loads == []
    assert {entry.name: entry.read_bytes() for entry in out.iterdir()} == before
    (out / "mine.txt").write_text("kept")
    assert patch(tiny_model_path, out, "-q", "--overwrite", *mode, *sweep) == 0
    assert (out / "mine.txt").read_text() == "kept"
    assert not any(name.startswith(".attnflow-") for name in os.listdir(tmp_path))


def test_a_file_run_in_an_occupied_out_needs_resume_or_overwrite_before_the_model_loads(
    tiny_model_path, tmp_path, capsys, loads
):
    pairs, out = write_pairs(tmp_path), tmp_path / "out"
    assert patch_file(tiny_model_path, pairs, out, "-q", "--sites", "heads") == 0
    loads.clear()
    assert patch_file(tiny_model_path, pairs, out, "-q", "--sites", "heads") == 2
    error = one_error_line(capsys)
    assert "--resume" in error and "--overwrite" in error and loads == []
    assert patch_file(tiny_model_path, pairs, out, "-q", "--resume", "--overwrite") == 2
    assert "either --resume" in one_error_line(capsys) and loads == []
    assert patch_file(tiny_model_path, pairs, out, "-q", "--sites", "residual", "--overwrite") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["effects"]["exact"]) == ["residual"]  # the new run's, not the old one's heads
    assert len((out / "pairs.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize(
    "mode", [["--sites", "heads"], ["--versus", "rollout"], ["--edges", "eap"], ["--file"]], ids=lambda m: m[0]
)
def test_a_read_only_out_is_one_line_before_the_model_loads(
    tiny_model_path, read_only_folder, tmp_path, capsys, loads, mode
):
    out = read_only_folder / "out"
    if mode == ["--file"]:
        code = patch_file(tiny_model_path, write_pairs(tmp_path), out, "-q")
    else:
        code = patch(tiny_model_path, out, "-q", *mode)
    assert code == 2
    error = one_error_line(capsys)
    assert error.startswith(f"attnflow: error: cannot write {out}: EROFS: Read-only file system"), error
    assert loads == []


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--versus", "all", "--edges", "eap"], "--edges"),
        (["--versus", "rollout", "--sites", "heads"], "--sites"),
        (["--versus", "rollout", "--method", "atp"], "--method"),
        (["--edges", "eap", "--direction", "noising"], "--direction"),
        (["--edges", "eap", "--batch-size", "4"], "--batch-size"),
        (["--edges", "eap", "--steps", "3"], "--steps"),
        (["--steps", "3"], "--steps"),
        (["--samples", "3"], "--samples"),
        (["--method", "exact", "--seed", "1"], "--seed"),  # with an estimate, --seed draws the sampled check
        (["--check-sites", "0", "--seed", "1"], "--seed"),
        (["--knockout-window", "3"], "--knockout-window"),  # without --sites knockout
        (["--versus", "rollout", "--knockout-target", "-1"], "--knockout-target"),
    ],
)
def test_flags_a_mode_would_ignore_are_refused_in_one_line(tiny_model_path, tmp_path, capsys, loads, extra, named):
    assert patch(tiny_model_path, tmp_path / "out", "-q", *extra) == 2
    error = one_error_line(capsys)
    assert named in error and loads == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [["--versus", "all"], ["--edges", "eap"], ["--steps", "2"]])
def test_a_file_run_refuses_the_analyses_of_one_pair(tiny_model_path, tmp_path, capsys, loads, extra):
    assert patch_file(tiny_model_path, write_pairs(tmp_path), tmp_path / "out", "-q", *extra) == 2
    assert extra[0] in one_error_line(capsys) and loads == []


@pytest.mark.parametrize("mode", [["--sites", "heads"], ["--versus", "rollout"], ["--edges", "eap"], ["--file"]])
def test_quiet_prints_only_the_paths(tiny_model_path, tmp_path, capsys, mode):
    out = tmp_path / "out"
    if mode == ["--file"]:
        assert patch_file(tiny_model_path, write_pairs(tmp_path), out, "-q", "--sites", "heads") == 0
    else:
        assert patch(tiny_model_path, out, "-q", *mode) == 0
    printed, said = capsys.readouterr()
    assert said == ""
    lines = printed.split()
    assert lines and all(Path(word).parent == out for word in lines), printed


@pytest.mark.parametrize(
    "mode, saying, page",
    [
        (["--sites", "heads"], "patching", "patch.html"),
        (["--versus", "rollout"], "comparing", "versus.html"),
        (["--edges", "eap"], "scoring every edge", "edges.html"),
    ],
)
def test_what_it_does_is_said_on_stderr_and_tables_have_headers_and_a_page(
    tiny_model_path, tmp_path, capsys, mode, saying, page
):
    out = tmp_path / "out"
    assert patch(tiny_model_path, out, *mode) == 0
    printed, said = capsys.readouterr()
    assert f"attnflow: loading {tiny_model_path('llama')}" in said and saying in said
    assert str(out / page) in printed
    html = (out / page).read_text()
    assert "How to read this page" in html and "<script" not in html
    if mode[0] == "--edges":
        assert printed.splitlines()[0].startswith("top 10 edges by |score|")
        assert '<table class="edges">' in html and '<table class="circuits">' in html
    if mode[0] == "--versus":
        assert printed.splitlines()[0].startswith("Spearman ρ per residual row")
        assert '<table class="versus">' in html
