"""Model replicas as Ray actors that each accumulate what they are given (`ActorPool`), for the
``--engine ray`` of the run engine (`attnflow.runs.engine.RayBackend`).

Without ``ray_address`` a private local Ray runtime is started (``ray.init(address="local")``: it
never joins somebody else's cluster) with ``workers`` CPUs (default 2) and no dashboard; it is shut
down by `ActorPool.close`. With an address (e.g. ``auto`` or ``ray://head:10001``) the actors go to
that cluster, which must have attnflow and the model available on its nodes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from attnflow.errors import AttnflowError

log = logging.getLogger(__name__)

IN_FLIGHT_PER_ACTOR = 2
MAX_REPLACEMENTS = 3  # per actor slot: a worker that keeps dying (e.g. out of memory) stops the run
LOCAL_OBJECT_STORE_BYTES = 512 * 1024**2


class ActorPool:
    """Model replicas as Ray actors that each accumulate what they are given, with fault recovery.

    ``worker_class`` is a plain class with ``process(*arguments)`` (one batch into its own
    accumulator) and ``take()`` (the accumulated state; it starts afresh); the pool starts
    ``workers`` of them as actors with ``worker_arguments + (threads, device)``.

    Faults: an actor that dies (its process killed, its node lost) takes its accumulator with it,
    so the pool keeps the arguments of every batch an actor has been given since its last `take`
    (``given``). When a call fails because the actor died, a fresh actor replaces it and is given
    all of those batches again: each batch ends up counted exactly once, in the accumulator of the
    actor that was alive when the pool took it. Errors inside a batch (not a dead actor) and an
    actor that keeps dying (``MAX_REPLACEMENTS`` per slot) stop the run with one line.
    """

    def __init__(
        self,
        worker_class: type,
        worker_arguments: tuple,
        *,
        workers: int | None,
        ray_address: str | None,
        device: str,
    ) -> None:
        try:
            import ray
        except ImportError:
            raise AttnflowError("{engine} ray needs Ray: pip install 'ray[data]'", parameter="engine") from None
        self.ray = ray
        self.owns_runtime = not ray.is_initialized()
        local = ray_address is None
        if self.owns_runtime:
            if local:
                ray.init(
                    address="local",
                    num_cpus=workers or 2,
                    num_gpus=0 if device == "cpu" else None,
                    include_dashboard=False,
                    log_to_driver=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    logging_level=logging.WARNING,
                )
            else:
                ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
        resources = ray.cluster_resources()
        cpus = int(resources.get("CPU", 1))
        workers = workers or max(1, cpus if not local else min(2, cpus))
        gpus = float(resources.get("GPU", 0))
        use_gpu = device == "cuda" or (device == "auto" and gpus > 0)
        gpu_share = min(1.0, gpus / workers) if use_gpu and gpus > 0 else (1.0 if device == "cuda" else 0.0)
        threads = max(1, cpus // workers) if local else max(1, (os.cpu_count() or 1) // max(1, workers))
        actor_device = "cuda" if use_gpu else "cpu"
        remote_worker = ray.remote(worker_class).options(num_cpus=1, num_gpus=gpu_share)
        self._new_actor = lambda: remote_worker.remote(*worker_arguments, threads, actor_device)
        self.actors = [self._new_actor() for _ in range(workers)]
        self.replacements = [0] * workers
        # Per actor: the batches' arguments given to it since its last `take` and, of those, the calls in flight.
        self.given: list[list[tuple]] = [[] for _ in self.actors]
        self.pending: list[list[Any]] = [[] for _ in self.actors]
        log.info("ray engine: %d actors, %d threads each, device %s", workers, threads, actor_device)

    def submit(self, *arguments: Any) -> None:
        """Give one batch (the arguments of ``worker.process``) to the least busy actor."""
        self._finish(block=sum(map(len, self.pending)) >= IN_FLIGHT_PER_ACTOR * len(self.actors))
        slot = min(range(len(self.actors)), key=lambda k: len(self.pending[k]))
        self._give(slot, arguments)

    def take_all(self) -> list[Any]:
        """Every actor's state, once all submitted batches are done (each actor starts afresh)."""
        states: list[Any] = [None] * len(self.actors)
        while any(state is None for state in states):
            for slot, queue in enumerate(self.pending):
                if states[slot] is None and self._wait_all(slot, queue):
                    states[slot] = self._take(slot)
        return states

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self.owns_runtime:
            self.ray.shutdown()

    def _give(self, slot: int, arguments: tuple) -> None:
        self.given[slot].append(arguments)
        self.pending[slot].append(self.actors[slot].process.remote(*arguments))

    def _finish(self, block: bool) -> None:
        """Drop finished calls from the queues (waiting for one when ``block``); replace dead actors."""
        refs = [ref for queue in self.pending for ref in queue]
        if not refs:
            return
        if block:
            self.ray.wait(refs, num_returns=1)
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        finished = set(done)
        for slot, queue in enumerate(self.pending):
            if any(ref in finished for ref in queue) and self._wait_all(
                slot, [ref for ref in queue if ref in finished]
            ):
                self.pending[slot] = [ref for ref in queue if ref not in finished]

    def _wait_all(self, slot: int, refs: list[Any]) -> bool:
        """Wait for ``refs`` of actor ``slot``; False when the actor died (it is then replaced)."""
        try:
            self._get(refs)
        except self.ray.exceptions.RayActorError:
            self._replace(slot)
            return False
        if refs is self.pending[slot]:
            self.pending[slot] = []
        return True

    def _take(self, slot: int) -> dict[str, Any] | None:
        try:
            state = self._get([self.actors[slot].take.remote()])[0]
        except self.ray.exceptions.RayActorError:
            self._replace(slot)
            return None
        self.given[slot] = []  # handed back: from now on these batches live in the driver's accumulator
        return state

    def _replace(self, slot: int) -> None:
        """A fresh actor in ``slot``, given again every batch the dead one had not handed back."""
        self.replacements[slot] += 1
        if self.replacements[slot] > MAX_REPLACEMENTS:
            raise AttnflowError(f"a Ray worker died {self.replacements[slot]} times; giving up")
        lost = self.given[slot]
        log.warning("a Ray worker died; a new one recomputes its %d batches", len(lost))
        self.ray.kill(self.actors[slot])
        self.actors[slot] = self._new_actor()
        self.given[slot], self.pending[slot] = [], []
        for arguments in lost:
            self._give(slot, arguments)

    def _get(self, refs: list[Any]) -> list[Any]:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError:
            raise
        except self.ray.exceptions.RayError as error:
            first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise AttnflowError(f"a Ray worker failed: {first}") from error
