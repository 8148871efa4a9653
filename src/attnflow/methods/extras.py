"""What a method may return besides its scores: numbers about the result (the backward rules:
conservation, bias share), kept per explanation in `Explanation.extras`.

A method returns its array, or a `Scored` (the array and its extras); a batch form returns one
`Scored` per trace. `split` turns either into ``(array, extras)``.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple


class Scored(NamedTuple):
    """A method's result with its extras: ``scores`` (``[key]``, ``[query, key]``, ...) and
    JSON-serialisable numbers about them."""

    scores: Any
    extras: Mapping[str, Any]


def split(result: Any) -> tuple[Any, dict[str, Any]]:
    """``(array, extras)`` of a method's result: a `Scored`, or a bare array (no extras)."""
    if isinstance(result, Scored):
        return result.scores, dict(result.extras)
    return result, {}
