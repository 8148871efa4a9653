"""`--engine ray` of evaluate, patch --file and explain --file on a tiny Llama: model replicas as
actors, results merged here, the numbers of the local run.

On the session's private local Ray runtime, with 4 actors: patch --file in the default set,
evaluate, explain --file and routes --data in the slow set (each actor imports torch and loads its replica: tens
of CPU seconds a run). Their fast equivalents run the same engine path with the actors in this
process (`InProcessActors`: the step pickled to each worker, batches dealt round-robin, results
taken as pickled states and merged, as Ray does). The corpus study's and the audit's Ray tests:
tests/corpus/test_ray_engine.py, tests/audit/test_ray_audit.py; a worker killed on a two-node
cluster: tests/corpus/test_ray_cluster.py (slow).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from attnflow.cli import main
from attnflow.runs import engine
from attnflow.runs.engine import EngineOptions, StepWorker
from run_helpers import TEXTS, assert_same_json, write_pairs


def evaluate_run(llama: str, _folder: Path) -> tuple[list[str], Callable[[Path], Any]]:
    argv = ["evaluate", "--model", llama, "--task", "next-token", "--window", "5", "--samples", "6",
            "--methods", "grad_x_input,random", "--sanity-samples", "2", "--sanity-layers", "1", "--bounds", "exact",
            "--device", "cpu", "--quiet"]  # fmt: skip
    return argv, lambda out: json.loads((out / "results.json").read_text())["methods"]


def patch_run(llama: str, folder: Path) -> tuple[list[str], Callable[[Path], Any]]:
    pairs = write_pairs(folder / "pairs.jsonl")
    argv = ["patch", "--file", str(pairs), "--model", llama, "--sites", "heads,residual", "--method", "exact,atp",
            "--samples", "2", "--device", "cpu", "--quiet"]  # fmt: skip
    return argv, lambda out: [json.loads(row) for row in (out / "pairs.jsonl").read_text().splitlines()]


def explain_run(llama: str, folder: Path) -> tuple[list[str], Callable[[Path], Any]]:
    source = folder / "texts.txt"
    source.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    argv = ["explain", "--file", str(source), "--model", llama, "--method", "grad_x_input", "--batch-size", "2",
            "--device", "cpu", "--quiet"]  # fmt: skip

    def saved(out: Path) -> Any:
        texts = [json.loads((out / f"{n:03d}" / "explanation.json").read_text()) for n in range(1, len(TEXTS) + 1)]
        return {"texts": texts, "index": (out / "index.html").read_text()}

    return argv, saved


def routes_run(llama: str, folder: Path) -> tuple[list[str], Callable[[Path], Any]]:
    wiki_like, code_like = folder / "wiki.txt", folder / "code.txt"
    wiki_like.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    code_like.write_text("def zebra ( a ) : return a\nthe cat is a good cat\n", encoding="utf-8")
    argv = ["routes", "--data", f"{wiki_like},{code_like}", "--model", llama, "--batch-size", "2",
            "--device", "cpu", "--quiet"]  # fmt: skip
    return argv, lambda out: json.loads((out / "summary.json").read_text())


RUNS = {"evaluate": evaluate_run, "patch --file": patch_run, "explain --file": explain_run, "routes --data": routes_run}
SLOW = pytest.mark.slow  # a real Ray run of 4 actors: tens of CPU seconds


@pytest.fixture(scope="module")
def llama(tiny_model_path) -> str:
    return str(tiny_model_path("llama"))


def local_and_on_actors(llama: str, folder: Path, command: str) -> tuple[Any, Any]:
    """The command's numbers from the local engine and from ``--engine ray --workers 4``."""
    argv, numbers = RUNS[command](llama, folder)
    assert main([*argv, "--out", str(folder / "local")]) == 0
    assert main([*argv, "--engine", "ray", "--workers", "4", "--out", str(folder / "ray")]) == 0
    return numbers(folder / "local"), numbers(folder / "ray")


@pytest.mark.parametrize(
    "command", [pytest.param(command, marks=SLOW) for command in RUNS]
)  # the default set's real Ray run: tests/corpus/test_ray_engine.py (the same engine, an actor killed)
@pytest.mark.usefixtures("ray_runtime")
def test_four_ray_actors_give_the_local_numbers(llama, tmp_path, command):
    assert_same_json(*local_and_on_actors(llama, tmp_path, command))


class InProcessActors:
    """`attnflow.runs.engine.RayBackend` without Ray: ``workers`` `StepWorker`s in this process,
    each built from its own pickled copy of the step, given the batches round-robin (pickled), their
    results taken as pickled states and merged into the driver's."""

    default_checkpoint_every = 8

    def __init__(self, step: Any, result: Any, options: EngineOptions) -> None:
        self.threads = torch.get_num_threads()
        self.workers = [StepWorker(pickle.loads(pickle.dumps(step)), 1, "cpu") for _ in range(options.workers or 2)]
        self.result, self.given = result, 0

    def process(self, batch: Any) -> None:
        self.workers[self.given % len(self.workers)].process(pickle.loads(pickle.dumps(batch)))
        self.given += 1

    def collect(self) -> Any:
        for worker in self.workers:
            state = pickle.loads(pickle.dumps(worker.take()))
            self.result = self.result.merge(type(self.result).from_state_dict(state))
        return self.result

    def close(self) -> None:
        torch.set_num_threads(self.threads)


@pytest.mark.parametrize("command", ["evaluate", "explain --file", "routes --data"])
def test_actors_merged_as_ray_merges_them_give_the_local_numbers(llama, tmp_path, monkeypatch, command):
    """The fast equivalent of the slow Ray runs above: the same path, the actors in this process."""
    monkeypatch.setattr(engine, "RayBackend", InProcessActors)
    assert_same_json(*local_and_on_actors(llama, tmp_path, command))
