"""`attnflow corpus` and `attnflow report` from the command line."""

from __future__ import annotations

import json

import pytest

from attnflow.cli import build_parser, main


def test_help_teaches_with_examples(capsys):
    with pytest.raises(SystemExit):
        main(["corpus", "--help"])
    text = capsys.readouterr().out
    for needle in (
        "--samples",
        "--stride",
        "--resume",
        "--engine",
        "--high",
        "top-percent:2",
        "examples:",
        "attnflow corpus --data wiki --samples 20000 --stride 50",
    ):
        assert needle in text
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "attnflow report out/study" in capsys.readouterr().out


def test_cli_end_to_end_and_report(tiny_bert, txt_corpus, tmp_path, capsys):
    out = tmp_path / "study"
    args = [
        "corpus",
        "--model",
        str(tiny_bert),
        "--data",
        str(txt_corpus),
        "--samples",
        "8",
        "--seq-len",
        "24",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        "--json",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["samples"] == 8 and len(printed["layers"]) == 2
    assert {"mean_distance_high", "same_sentence_share", "signal_share"} <= set(printed["layers"][0])
    for name in ("summary.json", "stats.npz", "heads.csv", "report.html", "checkpoint.npz"):
        assert (out / name).is_file()
    (out / "report.html").unlink()
    assert main(["report", str(out), "--png", str(tmp_path / "figures")]) == 0
    assert (out / "report.html").is_file()
    assert len(list((tmp_path / "figures").glob("*.png"))) == 6
    # Again without --resume/--overwrite: refused with one line, exit status 2.
    assert main(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("attnflow: error: ") and "--resume" in error and error.count("\n") == 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "nope.csv"], "no such file"),
        (["--high", "top-half:2"], "unknown rule 'top-half'"),
        (["--samples", "0"], "--samples must be at least 1"),
    ],
)
def test_cli_errors_are_one_line(tiny_bert, tmp_path, capsys, extra, message):
    args = ["corpus", "--model", str(tiny_bert), "--device", "cpu", "--quiet", "--out", str(tmp_path / "o"), *extra]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_resume_and_overwrite_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["corpus", "--out", "x", "--resume", "--overwrite"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_report_line_goes_to_stdout_like_explains_wrote_lines(tiny_bert, txt_corpus, tmp_path, capsys):
    out = tmp_path / "study"
    args = ["corpus", "--model", str(tiny_bert), "--data", str(txt_corpus), "--samples", "4", "--seq-len", "24"]
    assert main([*args, "--device", "cpu", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1] == f"4 windows studied; report: {out}/report.html"
    assert "report:" not in captured.err


@pytest.mark.slow  # the folder lock itself: tests/test_staging.py; two corpus processes here
def test_a_second_study_into_a_folder_in_use_refuses_at_once(tiny_bert, txt_corpus, tmp_path):
    from concurrent_runs import second_run_while_first_holds

    out = tmp_path / "study"
    argv = ["corpus", "--model", str(tiny_bert), "--data", str(txt_corpus), "--samples", "8", "--seq-len", "24"]
    runs = second_run_while_first_holds([*argv, "--device", "cpu", "--quiet", "--out", str(out)], out)
    assert runs.second_code == 2 and runs.second_cpu_seconds < 2, runs
    assert runs.second_err.strip().splitlines() == [
        f"attnflow: error: {out} is in use by another attnflow run (process {runs.first_pid}); "
        "wait for it to finish or choose another folder"
    ]
    assert runs.first_code == 0, runs.first_err
    assert json.loads((out / "summary.json").read_text())["samples"] == 8


# A command interrupted by Ctrl-C, then Ctrl-C again while the interpreter shuts down (an atexit hook).
INTERRUPTED_TWICE = """
import atexit, os, signal, sys
from attnflow import cli

def interrupted(args):
    raise KeyboardInterrupt  # as a run stops after Ctrl-C

atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))  # the second Ctrl-C, during shutdown
cli.corpus.run = interrupted  # the handler `register` names when main() builds the parser
sys.argv = ["attnflow", "corpus", "--out", sys.argv[1]]
sys.exit(cli.main())
"""


def test_ctrl_c_during_shutdown_prints_no_traceback(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_TWICE, str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines() == ["attnflow: interrupted"]
