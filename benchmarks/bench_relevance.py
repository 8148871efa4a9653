"""Relevance methods: batched attnflow against a plain per-example loop, measured in one run.

For each method, the same held-out Rotten Tomatoes snippets go through `minilm-sentiment`:
``model.explain(texts, batch_size=B)`` against ``[model.explain(text) for text in texts]``
(batch size 1, what the reference implementations do); value zeroing one altered variant at a
time against batches of variants. For `norm` it also times the reference
code's formulation, which materialises ``[head, query, key, d_model]`` per example, against
attnflow's Gram-matrix form on the same trace, and checks that both give the same matrix.

    python benchmarks/bench_relevance.py [--samples 32] [--batch-size 16] [--methods norm,alti,...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attnflow
from attnflow.datasets import rotten_tomatoes
from attnflow.explanation import explain
from attnflow.methods.relevance import norm_matrices


def timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def reference_norm(trace) -> np.ndarray:
    """Kobayashi et al.'s formulation: ‖Σ_h A f_h(x_j)‖ with the [head, query, key, d_model] tensor."""
    result = []
    for layer in range(trace.n_layers):
        transformed = np.einsum("jhd,hde->hje", trace.values[layer], trace.output_weights[layer])  # [head, key, d]
        weighted = trace.attentions[layer][..., None] * transformed[:, None]  # [head, query, key, d_model]
        result.append(np.linalg.norm(weighted.sum(axis=0), axis=-1))
    return np.stack(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--methods", default="norm,norm_rollout,alti,grad_rollout,grad_x_input,leave_one_out")
    args = parser.parse_args()
    data = rotten_tomatoes()
    _, test = data.split()
    texts = [data.texts[i] for i in test[: args.samples]]
    model = attnflow.load("minilm-sentiment", device="cpu")
    model.explain(texts[:2], method="norm")  # warm-up
    tokens = sum(e.n_tokens for e in model.explain(texts, method="random"))
    print(f"minilm-sentiment, {len(texts)} held-out snippets ({tokens / len(texts):.1f} tokens on average)")
    print(f"{'method':<16} {'loop s/ex':>10} {'batched s/ex':>13} {'speed-up':>9}  max |diff|")
    for method in args.methods.split(","):
        loop_time, loop = timed(lambda: [model.explain(text, method=method) for text in texts])
        batch_time, batched = timed(lambda: model.explain(texts, method=method, batch_size=args.batch_size))
        difference = max(float(np.abs(a.scores - b.scores).max()) for a, b in zip(loop, batched))
        print(
            f"{method:<16} {loop_time / len(texts):>10.4f} {batch_time / len(texts):>13.4f} "
            f"{loop_time / batch_time:>8.2f}x  {difference:.2e}"
        )
    # value zeroing re-runs each layer once per token: one variant at a time (the reference code)
    # against batches of 32 variants, on the same traces
    traces = model.trace(texts, needs=("attentions",))
    single_time, single = timed(lambda: [explain(t, "value_zeroing", model=model, batch_size=1) for t in traces])
    batch_time, batched = timed(lambda: [explain(t, "value_zeroing", model=model, batch_size=32) for t in traces])
    difference = max(float(np.abs(a.matrix - b.matrix).max()) for a, b in zip(single, batched))
    print(
        f"value_zeroing: one variant at a time {single_time / len(texts):.4f} s/ex, batches of 32 "
        f"{batch_time / len(texts):.4f} s/ex ({single_time / batch_time:.2f}x), max |diff| {difference:.1e}"
    )
    traces = model.trace(texts, needs=("values", "output_weights"))
    reference_time, references = timed(lambda: [reference_norm(t) for t in traces])
    gram_time, grams = timed(lambda: [norm_matrices(t) for t in traces])
    difference = max(float(np.abs(r - g).max()) for r, g in zip(references, grams))
    print(
        f"norm matrices: reference [head, query, key, d_model] {reference_time / len(texts):.4f} s/ex, "
        f"Gram form {gram_time / len(texts):.4f} s/ex ({reference_time / gram_time:.1f}x), max |diff| {difference:.1e}"
    )


if __name__ == "__main__":
    main()
