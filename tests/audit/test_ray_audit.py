"""`--engine ray` gives the local engine's numbers, also when an actor is killed mid-run."""

from __future__ import annotations

import pytest
from planted import BIASED

import attnflow
from attnflow.runs.engine import RayBackend

# The session's local Ray runtime (tests/conftest.py). Slow: the run engine's actor replacement is
# tested in the default set by tests/corpus/test_ray_engine.py; this is the audit's own run of it.
pytestmark = [pytest.mark.usefixtures("ray_runtime"), pytest.mark.slow]


def test_ray_with_a_killed_actor_matches_the_local_engine(planted_model, planted_task, tmp_path, monkeypatch):
    path, *_ = planted_task
    options = dict(task=str(path), samples=48, terms=[BIASED, "cat"], swap="he:she", device="cpu", quiet=True)
    options.update(batch_size=8, checkpoint_every=3)
    local = attnflow.audit(str(planted_model), tmp_path / "local", **options)
    process, killed = RayBackend.process, []

    def process_then_kill(backend, batch):
        process(backend, batch)
        if batch.first == 32 and not killed:  # the 5th batch: 2 given since the checkpoint
            killed.append(backend.actors[0])
            backend.ray.kill(backend.actors[0])

    monkeypatch.setattr(RayBackend, "process", process_then_kill)
    distributed = attnflow.audit(str(planted_model), tmp_path / "ray", engine="ray", workers=2, **options)
    assert killed and distributed["run"]["engine"] == "ray"
    local.pop("run"), distributed.pop("run")
    # Same examples, sums added in another order: equal up to float rounding.
    assert same(distributed, local)


def same(first, second) -> bool:
    """Equal structures, floats within 1e-9 (relative)."""
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(same(first[key], second[key]) for key in first)
    if isinstance(first, list):
        return len(first) == len(second) and all(same(a, b) for a, b in zip(first, second, strict=True))
    if isinstance(first, float):
        return first == pytest.approx(second, rel=1e-9, abs=1e-12)
    return first == second
