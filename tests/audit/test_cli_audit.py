"""`attnflow audit` on the command line: outputs, bad input in one line, SIGKILL and --resume."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import attnflow
from attnflow.cli import main
from attnflow.evaluate.scorer import ClassifierScorer
from run_helpers import kill_at_first_checkpoint

from conftest import write_task


def run_cli(*args: str) -> int:
    return main(["audit", *args, "--device", "cpu", "--quiet"])


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("attnflow: error: ")
    return lines[0]


def test_the_command_writes_results_and_report(planted_model, planted_task, tmp_path, capsys, caplog):
    path, *_ = planted_task
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        code = run_cli(
            "--model", str(planted_model), "--task", str(path), "--samples", "400", "--terms", "she,zebra",
            "--out", str(out),
        )  # fmt: skip
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.json", "report.html", "results.json"]
    results = json.loads((out / "results.json").read_text())
    assert results["run"]["samples"] == 300  # capped at the 300 rows
    messages = [record.getMessage() for record in caplog.records]
    assert any("--samples 400 is more than the 300" in message for message in messages)
    assert any("'zebra' occurs in no audited text" in message for message in messages)
    assert "300 texts, accuracy 1.000" in capsys.readouterr().out


def test_unlabelled_texts_give_words_without_errors(planted_model, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("great film\nthe cat sat on the mat\nshe was very good\n", encoding="utf-8")
    assert run_cli("--model", str(planted_model), "--file", str(texts), "--out", str(tmp_path / "out")) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["run"]["samples"] == 3 and "errors" not in results


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--swap", "he:she,new york:paris"], "--swap pair 'new york:paris': side 'new york' is not one word"),
        (["--terms", "ice cream"], "--terms: term 'ice cream' is not one word"),
        (["--min-count", "0"], "--min-count must be a positive integer"),
        (["--method", "nope"], "unknown method 'nope'"),
    ],
)
def test_bad_options_are_one_line(planted_model, planted_task, tmp_path, capsys, extra, message):
    path, *_ = planted_task
    assert run_cli("--model", str(planted_model), "--task", str(path), "--out", str(tmp_path / "o"), *extra) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a_task_file_without_the_named_columns(planted_model, tmp_path, capsys):
    path = write_task(tmp_path / "task.csv", ["great film"], [1])
    assert run_cli("--model", str(planted_model), "--task", str(path), "--label-column", "stars", "--out", "o") == 2
    assert "has no column 'stars' (columns: text, label)" in one_error_line(capsys)


def test_a_target_method_on_a_model_without_a_head(tiny_model_path, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("great film\n", encoding="utf-8")
    code = run_cli("--model", str(tiny_model_path("bert")), "--file", str(texts), "--out", str(tmp_path / "o"))
    assert code == 2
    line = one_error_line(capsys)
    assert "has no classifier head: attnlrp explains a target class" in line


@pytest.mark.slow  # the run engine's SIGKILL and resume run by default in tests/runs/test_acceptance.py
def test_sigkill_leaves_nothing_half_written_and_resume_gives_the_same_numbers(
    planted_model, planted_task, tmp_path, capsys
):
    """Only the killed run is a process of its own; the whole run and the resume run in-process.
    A resume with another option is refused first, in one line that names it (exit status 2)."""
    path, *_ = planted_task
    arguments = [
        "--model", str(planted_model), "--task", str(path), "--swap", "he:she", "--batch-size", "4",
        "--checkpoint-every", "2",
    ]  # fmt: skip
    assert run_cli(*arguments, "--out", str(tmp_path / "whole")) == 0
    killed = tmp_path / "killed"
    saved = kill_at_first_checkpoint(["audit", *arguments, "--device", "cpu", "--quiet"], killed)
    assert not saved["complete"] and 0 < saved["done"] < 300
    assert not (killed / "results.json").exists() and not (killed / "report.html").exists()
    capsys.readouterr()
    assert run_cli(*arguments, "--seed", "1", "--out", str(killed), "--resume") == 2
    assert "different configuration (seed: 0 then, 1 now);" in one_error_line(capsys)
    assert run_cli(*arguments, "--out", str(killed), "--resume") == 0
    assert not [entry.name for entry in killed.iterdir() if ".tmp-" in entry.name]
    first, second = (json.loads((folder / "results.json").read_text()) for folder in (tmp_path / "whole", killed))
    first.pop("run"), second.pop("run")
    assert first == second


def test_resume_refuses_another_configuration(planted_model, planted_task, tmp_path, capsys):
    path, *_ = planted_task
    out = str(tmp_path / "out")
    assert run_cli("--model", str(planted_model), "--task", str(path), "--samples", "20", "--out", out) == 0
    assert run_cli("--model", str(planted_model), "--task", str(path), "--samples", "30", "--out", out) == 2
    assert "holds an earlier run (checkpoint.json, report.html, results.json); pass --resume" in one_error_line(capsys)
    code = run_cli("--model", str(planted_model), "--task", str(path), "--samples", "30", "--out", out, "--resume")
    assert code == 2
    assert "was written with a different configuration (samples: 20 then, 30 now);" in one_error_line(capsys)


def test_a_damaged_checkpoint_is_one_line(planted_model, planted_task, tmp_path, capsys):
    path, *_ = planted_task
    (tmp_path / "checkpoint.json").write_text('{"format": 1, "exam', encoding="utf-8")
    code = run_cli("--model", str(planted_model), "--task", str(path), "--out", str(tmp_path), "--resume")
    assert code == 2
    assert "checkpoint.json: not a readable audit checkpoint" in one_error_line(capsys)


@pytest.mark.slow  # ~11 CPU-s (two interpreters, one loads torch); the corpus twin runs by default
def test_a_second_audit_into_a_folder_in_use_refuses_at_once(planted_model, planted_task, tmp_path):
    from concurrent_runs import second_run_while_first_holds

    path, *_ = planted_task
    out = tmp_path / "out"
    argv = ["audit", "--model", str(planted_model), "--task", str(path), "--samples", "40", "--out", str(out)]
    runs = second_run_while_first_holds([*argv, "--device", "cpu", "--quiet"], out)
    assert runs.second_code == 2 and runs.second_cpu_seconds < 2, runs
    assert runs.second_err.strip().splitlines() == [
        f"attnflow: error: {out} is in use by another attnflow run (process {runs.first_pid}); "
        "wait for it to finish or choose another folder"
    ]
    assert runs.first_code == 0, runs.first_err
    assert json.loads((out / "results.json").read_text())["run"]["samples"] == 40


def test_a_checkpoint_of_the_earlier_format_is_refused(planted_model, planted_task, tmp_path, capsys):
    """Format 3 was written before the run engine kept every checkpoint (another layout)."""
    path, *_ = planted_task
    saved = {"format": 3, "examples": 16, "elapsed_s": 1.0, "stats": {"n_classes": 2}}
    (tmp_path / "checkpoint.json").write_text(json.dumps(saved), encoding="utf-8")
    code = run_cli("--model", str(planted_model), "--task", str(path), "--out", str(tmp_path), "--resume")
    assert code == 2
    assert "checkpoint format 3 is not 4" in one_error_line(capsys)


def test_terms_and_swaps_follow_the_word_rules(planted_model, tmp_path, caplog):
    """ "he's" is the word he (a term found, a swap made with its clitic and case); a text with an
    ambiguous "her" is reported and not scored, never half swapped."""
    texts = tmp_path / "texts.txt"
    lines = ["He's very great.", "she said he'd go", "at her movie, proving that he's very good", "the cat"]
    texts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        code = run_cli(
            "--model", str(planted_model), "--file", str(texts), "--terms", "he,her", "--min-count", "1",
            "--swap", "he:she,his:her,him:her", "--out", str(out),
        )  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    swaps = results["swaps"]
    assert swaps["texts"] == 2  # lines 0 and 1, swapped; line 2 holds "her"; line 3 holds no swap word
    assert swaps["unswapped"] == 1 and swaps["ambiguous"] == {"her": 1}
    assert [record["text"] for record in swaps["unswapped_examples"]] == [lines[2]]
    # Oracle: the mean Δp of the two counterfactuals written by hand, scored by a plain forward pass.
    model = attnflow.load(str(planted_model), device="cpu")
    pairs = [lines[0], "She's very great.", lines[1], "he said she'd go"]
    p = ClassifierScorer(model).probabilities(model.tokenizer(pairs)["input_ids"])
    deltas = [p[k + 1][p[k].argmax()] - p[k].max() for k in (0, 2)]
    assert swaps["mean_delta_p"] == pytest.approx(np.mean(deltas), abs=1e-5)
    rows = {row["term"]: row for row in results["terms"]["terms"]}
    assert rows["he"]["examples"] == 3 and rows["her"]["examples"] == 1 and not results["terms"]["missing"]
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "'her' has several partners (his, him)" in messages and "1 texts not swapped" in messages


def test_a_read_only_out_is_one_line_before_the_model_loads(planted_task, read_only_folder, tmp_path, capsys):
    path, *_ = planted_task
    out = read_only_folder / "out"
    assert run_cli("--model", str(tmp_path / "no-such-model"), "--task", str(path), "--out", str(out)) == 2
    error = one_error_line(capsys)  # before the model loads: the missing model is never reached
    assert error.startswith(f"attnflow: error: cannot write {out}: EROFS: Read-only file system"), error


def test_quiet_has_its_short_flag(planted_model, planted_task, tmp_path, capsys):
    path, *_ = planted_task
    command = ["audit", "--model", str(planted_model), "--task", str(path), "--samples", "8", "--device", "cpu"]
    assert main([*command, "--out", str(tmp_path / "out"), "-q"]) == 0
    assert capsys.readouterr().err == ""
