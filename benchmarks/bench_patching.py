"""Activation patching on smollm2: AtP, AtP*, RelP and AtP-IG against exact patching, and the
batched exact sweep against a per-site loop of forward passes, measured in one run.

Pairs (``--pairs``): ``shipped``, the factual prompts with counterfactual subjects in
attnflow/causal/data/factual.jsonl (the set the defaults were chosen on), or ``heldout``, the 28
pairs of factual_heldout.jsonl written afterwards and disjoint from them (capitals, languages,
landmarks, continents; each checked on smollm2: same token length, single-token answers, the clean
prompt prefers the target and the corrupt one the contrast), or ``other``, the 12 pairs of
factual_other.jsonl written by another procedure (other templates, multi-token subjects, no
geography; checked the same way), or ``fresh``, the 9 pairs of factual_fresh.jsonl written after
the sampled check's design was fixed (dates whose answer is a later digit of a year, greetings,
authors, physics and biology; the clean and corrupt texts' top predictions are the target and the
contrast); shortest first, at most
``--max-tokens`` tokens (CPU time grows with the tokens twice: more sites, longer passes).
Metric: logit(target) − logit(contrast); denoising; every site kind. The run is checkpointed in
``--out`` (rerun to continue). Prints, per site kind, the Pearson and Spearman correlation of each
approximation with exact patching (pooled over every site of every pair, and the mean over pairs),
the time ratio exact / approximation, and the batched sweep's speed-up over a loop of one forward
per site on the same sites (their metrics must agree to 1e-4).

    OMP_NUM_THREADS=1 python benchmarks/bench_patching.py [--max-tokens 6] [--limit 24] [--out out/bench-patching]
    OMP_NUM_THREADS=1 python benchmarks/bench_patching.py --pairs heldout --max-tokens 12 --limit 28 \
        --out out/bench-patching-heldout
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

import attnflow
from attnflow.causal.api import resolve_metric
from attnflow.causal.dataset import CHECKPOINT, patch_file, read_pairs, summarise
from attnflow.causal.patching import PatchRunner, exact_sweep, stacked
from attnflow.causal.sites import SITE_KINDS, all_sites
from attnflow.runs.checkpoint import read_checkpoint
from attnflow.runs.engine import EngineOptions
from attnflow.targets import Target

APPROXIMATIONS = ("atp", "atp*", "relp", "atp-ig")
PAIR_FILES = {
    "shipped": "factual.jsonl",
    "heldout": "factual_heldout.jsonl",
    "other": "factual_other.jsonl",
    "fresh": "factual_fresh.jsonl",
}


def chosen_pairs(model, max_tokens: int, limit: int, which: str = "shipped") -> list[dict]:
    """The pairs of ``which`` set of at most ``max_tokens`` tokens, shortest first, at most ``limit``."""
    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / PAIR_FILES[which])))
    pairs = [(len(model.tokenizer(pair["clean"])["input_ids"]), number, pair) for number, pair in enumerate(pairs)]
    return [pair for length, _, pair in sorted(pairs, key=lambda item: item[:2]) if length <= max_tokens][:limit]


def loop_against_batch(model, pair: dict, n_sites: int, batch_size: int) -> dict:
    """The same ``n_sites`` sites (spread over every kind) patched in batches and one forward each."""
    clean = model.tokenizer(pair["clean"], return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(pair["corrupt"], return_tensors="pt")["input_ids"]
    target = Target(pair["target"], contrast=pair["contrast"])
    runner = PatchRunner(model, resolve_metric(model, clean, target))
    with torch.no_grad():
        source = stacked(runner.forward(clean, 1, record=True)[1])
    every = [s for kind in SITE_KINDS for s in all_sites(kind, model.n_layers, clean.shape[1], model.n_heads)]
    sites = every[:: max(1, len(every) // n_sites)][:n_sites]
    start = time.perf_counter()
    batched = exact_sweep(runner, corrupt, None, source, sites, 1, batch_size)
    batched_seconds = time.perf_counter() - start
    start = time.perf_counter()
    looped = exact_sweep(runner, corrupt, None, source, sites, 1, 1)
    loop_seconds = time.perf_counter() - start
    difference = float(np.abs(batched - looped).max())
    assert difference < 1e-4, difference
    return {
        "sites": len(sites),
        "batch_size": batch_size,
        "batched_seconds": batched_seconds,
        "loop_seconds": loop_seconds,
        "speedup": loop_seconds / batched_seconds,
        "max_difference": difference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", choices=tuple(PAIR_FILES), default="shipped")
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--loop-sites", type=int, default=96, help="sites of the loop-against-batch timing")
    parser.add_argument("--out", type=Path, default=Path("out/bench-patching"))
    parser.add_argument(
        "--summary-only", action="store_true", help="print the table of the pairs checkpointed in --out so far"
    )
    args = parser.parse_args()
    if args.summary_only:
        if (args.out / "bench.json").exists():  # a finished run keeps its summary, not its checkpoint
            finished = json.loads((args.out / "bench.json").read_text())
            print_table(finished["summary"], finished["loop"])
            return
        rows = sorted(read_checkpoint(args.out / CHECKPOINT)[1]["rows"].values(), key=lambda row: row["index"])
        print_table(summarise(rows), json.loads((args.out / "loop.json").read_text()))
        return
    model = attnflow.load("smollm2", device="cpu")
    pairs = chosen_pairs(model, args.max_tokens, args.limit, args.pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    pairs_file = args.out / "pairs-input.jsonl"
    pairs_file.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    loop = loop_against_batch(model, pairs[0], args.loop_sites, args.batch_size)  # first: a few seconds
    (args.out / "loop.json").write_text(json.dumps(loop, indent=1))
    summary = patch_file(
        model,
        pairs_file,
        args.out,
        resume=(args.out / CHECKPOINT).exists(),
        engine=EngineOptions(),  # its progress bar counts the pairs
        sites=SITE_KINDS,
        methods=("exact", *APPROXIMATIONS),
        batch_size=args.batch_size,
        progress=False,
    )
    ratios = print_table(summary, loop)
    (args.out / "bench.json").write_text(
        json.dumps({"summary": summary, "time_ratios": ratios, "loop": loop}, indent=1)
    )


def print_table(summary: dict, loop: dict) -> dict[str, float]:
    """The markdown table of correlations, the time ratios and the loop speed-up; returns the ratios."""
    seconds = summary["seconds"]
    print(f"\n{summary['pairs']} pairs ({len(summary['failed'])} left out), smollm2, denoising, logit difference")
    print("| sites | " + " | ".join(f"{m} Pearson (pooled / mean)" for m in APPROXIMATIONS) + " |")
    print("|---|" + "---|" * len(APPROXIMATIONS))
    for kind in SITE_KINDS:
        cells = []
        for method in APPROXIMATIONS:
            values = summary["correlations"][method][kind]
            cells.append(
                f"{values['pooled_pearson']:.2f} / {values['pearson_mean']:.2f} (ρ {values['pooled_spearman']:.2f})"
            )
        print(f"| {kind} | " + " | ".join(cells) + " |")
    ratios = {method: seconds["exact"] / seconds[method] for method in APPROXIMATIONS}
    print("time exact / approximation: " + ", ".join(f"{m} {r:.1f}x" for m, r in ratios.items()))
    print(
        f"batched exact sweep vs a loop of forwards ({loop['sites']} sites, batch {loop['batch_size']}): "
        f"{loop['loop_seconds']:.1f} s / {loop['batched_seconds']:.1f} s = {loop['speedup']:.1f}x "
        f"(max difference {loop['max_difference']:.1e})"
    )
    return ratios


if __name__ == "__main__":
    main()
