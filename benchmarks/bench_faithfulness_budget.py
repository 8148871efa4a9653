"""What per-input faithfulness costs on a warm model: `attnflow explain`'s (and `attnflow serve`'s)
default request — auto's candidates, each map's faithfulness on this input — on texts the model has
not seen, of three lengths, against the greedy bounds search every input got before the budget
(a beam of width 1 beyond 8 content tokens), measured in the same run on the same texts.

    .venv/bin/python benchmarks/bench_faithfulness_budget.py            # ~2 min
    .venv/bin/python benchmarks/bench_faithfulness_budget.py --texts 3  # fewer texts per length

The texts are held-out Rotten Tomatoes snippets (the classifier never trained on them): one
snippet (~16 tokens), snippets joined to ~80 tokens, and joined to ~300 words. Each request is
timed from the plan to the last badge (the model loaded and warmed up on another text first); the
old search is timed alone on the same input (its bounds are what the request paid on top of the
maps and random rankings), only where it finishes in minutes (16 and 80 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

LENGTHS = {"~16 tokens": (10, 20), "~80 tokens": (72, 88), "~300 words": (300, None)}


def held_out_texts(tokenizer, per_length: int) -> dict[str, list[str]]:
    """``per_length`` texts per length class, from the held-out Rotten Tomatoes snippets."""
    from attnflow.datasets import load_task

    data = load_task("rotten-tomatoes")
    snippets = [data.texts[i] for i in data.split()[1]]
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    texts: dict[str, list[str]] = {name: [] for name in LENGTHS}
    short_low, short_high = LENGTHS["~16 tokens"]
    texts["~16 tokens"] = [s for s in snippets if short_low <= count(s) <= short_high][:per_length]
    joined, rest = [], iter(snippets[500:])
    for name, (low, high) in list(LENGTHS.items())[1:]:
        while len(texts[name]) < per_length:
            joined.append(next(rest))
            text = " ".join(joined)
            size = len(text.split()) if name.endswith("words") else count(text)
            if size >= low:
                if high is None or size <= high:
                    texts[name].append(text)
                joined = []
    return texts


def request(model, text: str) -> tuple[float, dict]:
    """Seconds of one default explain request (plan, trace, auto's candidates, badges)."""
    from attnflow.evaluate.per_input import explain_planned, plan_methods

    began = time.perf_counter()
    plan = plan_methods(model, None, {})
    trace = model.trace_for(list(plan.per_method), [text])[0]
    (chosen,) = explain_planned(model, trace, plan)
    return time.perf_counter() - began, {"tokens": len(trace.tokens), "chosen": chosen}


def old_bounds_seconds(model, text: str) -> float:
    """Seconds of the greedy search (beam width 1) the badges ran on every input before the budget."""
    from attnflow.evaluate.benchmark import Example, mask_token_id
    from attnflow.evaluate.bounds import search_bounds
    from attnflow.evaluate.per_input import BINS
    from attnflow.evaluate.scorer import ClassifierScorer

    trace = model.trace([text], needs=("target",))[0]
    example = Example(
        text,
        -1,
        tuple(int(i) for i in trace.token_ids),
        np.asarray(trace.special_mask, dtype=bool),
        int(trace.target.index),
        float(trace.target.probability),
    )
    began = time.perf_counter()
    search_bounds(ClassifierScorer(model), [example], BINS, "remove", mask_token_id(model), "beam", beam_width=1)
    return time.perf_counter() - began


def main() -> None:
    import torch

    import attnflow

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=5, help="unseen texts per length (default 5)")
    args = parser.parse_args()
    model = attnflow.load("minilm-sentiment", device="cpu", progress=False)
    texts = held_out_texts(model.tokenizer, args.texts)
    request(model, "A warm-up sentence about a film that is neither good nor bad.")
    load = open("/proc/loadavg").read().split()[0]
    print(f"minilm-sentiment, {torch.get_num_threads()} torch threads; load average {load}")
    print(
        "| input | tokens | request with the budget (median / max) | NAOPC bounds "
        "| greedy search before, alone (median) | before ÷ now |"
    )
    print("|---|---|---|---|---|---|")
    for name, group in texts.items():
        times, shown = [], []
        for text in group:
            seconds, info = request(model, text)
            times.append(seconds)
            shown.append(info)
        searches = sorted(
            {
                "none" if i["chosen"].faithfulness is None else i["chosen"].faithfulness["bounds"]["search"]
                for i in shown
            }
        )
        old = "not run (minutes)"
        ratio = ""
        if not name.endswith("words"):
            before = statistics.median(old_bounds_seconds(model, text) for text in group)
            old = f"{before:.2f} s"
            ratio = f"{before / statistics.median(times):.0f}×"
        tokens = statistics.median(info["tokens"] for info in shown)
        print(
            f"| {name} | {tokens:.0f} | {statistics.median(times):.2f} / {max(times):.2f} s | {', '.join(searches)} "
            f"| {old} | {ratio} |"
        )


if __name__ == "__main__":
    main()
