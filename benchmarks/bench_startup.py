"""Start-up times of the command line (issue 23): `attnflow --help`, one sentence explained on
minilm (beside its floor: importing torch and transformers' BERT code, which attnflow cannot
avoid), and the attention-flow kernel compiled by numba (a cold cache) or loaded from its cache.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_startup.py             # ~3 min (mostly the cold compilation)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_startup.py --no-cold   # skip the cold compilation

Every measurement is the wall time of a fresh process (what a user waits for), repeated; the
median and the fastest run are printed with the load average of the machine, since a shared
machine's load stretches wall times. The cold compilation runs with an empty ``NUMBA_CACHE_DIR``
of its own; the warm one with the same folder after it was filled. The command is run as
``python -c "from attnflow.cli import main; ..."``, so that PYTHONPATH=OTHER/src measures another
checkout (the flow line of a checkout without ``--no-cold`` then still compiles in a cold cache).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SENTENCE = "The movie was terrible, but the acting was great."
LIBRARIES = "import torch; from transformers.models.bert import modeling_bert"
FIRST_FLOW = (
    "import numpy as np; from attnflow.methods.flow import attention_flow; attention_flow(np.full((1, 1, 2, 2), 0.5))"
)


def wall(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run of ``command`` in a new process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    elapsed = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def report(name: str, runs: list[tuple[float, float]]) -> None:
    """Median and fastest wall time, and the median CPU time: with OMP_NUM_THREADS=1 the process
    computes on about one core, so its CPU time is close to the wall time on an idle machine."""
    walls, cpus = [run[0] for run in runs], [run[1] for run in runs]
    print(
        f"{name:<44} wall median {statistics.median(walls):6.2f} s, fastest {min(walls):6.2f} s;   "
        f"CPU median {statistics.median(cpus):6.2f} s   ({len(runs)} runs, load average {os.getloadavg()[0]:.1f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (default 5)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold compilation of the flow kernel")
    args = parser.parse_args()
    attnflow = [sys.executable, "-c", "import sys; from attnflow.cli import main; sys.exit(main())"]
    with tempfile.TemporaryDirectory() as scratch:
        report("attnflow --help", [wall([*attnflow, "--help"]) for _ in range(args.repeats)])
        explain = [*attnflow, "explain", SENTENCE, "--model", "minilm", "--out", f"{scratch}/out", "--overwrite", "-q"]
        wall(explain)  # the operating system's file cache holds the weights from here on, as after any first run
        explained = [wall(explain) for _ in range(args.repeats)]
        report("attnflow explain (one sentence, minilm)", explained)
        # The floor under it: the libraries a BERT model needs, imported (no attnflow).
        floor = [wall([sys.executable, "-c", LIBRARIES]) for _ in range(args.repeats)]
        report("floor: import torch + transformers' BERT code", floor)
        median = statistics.median
        print(
            f"{'':<44} explain / floor: {median(run[0] for run in explained) / median(run[0] for run in floor):.2f}x "
            f"(wall medians); attnflow's own share "
            f"{median(run[0] for run in explained) - median(run[0] for run in floor):.2f} s"
        )
        env = {**os.environ, "NUMBA_CACHE_DIR": f"{scratch}/numba"}
        flow = [sys.executable, "-c", FIRST_FLOW]
        if not args.no_cold:
            report("flow kernel: cold numba cache (compiles)", [wall(flow, env)])
        else:
            wall(flow, env)
        report("flow kernel: warm numba cache (loads)", [wall(flow, env) for _ in range(args.repeats)])


if __name__ == "__main__":
    main()
