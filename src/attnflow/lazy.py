"""Package attributes that load their module on first use, so that importing a package stays cheap
(no torch, no plotting until they are needed), and that `dir()` and tab completion still list.

    _LAZY = {"load": "attnflow.model", ...}
    __getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_attributes(
    package: str, table: Mapping[str, str], namespace: Mapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` (an attribute named in ``table`` comes from the module it names,
    imported then) and ``__dir__`` (the module's own names, ``namespace``, and the lazy ones)."""

    def getattr_(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted({*namespace, *table})

    return getattr_, dir_
