"""Information flow routes (Ferrando & Voita 2024): how much each part of every residual update
contributes to the whole, from one forward pass, and the route a prediction takes through them
(definitions: docs/routes.md).

The package is also the front door: ``attnflow.routes(model, text, ...)`` calls
`attnflow.routes.api.routes` and returns a `Routes`. Modules: ``forward`` (the one forward pass,
its hooks and the weights read), ``contributions`` (parts, proximities, the compiled kernel),
``graph`` (extraction, importance), ``lens`` (the logit lens, direct effects), ``api`` (the front
door), ``result`` (`Routes`, ``routes.json``).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    """``attnflow.routes`` is both this package and the function that computes routes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from attnflow.routes.api import routes

        return routes(*args, **kwargs)


def __getattr__(name: str) -> Any:
    # torch loads with the modules that use it, on first use
    if name == "routes":
        from attnflow.routes.api import routes

        return routes
    if name == "Routes":
        from attnflow.routes.result import Routes

        return Routes
    raise AttributeError(f"module 'attnflow.routes' has no attribute {name!r}")


sys.modules[__name__].__class__ = _CallablePackage
