"""How results show themselves in a notebook: one compact ``repr`` line and a small HTML summary
(``_repr_html_``) for every result object, and the cell a result was made in (its warnings were
said on stderr there: its HTML does not say them a second time in the same cell).

The HTML views live in `attnflow.viz.notebook` (connected by the package root into `_VIEWS`, as
the pages are): this module imports nothing of attnflow, so low-level results (`attnflow.trace`,
`attnflow.flow_routes`) can use it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping

import numpy as np

# kind -> the HTML summary of a result of that kind (`attnflow.viz.notebook`; the root connects them).
_VIEWS: dict[str, Callable[[Any], str]] = {}
SHOWN_ITEMS = 3  # how many top entries a repr names


def current_cell() -> int | None:
    """The execution count of the notebook cell running now (IPython), or None outside a notebook."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    count = getattr(shell, "execution_count", None)
    return count if isinstance(count, int) else None


def compact_repr(name: str, fields: Mapping[str, Any]) -> str:
    """``Name(key=value, ...)`` on one line: arrays by their shape, long texts shortened, None left out."""
    return f"{name}({', '.join(f'{key}={_short(value)}' for key, value in fields.items() if value is not None)})"


def _short(value: Any, width: int = 60) -> str:
    if isinstance(value, np.ndarray):
        return f"[{' x '.join(str(size) for size in value.shape)}]"
    if isinstance(value, str):
        return repr(value if len(value) <= width else value[: width - 1] + "…")
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(str(item) for item in value[: 2 * SHOWN_ITEMS])
        return f"[{shown}{', …' if len(value) > 2 * SHOWN_ITEMS else ''}]"
    return str(value)


def view(kind: str, result: Any) -> str:
    """The HTML summary of ``result`` (one of `_VIEWS`' kinds)."""
    return _VIEWS[kind](result)


class Results(dict):
    """A run's results dictionary (what ``results.json`` or ``summary.json`` holds; still a plain
    ``dict`` to index and serialise) that shows itself compactly: ``kind`` is ``"audit"``,
    ``"evaluate"`` or ``"corpus"``."""

    def __init__(self, kind: str, results: Mapping[str, Any]) -> None:
        super().__init__(results)
        self.kind = kind

    def __repr__(self) -> str:
        """One line: the kind, the model, the run's size and the top-level keys (the numbers are in the dict)."""
        run: dict[str, Any] = self["run"] if isinstance(self.get("run"), dict) else {}
        model = run.get("model", self.get("model"))
        fields: dict[str, Any] = {"kind": self.kind, "model": model.get("name") if isinstance(model, dict) else model}
        for key in ("method", "methods", "samples"):
            fields[key] = run.get(key, self.get(key))
        fields["keys"] = list(self)
        return compact_repr("Results", fields)

    def _repr_html_(self) -> str:
        """A small table: the run, then each section's headline numbers."""
        return view("results", self)
