"""A registry of attention methods by name (what `attnflow explain --method` looks up).

Every registered method has the same contract: ``method(attentions, **options) -> matrix``
where ``attentions`` is ``[layer, head, query, key]`` (or batched with a leading axis) and
the result is ``[query, key]`` (or ``[batch, query, key]``): row i is how much output position i
draws on input position j. Adding a method is one function and one `register` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MethodSpec:
    name: str
    function: Callable[..., Any]
    summary: str
    options: tuple[str, ...]  # keyword options the method understands (the CLI passes only these)


_METHODS: dict[str, MethodSpec] = {}


def register(name: str, summary: str, options: tuple[str, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``function`` under ``name``."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if name in _METHODS:
            raise ValueError(f"method {name!r} is registered twice")
        _METHODS[name] = MethodSpec(name, function, summary, options)
        return function

    return decorate


def get_method(name: str) -> MethodSpec:
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}") from None


def available_methods() -> list[str]:
    return sorted(_METHODS)
