"""Loading models and capturing their attention into `Trace`s (no method math here; where each
part of a model lives is `attnflow.rows`).

The torch-heavy parts (`CaptureModel`; `load` imports transformers when called) import on first
use, so that listing models or printing `--help` stays fast.
"""

from attnflow.capture.loading import EMBEDDED, install_dinov2_s, install_mpnet, load, load_as, resolve

_MODEL_NAMES = ("BatchCapture", "CaptureModel", "resolve_device")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        from attnflow.capture import model

        return getattr(model, name)
    raise AttributeError(f"module 'attnflow.capture' has no attribute {name!r}")


__all__ = ["EMBEDDED", "install_dinov2_s", "install_mpnet", "load", "load_as", "resolve", *_MODEL_NAMES]
