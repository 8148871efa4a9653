"""A registry of relevance methods by name (what `attnflow explain --method` looks up).

Every registered method declares what it ``needs`` from a forward pass (names from
`attnflow.trace.NEEDS`); the capture grants exactly those, so a forward-only method never pays
for a gradient method's backward pass. How a method is called follows from its needs and its
first parameter:

- ``method(attentions, **options)``: attention-only methods (``[layer, head, query, key]``,
  or batched with a leading axis);
- ``method(trace, **options)``: methods that read more of the `Trace` (values, gradients, ...);
- ``method(model, trace, **options)``: methods that need ``"model"`` and re-run it
  (perturbations, integrated gradients).

A method returns ``[query, key]`` (row i: how much output position i draws on input j), or
``[head, query, key]`` when heads stay apart, or — ``scores_only`` methods — one score per token
``[key]``. Adding a method is one function and one `register` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from attnflow.trace import NEEDS


@dataclass(frozen=True)
class MethodSpec:
    name: str
    function: Callable[..., Any]
    summary: str
    options: tuple[str, ...]  # keyword options the method understands (the CLI passes only these)
    needs: frozenset[str] = frozenset({"attentions"})
    families: tuple[str, ...] | None = None  # adapter families it supports; None: every family
    scores_only: bool = False  # one score per token, no [query, key] matrix

    @property
    def uses_target(self) -> bool:
        return bool(self.needs & {"target", "attention_grads", "embedding_grads"})


_METHODS: dict[str, MethodSpec] = {}


def register(
    name: str,
    summary: str,
    options: tuple[str, ...],
    needs: tuple[str, ...] = ("attentions",),
    families: tuple[str, ...] | None = None,
    scores_only: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``function`` under ``name``."""
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"method {name!r} needs unknown names {sorted(unknown)}; known: {', '.join(NEEDS)}")

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if name in _METHODS:
            raise ValueError(f"method {name!r} is registered twice")
        _METHODS[name] = MethodSpec(name, function, summary, options, frozenset(needs), families, scores_only)
        return function

    return decorate


def get_method(name: str) -> MethodSpec:
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}") from None


def available_methods() -> list[str]:
    return sorted(_METHODS)


def methods_for(family: str) -> list[str]:
    """The registered methods that support an adapter family (e.g. ``"bert"``, ``"llama"``)."""
    return [name for name in available_methods() if _supports(_METHODS[name], family)]


def _supports(spec: MethodSpec, family: str) -> bool:
    return spec.families is None or family in spec.families


def check_family(spec: MethodSpec, family: str) -> None:
    """One clear line when ``spec`` does not support ``family``, naming the methods that do."""
    if spec.families is not None and family not in spec.families:
        raise ValueError(
            f"method {spec.name!r} does not support the {family} family (it supports: "
            f"{', '.join(spec.families)}); methods for {family}: {', '.join(methods_for(family))}"
        )
