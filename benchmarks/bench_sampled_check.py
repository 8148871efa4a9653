"""The sampled check of the patching estimates against the full correlation: does the Pearson r of an
estimate with exact patching on the check's sample (`attnflow.causal.api.check_design`: 24 sites a
kind, a third the estimate's strongest, the rest seeded, each drawn site weighted by the sites it
stands for) land within 0.1 of its r over every site? The unweighted r of the same sample (the
check before the weights) is printed beside it.

Reads the rows of a `benchmarks/bench_patching.py` run (its ``pairs.jsonl``, or the checkpoint while
it runs: every pair's exact sweep and every estimate over every site kind), draws the sample each
estimate's own run would draw (`patch(..., methods=METHOD)`: the sample holds that estimate's
strongest sites) and computes the sampled r exactly as `patch` does when an exact sweep is at hand
(the sample read from it: the same numbers a separate exact patch of those sites gives, to float32
batch noise). Prints per estimate and site kind the pooled r over every site of every pair, the
fraction of pairs whose sampled r is within 0.1 of the full r, and how often the check's warning
(sampled r < `CHECK_THRESHOLD`) agrees with the full r being below it; then the same fraction for
other seeds and sample sizes.

    OMP_NUM_THREADS=1 python benchmarks/bench_patching.py --pairs other --max-tokens 12 --limit 12 \\
        --out out/bench-patching-other
    OMP_NUM_THREADS=1 python benchmarks/bench_sampled_check.py out/bench-patching-other
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from attnflow.causal.api import CHECK_SITES, CHECK_THRESHOLD, check_design, correlation
from attnflow.causal.dataset import CHECKPOINT, ROWS, summarise
from attnflow.runs.checkpoint import read_checkpoint

WITHIN = 0.1


def read_rows(folder: Path) -> list[dict]:
    """The pairs' rows of a finished run (pairs.jsonl) or of one in progress (its checkpoint)."""
    if (folder / ROWS).exists():
        rows = [json.loads(line) for line in (folder / ROWS).read_text().splitlines() if line.strip()]
    else:
        rows = sorted(read_checkpoint(folder / CHECKPOINT)[1]["rows"].values(), key=lambda row: row["index"])
    return [row for row in rows if "error" not in row]


def sampled(row: dict, method: str, kind: str, size: int, seed: int, weighted: bool = True) -> tuple[float, float]:
    """(sampled r, full r) of one estimate on one pair's sites of one kind; ``weighted``: as `patch`
    computes it (each drawn site weighted by the sites it stands for), else unweighted."""
    estimate = np.asarray(row["effects"][method][kind], dtype=float)
    exact = np.asarray(row["effects"]["exact"][kind], dtype=float)
    sites, weights = check_design({method: {kind: estimate}}, size, seed)[kind]
    rows, columns = np.array(sites).T
    on_sample = correlation(estimate[rows, columns], exact[rows, columns], weights if weighted else None)
    return on_sample["pearson"], correlation(estimate, exact)["pearson"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a bench_patching.py --out folder")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 … N − 1 for the spread line")
    args = parser.parse_args()
    rows = read_rows(args.folder)
    methods = [method for method in rows[0]["effects"] if method != "exact"]
    kinds = list(rows[0]["effects"]["exact"])
    summary = summarise(rows)
    print(f"{len(rows)} pairs; sample {CHECK_SITES} sites a kind, seed 0; warning below r {CHECK_THRESHOLD}")
    print("| estimate | sites | pooled r (all sites) | mean per-pair r | sampled within 0.1 | warning agrees |")
    print("|---|---|---:|---:|---:|---:|")
    hits = total = 0
    for method in methods:
        for kind in kinds:
            pairs = [sampled(row, method, kind, CHECK_SITES, 0) for row in rows]
            close = sum(abs(s - f) <= WITHIN for s, f in pairs)
            agree = sum((s < CHECK_THRESHOLD) == (f < CHECK_THRESHOLD) for s, f in pairs)
            hits, total = hits + close, total + len(pairs)
            values = summary["correlations"][method][kind]
            print(
                f"| {method} | {kind} | {values['pooled_pearson']:.2f} | {values['pearson_mean']:.2f} | "
                f"{close}/{len(pairs)} | {agree}/{len(pairs)} |"
            )
    print(f"all estimates and kinds: sampled r within {WITHIN} of the full r for {hits}/{total} = {hits / total:.0%}")
    every = [(row, m, k) for row in rows for m in methods for k in kinds]
    plain = [sampled(row, m, k, CHECK_SITES, 0, weighted=False) for row, m, k in every]
    plain_misses = [(s, f) for s, f in plain if abs(s - f) > WITHIN]
    print(
        f"unweighted (the check before the weights): within {WITHIN} for {1 - len(plain_misses) / len(plain):.0%}, "
        f"sampled r higher in {sum(s > f for s, f in plain_misses)} of its {len(plain_misses)} misses"
    )
    low = [(s, f) for s, f in (sampled(row, m, k, CHECK_SITES, 0) for row, m, k in every)]
    caught = sum(s < CHECK_THRESHOLD for s, f in low if f < CHECK_THRESHOLD)
    alarms = sum(s < CHECK_THRESHOLD for s, f in low if f >= CHECK_THRESHOLD)
    print(
        f"warning: on {caught} of the {sum(f < CHECK_THRESHOLD for _, f in low)} with full r below "
        f"{CHECK_THRESHOLD}; false alarms {alarms} of {sum(f >= CHECK_THRESHOLD for _, f in low)}; "
        f"sampled r higher in {sum(s > f for s, f in low if abs(s - f) > WITHIN)} of the "
        f"{sum(abs(s - f) > WITHIN for s, f in low)} misses"
    )
    for size in (12, 24, 48):
        for weighted in (True, False):
            fractions = []
            for seed in range(args.seeds):
                pairs = [sampled(row, m, k, size, seed, weighted) for row, m, k in every]
                fractions.append(np.mean([abs(s - f) <= WITHIN for s, f in pairs]))
            print(
                f"sample of {size} ({'weighted' if weighted else 'unweighted'}): within {WITHIN} for "
                f"{np.mean(fractions):.0%} of (pair, estimate, kind) "
                f"(seeds 0–{args.seeds - 1}: {min(fractions):.0%}–{max(fractions):.0%})"
            )
    missed = [
        (row["clean_text"], m, k, s, f)
        for row in rows
        for m in methods
        for k in kinds
        for s, f in [sampled(row, m, k, CHECK_SITES, 0)]
        if abs(s - f) > WITHIN
    ]
    print("misses (seed 0): " + "; ".join(f"{t!r} {m} {k}: sampled {s:.2f}, full {f:.2f}" for t, m, k, s, f in missed))


if __name__ == "__main__":
    main()
