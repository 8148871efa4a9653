"""`attnflow serve`'s estimates: each model's `Rates` (measured when it first serves, taught by what
finished requests took) and the time limit requests are held to (`TooExpensive`: 413 before a
request runs, one line saying what would fit). The cost model itself (`Work`, `Rates`, the
``*_parts`` of each request) is `attnflow.costs`, which `attnflow why` plans with too."""

from __future__ import annotations

import copy
import threading
from dataclasses import replace
from typing import Any, Mapping, Sequence

from attnflow.costs import (
    FAITHFULNESS,
    FLOW_PER_CPU,
    ROUTES,
    SCALED_ABOVE_S,
    TRACE,
    Estimator,
    Parts,
    Rates,
    calibrate,
)
from attnflow.errors import AttnflowError
from attnflow.model_like import ModelLike
from attnflow.serve.pool import Job


class TooExpensive(AttnflowError):
    """A request whose estimate exceeds the time limit (answered 413 before it runs)."""


class Costs:
    """Each model's `Rates` and a copy of its tokenizer (for estimates made on the event loop, never
    the model's own, which a worker thread may be using), and the time limit estimates are held to."""

    def __init__(self, time_limit_s: float) -> None:
        self.time_limit_s = time_limit_s
        self._rates: dict[str, Rates] = {}
        self._tokenizers: dict[str, Any] = {}
        self._guard = threading.Lock()

    def rates(self, name: str) -> Rates | None:
        with self._guard:
            return self._rates.get(name)

    def tokenizer(self, name: str) -> Any:
        with self._guard:
            return self._tokenizers.get(name)

    def set_rates(self, name: str, rates: Rates | None) -> None:
        """Set (None: forget) ``name``'s rates: measured ones, or given ones (tests, a slower machine)."""
        with self._guard:
            if rates is None:
                self._rates.pop(name, None)
            else:
                self._rates[name] = rates

    def ready(self, name: str, model: ModelLike) -> Rates | None:
        """``name``'s rates, measured now if they are not yet (call it holding the model)."""
        rates = self.rates(name)
        if rates is None:
            rates = calibrate(model)
            self.set_rates(name, rates)
        if self.tokenizer(name) is None and getattr(model, "tokenizer", None) is not None:
            try:
                copied = copy.deepcopy(model.tokenizer)
            except Exception:  # a tokenizer that cannot be copied: estimates in the worker only
                copied = None
            with self._guard:
                self._tokenizers[name] = copied
        return rates

    def seconds(self, name: str, parts: Parts) -> float | None:
        rates = self.rates(name)
        return None if rates is None else sum(rates.seconds(work) for work in parts.values())

    def check(self, job: Job, estimates: Sequence[tuple[str, Estimator]], n: int, what: str) -> None:
        """Set ``job.estimate_s`` to the seconds of ``estimates`` (per model: its name and the work of
        each step for n tokens) on ``n`` tokens; `TooExpensive` when that exceeds the time limit,
        saying the longest step and what fits (a shorter text, or the request without that step)."""
        seconds = self._seconds(estimates, n)
        if seconds is None:
            return
        job.estimate_s = round(seconds, 3)
        if seconds <= self.time_limit_s:
            return
        steps: dict[str, float] = {}
        for name, estimate in estimates:
            rates = self.rates(name)
            for step, work in estimate(n).items():
                steps[step] = steps.get(step, 0.0) + (rates.seconds(work) if rates else 0.0)
        longest = max(steps, key=lambda step: steps[step])
        fits = [
            f"a text of at most {tokens} tokens ({what})" for tokens in [self._tokens_that_fit(estimates, n)] if tokens
        ]
        if seconds - steps[longest] <= self.time_limit_s and longest not in (TRACE, ROUTES):  # steps one can leave out
            fits.append('"faithfulness": false' if longest == FAITHFULNESS else f"the request without {longest}")
        raise TooExpensive(
            f"this request would take about {seconds:.0f} s on {n} tokens ({longest}: about {steps[longest]:.0f} s), "
            f"over this server's time limit of {self.time_limit_s:g} s; what would fit: "
            + (" or ".join(fits) or "nothing on this model: ask for cheaper methods")
        )

    def observe(self, name: str, parts: Parts, seconds: float, timings: Mapping[str, float]) -> None:
        """Teach ``name``'s rates what a request estimated at ``parts`` took: ``seconds`` in all,
        ``timings`` per step. Attention flow's time (its step) moves ``flow_s``, the rest ``scale``;
        only work estimated at `SCALED_ABOVE_S` or more counts (below, fixed costs dominate), and
        each moves at most to 1/4 or 8 times its starting value (a kernel compiled once, a machine
        busy for a moment)."""
        rates = self.rates(name)
        if rates is None:
            return
        flow_units = sum(work.flow for work in parts.values())
        flow_seconds = timings.get("flow", 0.0) if flow_units else 0.0
        if flow_units * rates.flow_s >= SCALED_ABOVE_S and flow_seconds > 0:
            rates = replace(rates, flow_s=_moved(rates.flow_s, flow_seconds / flow_units, FLOW_PER_CPU * rates.cpu_s))
        unscaled = replace(rates, scale=1.0, flow_s=0.0, element_s=0.0, alti_s=0.0)
        predicted = sum(unscaled.seconds(work) for work in parts.values())
        if predicted * rates.scale >= SCALED_ABOVE_S:
            rates = replace(rates, scale=_moved(rates.scale, (seconds - flow_seconds) / predicted, 1.0))
        self.set_rates(name, rates)

    def _seconds(self, estimates: Sequence[tuple[str, Estimator]], n: int) -> float | None:
        total = 0.0
        for name, estimate in estimates:
            seconds = self.seconds(name, estimate(n))
            if seconds is None:
                return None
            total += seconds
        return total

    def _tokens_that_fit(self, estimates: Sequence[tuple[str, Estimator]], n: int) -> int:
        """The most tokens (below ``n``) whose estimate fits the time limit; 0 when even 3 do not."""
        low, high = 0, n - 1
        while low < high:
            middle = (low + high + 1) // 2
            seconds = self._seconds(estimates, middle)
            if seconds is not None and seconds <= self.time_limit_s:
                low = middle
            else:
                high = middle - 1
        return low if low >= 3 else 0


def _moved(value: float, measured: float, start: float) -> float:
    """``value`` moved towards ``measured`` (a third of the way), kept within [start / 4, start · 8]."""
    return min(8 * start, max(start / 4, 0.7 * value + 0.3 * measured))
