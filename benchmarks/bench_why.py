"""`attnflow why` end to end, as a user runs it: each command a process of its own (the model's load
included), its wall time, its CPU time (user + system of the child) and the load average around it,
and the plan's estimated seconds against what each step took (from why.json).

Targets (issue 47): smollm2 on "The capital of France is" with --contrast " Rome" ≤ 60 s on the
2-core CPU; minilm-sentiment on the demo sentence (the Makefile's DEMO_TEXT) ≤ 10 s. The load
average is printed: other processes on the machine slow every wall time; the CPU time does not
include their share.

    OMP_NUM_THREADS=1 python benchmarks/bench_why.py [--repeats 1] [--out out/bench-why]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RUNS = {
    "smollm2": ["The capital of France is", "--model", "smollm2", "--contrast", " Rome"],
    "minilm-sentiment": ["The movie was terrible, but the acting was great.", "--model", "minilm-sentiment"],
}
TARGETS = {"smollm2": 60.0, "minilm-sentiment": 10.0}


def run_once(name: str, out: Path) -> dict:
    """One `attnflow why` process: wall and CPU seconds, load averages, the plan against the steps."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    command = [sys.executable, "-m", "attnflow.cli", "why", *RUNS[name], "--out", str(out), "--overwrite", "--quiet"]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    data = json.loads((out / "why.json").read_text())
    estimated = {step["evidence"]: step["estimated_seconds"] for step in data["plan"]["steps"]}
    return {
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "load": (load_before, os.getloadavg()[0]),
        "estimated": estimated,
        "took": data["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out/bench-why"))
    args = parser.parse_args()
    for name in RUNS:
        for repeat in range(args.repeats):
            result = run_once(name, args.out / name)
            verdict = "met" if result["wall_s"] <= TARGETS[name] else "MISSED"
            print(
                f"{name} run {repeat + 1}: wall {result['wall_s']:.1f} s (target {TARGETS[name]:g} s: {verdict}), "
                f"CPU {result['cpu_s']:.1f} s, load average {result['load'][0]:.1f} -> {result['load'][1]:.1f}"
            )
            for step, seconds in result["took"].items():
                print(f"    {step:<20} took {seconds:6.2f} s, estimated {result['estimated'].get(step)} s")


if __name__ == "__main__":
    main()
