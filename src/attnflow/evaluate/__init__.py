"""Faithfulness benchmark: how truthfully each registered method explains a classifier.

Metrics (`metrics`) are pure functions on score arrays; perturbed inputs are rebuilt from token
ids (`perturb`); a batched scorer (`scorer`) gives class probabilities; `sanity` randomises the
model from the top down; `benchmark` runs every method through one loop; `report` writes the
table, figures and HTML page. Nothing here imports a specific method: scores come from the
model's ``explain`` front door (`attribute`).

    import attnflow.evaluate as ev
    results = ev.evaluate("minilm-sentiment", methods=["rollout", "alti", "random"], samples=50, out="out/eval")
"""

from attnflow.evaluate.api import evaluate, select_samples
from attnflow.evaluate.benchmark import BenchmarkOptions, run_benchmark
from attnflow.evaluate.metrics import BINS

__all__ = ["BINS", "BenchmarkOptions", "evaluate", "run_benchmark", "select_samples"]
