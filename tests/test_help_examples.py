"""Every example in every `--help` runs: each `attnflow ...` line of every command's epilog (found
by walking the real parser, so a new command's examples are tested without a new line here) is
run with `attnflow.cli.main` in a folder holding the files the examples name, until it would load
a model, unpack one or start Ray actors (the costly steps, replaced here by a stop). What must pass is everything
before it: the argument parsing and the command's own checks of its options, files and output
folder. An example that stops there or ends with status 0 passes; one line of error fails it.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shlex

import pytest

from attnflow.cli import build_parser, main
from attnflow.runs.checkpoint import RunFolder


class ReachedModelLoad(BaseException):
    """Raised where the example would load or unpack a model (a BaseException: no handler of the
    command catches it as an error)."""


def subcommand_parsers(parser: argparse.ArgumentParser, prefix: str = "attnflow") -> dict[str, argparse.ArgumentParser]:
    """``{"attnflow explain": parser, "attnflow models install": parser, ...}``, every level."""
    found = {prefix: parser}
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(subcommand_parsers(child, f"{prefix} {name}"))
    return found


def help_examples() -> list[tuple[str, str]]:
    """``(command, example line)`` of every epilog: lines that start with ``attnflow`` or pipe into
    it, joined over trailing backslashes, until the first blank line after ``examples:``."""
    examples = []
    for command, parser in subcommand_parsers(build_parser()).items():
        epilog = parser.epilog or ""
        if "examples:" not in epilog:
            continue
        lines = epilog.split("examples:", 1)[1].strip("\n").split("\n")
        joined: list[str] = []
        for line in lines:
            if not line.strip():
                break
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line.strip())
        examples += [(command, line) for line in joined if "attnflow " in line]
    return examples


def argv_of(line: str) -> tuple[list[str], str | None]:
    """The arguments after ``attnflow`` (shell comments and an output redirection dropped) and
    the text piped in from ``cat FILE |``, if any."""
    stdin_file = None
    if "|" in line:
        source, line = line.split("|", 1)
        stdin_file = shlex.split(source)[1]
    words = shlex.split(line, comments=True)
    if ">" in words:
        words = words[: words.index(">")]
    assert words[0] == "attnflow", line
    return words[1:], stdin_file


EXAMPLES = help_examples()
REDRAWS = "attnflow report"  # its examples redraw a study's figures (seconds each): marked slow


def test_the_examples_are_found():
    """The oracle can fail: it sees the examples of several commands, the audit's included."""
    commands = {command for command, _ in EXAMPLES}
    assert {"attnflow explain", "attnflow audit", "attnflow corpus", "attnflow models"} <= commands
    assert any("--swap he:she,his:her,him:her" in line for _, line in EXAMPLES)  # joined over its backslash


@pytest.fixture(scope="module")
def study_folder(tmp_path_factory):
    """What `attnflow report out/study` reads: summary.json and stats.npz of a small corpus study
    (a 2-layer, 2-head accumulator fed one random batch), as `attnflow corpus` writes them."""
    import numpy as np

    from attnflow.corpus.engine import STATS, SUMMARY
    from study_stats import random_study_stats

    stats = random_study_stats({"[CLS]": 0, "[SEP]": 2})
    summary = stats.summary(lambda token_id: f"w{token_id}")
    summary.update(model={"name": "minilm"}, config={**summary["config"], "stride": 10})
    folder = tmp_path_factory.mktemp("study")
    (folder / SUMMARY).write_text(json.dumps(summary), encoding="utf-8")
    np.savez_compressed(folder / STATS, **stats.arrays())
    return folder


