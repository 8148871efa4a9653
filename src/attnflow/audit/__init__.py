"""The dataset audit: what a classifier relies on across many texts (docs/audit.md).

    import attnflow
    results = attnflow.audit("minilm-sentiment", "out/audit", task="rotten-tomatoes", samples=500,
                             terms="he,she", swap="he:she,his:her")

This package is callable: ``attnflow.audit(...)`` is `attnflow.audit.engine.audit`, while
``attnflow.audit.engine``, ``.words``, ``.stats``, ``.analysis`` and ``.report`` stay importable.
Its names load on first use, so that ``attnflow --help`` does not import torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "audit": "attnflow.audit.engine",
    "run_audit": "attnflow.audit.engine",
    "AuditOptions": "attnflow.audit.step",
    "DEFAULT_METHOD": "attnflow.audit.step",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnflow.audit' has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """The package module, callable as `audit` (a package and a function cannot share one name otherwise)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from attnflow.audit.engine import audit

        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = sorted(_EXPORTS)
