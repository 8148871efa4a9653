"""`attnflow audit`: its cost against the method alone, its memory against the number of texts,
and 2 local workers against 1, in one run.

    python benchmarks/bench_audit.py [--model minilm-sentiment] [--task rotten-tomatoes]
        [--overhead-samples 500] [--repeats 2] [--small 200] [--large 2000] [--worker-samples 300]
        [--only overhead|memory|workers]

(a) Overhead, in one process on the same held-out texts: the chosen method alone
    (``model.explain`` over batches of 16, what the audit's batch step calls) against the whole
    audit call (`run_audit` with the loaded model: data, explanations, words, statistics,
    checkpoints, results.json and report.html), timed alternately ``--repeats`` times; the ratio
    of the medians. Target (issue 20): audit / method alone <= 1.2.
(b) Memory: the audit in a fresh subprocess for ``--small`` and ``--large`` texts; each child
    reports its peak RSS (``getrusage`` ru_maxrss). Target: large / small <= 1.2.
(c) Workers: the audit on ``--worker-samples`` texts in fresh subprocesses with ``--workers 1``
    and ``--workers 2`` (torch threads of the local engine); the time ratio is recorded.
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

from attnflow.dataset_audit.engine import load_data, run_audit
from attnflow.dataset_audit.step import DEFAULT_METHOD, AuditOptions


def overhead(model_name: str, task: str, samples: int, repeats: int) -> dict:
    from attnflow.evaluate.scorer import check_classifier
    from attnflow.model import load

    model = load(model_name, device="cpu")
    options = AuditOptions(model=model_name, task=task, samples=samples, quiet=True, device="cpu")
    texts = list(load_data(options, model, check_classifier(model)).texts)

    def method_alone() -> None:
        for start in range(0, len(texts), options.batch_size):
            batch = texts[start : start + options.batch_size]
            model.explain(batch, DEFAULT_METHOD, batch_size=len(batch))

    def audit() -> None:
        with tempfile.TemporaryDirectory() as folder:
            run_audit(options, Path(folder) / "out", model=model)

    times: dict[str, list[float]] = {"method_alone": [], "audit": []}
    for _ in range(repeats):
        for name, step in (("method_alone", method_alone), ("audit", audit)):
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "samples": len(texts),
        "seconds": times,
        "median_s": medians,
        "ratio": medians["audit"] / medians["method_alone"],
    }


def child(samples: int, model_name: str, task: str, workers: int | None) -> dict:
    """One audit in this (fresh) process: wall time of the run and peak RSS."""
    options = AuditOptions(model=model_name, task=task, samples=samples, quiet=True, device="cpu", workers=workers)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        results = run_audit(options, Path(folder) / "out")
        wall = time.perf_counter() - started
    return {
        "samples": results["run"]["samples"],
        "workers": workers,
        "wall_s": wall,
        "loop_s": results["run"]["elapsed_s"],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def in_subprocess(samples: int, model_name: str, task: str, workers: int | None = None) -> dict:
    command = [sys.executable, __file__, "--child", str(samples), "--model", model_name, "--task", task]
    if workers is not None:
        command += ["--workers", str(workers)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm-sentiment")
    parser.add_argument("--task", default="rotten-tomatoes")
    parser.add_argument("--overhead-samples", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=2000)
    parser.add_argument("--worker-samples", type=int, default=300)
    parser.add_argument("--only", choices=("overhead", "memory", "workers"), help="run one part only")
    parser.add_argument("--workers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.model, args.task, args.workers)))
        return
    report: dict = {
        "machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0], "python": platform.python_version()},
        "model": args.model,
        "task": args.task,
        "method": DEFAULT_METHOD,
    }
    if args.only in (None, "overhead"):
        report["overhead"] = overhead(args.model, args.task, args.overhead_samples, args.repeats)
        print(json.dumps(report["overhead"]), flush=True)
    if args.only in (None, "memory"):
        small, large = (in_subprocess(n, args.model, args.task) for n in (args.small, args.large))
        report["memory"] = {"small": small, "large": large, "ratio": large["peak_rss_mib"] / small["peak_rss_mib"]}
        print(json.dumps(report["memory"]), flush=True)
    if args.only in (None, "workers"):
        one, two = (in_subprocess(args.worker_samples, args.model, args.task, workers=w) for w in (1, 2))
        report["workers"] = {"one": one, "two": two, "speedup": one["loop_s"] / two["loop_s"]}
    report["machine"]["load_1min_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
