"""Routes against exact patching, with and without the counterfactual: does weighting the route's
node importance by how much each node differs between the clean and the corrupted run follow
activation patching better than the route alone?

For each factual pair (smollm2, denoising, metric logit(target) − logit(contrast)) the exact
residual sweep gives, for every residual row r and position j, the share of the answer restoring
the clean stream at (r, j) brings back (`attnflow.patch(..., sites="residual", methods="exact")`).
Predictions for the same cells, each ``[L + 1, T]``:

- ``routes``: the route's node importance on the clean text (`prediction_importance`, what
  ``attnflow patch --versus routes`` compares; threshold 0.04);
- ``difference``: ‖x_clean(r, j) − x_corrupt(r, j)‖, how much the stream at that node differs between
  the two runs (no route: the control);
- ``routes × difference``: the route's importance times that difference (the counterfactual mode
  tried: a node matters to patching when the prediction reads it *and* it differs);
- ``routes × relative``: the route's importance times ‖x_clean − x_corrupt‖ / ‖x_clean‖, the
  share of the node the corruption changes: what `prediction_importance(..., corrupt=...)` and
  ``attnflow patch --versus routes_counterfactual`` compute (called here, not re-implemented).

Prints per residual row the mean Spearman ρ over pairs (over positions, as `attnflow.causal.versus`
computes it), and the mean over rows (the rows where ρ is defined). The exact sweeps are reused
from a `benchmarks/bench_patching.py` output (``--rows``, its pairs.jsonl) where one is given.

    OMP_NUM_THREADS=1 python benchmarks/bench_routes_counterfactual.py --pairs shipped --max-tokens 6 --limit 24
    OMP_NUM_THREADS=1 python benchmarks/bench_routes_counterfactual.py --pairs other --limit 12 \\
        --rows out/bench-patching-other/pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import attnflow
from attnflow.causal import patch
from attnflow.causal.versus import LayerComparison, format_table, spearman_table
from attnflow.flow_routes.api import prediction_importance
from attnflow.flow_routes.forward import record
from attnflow.targets import Target
from bench_patching import chosen_pairs


def streams(model, text: str) -> torch.Tensor:
    """``[L + 1, T, d]`` the residual stream entering each layer and leaving the last (float64)."""
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
    return record(model, ids).inputs.double()


def exact_residual(model, pair: dict, rows: dict[str, dict]) -> np.ndarray:
    """``[L + 1, T]`` the exact denoising effects of the residual sites (from ``rows`` if there)."""
    if pair["clean"] in rows:
        return np.asarray(rows[pair["clean"]]["effects"]["exact"]["residual"], dtype=float)
    target = Target(pair["target"], contrast=pair["contrast"])
    result = patch(
        model, pair["clean"], pair["corrupt"], target=target, sites="residual", methods="exact", progress=False
    )
    return result.effects["exact"]["residual"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", choices=("shipped", "heldout", "other"), default="shipped")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--rows", type=Path, help="a bench_patching pairs.jsonl whose exact sweeps to reuse")
    parser.add_argument("--out", type=Path, help="write every pair's arrays and the table as JSON")
    args = parser.parse_args()
    model = attnflow.load("smollm2", device="cpu")
    rows = {}
    if args.rows is not None:
        for line in args.rows.read_text().splitlines():
            row = json.loads(line)
            if "error" not in row:
                rows[row["clean_text"]] = row
    comparisons = []
    for pair in chosen_pairs(model, args.max_tokens, args.limit, args.pairs):
        effects = exact_residual(model, pair, rows)
        routes = prediction_importance(model, pair["clean"], "last")
        clean, corrupt = streams(model, pair["clean"]), streams(model, pair["corrupt"])
        difference = (clean - corrupt).norm(dim=-1).numpy()  # [L + 1, T]
        predictions = {
            "routes": routes,
            "difference": difference,
            "routes × difference": routes * difference,
            "routes × relative": prediction_importance(model, pair["clean"], "last", corrupt=pair["corrupt"]),
        }
        tokens = model.tokenizer.convert_ids_to_tokens(model.tokenizer(pair["clean"])["input_ids"])
        comparisons.append(LayerComparison(pair["clean"], pair["corrupt"], tokens, "last", effects, predictions))
        print(f"{pair['clean']!r}: " + ", ".join(
            f"{name} {np.nanmean(rho):+.2f}" for name, rho in comparisons[-1].spearman().items()
        ), flush=True)  # fmt: skip
    table = spearman_table(comparisons)
    print(f"\n{len(comparisons)} pairs ({args.pairs}), smollm2: Spearman ρ over positions per residual row")
    print(format_table(table))
    means = {method: float(np.nanmean(values["mean"])) for method, values in table.items()}
    print("mean over rows: " + ", ".join(f"{method} {value:+.2f}" for method, value in means.items()))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "pairs": [comparison.to_dict() for comparison in comparisons],
                    "table": {m: {k: np.asarray(v).tolist() for k, v in t.items()} for m, t in table.items()},
                    "mean_over_rows": means,
                }
            )
        )


if __name__ == "__main__":
    main()
