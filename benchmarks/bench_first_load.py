"""First and later load of each embedded model: ``attnflow.load(alias, device="cpu")`` in a fresh
process with an empty attnflow cache (``ATTNFLOW_CACHE`` a new folder: unpacking, converting,
joining, dequantising and caching included), then again reading that cache. Prints the seconds from
``import attnflow`` to the loaded model and the process's peak resident memory (the README's model
table).

    .venv/bin/python benchmarks/bench_first_load.py minilm smollm2      # or no alias: every one but qwen2.5-1.5b
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = """
import resource, sys, time
start = time.perf_counter()
import attnflow
attnflow.load(sys.argv[1], device="cpu", progress=False)
print(round(time.perf_counter() - start, 1), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # s, peak KB
"""
ALIASES = ("minilm", "minilm-sentiment", "mpnet", "dinov2-s", "smollm2", "gemma3-270m", "qwen2.5-0.5b")


def measure(alias: str, cache: str) -> tuple[float, float]:
    """Seconds and peak GB of one load in a child process using ``cache``."""
    environment = {**os.environ, "ATTNFLOW_CACHE": cache, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, alias], env=environment, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    seconds, peak_kb = done.stdout.strip().splitlines()[-1].split()
    return float(seconds), int(peak_kb) / 1e6


def main() -> None:
    for alias in sys.argv[1:] or ALIASES:
        with tempfile.TemporaryDirectory() as cache:
            first, first_gb = measure(alias, cache)
            later, later_gb = measure(alias, cache)
        print(f"{alias}: first load {first:.1f} s, {first_gb:.1f} GB; later loads {later:.1f} s, {later_gb:.1f} GB")


if __name__ == "__main__":
    main()
