"""The corpus study: overhead against a bare forward pass, and memory that does not grow with samples.

    python benchmarks/bench_corpus.py [--quick] [--model minilm] [--skip-overhead] [--skip-memory]

(a) Overhead, in one process on the same windows of the embedded Wikipedia text: a bare batched
    forward pass of the Hugging Face model with ``output_attentions=True`` against the study's
    per-batch work (``capture_batch`` with head outputs + ``StudyStats.update``). The two are
    timed alternately, ``--repeats`` times, and the ratio of the medians is printed, with each
    part of the study (capture, statistics) and the windowing (tokenizer + pysbd) alone.
    Target (issue 4): study / bare <= 1.3.
(b) Memory: ``attnflow corpus`` (`run_study`, local engine, output files included) in a fresh
    subprocess for ``--small`` and for ``--large`` windows (default 2,000 and 20,000 at stride 50);
    each child reports its peak RSS (``getrusage`` ru_maxrss). Target: large <= 1.2 x small.
    ``--quick``: a small random BERT (2 layers x 4 heads, hidden 64, the minilm vocabulary and
    tokenizer) instead of the real model, so that 20,000 windows take minutes; the overhead part
    then uses fewer windows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnflow.corpus.engine import run_study
from attnflow.corpus.study import StudyOptions, new_stats, process_batch
from attnflow.corpus.windows import WindowStream, batched
from attnflow.model import load
from attnflow.runs.readers import open_corpus


def overhead(model_name: str, windows: int, batch_size: int, repeats: int) -> dict:
    model = load(model_name, device="cpu")
    started = time.perf_counter()
    batches = list(batched(WindowStream(open_corpus("wiki"), model.tokenizer, samples=windows), batch_size))
    windowing = time.perf_counter() - started
    stats = new_stats(model, StudyOptions(model=model_name))

    def bare() -> None:
        with torch.no_grad():
            for batch in batches:
                ids = torch.from_numpy(batch.token_ids)
                model.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)

    def capture_only() -> None:
        for batch in batches:
            model.capture_batch(torch.from_numpy(batch.token_ids), head_outputs=True)

    def study() -> None:
        for batch in batches:
            process_batch(model, stats, batch)

    for run in (bare, capture_only, study):  # warm-up
        run()
    times: dict[str, list[float]] = {"bare": [], "capture": [], "study": []}
    for _ in range(repeats):
        for name, run in (("bare", bare), ("capture", capture_only), ("study", study)):
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "model": model_name,
        "windows": windows,
        "batch_size": batch_size,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "bare_s": median["bare"],
        "capture_s": median["capture"],
        "study_s": median["study"],
        "statistics_s": median["study"] - median["capture"],
        "windowing_s": windowing,
        "ratio": median["study"] / median["bare"],
        "ratio_with_windowing": (median["study"] + windowing) / median["bare"],
        "all_times": times,
    }


def small_bert(folder: Path) -> Path:
    """A random 2-layer, 4-head BERT (hidden 64) with the real minilm tokenizer, saved to ``folder``."""
    import transformers

    minilm = load("minilm", device="cpu")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(minilm.tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    transformers.BertModel(config).save_pretrained(folder)
    minilm.tokenizer.save_pretrained(folder)
    return folder


def child_rss(model: str, samples: int, stride: int, batch_size: int) -> dict:
    """Run in a fresh process: one study of ``samples`` windows, then its peak RSS."""
    command = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        model,
        "--child-samples",
        str(samples),
        "--stride",
        str(stride),
        "--batch-size",
        str(batch_size),
    ]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child run failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - began
    return result


def child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as out:
        options = StudyOptions(
            model=args.model,
            data="wiki",
            samples=args.child_samples,
            stride=args.stride,
            batch_size=args.batch_size,
            device="cpu",
            quiet=True,
        )
        summary = run_study(options, Path(out) / "study")
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    print(json.dumps({"samples": summary["samples"], "peak_rss_mb": peak_kb / 1024, "elapsed_s": summary["elapsed_s"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small random BERT for the memory part, fewer windows")
    parser.add_argument(
        "--model", default="minilm", help="model of the overhead part (and of the memory part without --quick)"
    )
    parser.add_argument(
        "--windows", type=int, default=None, help="windows of the overhead part (default 128, quick 48)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=None, help="alternating repetitions (default 5, quick 3)")
    parser.add_argument("--small", type=int, default=2000, help="windows of the small memory run")
    parser.add_argument("--large", type=int, default=20000, help="windows of the large memory run")
    parser.add_argument(
        "--stride", type=int, default=50, help="window stride of the memory runs (wiki has ~8,000 disjoint windows)"
    )
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-samples", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(
        f"# corpus study benchmark: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    results: dict = {}
    if not args.skip_overhead:
        windows = args.windows or (48 if args.quick else 128)
        repeats = args.repeats or (3 if args.quick else 5)
        result = overhead(args.model, windows, args.batch_size, repeats)
        results["overhead"] = result
        print(
            f"(a) overhead, {args.model}, {windows} windows x 128 tokens, batch {args.batch_size}, "
            f"median of {repeats} alternating runs:"
        )
        print(f"    bare forward (output_attentions=True)  {result['bare_s']:8.2f} s")
        print(f"    capture (attentions + head outputs)    {result['capture_s']:8.2f} s")
        print(
            f"    study = capture + statistics           {result['study_s']:8.2f} s   (statistics {result['statistics_s']:.2f} s)"
        )
        print(f"    windowing (tokenizer + pysbd), once    {result['windowing_s']:8.2f} s")
        print(f"    ratio study / bare                     {result['ratio']:8.2f}   (target <= 1.3)")
        print(f"    ratio incl. windowing                  {result['ratio_with_windowing']:8.2f}")
    if not args.skip_memory:
        with tempfile.TemporaryDirectory() as scratch:
            model = str(small_bert(Path(scratch) / "small-bert")) if args.quick else args.model
            label = "random BERT 2x4 (hidden 64, minilm tokenizer)" if args.quick else args.model
            small = child_rss(model, args.small, args.stride, args.batch_size)
            large = child_rss(model, args.large, args.stride, args.batch_size)
        ratio = large["peak_rss_mb"] / small["peak_rss_mb"]
        results["memory"] = {"model": label, "small": small, "large": large, "ratio": ratio}
        print(f"(b) memory, {label}, wiki at stride {args.stride}, each run in a fresh process:")
        for name, run in (("small", small), ("large", large)):
            print(f"    {run['samples']:6d} windows: peak RSS {run['peak_rss_mb']:8.1f} MB  ({run['elapsed_s']:.0f} s)")
        print(f"    ratio large / small                    {ratio:8.3f}   (target <= 1.2)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
