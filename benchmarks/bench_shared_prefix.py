"""Edited inputs of a causal LM on their input's key/value cache against whole forwards, in one run.

On held-out next-token windows of smollm2 (as ``attnflow evaluate --task next-token`` cuts them), two
workloads run both ways: leave-one-out of every window (batched, as the benchmark's agreement
reference runs it) and the faithfulness metrics' perturbed inputs of each window under one method's
ranking (``--ranking``: attnlrp, the benchmark's first candidate, or random; comprehensiveness and
sufficiency bins, deletion curve). "whole" disables the cache
(every edited input runs from its first token, as before), "cached" is attnflow's default; both
give the same numbers (max |diff| printed).

    OMP_NUM_THREADS=1 python benchmarks/bench_shared_prefix.py [--windows 16] [--window 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attnflow
import attnflow.shared_prefix as shared_prefix
from attnflow.datasets import next_token_windows
from attnflow.evaluate.benchmark import BenchmarkOptions, mask_token_id, perturbation_probabilities, prepare_examples
from attnflow.evaluate.metrics import content_ranking
from attnflow.evaluate.scorer import ClassifierScorer


def timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="alternating whole/cached runs; the best of each")
    parser.add_argument("--ranking", default="attnlrp", help="the method whose rankings are perturbed, or random")
    args = parser.parse_args()
    model = attnflow.load(args.model, device="cpu")
    texts = list(next_token_windows(model.tokenizer, args.window).texts[: args.windows])
    examples = prepare_examples(model, ClassifierScorer(model), texts, [0] * len(texts))
    if args.ranking == "random":
        rng = np.random.default_rng(0)
        rankings = [rng.permutation(int((~e.special_mask).sum())) for e in examples]
    else:
        maps = model.explain(texts, method=args.ranking)
        rankings = [content_ranking(m.scores, e.special_mask) for m, e in zip(maps, examples, strict=True)]
    options, mask_id = BenchmarkOptions(), mask_token_id(model)
    usable = shared_prefix._cache_argument

    def leave_one_out():
        return np.concatenate([e.scores for e in model.explain(texts, method="leave_one_out")])

    def perturbations():
        parts = perturbation_probabilities(ClassifierScorer(model), examples, rankings, options, mask_id)
        return np.concatenate([part.ravel() for part in parts])

    model.explain(texts[:2], method="leave_one_out")  # warm-up
    print(f"{args.model}, {len(texts)} held-out windows of {args.window} tokens, one process")
    print(f"{'workload':<28} {'whole s':>8} {'cached s':>9} {'speed-up':>9}  max |diff|")
    workloads = {"leave-one-out": leave_one_out, f"perturbed inputs ({args.ranking})": perturbations}
    for name, workload in workloads.items():
        best = {"whole": np.inf, "cached": np.inf}
        values = {}
        for _ in range(args.repeats):
            for mode in ("whole", "cached"):
                shared_prefix._cache_argument = (lambda model: None) if mode == "whole" else usable
                seconds, values[mode] = timed(workload)
                best[mode] = min(best[mode], seconds)
        shared_prefix._cache_argument = usable
        difference = float(np.abs(values["whole"] - values["cached"]).max())
        print(
            f"{name:<28} {best['whole']:>8.2f} {best['cached']:>9.2f} {best['whole'] / best['cached']:>8.2f}×  "
            f"{difference:.1e} (of values up to {np.abs(values['whole']).max():.2f})"
        )


if __name__ == "__main__":
    main()
