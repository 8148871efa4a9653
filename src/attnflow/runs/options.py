"""The options every streamed run takes, checked in one line each before any work starts."""

from __future__ import annotations

from typing import Any, Sequence

from attnflow.errors import InputError


def check_counts(required: Sequence[tuple[str, Any]], optional: Sequence[tuple[str, Any]], engine: str) -> None:
    """One line for a bad option of a run (`attnflow.runs.engine`, the corpus study, the audit): each of
    ``required`` (parameter, value) a positive integer, each of ``optional`` None or at least 1, and
    ``engine`` local or ray (the messages name the parameters, `attnflow.errors`)."""
    for name, value in required:
        if not isinstance(value, int) or value < 1:
            raise InputError(f"{{{name}}} must be a positive integer, not {value!r}", parameter=name)
    for name, value in optional:
        if value is not None and value < 1:
            raise InputError(f"{{{name}}} must be at least 1, not {value}", parameter=name)
    if engine not in ("local", "ray"):
        raise InputError(f"{{engine}} must be local or ray, not {engine!r}", parameter="engine")
