"""The Ray engine (``--engine ray``): model replicas as Ray actors, statistics merged on the driver.

The driver reads the corpus and cuts the deterministic window stream into batches exactly as the
local engine does (`attnflow.corpus.engine.run_study` drives both engines); `RayBackend.process` sends each
batch (two small ``[batch, seq_len]`` int64 arrays) to the least busy actor. Every actor holds a
model replica and its own `StudyStats`; `RayBackend.collect` waits for the batches in flight, takes
each actor's accumulator (``state_dict``, then the actor starts a fresh one) and merges it into the
driver's. Checkpoints call `collect`, so a checkpoint always covers exactly the windows consumed,
and ``--resume`` works as with the local engine.

Plain actors rather than Ray Data ``map_batches``: the accumulators must live across batches and
be handed back once, which actors do directly, while ``map_batches`` has no end-of-stream hook.

The actors, the Ray runtime (a private local one without ``--ray-address``) and the recovery from
a dead actor are `attnflow.runs.actors.ActorPool`'s, shared with the audit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnflow.corpus.stats import StudyStats
from attnflow.corpus.study import StudyOptions, new_stats, process_batch
from attnflow.corpus.windows import WindowBatch
from attnflow.runs.actors import ActorPool


class StudyWorker:
    """A Ray actor: one model replica and its own accumulator."""

    def __init__(self, options: StudyOptions, threads: int, device: str) -> None:
        import torch

        from attnflow.model import load

        torch.set_num_threads(max(1, threads))
        self.options = options
        self.model = load(options.model, device=device)
        self.stats = new_stats(self.model, options)

    def process(self, token_ids, sentence_ids) -> int:
        batch = WindowBatch(first=0, token_ids=token_ids, sentence_ids=sentence_ids)
        process_batch(self.model, self.stats, batch)
        return len(batch)

    def take(self) -> dict[str, Any]:
        """The accumulated state since the last `take`; the actor starts a fresh accumulator."""
        state = self.stats.state_dict()
        self.stats = new_stats(self.model, self.options)
        return state


class RayBackend(ActorPool):
    """`attnflow.corpus.engine.Backend` over Ray actors (see the module doc and `ActorPool`)."""

    def __init__(self, options: StudyOptions, stats: StudyStats) -> None:
        super().__init__(
            StudyWorker, (options,), workers=options.workers, ray_address=options.ray_address, device=options.device
        )
        self.stats = stats

    def process(self, batch: WindowBatch) -> None:
        self.submit(batch.token_ids, batch.sentence_ids)

    def collect(self) -> StudyStats:
        for state in self.take_all():
            if int(state["n_samples"]) > 0:  # copies: arrays from Ray's object store are read-only
                own = {name: np.array(value) for name, value in state.items()}
                self.stats = self.stats.merge(StudyStats.from_state_dict(own))
        return self.stats
