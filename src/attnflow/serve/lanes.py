"""One queue and one worker thread per model (a `Lane`): requests for a model wait for it in
arrival order and run on its own thread, so a request for model B never waits behind model A's
work, nor for a thread that A's queue holds; the event loop only waits (never computes).

A lane is held from the moment its request's work is handed to the thread until that work ends
(not until the route stops waiting for it: a stopped job that has not reached its next check
still holds the model). `Lane.backlog_s` is the estimated work ahead of a new request: the
estimates of the jobs waiting, and what the running one has left.

Each lane's work runs on a budget of CPU threads (`Lane.budgeted`: torch's intra-op threads, set
in the lane's own thread, where they apply): with the machine's threads shared out among the
models, heavy work on one model leaves the others their share, where two models each running on
every core would slow both several times over (threads fighting for the same cores).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from attnflow.serve.pool import Job


class Lane:
    """One model's queue (an asyncio lock, fair: first come, first served) and its worker thread."""

    def __init__(self, name: str, threads: int | None = None) -> None:
        self.name = name
        self.threads = threads  # CPU threads its work runs on (None: as the process set them)
        self.lock = asyncio.Lock()  # bound to the event loop that first waits on it
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnflow-serve")
        self.jobs: dict[str, Job] = {}  # waiting for this lane or running on it, in arrival order
        self.running: tuple[Job, float] | None = None  # the job its thread runs, and since when

    def backlog_s(self) -> float:
        """Seconds of estimated work ahead of a request that joins the queue now."""
        total = sum(job.estimate_s or 0.0 for job in self.jobs.values())
        if self.running is not None:
            job, began = self.running
            total -= min(job.estimate_s or 0.0, time.monotonic() - began)
        return max(0.0, total)

    def budgeted(self, function: Callable[[], Any], threads: int | None = None) -> Callable[[], Any]:
        """``function`` run on ``threads`` (default: the lane's) CPU threads: to hand to its executor."""
        budget = threads or self.threads

        def run() -> Any:
            if budget is not None:
                import torch

                torch.set_num_threads(budget)  # this thread's (OpenMP) threads: each lane keeps its own
            return function()

        return run

    def close(self) -> None:
        """No more work: queued work is dropped, running work finishes on its own."""
        self.executor.shutdown(wait=False, cancel_futures=True)


Wait = Callable[["asyncio.Future[Any]"], Awaitable[Any]]  # the awaitable's result, or raises once the request gives up


async def hold(lanes: list[Lane], job: Job, wait: Wait) -> list[Lane]:
    """Acquire ``lanes`` in order (callers sort them by name, so two requests never wait for each
    other), each through ``wait`` (which gives up by raising); on giving up, nothing stays held."""
    held: list[Lane] = []
    try:
        for lane in lanes:
            job.current = f"waiting for {lane.name}"
            acquiring = asyncio.ensure_future(lane.lock.acquire())
            try:
                await wait(acquiring)
            except BaseException:
                if acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None:
                    lane.lock.release()
                else:
                    acquiring.cancel()
                raise
            held.append(lane)
    except BaseException:
        for lane in held:
            lane.lock.release()
        raise
    return held


def release_when_done(work: Future, lanes: list[Lane], job: Job, loop: asyncio.AbstractEventLoop) -> None:
    """Release ``lanes`` (on the event loop) once ``work`` ends, however it ends."""
    began = time.monotonic()
    for lane in lanes:
        lane.running = (job, began)

    def release() -> None:
        for lane in lanes:
            lane.running = None
            lane.jobs.pop(job.id, None)
            lane.lock.release()

    def released(_work: Future) -> None:
        try:
            loop.call_soon_threadsafe(release)
        except RuntimeError:  # its event loop is closed: nothing waits on these locks any more
            release()

    work.add_done_callback(released)
