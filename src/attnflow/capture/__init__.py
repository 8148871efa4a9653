"""Loading models and capturing their attention into `Trace`s (no method math here).

The torch-heavy parts (`CaptureModel`, `check_adapter`; `load` imports transformers when called)
import on first use, so that listing models or printing `--help` stays fast.
"""

from attnflow.capture.adapters import (
    ADAPTERS,
    Adapter,
    Fused,
    GatedMLP,
    Norms,
    Sites,
    Stack,
    Streams,
    Values,
    adapter_for,
    register_adapter,
    unregister_adapter,
)
from attnflow.capture.loading import EMBEDDED, install_dinov2_s, install_mpnet, load, load_as, resolve

_MODEL_NAMES = ("BatchCapture", "CaptureModel", "resolve_device")
_CONFORMANCE_NAMES = ("AdapterCheckError", "check_adapter")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        from attnflow.capture import model

        return getattr(model, name)
    if name in _CONFORMANCE_NAMES:
        from attnflow.capture import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'attnflow.capture' has no attribute {name!r}")


__all__ = [
    "ADAPTERS",
    "EMBEDDED",
    "Adapter",
    "Fused",
    "GatedMLP",
    "Norms",
    "Sites",
    "Stack",
    "Streams",
    "Values",
    "adapter_for",
    "install_dinov2_s",
    "install_mpnet",
    "load",
    "load_as",
    "register_adapter",
    "resolve",
    "unregister_adapter",
    *_MODEL_NAMES,
    *_CONFORMANCE_NAMES,
]
