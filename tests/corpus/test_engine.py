"""The local engine: outputs, output-folder rules, checkpoints, resume (Ctrl-C and SIGKILL)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnflow.corpus.engine import CHECKPOINT, StudyOptions, rebuild_report, run_study
from attnflow.corpus.stats import StudyConfig
from attnflow.errors import InputError
from attnflow.runs.checkpoint import read_checkpoint

from corpus_helpers import assert_same_arrays, load_npz, tiny_options

REQUIRED_SCALARS = (
    "mean_distance_high",
    "mean_distance_all",
    "same_sentence_share",
    "same_sentence_chance",
    "repeat_share",
    "repeat_chance",
    "signal_share",
)


def test_study_writes_every_output(tiny_bert, txt_corpus, tmp_path):
    out = tmp_path / "study"
    summary = run_study(tiny_options(tiny_bert, txt_corpus), out)
    assert sorted(p.name for p in out.iterdir()) == [
        CHECKPOINT,
        "heads.csv",
        "report.html",
        "stats.npz",
        "summary.json",
    ]
    saved = json.loads((out / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["samples"] == 24 and saved["seq_len"] == 32 and saved["model"]["n_layers"] == 2
    assert saved["config"]["high"] == "top-percent:2" and saved["config"]["stride"] == 30
    assert saved["corpus"]["kind"] == "txt" and saved["corpus"]["documents"] == 80
    assert {"attnflow", "torch", "transformers"} <= set(saved["versions"])
    assert len(saved["layers"]) == 2
    for layer in saved["layers"]:
        assert set(REQUIRED_SCALARS) <= set(layer) and len(layer["heads"]) == 4
        for head in layer["heads"]:
            assert set(REQUIRED_SCALARS) <= set(head) and isinstance(head["top_anchor_tokens"], list)
    assert saved["layers"][0]["mean_distance_all"] == pytest.approx(33 / 3)  # (n + 1) / 3
    arrays = load_npz(out / "stats.npz")
    assert arrays["mean_similarity"].shape == (2, 4, 32, 32)
    rows = list(csv.DictReader((out / "heads.csv").open()))
    assert len(rows) == 8 and {"layer", "head", "signal_share", "top_anchor_tokens"} <= set(rows[0])
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 6 and "<script" not in html


def test_batch_size_does_not_change_the_statistics(tiny_bert, txt_corpus, tmp_path):
    run_study(tiny_options(tiny_bert, txt_corpus, batch_size=3), tmp_path / "a")
    run_study(tiny_options(tiny_bert, txt_corpus, batch_size=8), tmp_path / "b")
    assert_same_arrays(load_npz(tmp_path / "a" / "stats.npz"), load_npz(tmp_path / "b" / "stats.npz"), exact=False)


def test_output_folder_rules(tiny_bert, txt_corpus, tmp_path):
    """The run engine's one rule (attnflow.runs.checkpoint.RunFolder): the user's files never stop a
    run nor are touched; an earlier study is continued with --resume or replaced with --overwrite."""
    out = tmp_path / "study"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    options = tiny_options(tiny_bert, txt_corpus, samples=4)
    with pytest.raises(InputError, match=f"^resume: .* has no {CHECKPOINT}"):
        run_study(options, out, resume=True)
    with pytest.raises(InputError, match="either resume .* or overwrite"):
        run_study(options, out, resume=True, overwrite=True)
    run_study(options, out)
    with pytest.raises(InputError, match=r"holds an earlier run \(checkpoint.npz, .*\); pass resume .* or overwrite "):
        run_study(options, out)
    run_study(options, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"  # --overwrite deletes only attnflow's files
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is not a folder"):
        run_study(options, tmp_path / "file")


def test_bad_input_writes_nothing(tiny_bert, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat."}\n{"text": \n', encoding="utf-8")
    with pytest.raises(InputError, match="line 2: malformed JSON"):
        run_study(tiny_options(tiny_bert, bad), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_seq_len_above_the_model_maximum_is_refused(tiny_bert, txt_corpus, tmp_path):
    with pytest.raises(InputError, match=r"^seq_len 61 exceeds the maximum of .* \(60 tokens\)"):
        run_study(tiny_options(tiny_bert, txt_corpus, seq_len=61), tmp_path / "out")


def test_resume_with_another_configuration_is_refused(tiny_bert, txt_corpus, tmp_path):
    out = tmp_path / "study"
    run_study(tiny_options(tiny_bert, txt_corpus, samples=4), out)
    with pytest.raises(InputError, match=r"different configuration \(seq_len: 32 then, 16 now\);"):
        run_study(tiny_options(tiny_bert, txt_corpus, samples=4, seq_len=16), out, resume=True)
    with pytest.raises(InputError, match=r"\(study.high: \"top-percent:2\" then, \"zscore:2\" now\)"):
        run_study(
            tiny_options(tiny_bert, txt_corpus, samples=4, statistics=StudyConfig(high="zscore:2")), out, resume=True
        )
    # Neither the batch size nor the engine settings are part of the configuration.
    run_study(tiny_options(tiny_bert, txt_corpus, samples=4, batch_size=2), out, resume=True)


class InterruptAfter:
    """The real model, but the process gets SIGINT (Ctrl-C) during batch ``after``."""

    def __init__(self, model, after: int) -> None:
        self._model, self._after, self.calls = model, after, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def capture_batch(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self._after:
            os.kill(os.getpid(), signal.SIGINT)
        return self._model.capture_batch(*args, **kwargs)


@pytest.mark.slow  # the engine's Ctrl-C: tests/runs/test_run_engine.py; this is the corpus study's own
def test_ctrl_c_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tiny_bert, txt_corpus, tmp_path):
    from attnflow.capture import load

    options = tiny_options(tiny_bert, txt_corpus, checkpoint_every=2)
    run_study(options, tmp_path / "whole")
    model = InterruptAfter(load(str(tiny_bert), device="cpu"), after=3)
    with pytest.raises(KeyboardInterrupt):
        run_study(options, tmp_path / "cut", model=model)
    assert model.calls == 3  # stopped after the batch in progress
    meta, _ = read_checkpoint(tmp_path / "cut" / CHECKPOINT)
    assert meta["done"] == 12 and not meta["complete"]
    assert not (tmp_path / "cut" / "summary.json").exists()
    summary = run_study(options, tmp_path / "cut", resume=True)
    assert summary["samples"] == 24
    assert_same_arrays(load_npz(tmp_path / "whole" / "stats.npz"), load_npz(tmp_path / "cut" / "stats.npz"))
    # Resuming a finished run recomputes nothing and writes the same statistics again.
    run_study(options, tmp_path / "cut", resume=True)
    assert_same_arrays(load_npz(tmp_path / "whole" / "stats.npz"), load_npz(tmp_path / "cut" / "stats.npz"))


# The CLI in a child process whose model kills the process (SIGKILL: no handler, no cleanup) when
# batch KILL_AT starts: between two checkpoints, deterministically.
KILLED_CLI = """
import os, signal, sys
from attnflow.model import AttentionModel
from attnflow.cli import main

