"""Start-up times of the command line (issue 23): `attnflow --help`, one sentence explained on
minilm, and the attention-flow kernel compiled by numba (a cold cache) or loaded from its cache.

    .venv/bin/python benchmarks/bench_startup.py             # ~3 min (the cold compilation is most of it)
    .venv/bin/python benchmarks/bench_startup.py --no-cold   # skip the cold compilation

Every measurement is the wall time of a fresh process (what a user waits for), repeated; the
median and the fastest run are printed with the load average of the machine, since a shared
machine's load stretches wall times. The cold compilation runs with an empty ``NUMBA_CACHE_DIR``
of its own; the warm one with the same folder after it was filled.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SENTENCE = "The movie was terrible, but the acting was great."
FIRST_FLOW = (
    "import numpy as np; from attnflow.methods.flow import attention_flow; attention_flow(np.full((1, 1, 2, 2), 0.5))"
)


def wall(command: list[str], env: dict[str, str] | None = None) -> float:
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - began


def report(name: str, times: list[float]) -> None:
    load = os.getloadavg()[0]
    print(
        f"{name:<44} median {statistics.median(times):6.2f} s   fastest {min(times):6.2f} s   "
        f"({len(times)} runs, load average {load:.1f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (default 5)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold compilation of the flow kernel")
    args = parser.parse_args()
    attnflow = [sys.executable, "-m", "attnflow.cli"]
    with tempfile.TemporaryDirectory() as scratch:
        report("attnflow --help", [wall([*attnflow, "--help"]) for _ in range(args.repeats)])
        explain = [*attnflow, "explain", SENTENCE, "--model", "minilm", "--out", f"{scratch}/out", "--overwrite", "-q"]
        wall(explain)  # the operating system's file cache holds the weights from here on, as after any first run
        report("attnflow explain (one sentence, minilm)", [wall(explain) for _ in range(args.repeats)])
        env = {**os.environ, "NUMBA_CACHE_DIR": f"{scratch}/numba"}
        flow = [sys.executable, "-c", FIRST_FLOW]
        if not args.no_cold:
            report("flow kernel: cold numba cache (compiles)", [wall(flow, env)])
        else:
            wall(flow, env)
        report("flow kernel: warm numba cache (loads)", [wall(flow, env) for _ in range(args.repeats)])


if __name__ == "__main__":
    main()