@pytest.fixture
def example_folder(tmp_path, monkeypatch):
    """A working folder with the files the examples name, and model loading replaced by a stop."""
    import pyarrow
    import pyarrow.parquet as pyarrow_parquet
    from PIL import Image

    import attnflow.model
    from attnflow.capture import loading
    from attnflow.runs import actors

    Image.new("RGB", (32, 24), (200, 80, 20)).save(tmp_path / "photo.jpg")
    (tmp_path / "review.txt").write_text("A fine, moving film.\n", encoding="utf-8")
    (tmp_path / "sentences.txt").write_text("A cat sat on the mat.\nThe film was dull.\n", encoding="utf-8")
    (tmp_path / "texts.txt").write_text("a film about war\nthe league's final\n", encoding="utf-8")
    rows = [{"review": "A fine, moving film.", "body": "A fine, moving film."}, {"review": "Dull.", "body": "Dull."}]
    (tmp_path / "reviews.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (tmp_path / "reviews.csv").write_text("review,stars\nA fine film.,positive\nDull.,negative\n", encoding="utf-8")
    pair = {"clean": "The capital of France is", "corrupt": "The capital of Italy is", "target": " Paris"}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n", encoding="utf-8")
    pyarrow_parquet.write_table(pyarrow.table({"text": ["A fine film.", "Dull."]}), tmp_path / "table.parquet")

    def stop(*_args, **_kwargs):
        raise ReachedModelLoad

    monkeypatch.setattr(attnflow.model, "load", stop)
    monkeypatch.setattr(actors.ActorPool, "__init__", stop)  # --engine ray: its actors would load the model
    try:  # `attnflow serve`: starting the server is the stop
        import uvicorn

        monkeypatch.setattr(uvicorn, "run", stop)
        monkeypatch.setattr(uvicorn.Server, "run", stop)  # `attnflow serve` runs its own Server subclass
    except ImportError:  # without the serve extra, `attnflow serve` stops with its one-line error
        pass
    for alias, model in loading.EMBEDDED.items():
        if model.install is not None:
            monkeypatch.setitem(loading.EMBEDDED, alias, dataclasses.replace(model, install=stop))
    monkeypatch.setattr(loading, "install_finetuned", stop)  # fine-tuning a classifier (minutes)
    (tmp_path / ".attnflow-token").write_text("0123456789abcdef0123456789abcdef\n", encoding="utf-8")
    monkeypatch.setenv("HOME", str(tmp_path))  # `attnflow serve --token-file ~/.attnflow-token`
    monkeypatch.chdir(tmp_path)
    return tmp_path


def save_checkpoint_of(argv: list[str], monkeypatch) -> None:
    """Save the checkpoint a run of ``argv`` would write: the fields the command checks before its
    model loads, recorded where its run folder opens (`RunFolder`), that run stopped there."""
    seen = []

    def record(folder):
        seen.append(folder)
        raise ReachedModelLoad

    with monkeypatch.context() as patch:
        patch.setattr(RunFolder, "__enter__", record)
        with pytest.raises(ReachedModelLoad):
            main(argv)
    folder = seen[0]
    meta = {"done": 0, "batches": 0, "fingerprint": "", "fields": folder.fields, "complete": False}
    folder.save({}, meta)


@pytest.mark.parametrize(
    "command, line",
    [pytest.param(*example, marks=[pytest.mark.slow] if example[0] == REDRAWS else []) for example in EXAMPLES],
    ids=[line for _, line in EXAMPLES],
)
def test_every_help_example_runs(example_folder, monkeypatch, capsys, request, command, line):
    argv, stdin_file = argv_of(line)
    if command == REDRAWS:  # it reads what `attnflow corpus --out out/study` wrote
        (example_folder / "out").mkdir()
        (example_folder / "out" / "study").symlink_to(request.getfixturevalue("study_folder"))
    if "--resume" in argv:  # it continues the run saved in --out: a checkpoint of the same options
        save_checkpoint_of([word for word in argv if word != "--resume"], monkeypatch)
    if stdin_file is not None:
        piped = (example_folder / stdin_file).read_bytes()
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(piped), encoding="utf-8"))
    try:
        code = main(argv)
    except ReachedModelLoad:
        code = 0
    assert code == 0, f"{command}: {line!r} -> {capsys.readouterr().err.strip()}"