kill_at, calls, capture = int(os.environ["KILL_AT_BATCH"]), [0], AttentionModel.capture_batch

def capture_or_die(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return capture(self, *args, **kwargs)

AttentionModel.capture_batch = capture_or_die
sys.exit(main())
"""


@pytest.mark.slow  # the run engine's SIGKILL and resume run by default in tests/runs/test_acceptance.py
def test_resume_after_sigkill_matches_an_uninterrupted_run(tiny_bert, txt_corpus, tmp_path, capsys):
    """Only the killed run is a process of its own; the whole run and the resume run in-process.
    A resume with another option is refused first, in one line that names it (exit status 2)."""
    from attnflow.cli import main

    def arguments(out: Path) -> list[str]:
        options = ["--model", str(tiny_bert), "--data", str(txt_corpus), "--samples", "24", "--seq-len", "24"]
        return ["corpus", *options, "--batch-size", "2", "--checkpoint-every", "3", "--device", "cpu", "--quiet",
                "--out", str(out)]  # fmt: skip

    assert main(arguments(tmp_path / "whole")) == 0
    cut = tmp_path / "cut"
    # the killed process computes with this process's thread count: the same sums in the same order
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "KILL_AT_BATCH": "8"}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_CLI, *arguments(cut)], env=env, capture_output=True, timeout=600
    )
    assert killed.returncode == -signal.SIGKILL
    meta, _ = read_checkpoint(cut / CHECKPOINT)
    assert meta["done"] == 12 and not meta["complete"]  # the checkpoint after batch 6 of 2 windows each
    assert not (cut / "summary.json").exists()

    changed = [*arguments(cut), "--resume"]
    changed[changed.index("24")] = "20"  # --samples
    capsys.readouterr()
    assert main(changed) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"attnflow: error: --resume: {cut / CHECKPOINT} was written with a different configuration (samples: 24 "
        "then, 20 now); rerun with the original options, or use --overwrite to start again"
    ]
    assert main([*arguments(cut), "--resume"]) == 0
    assert_same_arrays(load_npz(tmp_path / "whole" / "stats.npz"), load_npz(cut / "stats.npz"))
    assert json.loads((cut / "summary.json").read_text())["samples"] == 24
    assert not [p.name for p in cut.iterdir() if ".tmp-" in p.name]


def test_report_is_rebuilt_from_saved_statistics(tiny_bert, txt_corpus, tmp_path):
    out = tmp_path / "study"
    run_study(tiny_options(tiny_bert, txt_corpus, samples=4), out)
    (out / "report.html").unlink()
    assert rebuild_report(out) == out / "report.html"
    assert "data:image/png;base64," in (out / "report.html").read_text()
    with pytest.raises(InputError, match="no summary.json or stats.npz"):
        rebuild_report(tmp_path)


def test_study_options_declare_the_statistics_and_reading_options_once():
    from dataclasses import fields

    from attnflow.runs.readers import ReadOptions

    own = {field.name for field in fields(StudyOptions)}
    assert not own & {field.name for field in fields(StudyConfig)}
    assert not own & {field.name for field in fields(ReadOptions)}
    assert isinstance(StudyOptions().statistics, StudyConfig) and isinstance(StudyOptions().reading, ReadOptions)


@pytest.mark.parametrize("state, words", [("missing", "does not exist"), ("empty", "is empty")])
def test_resume_without_a_run_to_continue_is_refused(tmp_path, state, words):
    from attnflow.corpus.engine import OUTPUTS
    from attnflow.runs.checkpoint import RunFolder

    out = tmp_path / "out"
    if state == "empty":
        out.mkdir()
    folder = RunFolder(
        out, kind="corpus study", checkpoint=CHECKPOINT, owned=OUTPUTS.__contains__, state_format=2, resume=True
    )
    with pytest.raises(InputError, match=f"^resume: .*out {words}, so there is no run to continue"):
        folder.__enter__()


def test_report_of_a_missing_folder_says_so(tmp_path, capsys):
    from attnflow.cli import main

    assert main(["report", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"attnflow: error: {tmp_path / 'nope'}: no such folder"
