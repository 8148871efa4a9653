"""Routes in 16 bits against float32 on the same prompts (docs/precision.md's routes row).

The model is loaded twice, in float32 and in ``--dtype``; for each of the first ``--samples``
embedded Wikipedia summaries cut to ``--max-tokens`` tokens (`attnflow.flow_routes.dataset.cut`),
`attnflow.routes` (τ = 0.04, no lens) runs in both and the two are compared: whether the
predicted next token is the same; the share of float32's ``--top`` most important route edges
(kind, layer, source, target) among the 16-bit run's top ``--top``; Spearman ρ of the head importance
``[L, H]`` on every edge (`Routes.importance_full.heads`) and on the route (`Routes.importance.heads`);
and the largest difference of any attention share (`Graph.attention`). Means over the prompts,
with the minimum in brackets, and both precisions' times.

    OMP_NUM_THREADS=1 python benchmarks/bench_routes_dtype.py [--model smollm2] [--dtype bfloat16]
        [--samples 24] [--max-tokens 24] [--top 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import islice

import numpy as np

import attnflow
from attnflow.flow_routes.dataset import cut
from attnflow.methods.agreement import spearman
from attnflow.runs.readers import open_corpus


def edge_keys(routes: attnflow.Routes, top: int) -> set[tuple]:
    """The ``top`` most important route edges, by what they join."""
    return {(edge.kind, edge.layer, edge.source, edge.target) for edge in routes.edges[:top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    full = attnflow.load(args.model, progress=False)
    low = attnflow.load(args.model, dtype=args.dtype, progress=False)
    texts = [cut(full.tokenizer, text, args.max_tokens) for text in islice(open_corpus("wiki"), args.samples)]
    attnflow.routes(full, texts[0], lens="none"), attnflow.routes(low, texts[0], lens="none")  # warm-up
    rows = []
    for text in texts:
        start = time.perf_counter()
        a = attnflow.routes(full, text, lens="none")
        middle = time.perf_counter()
        b = attnflow.routes(low, text, lens="none")
        end = time.perf_counter()
        rows.append(
            {
                "same_prediction": a.prediction["id"] == b.prediction["id"],
                "edges": len(edge_keys(a, args.top) & edge_keys(b, args.top)) / max(1, len(edge_keys(a, args.top))),
                "rho_full": spearman(a.importance_full.heads.ravel(), b.importance_full.heads.ravel()),
                "rho_route": spearman(a.importance.heads.ravel(), b.importance.heads.ravel()),
                "attention": float(np.abs(a.graph.attention - b.graph.attention).max()),
                "seconds": (middle - start, end - middle),
            }
        )
        print(f"{text[:40]!r}: " + ", ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)

    def mean_min(key: str) -> str:
        values = [row[key] for row in rows]
        return f"{statistics.mean(values):.3f} ({min(values):.3f})"

    print(
        f"{args.model} {args.dtype} vs float32, {len(rows)} prompts of ≤ {args.max_tokens} tokens: "
        f"same prediction {sum(row['same_prediction'] for row in rows)}/{len(rows)}; "
        f"top-{args.top} edge overlap {mean_min('edges')}; head importance ρ, every edge {mean_min('rho_full')}, "
        f"route {mean_min('rho_route')}; largest attention-share difference "
        f"{max(row['attention'] for row in rows):.4f}; seconds float32 {sum(r['seconds'][0] for r in rows):.1f}, "
        f"{args.dtype} {sum(r['seconds'][1] for r in rows):.1f}"
    )


if __name__ == "__main__":
    main()
