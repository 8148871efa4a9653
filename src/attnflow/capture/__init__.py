"""Loading models and capturing their attention into `Trace`s (no method math here)."""

from attnflow.capture.adapters import ADAPTERS, Adapter, Stack, adapter_for
from attnflow.capture.loading import EMBEDDED, install_mpnet, resolve
from attnflow.capture.model import AttentionModel, BatchCapture, load, resolve_device

__all__ = [
    "ADAPTERS",
    "Adapter",
    "AttentionModel",
    "BatchCapture",
    "EMBEDDED",
    "Stack",
    "adapter_for",
    "install_mpnet",
    "load",
    "resolve",
    "resolve_device",
]
