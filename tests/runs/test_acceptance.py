"""Every dataset command on the run engine, from the command line, on a tiny Llama: killed with
SIGKILL mid-run and resumed, it gives the numbers of an uninterrupted run (routes over a dataset
included); a resume with a changed
option is refused in one line that names it (exit status 2). `patch --file` also refuses a pairs
file named like a file it writes, and never continues a checkpoint it cannot read.

The corpus study's and the audit's twins: tests/corpus/test_engine.py and
tests/audit/test_cli_audit.py. Only the killed run is a process of its own; the others run in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnflow.cli import main
from attnflow.runs.checkpoint import read_checkpoint
from run_helpers import TEXTS, assert_same_json, write_pairs

# The CLI in a child process that kills itself (SIGKILL: no handler, no cleanup) when the function
# KILL_IN (module:attribute path) is called for the KILL_AT-th time: mid-run, deterministically.
KILLED_CLI = """
import importlib, os, signal, sys
from attnflow.cli import main

module, _, path = os.environ["KILL_IN"].partition(":")
*owners, name = path.split(".")
owner = importlib.import_module(module)
for part in owners:
    owner = getattr(owner, part)
original, calls, kill_at = getattr(owner, name), [0], int(os.environ["KILL_AT"])

def or_die(*args, **kwargs):
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)

setattr(owner, name, or_die)
sys.exit(main())
"""


def killed_run(argv: list[str], kill_in: str, kill_at: int) -> None:
    """Run ``attnflow ARGV`` in a child process killed at the ``kill_at``-th call of ``kill_in``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # the same sums in the same order as this process
        "KILL_IN": kill_in,
        "KILL_AT": str(kill_at),
    }
    killed = subprocess.run([sys.executable, "-c", KILLED_CLI, *argv], env=env, capture_output=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]


def assert_killed_mid_run(out: Path, outputs: tuple[str, ...]) -> None:
    meta, _ = read_checkpoint(out / "checkpoint.json")
    assert meta["done"] > 0 and not meta["complete"]
    assert not [name for name in outputs if (out / name).exists()]


def refused_naming(capsys, argv: list[str], named: str) -> None:
    """``argv`` with --resume and a changed option: exit status 2, one line naming the field."""
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnflow: error: --resume: "), lines
    assert f"different configuration ({named}" in lines[0], lines[0]


@pytest.fixture(scope="module")
def llama(tiny_model_path) -> str:
    return str(tiny_model_path("llama"))


def test_evaluate_killed_and_resumed(llama, tmp_path, capsys):
    argv = ["evaluate", "--model", llama, "--task", "next-token", "--window", "5", "--samples", "6",
            "--methods", "grad_x_input,random", "--sanity-samples", "2", "--sanity-layers", "1", "--bounds", "exact",
            "--device", "cpu", "--quiet"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    cut = tmp_path / "cut"
    # units: bounds, the reference (leave_one_out), then per method its chunk and two sanity stages
    killed_run([*argv, "--out", str(cut)], "attnflow.model:AttentionModel.explain", kill_at=4)
    assert_killed_mid_run(cut, ("results.json", "run.json", "bounds.json", "methods"))
    changed = [*argv, "--out", str(cut), "--resume"]
    refused_naming(capsys, [*changed[: changed.index("2")], "3", *changed[changed.index("2") + 1 :]],
                   "options.sanity_samples: 2 then, 3 now")  # fmt: skip
    assert main([*argv, "--out", str(cut), "--resume"]) == 0
    whole, resumed = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("whole", "cut"))
    assert_same_json(whole["methods"], resumed["methods"])
    for name in ("bounds.json", "methods/grad_x_input.json", "methods/random.json"):
        assert_same_json(*(json.loads((tmp_path / run / name).read_text()) for run in ("whole", "cut")))


