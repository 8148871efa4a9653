"""Load time of the embedded smollm2: dequantising the GGUF file (the old way, every load) vs the
safetensors cache of its dequantised weights (written on the first load).

    .venv/bin/python benchmarks/bench_load.py            # ~3 min: each load in a fresh process

Each measurement runs in its own Python process with an empty (or just filled) cache folder of
its own, so nothing is warm but the operating system's file cache. The "before" load is the
GGUF path with the cache write switched off. The traces of one sentence from the GGUF load and
from the cached load are compared (max |difference| of the attentions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SENTENCE = "Once upon a time, a small model explained itself."

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import attnflow
from attnflow.capture import loading, weight_cache
mode = sys.argv[1]
if mode == "gguf":
    loading.weight_cache = type("NoCache", (), {"write": staticmethod(lambda *a, **k: False)})
imported = time.perf_counter()
model = attnflow.load("smollm2", device="cpu", progress=False)
loaded = time.perf_counter()
trace = model.trace(sys.argv[2])[0]
import numpy as np
np.save(sys.argv[3], trace.attentions)
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported}))
"""


def run(mode: str, cache: str, out: str) -> dict:
    environment = {**os.environ, "ATTNFLOW_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, SENTENCE, out], capture_output=True, text=True, env=environment
    )
    if result.returncode != 0:
        sys.exit(f"the {mode} load failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="cached loads to time (default: 2)")
    args = parser.parse_args()
    import numpy as np

    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as scratch:
        gguf = run("gguf", os.path.join(scratch, "none"), os.path.join(scratch, "gguf.npy"))
        print(f"before (GGUF dequantised, no cache): load {gguf['load_s']:.1f} s")
        cache = os.path.join(scratch, "cache")
        first = run("first", cache, os.path.join(scratch, "first.npy"))
        print(f"first load (GGUF + writing the cache): load {first['load_s']:.1f} s")
        cached = [run("cached", cache, os.path.join(scratch, "cached.npy"))["load_s"] for _ in range(args.repeats)]
        print(
            f"cached loads: {', '.join(f'{t:.1f}' for t in cached)} s (best {min(cached):.1f} s); "
            f"speed-up {gguf['load_s'] / min(cached):.1f}x"
        )
        size = os.path.getsize(os.path.join(cache, "smollm2-dequantised", "model.safetensors"))
        print(f"cache size: {size / 2**20:.0f} MiB")
        difference = np.abs(
            np.load(os.path.join(scratch, "gguf.npy")) - np.load(os.path.join(scratch, "cached.npy"))
        ).max()
        print(f"max |attention difference| GGUF vs cached: {difference:.3g}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
