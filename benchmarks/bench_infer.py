"""What inferring an adapter row costs at load: `attnflow.load` of a model with a hand row (its
load time is the baseline, measured in the same run) against the same load plus inference and the
conformance checks on its row (`attnflow.rows.infer.verified_row`), the work a model type without
a hand row adds.

    .venv/bin/python benchmarks/bench_infer.py                 # smollm2 (real weights)
    .venv/bin/python benchmarks/bench_infer.py --model PATH    # any model folder
"""

from __future__ import annotations

import argparse
import statistics
import time

import attnflow
from attnflow.rows.infer import verified_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    loads, inferences = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        model = attnflow.load(args.model, device="cpu", progress=False)
        loads.append(time.perf_counter() - start)
        start = time.perf_counter()
        row = verified_row(model.hf_model, model.adapter.kind)
        inferences.append(time.perf_counter() - start)
    load, inference = statistics.median(loads), statistics.median(inferences)
    print(f"{args.model}: load {load:.2f} s (hand row), inference + checks {inference:.2f} s more "
          f"({inference / load:.2f}x the load); inferred row unverified: {list(row.unverified) or 'none'}")


if __name__ == "__main__":
    main()
