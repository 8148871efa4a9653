"""Numbers a method reports about its result besides the scores (LRP: conservation), kept per
explanation in `Explanation.extras`.

A method calls `report_extras(name=value, ...)` while it runs; `attnflow.explain` collects them
(`collect_extras`) into the Explanation it builds. Outside a collection the call does nothing, so
a method stays an ordinary function that returns its array.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

_COLLECTED: ContextVar[dict[str, Any] | None] = ContextVar("attnflow_method_extras", default=None)


def report_extras(**values: Any) -> None:
    """Record JSON-serialisable ``values`` for the explanation being computed (if any)."""
    collected = _COLLECTED.get()
    if collected is not None:
        collected.update(values)


@contextmanager
def collect_extras() -> Iterator[dict[str, Any]]:
    """The dict that `report_extras` fills while the block runs."""
    collected: dict[str, Any] = {}
    token = _COLLECTED.set(collected)
    try:
        yield collected
    finally:
        _COLLECTED.reset(token)
