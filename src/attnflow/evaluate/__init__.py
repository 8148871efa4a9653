"""Faithfulness benchmark: how truthfully each registered method explains a classifier.

Metrics (`metrics`) are pure functions on score arrays; perturbed inputs are rebuilt from token
ids (`deletion`); a batched scorer (`scorer`) gives class probabilities; `bounds` finds the lowest
and highest AOPC of each input (normalised AOPC); `sanity` randomises the model from the top down;
`benchmark` runs every method through one loop; `per_input` scores one explanation's own
faithfulness; `report` writes the table, figures and HTML page. Nothing here imports a specific
method: scores come from the model's ``explain`` front door (`attribute`).

    import attnflow.evaluate as ev
    results = ev.evaluate("minilm-sentiment", methods=["rollout", "alti", "random"], samples=50, out="out/eval")

The names below load on first use (the benchmark imports torch), so `attnflow --help` stays fast.
"""

import importlib
from typing import Any

_HOMES = {
    "evaluate": "attnflow.evaluate.api",
    "select_samples": "attnflow.evaluate.api",
    "BenchmarkOptions": "attnflow.evaluate.benchmark",
    "run_benchmark": "attnflow.evaluate.benchmark",
    "BINS": "attnflow.evaluate.metrics",
}

__all__ = ["BINS", "BenchmarkOptions", "evaluate", "run_benchmark", "select_samples"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'attnflow.evaluate' has no attribute {name!r}")
