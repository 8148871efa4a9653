"""Peak memory of capturing what rollout needs on a long input: every layer's [head, T, T] weights
(the full capture) against the head-fused capture (``fuse_heads="mean"``: each layer reduced to its
heads' mean inside the hook, what ``model.explain(text, method="rollout")`` uses).

Each measurement runs in a fresh process: the model loads (float32 unless ``--dtype``), the peak
resident set (VmHWM) is reset (``/proc/self/clear_refs``) once the model is loaded, then one text of
``--tokens`` tokens (cut from the embedded Wikipedia text) is

- ``capture``: traced (``model.trace(text, needs=("attentions",))``, or ``fuse_heads="mean"``);
  ``forward``, the floor: the base model's bare forward pass (no weights kept, no cache, no logits);
- ``rollout``: explained with rollout end to end (full: the trace above, then `attnflow.explain`;
  lean: ``model.explain(text, method="rollout")``).

Printed per run: the peak above the loaded model (VmHWM after − RSS after loading), the wall
time, and for the rollout runs the largest difference between the two maps. A child whose address
space would exceed ``--max-gb`` fails with MemoryError instead of pushing the shared machine
into the OOM killer; that is reported as "over the cap". ``--modes full`` with ``PYTHONPATH`` set to
another checkout's ``src`` measures that version's full capture (the before of this change).

    OMP_NUM_THREADS=1 python benchmarks/bench_capture_memory.py --model smollm2 --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
import numpy as np
model_name, tokens, mode, what, dtype, cap_gb, out = sys.argv[1:8]
tokens, cap_gb = int(tokens), float(cap_gb)
import torch
import attnflow
from attnflow.runs.readers import open_corpus
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
precision = {} if dtype == "float32" else {"dtype": dtype}  # float32: also code from before --dtype
model = attnflow.load(model_name, device="cpu", progress=False, **precision)
ids = []
for document in open_corpus("wiki"):
    ids += model.tokenizer(document, add_special_tokens=False)["input_ids"]
    if len(ids) >= tokens + 64:
        break
text = model.tokenizer.decode(ids[:tokens])

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0

if cap_gb > 0:  # address space cap: a MemoryError instead of the machine's OOM killer
    limit = int(rss("VmSize") + cap_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
loaded = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as handle:  # reset the peak (VmHWM) to the current RSS
    handle.write("5")
start = time.perf_counter()
status, scores, n = "ok", None, 0
try:
    fuse = "mean" if mode == "lean" else None
    if mode == "forward":  # the floor: a bare forward pass, no weights kept, no logits
        encoded = model.tokenizer(text, return_tensors="pt", truncation=True, max_length=tokens + 8)
        with torch.no_grad():
            model.hf_model.base_model(**encoded, output_attentions=False, use_cache=False)
        n = int(encoded["input_ids"].shape[1])
    elif what == "capture":
        kept = {"fuse_heads": fuse} if fuse else {}  # the full capture runs on code without fuse_heads too
        trace = model.trace(text, needs=("attentions",), max_length=tokens + 8, **kept)[0]
        n = trace.n_tokens
    elif mode == "lean":
        explanation = model.explain(text, method="rollout", max_length=tokens + 8)
        scores, n = explanation.scores, explanation.n_tokens
    else:
        trace = model.trace(text, needs=("attentions",), max_length=tokens + 8)[0]
        explanation = attnflow.explain(trace, "rollout")
        scores, n = explanation.scores, explanation.n_tokens
except MemoryError:
    status = "over the cap"
except RuntimeError as error:  # torch's allocator
    if "allocate" not in str(error):
        raise
    status = "over the cap"
seconds = time.perf_counter() - start
if scores is not None:
    np.save(out, np.asarray(scores))
print(json.dumps({"status": status, "loaded": loaded, "peak": rss("VmHWM"), "seconds": seconds, "tokens": n}))
"""


def measure(model: str, tokens: int, mode: str, what: str, dtype: str, cap_gb: float, out: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(tokens), mode, what, dtype, str(cap_gb), str(out)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    lines = [line for line in result.stdout.strip().splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        return {"status": f"failed (exit {result.returncode}): {' / '.join(tail)}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--what", default="capture,rollout", help="capture and/or rollout (default: both)")
    parser.add_argument(
        "--modes", default="forward,full,lean", help="forward (the floor), full and/or lean (default: all three)"
    )
    parser.add_argument("--max-gb", type=float, default=14.0, help="address-space cap per child above the model")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    print(f"# {' '.join(['python', *sys.argv])}")
    print(f"# {args.model} in {args.dtype}, one text of {args.tokens} tokens, one torch thread per child")
    print("| measured | capture | tokens | peak above the loaded model | wall s | status |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        maps = {}
        for what in args.what.split(","):
            for mode in args.modes.split(","):
                if mode == "forward" and what != "capture":
                    continue
                out = Path(scratch) / f"{what}-{mode}.npy"
                found = measure(args.model, args.tokens, mode, what, args.dtype, args.max_gb, out)
                extra = found.get("peak", 0) - found.get("loaded", 0)
                print(
                    f"| {what} | {mode} | {found.get('tokens', '')} | {extra / 2**20:,.0f} MiB | "
                    f"{found.get('seconds', float('nan')):.1f} | {found['status']} |"
                )
                if out.exists():
                    import numpy as np

                    maps[mode] = np.load(out)
        if "full" in maps and "lean" in maps:
            import numpy as np

            print(
                f"\nrollout maps, full against lean: max |difference| {np.abs(maps['full'] - maps['lean']).max():.3g}"
            )


if __name__ == "__main__":
    main()
