"""The dataset audit: what a classifier relies on across many texts (docs/audit.md).

    import attnflow
    results = attnflow.audit("minilm-sentiment", "out/audit", task="rotten-tomatoes", samples=500,
                             terms="he,she", swap="he:she,him:her")

This package is callable: ``attnflow.audit(...)`` is `attnflow.audit.engine.audit`, while
``attnflow.audit.engine``, ``.words``, ``.stats``, ``.analysis`` and ``.report`` stay importable.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from attnflow.audit.engine import audit, run_audit
from attnflow.audit.step import DEFAULT_METHOD, AuditOptions


class _CallableModule(types.ModuleType):
    """The package module, callable as `audit` (a package and a function cannot share one name otherwise)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["DEFAULT_METHOD", "AuditOptions", "audit", "run_audit"]