def test_patch_file_killed_and_resumed(llama, tmp_path, capsys):
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    argv = ["patch", "--file", str(pairs), "--model", llama, "--sites", "heads,residual", "--method", "exact,atp",
            "--samples", "2", "--device", "cpu", "--quiet"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    cut = tmp_path / "cut"
    killed_run([*argv, "--out", str(cut)], "attnflow.causal.dataset:patch", kill_at=3)
    assert_killed_mid_run(cut, ("pairs.jsonl", "summary.json", "summary.html"))
    refused_naming(capsys, [*argv, "--direction", "noising", "--out", str(cut), "--resume"],
                   'direction: "denoising" then, "noising" now')  # fmt: skip
    assert main([*argv, "--out", str(cut), "--resume"]) == 0
    whole, resumed = ((tmp_path / name / "pairs.jsonl").read_text().splitlines() for name in ("whole", "cut"))
    assert [json.loads(row)["index"] for row in resumed] == [0, 1, 2, 3, 4]
    assert_same_json([json.loads(row) for row in whole], [json.loads(row) for row in resumed])
    assert_same_json(*(json.loads((tmp_path / name / "summary.json").read_text()) for name in ("whole", "cut")))


def test_patch_file_refuses_its_own_files_and_a_checkpoint_it_cannot_read(llama, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    pairs = write_pairs(out / "pairs.jsonl")  # named like the rows it writes in --out
    before = pairs.read_bytes()
    assert main(["patch", "--file", str(pairs), "--model", llama, "--out", str(out), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "is named like a file this run writes in --out" in error
    assert pairs.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["pairs.jsonl"]
    # A checkpoint cut short (as the append-only file of earlier versions was by a kill): refused, untouched.
    elsewhere = write_pairs(tmp_path / "my-pairs.jsonl")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "checkpoint.json").write_text('{"format": 1, "done": 2, "fields": {"model": "x"}, "state": {"rows": {"0"')
    damaged = (cut / "checkpoint.json").read_bytes()
    assert main(["patch", "--file", str(elsewhere), "--model", llama, "--out", str(cut), "--quiet", "--resume"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "checkpoint.json: not a readable patch checkpoint" in error
    assert (cut / "checkpoint.json").read_bytes() == damaged


@pytest.mark.slow  # it writes every text's figures three times; evaluate and patch --file run by default
def test_explain_file_killed_and_resumed(llama, tmp_path, capsys):
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    argv = ["explain", "--file", str(source), "--model", llama, "--method", "rollout,grad_x_input",
            "--batch-size", "2", "--device", "cpu", "--quiet"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    cut = tmp_path / "cut"
    killed_run([*argv, "--out", str(cut)], "attnflow.model:AttentionModel.trace_for", kill_at=3)
    assert_killed_mid_run(cut, ("index.html", "005"))
    assert sorted(p.name for p in cut.iterdir()) == ["001", "002", "003", "004", "checkpoint.json"]  # 2 batches
    changed = [*argv, "--out", str(cut), "--resume"]
    changed[changed.index("rollout,grad_x_input")] = "rollout"
    refused_naming(capsys, changed, 'method: ["rollout", "grad_x_input"] then, ["rollout"] now')
    assert main([*argv, "--out", str(cut), "--resume"]) == 0
    assert sorted(p.name for p in cut.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())
    for number in range(1, len(TEXTS) + 1):
        for method in ("rollout", "grad_x_input"):
            saved = [json.loads((tmp_path / run / f"{number:03d}" / method / "explanation.json").read_text())
                     for run in ("whole", "cut")]  # fmt: skip
            assert_same_json(*saved)
    assert (tmp_path / "whole" / "index.html").read_text() == (cut / "index.html").read_text()


def test_routes_data_killed_and_resumed(llama, tmp_path, capsys):
    wiki_like, code_like = tmp_path / "wiki.txt", tmp_path / "code.txt"
    wiki_like.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    code_like.write_text("def zebra ( a ) : return a\nthe cat is a good cat\n", encoding="utf-8")
    argv = ["routes", "--data", f"{wiki_like},{code_like}", "--model", llama, "--batch-size", "2",
            "--device", "cpu", "--quiet"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    cut = tmp_path / "cut"
    killed_run([*argv, "--out", str(cut)], "attnflow.flow_routes.dataset:add_prompt", kill_at=5)  # in batch 3
    meta, state = read_checkpoint(cut / "checkpoint.npz")
    assert meta["done"] == 4 and not meta["complete"] and state["0/heads|count"] == 4
    assert not [name for name in ("summary.json", "report.html", "prompts.jsonl") if (cut / name).exists()]
    refused_naming(
        capsys, [*argv, "--threshold", "0.1", "--out", str(cut), "--resume"], "threshold: 0.04 then, 0.1 now"
    )
    assert main([*argv, "--out", str(cut), "--resume"]) == 0
    whole, resumed = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("whole", "cut"))
    assert_same_json(whole, resumed)
    assert whole["domains"][0]["heads"] == resumed["domains"][0]["heads"]  # the same sums in the same order
    assert (tmp_path / "whole" / "prompts.jsonl").read_text() == (cut / "prompts.jsonl").read_text()
