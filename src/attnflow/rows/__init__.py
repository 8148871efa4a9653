"""Where each part of a model lives, and the proof that it does: the adapter rows (one per family,
hand-written, or inferred from a model that has none), and the conformance suite that checks a row
on its model.

The torch-heavy parts (`check_adapter`) import on first use, so that listing models or printing
`--help` stays fast.
"""

from attnflow.rows.adapters import (
    ADAPTERS,
    Adapter,
    Experts,
    Fused,
    GatedMLP,
    Mixers,
    Norms,
    Sites,
    Stack,
    Streams,
    Values,
    adapter_for,
    register_adapter,
    unregister_adapter,
)

_CONFORMANCE_NAMES = ("AdapterCheckError", "check_adapter")


def __getattr__(name: str):
    if name in _CONFORMANCE_NAMES:
        from attnflow.rows import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'attnflow.rows' has no attribute {name!r}")


__all__ = [
    "ADAPTERS",
    "Adapter",
    "Experts",
    "Fused",
    "GatedMLP",
    "Mixers",
    "Norms",
    "Sites",
    "Stack",
    "Streams",
    "Values",
    "adapter_for",
    "register_adapter",
    "unregister_adapter",
    *_CONFORMANCE_NAMES,
]
