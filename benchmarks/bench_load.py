"""Load time of an embedded GGUF model (smollm2, gemma3-270m, qwen2.5-0.5b): dequantising the GGUF
file (the old way, every load) vs the safetensors cache of its dequantised weights (written on the
first load); then the time of one next-token explanation of a short prompt per method.

    .venv/bin/python benchmarks/bench_load.py                       # smollm2, ~3 min
    .venv/bin/python benchmarks/bench_load.py --model gemma3-270m   # split GGUF: joined first

Each measurement runs in its own Python process with an empty (or just filled) cache folder of
its own, so nothing is warm but the operating system's file cache. The "before" load is the
GGUF path with the cache write switched off (a split GGUF is joined into the scratch cache first,
outside the timed load). The traces of one sentence from the GGUF load and
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
PROMPT = "The capital of France is"
METHODS = "rollout,grad_x_input,attnlrp"

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import attnflow
from attnflow.capture import loading, weight_cache
mode, alias, sentence, out, prompt, methods = sys.argv[1:7]
if mode == "gguf":
    weight_cache.write = lambda *a, **k: False
install = loading.EMBEDDED[alias].install
if install is not None:
    install(False)  # a split GGUF: joined once, not part of the load
imported = time.perf_counter()
model = attnflow.load(alias, device="cpu", progress=False)
loaded = time.perf_counter()
trace = model.trace(sentence)[0]
import numpy as np
np.save(out, trace.attentions)
explain_s = {}
if mode == "cached":
    for method in methods.split(","):
        model.explain(prompt, method=method)  # warm-up: first calls compile and allocate
        began = time.perf_counter()
        model.explain(prompt, method=method)
        explain_s[method] = time.perf_counter() - began
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "explain_s": explain_s}))
"""


def run(mode: str, alias: str, cache: str, out: str) -> dict:
    environment = {**os.environ, "ATTNFLOW_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, alias, SENTENCE, out, PROMPT, METHODS],
        capture_output=True,
        text=True,
        env=environment,
    )
    if result.returncode != 0:
        sys.exit(f"the {mode} load failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="cached loads to time (default: 2)")
    parser.add_argument(
        "--model", default="smollm2", choices=("smollm2", "gemma3-270m", "qwen2.5-0.5b"), help="default: smollm2"
    )
    args = parser.parse_args()
    import numpy as np

    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as scratch:
        alias = args.model
        gguf = run("gguf", alias, os.path.join(scratch, "none"), os.path.join(scratch, "gguf.npy"))
        print(f"before (GGUF dequantised, no cache): load {gguf['load_s']:.1f} s")
        cache = os.path.join(scratch, "cache")
        first = run("first", alias, cache, os.path.join(scratch, "first.npy"))
        print(f"first load (GGUF + writing the cache): load {first['load_s']:.1f} s")
        runs = [run("cached", alias, cache, os.path.join(scratch, "cached.npy")) for _ in range(args.repeats)]
        cached = [result["load_s"] for result in runs]
        print(
            f"cached loads: {', '.join(f'{t:.1f}' for t in cached)} s (best {min(cached):.1f} s); "
            f"speed-up {gguf['load_s'] / min(cached):.1f}x"
        )
        for method in runs[0]["explain_s"]:
            best = min(result["explain_s"][method] for result in runs)
            print(f"one next-token explanation of {PROMPT!r} with {method}: {best:.2f} s (best of {len(runs)})")
        size = os.path.getsize(os.path.join(cache, f"{alias}-dequantised", "model.safetensors"))
        print(f"cache size: {size / 2**20:.0f} MiB")
        difference = np.abs(
            np.load(os.path.join(scratch, "gguf.npy")) - np.load(os.path.join(scratch, "cached.npy"))
        ).max()
        print(f"max |attention difference| GGUF vs cached: {difference:.3g}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
