"""`--engine ray` on a private local Ray runtime gives the local engine's statistics (faults on a
multi-node cluster: test_ray_cluster.py)."""

from __future__ import annotations

import pytest

from attnflow.corpus.engine import run_study

from corpus_helpers import assert_same_arrays, load_npz, tiny_options

pytestmark = pytest.mark.usefixtures("ray_runtime")  # the session's local Ray runtime (tests/conftest.py)


@pytest.mark.slow  # the killed-actor test below compares with the local engine too
def test_ray_engine_matches_the_local_engine(tiny_bert, txt_corpus, tmp_path):
    options = dict(samples=30, stride=20, checkpoint_every=3)
    local = run_study(tiny_options(tiny_bert, txt_corpus, **options), tmp_path / "local")
    distributed = run_study(tiny_options(tiny_bert, txt_corpus, **options, engine="ray", workers=2), tmp_path / "ray")
    assert distributed["samples"] == local["samples"] == 30
    assert distributed["config"]["engine"] == "ray"
    # Same windows, accumulators merged in another order: equal up to float64 rounding.
    assert_same_arrays(
        load_npz(tmp_path / "local" / "stats.npz"), load_npz(tmp_path / "ray" / "stats.npz"), exact=False
    )
    heads = lambda summary: [h["top_anchor_tokens"] for layer in summary["layers"] for h in layer["heads"]]  # noqa: E731
    assert heads(distributed) == heads(local)


def test_a_killed_actor_is_replaced_and_its_batches_recomputed(tiny_bert, txt_corpus, tmp_path, monkeypatch):
    """`ray.kill` of an actor mid-study (after a checkpoint, with batches accumulated and in flight):
    the statistics still equal the local engine's, no window lost or counted twice."""
    from attnflow.runs.engine import RayBackend

    options = dict(samples=30, stride=20, batch_size=2, checkpoint_every=3)
    local = run_study(tiny_options(tiny_bert, txt_corpus, **options), tmp_path / "local")
    process_batch, killed = RayBackend.process, []

    def process_then_kill(backend, batch):
        process_batch(backend, batch)
        if batch.first == 8 and not killed:  # the 5th batch: 2 given since the checkpoint
            killed.append(backend.actors[0])
            backend.ray.kill(backend.actors[0])

    monkeypatch.setattr(RayBackend, "process", process_then_kill)
    distributed = run_study(tiny_options(tiny_bert, txt_corpus, **options, engine="ray", workers=2), tmp_path / "ray")
    assert killed and distributed["samples"] == local["samples"] == 30
    assert_same_arrays(
        load_npz(tmp_path / "local" / "stats.npz"), load_npz(tmp_path / "ray" / "stats.npz"), exact=False
    )
