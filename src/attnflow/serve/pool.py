"""The models a server keeps loaded, and the jobs that use them.

`ModelPool` loads a model on its first request and keeps it: at most ``max_models`` stay loaded
(and, with ``max_rss_mb``, fewer while the process's resident memory is above that); the least
recently used one that no request holds goes first (a model the server does not offer before
the offered ones). Only the offered models load, unless ``allow_any_model``. A load runs
`attnflow.staging.interruptible` by its request's job: a cancelled or timed-out request stops its
load at the next block written or tensor converted (the temporary files go, nothing is left
half-written), and a load that ends after its request was stopped is not kept. Each model has
one lock: one thread at a time runs inside its hooks, whatever the number of worker threads.

A `Job` is one request's handle: its progress (the step it is on, the forward passes run) and its
cancellation, checked between steps (`Job.step`) and before every forward pass of the model while
the job holds it (a forward pre-hook, removed when the job lets go): a cancelled or timed-out
request stops within one forward pass, even inside an expensive method (leave-one-out, SHAP,
integrated gradients), and releases its model.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from attnflow.errors import AttnflowError
from attnflow.model_like import ModelLike
from attnflow.staging import interruptible

LOCK_POLL_S = 0.05  # how often a request waiting for a busy model checks whether it was cancelled


class Cancelled(AttnflowError):
    """A request was stopped (cancelled by the client, disconnected, or over its time limit)."""


class ModelRefused(AttnflowError):
    """A model name the server does not serve (not an alias it offers)."""


class PathRefused(ModelRefused):
    """A model path, refused: no ``--allow-path``, or outside it."""


@dataclass
class Job:
    """One request's progress and cancellation (shared by the request's route and its worker thread)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    current: str = "queued"
    done: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    reason: str | None = None  # why it was cancelled
    forwards: int = 0  # forward passes of the model run for this job
    tokens: int = 0  # the tokens those passes held (batch x sequence)
    deadline: float | None = None  # time.monotonic() after which the request is over its time limit
    estimate_s: float | None = None  # the seconds its work was estimated to take (`attnflow.costs`)
    durations: dict[str, float] = field(default_factory=dict)  # seconds spent in each finished step
    _entered: float = field(default_factory=time.monotonic)  # when the current step began
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self, reason: str) -> None:
        """Ask the job to stop at its next step (the worker raises `Cancelled` there)."""
        if not self._cancelled.is_set():
            self.reason = reason
            self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Raise `Cancelled` if the job was cancelled."""
        if self._cancelled.is_set():
            raise Cancelled(f"the request was stopped at {self.current}: {self.reason}")

    def step(self, name: str) -> None:
        """Enter step ``name`` (a method, "faithfulness", "loading MODEL", ...), unless cancelled."""
        now = time.monotonic()
        if self.current != name:
            self.durations[self.current] = self.durations.get(self.current, 0.0) + now - self._entered
            self._entered = now
        if self.current not in ("queued", name):
            self.done.append(self.current)
        self.current = name
        self.check()

    def timings(self) -> dict[str, float]:
        """Seconds spent in each step so far, the current one included."""
        current = self.durations.get(self.current, 0.0) + time.monotonic() - self._entered
        return {**self.durations, self.current: current}

    def forward(self, tokens: int = 0) -> None:
        """Count one forward pass of the model (of ``tokens`` tokens), unless cancelled (called by the pool's hook)."""
        self.forwards += 1
        self.tokens += tokens
        self.check()

    def remaining_s(self) -> float | None:
        """Seconds left before the time limit (None: no limit)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def progress(self) -> dict[str, Any]:
        """``{"id", "step", "done" [steps], "forward_passes", "elapsed_s", "cancelled"}`` (the progress endpoint)."""
        return {
            "id": self.id,
            "step": self.current,
            "done": list(self.done),
            "forward_passes": self.forwards,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "cancelled": self.cancelled,
        }


@dataclass
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    model: ModelLike | None = None
    users: int = 0


class ModelPool:
    """Lazily loaded models, at most ``max_models`` kept (least recently used evicted), one lock each.

    Args:
        models: the aliases the server offers (listed by ``/api/models``, the first is the default).
        allow_path: a folder whose model folders may be loaded by path; None refuses every path.
        max_models: how many models stay loaded.
        max_rss_mb: evict idle models while the process's resident memory exceeds this (None: no limit).
        loader: ``loader(name) -> AttentionModel`` (default: `attnflow.load` on the CPU or GPU).
        known: the other names that may be asked for, with ``allow_any_model`` (default: the
            embedded aliases, `attnflow.capture.loading`).
        allow_any_model: also load the ``known`` names that are not offered (``--allow-any-model``).
        dtype: the precision the default loader loads every model in (``--dtype``; `attnflow.load`).
    """

    def __init__(
        self,
        models: Sequence[str],
        allow_path: str | Path | None = None,
        max_models: int = 2,
        max_rss_mb: float | None = None,
        loader: Callable[[str], Any] | None = None,
        known: Sequence[str] | None = None,
        allow_any_model: bool = False,
        dtype: str = "float32",
    ) -> None:
        if not models:
            raise ValueError("a model pool needs at least one model")
        if max_models < 1:
            raise ValueError(f"max_models must be at least 1, got {max_models}")
        if known is None:
            from attnflow.capture.loading import EMBEDDED, PROBES

            known = [*EMBEDDED, *PROBES]
        self.offered = list(dict.fromkeys(models))
        self.known = set(self.offered) | (set(known) if allow_any_model else set())
        self.others = sorted(set(known) - self.known)  # aliases that --allow-any-model would add
        self.allow_path = Path(allow_path).expanduser().resolve() if allow_path is not None else None
        self.max_models = max_models
        self.max_rss_mb = max_rss_mb
        self._loader = loader or functools.partial(_load, dtype=dtype)
        self._guard = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    @property
    def default(self) -> str:
        """The model a request gets when it names none."""
        return self.offered[0]

    def loaded(self) -> list[str]:
        """Names of the loaded models, least recently used first."""
        with self._guard:
            return [name for name, entry in self._entries.items() if entry.model is not None]

    def model_if_loaded(self, name: str) -> Any:
        """The loaded model called ``name``, or None (never loads; for listings)."""
        with self._guard:
            entry = self._entries.get(name)
            return None if entry is None else entry.model

    def check_name(self, name: str) -> str:
        """``name`` as the pool loads it (a path resolved), or `ModelRefused` saying why not."""
        if name in self.known:
            return name
        offered = ", ".join(sorted(self.known))
        if name in self.others:
            raise ModelRefused(
                f"model {name!r} is not offered by this server (it offers: {offered}); its operator can add it "
                "with {models}, or allow every alias with {allow_any_model}",
                parameter=("models", "allow_any_model"),
            )
        looks_like_path = "/" in name or "\\" in name or name.startswith((".", "~"))
        if not looks_like_path:
            raise ModelRefused(f"unknown model {name!r}; this server offers: {offered}")
        if self.allow_path is None:
            raise PathRefused(
                f"model paths are refused ({name!r}): start the server with {{allow_path}} (a folder)",
                parameter="allow_path",
            )
        path = Path(name).expanduser().resolve()
        if not path.is_relative_to(self.allow_path):
            raise PathRefused(f"model path {name!r} is outside the allowed folder {self.allow_path}")
        return str(path)

    @contextmanager
    def using(self, name: str, job: Job) -> Iterator[Any]:
        """The model ``name`` (loaded on first use), held by this thread alone for the block.

        Waiting for a busy model stops when ``job`` is cancelled."""
        name = self.check_name(name)
        with self._guard:
            entry = self._entries.setdefault(name, _Entry())
            self._entries.move_to_end(name)
            entry.users += 1
        try:
            job.step(f"waiting for {name}")
            while not entry.lock.acquire(timeout=LOCK_POLL_S):
                job.check()
            try:
                if entry.model is None:
                    job.step(f"loading {name}")
                    with interruptible(job.check):
                        model = self._loader(name)
                    job.check()  # stopped meanwhile: not kept (it would push out a model in use)
                    entry.model = model
                with watched_forwards(entry.model, job):
                    yield entry.model
            finally:
                entry.lock.release()
        finally:
            with self._guard:
                entry.users -= 1
                if entry.model is None and entry.users == 0 and self._entries.get(name) is entry:
                    del self._entries[name]  # its load failed or was never tried: nothing to keep
            self._evict()

    @contextmanager
    def using_both(self, first: str, second: str, job: Job) -> Iterator[tuple[Any, Any]]:
        """Two models held at once, locked in a fixed order (two requests never wait for each other)."""
        if self.check_name(first) == self.check_name(second):
            with self.using(first, job) as model:
                yield model, model
            return
        ordered = sorted([first, second], key=self.check_name)
        with self.using(ordered[0], job) as a, self.using(ordered[1], job) as b:
            models = {ordered[0]: a, ordered[1]: b}
            yield models[first], models[second]

    def _evict(self) -> None:
        """Drop the least recently used idle models beyond ``max_models`` (or over ``max_rss_mb``)."""
        dropped = False
        with self._guard:
            while True:
                loaded = [name for name, entry in self._entries.items() if entry.model is not None]
                over = len(loaded) > self.max_models or (
                    self.max_rss_mb is not None and len(loaded) > 1 and resident_mb() > self.max_rss_mb
                )
                idle = [name for name in loaded if self._entries[name].users == 0]
                idle.sort(key=lambda name: name in self.offered)  # models not offered go first, then LRU
                if not over or not idle:
                    break
                del self._entries[idle[0]]
                dropped = True
        if dropped:
            gc.collect()


@contextmanager
def watched_forwards(model: ModelLike, job: Job) -> Iterator[None]:
    """Within the block, every forward pass of ``model``'s network first calls `Job.forward` (counts
    it; raises `Cancelled` when the job was cancelled). The hook is removed on leaving, always."""
    import torch

    from attnflow.rows.hook_points import HookPoint, hooks

    network = getattr(model, "hf_model", None)
    if not isinstance(network, torch.nn.Module):  # not a torch network: steps alone are checked
        yield
        return
    with hooks([(HookPoint(network, "call"), lambda args, kwargs: job.forward(_tokens(args, kwargs)))]):
        yield


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The tokens a forward pass holds (batch x sequence of its ids or embeddings), or 0."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) >= 2:
            return int(shape[0]) * int(shape[1])
    return 0


def resident_mb() -> float:
    """This process's resident memory in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _load(name: str, dtype: str = "float32") -> Any:
    from attnflow.model import load

    return load(name, progress=False, dtype=dtype)
