"""The one run engine of every dataset command (the corpus study, the audit, `evaluate`, `patch
--file`, `explain --file`).

A dataset command is a `Job`: work items cut into batches, a step that turns a batch into a
mergeable result, and the configuration fields that decide the numbers. `run` drives it::

    job.batches(done) ──backend.process──> step.run(context, result, batch)     (local or Ray actors)
        every K batches, on Ctrl-C / SIGTERM and at the end: collect ──> job.absorb ──> checkpoint
    returns the result; the command writes its summary and outputs from it

The engine owns what every command used to repeat: the checkpoint (`attnflow.runs.checkpoint.RunFolder`:
the output folder, ``--resume``, ``--overwrite``, the configuration check), written atomically
after each K batches (``checkpoint_every``; default: every batch locally, every two batches per
actor on Ray), on Ctrl-C / SIGTERM after the batch in progress (`attnflow.runs.signals`), and at the
end; the progress bar with its ETA; and the engine choice (`EngineOptions`): ``local`` runs the
step in this process, ``ray`` runs it in model replicas as Ray actors (`attnflow.runs.actors`: a dead
one replaced and its batches recomputed) and merges their results here. A resumed run restarts the
batches after the work items the checkpoint covers, on the same batch boundaries, so it ends with
the numbers of an uninterrupted run.

What a job provides:

- ``step`` (`Step`, picklable: it travels to every actor): ``load(device)`` gives a worker's context
  (the model, loaded once per worker), ``empty(context)`` a fresh result, ``run(context, result,
  batch)`` adds one batch to ``result`` and returns it;
- ``result``: the driver's empty result (or, on resume, the engine restores it with its class's
  ``from_state_dict``); results have ``merge(other)`` and ``state_dict()``. `Rows` is the result of
  commands that keep one row per work item;
- ``batches(start)``: the batches from work item ``start`` on, each with ``len(batch)`` items, in an
  order fixed by the configuration;
- ``absorb(result)`` (optional): called on the driver after each collection, before the checkpoint,
  e.g. to write what the new rows hold and keep only a light record of them.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import numpy as np

from attnflow.runs.actors import IN_FLIGHT_PER_ACTOR, ActorPool
from attnflow.runs.checkpoint import RunFolder, digest
from attnflow.runs.options import check_counts
from attnflow.runs.signals import stop_requests

log = logging.getLogger(__name__)

ENGINES = ("local", "ray")
BAR = {"dynamic_ncols": True, "smoothing": 0.1}  # the progress bar's look (tqdm)


@dataclass(frozen=True)
class EngineOptions:
    """Where and how a job runs (the ``--engine`` options every dataset command shares).

    Attributes:
        engine: ``local`` (this process) or ``ray`` (model replicas as Ray actors).
        workers: local: torch threads (default: torch's choice); ray: actors (default: 2 on a
            private local runtime, one per CPU of a cluster).
        ray_address: a running Ray cluster (``auto``, ``ray://head:10001``); None: a private local
            runtime started for the run. A cluster that requires Ray's token authentication is
            joined with ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` set in the environment.
        device: ``auto``, ``cpu`` or ``cuda`` for the model (each actor's replica on Ray).
        checkpoint_every: batches between checkpoints (default: 1 locally, 2 per actor on Ray).
        quiet: no progress bar.
    """

    engine: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    device: str = "auto"
    checkpoint_every: int | None = None
    quiet: bool = False

    @classmethod
    def of(cls, options: Any) -> "EngineOptions":
        """The engine settings of a command's options object (its fields of the same names)."""
        return cls(**{name: getattr(options, name) for name in cls.__dataclass_fields__})

    def check(self) -> None:
        """One line for a bad option, before any work."""
        check_counts((), (("workers", self.workers), ("checkpoint_every", self.checkpoint_every)), self.engine)

    @property
    def driver_device(self) -> str:
        """Where the driver's own model copy goes: the CPU under Ray (it only tokenises and plans)."""
        return "cpu" if self.engine == "ray" else self.device


class Step(Protocol):
    """What a job computes, one batch at a time (see the module doc); picklable."""

    def load(self, device: str) -> Any: ...

    def empty(self, context: Any) -> Any: ...

    def run(self, context: Any, result: Any, batch: Any) -> Any: ...


@dataclass
class Rows:
    """A result that keeps one row per work item: ``rows`` maps a key (a string) to the row.

    Merging two results joins their rows (work items are disjoint); the state is ``{"rows": ...}``,
    JSON-able when the rows are."""

    rows: dict[str, Any] = field(default_factory=dict)

    def merge(self, other: "Rows") -> "Rows":
        self.rows.update(other.rows)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Rows":
        return cls(dict(state["rows"]))


@dataclass
class Job:
    """A dataset command as the engine runs it (see the module doc).

    Attributes:
        name: the progress bar's label (``"corpus study"``).
        unit: what one work item is (``"window"``), for the bar and the log.
        total: work items in all (None: until ``batches`` ends).
        fields: the configuration fields that decide the numbers (the checkpoint's fingerprint).
        step: the `Step`.
        result: the driver's empty result.
        batches: ``batches(start)``: the batches from work item ``start`` on.
        absorb: ``absorb(result)``, on the driver after each collection (optional).
        label: ``label(batch)``: what the bar shows beside it while the batch runs (optional).
    """

    name: str
    unit: str
    total: int | None
    fields: dict[str, Any]
    step: Step
    result: Any
    batches: Callable[[int], Iterable[Any]]
    absorb: Callable[[Any], None] | None = None
    label: Callable[[Any], str] | None = None


@dataclass(frozen=True)
class Finished:
    """What `run` returns: the merged ``result``, the work items ``done`` (all of them), the run's
    seconds (its interrupted parts included) and the configuration's ``fingerprint``."""

    result: Any
    done: int
    elapsed_s: float
    fingerprint: str


def run(job: Job, folder: RunFolder | None, options: EngineOptions, context: Any = None) -> Finished:
    """Run (or continue, when ``folder`` holds a checkpoint) ``job``; returns its merged result.

    ``folder``: where the checkpoint lives (None: no checkpoint, e.g. output on stdout only);
    ``context``: the step's context already loaded in this process (the local engine uses it
    instead of ``step.load``).

    Raises:
        InputError: the checkpoint was written with another configuration (each differing field named).
        KeyboardInterrupt: after Ctrl-C / SIGTERM, once the batch in progress is done and checkpointed.
    """
    options.check()
    fingerprint = digest(job.fields)
    result, done, batches, elapsed_before = job.result, 0, 0, 0.0
    if folder is not None and folder.saved is not None:
        folder.check(job.fields)
        result = type(job.result).from_state_dict(folder.state)
        done, batches = folder.done, int(folder.saved.get("batches", 0))
        elapsed_before = float(folder.saved.get("elapsed_s", 0.0))
        log.info("resuming %s after %d %ss", folder.out, done, job.unit)
    backend: LocalBackend | RayBackend | None = None  # started with the first batch: a finished run starts none
    started = time.perf_counter()

    def collect(complete: bool = False) -> Any:
        collected = backend.collect() if backend is not None else result
        if job.absorb is not None:
            job.absorb(collected)
        if folder is not None:
            meta = {"done": done, "batches": batches, "fingerprint": fingerprint, "fields": job.fields}
            elapsed = elapsed_before + time.perf_counter() - started
            folder.save(collected.state_dict(), {**meta, "elapsed_s": elapsed, "complete": complete})
        return collected

    bar = _progress(job, done, options.quiet)
    try:
        with stop_requests() as stop:
            for batch in job.batches(done):
                if job.label is not None:
                    bar.set_postfix_str(job.label(batch), refresh=False)
                backend = backend or _backend(job.step, result, options, context)
                backend.process(batch)
                done, batches = done + len(batch), batches + 1
                bar.update(len(batch))
                if stop.is_set() or batches % (options.checkpoint_every or backend.default_checkpoint_every) == 0:
                    collect()
                if stop.is_set():
                    saved = "checkpoint saved" if folder is not None else "nothing saved"
                    log.warning(
                        "stopped: %s after %d %ss; continue with the same command and --resume", saved, done, job.unit
                    )
                    raise KeyboardInterrupt
            result = collect(complete=True)
    finally:
        bar.close()
        if backend is not None:
            backend.close()
    return Finished(result, done, elapsed_before + time.perf_counter() - started, fingerprint)


class LocalBackend:
    """The step in this process, one batch at a time, into the driver's result."""

    default_checkpoint_every = 1

    def __init__(self, step: Step, result: Any, context: Any, device: str, threads: int | None) -> None:
        import torch

        self._threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(int(threads))
        self.step, self.result = step, result
        self.context = context if context is not None else step.load(device)

    def process(self, batch: Any) -> None:
        self.result = self.step.run(self.context, self.result, batch)

    def collect(self) -> Any:
        return self.result

    def close(self) -> None:
        import torch

        torch.set_num_threads(self._threads)


class StepWorker:
    """A Ray actor: one replica of a job's step context (its model) and its own result."""

    def __init__(self, step: Step, threads: int, device: str) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.step = step
        self.context = step.load(device)
        self.result = step.empty(self.context)

    def process(self, batch: Any) -> int:
        self.result = self.step.run(self.context, self.result, batch)
        return len(batch)

    def take(self) -> Any:
        """The result accumulated since the last `take`, as its state; the actor starts afresh."""
        state = self.result.state_dict()
        self.result = self.step.empty(self.context)
        return state


class RayBackend(ActorPool):
    """The step on Ray (``--engine ray``): each batch goes to the least busy `StepWorker`
    (`attnflow.runs.actors.ActorPool`: a dead actor replaced and its batches since the last
    collection recomputed); `collect` merges every actor's result into the driver's."""

    def __init__(self, step: Step, result: Any, options: EngineOptions) -> None:
        super().__init__(
            StepWorker, (step,), workers=options.workers, ray_address=options.ray_address, device=options.device
        )
        self.result = result

    @property
    def default_checkpoint_every(self) -> int:
        """Batches between checkpoints unless told: enough to keep every actor busy in between."""
        return IN_FLIGHT_PER_ACTOR * len(self.actors)

    def process(self, batch: Any) -> None:
        self.submit(batch)

    def collect(self) -> Any:
        for state in self.take_all():
            self.result = self.result.merge(type(self.result).from_state_dict(writable(state)))
        return self.result


def _backend(step: Step, result: Any, options: EngineOptions, context: Any) -> LocalBackend | RayBackend:
    if options.engine == "ray":
        return RayBackend(step, result, options)
    return LocalBackend(step, result, context, options.device, options.workers)


def _progress(job: Job, initial: int, quiet: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=job.total, initial=initial, unit=job.unit, desc=job.name, disable=quiet, file=sys.stderr, **BAR)


def writable(state: Any) -> Any:
    """``state`` with its numpy arrays copied (arrays from Ray's object store are read-only)."""
    if isinstance(state, np.ndarray):
        return np.array(state)
    if isinstance(state, dict):
        return {key: writable(value) for key, value in state.items()}
    if isinstance(state, list):
        return [writable(value) for value in state]
    return state
