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

Without ``--ray-address`` a private local Ray runtime is started (``ray.init(address="local")``:
it never joins somebody else's cluster) with ``--workers`` CPUs (default 2) and no dashboard; it is
shut down at the end. With ``--ray-address`` (e.g. ``auto`` or ``ray://head:10001``) the actors go
to that cluster, which must have attnflow and the model available on its nodes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from attnflow.corpus.stats import StudyStats
from attnflow.corpus.study import StudyOptions, new_stats, process_batch
from attnflow.corpus.windows import WindowBatch
from attnflow.errors import AttnflowError

log = logging.getLogger(__name__)

IN_FLIGHT_PER_ACTOR = 2
LOCAL_OBJECT_STORE_BYTES = 512 * 1024**2


class StudyWorker:
    """A Ray actor: one model replica and its own accumulator."""

    def __init__(self, options: StudyOptions, threads: int, device: str) -> None:
        import torch

        from attnflow.capture import load

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


class RayBackend:
    """`attnflow.corpus.engine.Backend` over Ray actors (see the module doc)."""

    def __init__(self, options: StudyOptions, stats: StudyStats) -> None:
        try:
            import ray
        except ImportError:
            raise AttnflowError("--engine ray needs Ray: pip install 'ray[data]'") from None
        self.ray = ray
        self.stats = stats
        self.owns_runtime = not ray.is_initialized()
        local = options.ray_address is None
        if self.owns_runtime:
            workers = options.workers or 2
            if local:
                ray.init(
                    address="local",
                    num_cpus=workers,
                    num_gpus=0 if options.device == "cpu" else None,
                    include_dashboard=False,
                    log_to_driver=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    logging_level=logging.WARNING,
                )
            else:
                ray.init(address=options.ray_address, log_to_driver=False, logging_level=logging.WARNING)
        resources = ray.cluster_resources()
        cpus = int(resources.get("CPU", 1))
        workers = options.workers or max(1, cpus if not local else min(2, cpus))
        gpus = float(resources.get("GPU", 0))
        use_gpu = options.device == "cuda" or (options.device == "auto" and gpus > 0)
        gpu_share = min(1.0, gpus / workers) if use_gpu and gpus > 0 else (1.0 if options.device == "cuda" else 0.0)
        threads = max(1, cpus // workers) if local else max(1, (os.cpu_count() or 1) // max(1, workers))
        actor = ray.remote(StudyWorker)
        device = "cuda" if use_gpu else "cpu"
        self.actors = [
            actor.options(num_cpus=1, num_gpus=gpu_share).remote(options, threads, device) for _ in range(workers)
        ]
        self.pending: list[list[Any]] = [[] for _ in self.actors]
        log.info("ray engine: %d actors, %d threads each, device %s", workers, threads, device)

    def process(self, batch: WindowBatch) -> None:
        self._finish(block=sum(map(len, self.pending)) >= IN_FLIGHT_PER_ACTOR * len(self.actors))
        target = min(range(len(self.actors)), key=lambda k: len(self.pending[k]))
        self.pending[target].append(self.actors[target].process.remote(batch.token_ids, batch.sentence_ids))

    def collect(self) -> StudyStats:
        for queue in self.pending:
            self._get(queue)
            queue.clear()
        for state in self._get([actor.take.remote() for actor in self.actors]):
            if int(state["n_samples"]) > 0:  # copies: arrays from Ray's object store are read-only
                own = {name: np.array(value) for name, value in state.items()}
                self.stats = self.stats.merge(StudyStats.from_state_dict(own))
        return self.stats

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self.owns_runtime:
            self.ray.shutdown()

    def _finish(self, block: bool) -> None:
        """Drop finished batches from the queues (waiting for one when ``block``); re-raise failures."""
        refs = [ref for queue in self.pending for ref in queue]
        if not refs:
            return
        if block:
            self.ray.wait(refs, num_returns=1)
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        self._get(done)
        finished = set(done)
        self.pending = [[ref for ref in queue if ref not in finished] for queue in self.pending]

    def _get(self, refs: list[Any]) -> list[Any]:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayError as error:
            first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise AttnflowError(f"a Ray worker failed: {first}") from error
