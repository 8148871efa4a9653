"""The dataset audit: what a classifier relies on across many texts (docs/audit.md).

    import attnflow
    results = attnflow.audit("minilm-sentiment", "out/audit", task="rotten-tomatoes", samples=500,
                             terms="he,she", swap="he:she,his:her")

``attnflow.audit`` is `attnflow.dataset_audit.engine.audit`. Its names load on first use, so that
``attnflow --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "audit": "attnflow.dataset_audit.engine",
    "run_audit": "attnflow.dataset_audit.engine",
    "AuditOptions": "attnflow.dataset_audit.step",
    "DEFAULT_METHOD": "attnflow.dataset_audit.step",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnflow.dataset_audit' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
