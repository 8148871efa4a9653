"""What a bigger model costs through every command: qwen2.5-0.5b beside qwen2.5-1.5b (the same
family, 3× the parameters), each command a process of its own, wall time and peak resident memory.

    .venv/bin/python benchmarks/bench_model_size.py                      # ~25 min on 2 cores
    .venv/bin/python benchmarks/bench_model_size.py --models qwen2.5-0.5b --commands explain

Both models must be installed and their dequantised weights cached (`attnflow models install
qwen2.5-1.5b`, then one load); every command then loads from the cache, so the times include a
cached load (measured alone as the first row). The commands, on a short code prompt:

- load: `attnflow.load` alone;
- explain: attnlrp, grad_x_input and rollout (with each map's per-input faithfulness);
- generate: 8 greedy tokens, each explained by grad_x_input;
- patch: the residual sweep (exact) with AtP and RelP beside it, a counterfactual prompt;
- routes: the information-flow graph, the route and its logit lens;
- evaluate: the next-token benchmark on 3 windows of 8 tokens (grad_x_input and random, no sanity check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPT = "def add(a, b):\n    return"
CORRUPT = "def mul(a, b):\n    return"  # same token length (checked by attnflow patch)
COMMANDS = {
    "load": ["-c", "import sys, attnflow; attnflow.load(sys.argv[1], progress=False)"],
    "explain": ["explain", PROMPT, "--method", "attnlrp,grad_x_input,rollout", "--quiet"],
    "generate": ["explain", PROMPT, "--generate", "8", "--method", "grad_x_input", "--quiet"],
    "patch": ["patch", PROMPT, "--corrupt", CORRUPT, "--sites", "residual", "--method", "exact,atp,relp", "--quiet"],
    "routes": ["routes", PROMPT, "--quiet"],
    "evaluate": [
        "evaluate", "--task", "next-token", "--window", "8", "--samples", "3", "--methods", "grad_x_input,random",
        "--sanity-samples", "0", "--quiet",
    ],
}  # fmt: skip


def measure(model: str, command: str) -> dict:
    """Wall seconds and peak resident memory (GiB, of that process alone: `os.wait4`) of one command
    in a fresh process."""
    arguments = COMMANDS[command]
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryFile("w+") as log:
        if arguments[0] == "-c":
            argv = [sys.executable, *arguments, model]
        else:
            argv = [sys.executable, "-m", "attnflow.cli", *arguments, "--model", model, "--out", f"{out}/out"]
        began = time.perf_counter()
        process = subprocess.Popen(argv, stdout=log, stderr=log, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - began
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            log.seek(0)
            raise SystemExit(f"{model} {command} failed:\n{log.read()[-2000:]}")
    return {"model": model, "command": command, "seconds": seconds, "peak_gib": usage.ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--commands", default=",".join(COMMANDS))
    args = parser.parse_args()
    models, commands = args.models.split(","), args.commands.split(",")
    rows = []
    for model in models:
        for command in commands:
            rows.append(measure(model, command))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}; torch threads: {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print("| command | " + " | ".join(f"{m}: s, peak GiB" for m in models) + " | time ratio |")
    print("|---|" + "---|" * (len(models) + 1))
    for command in commands:
        found = [next(r for r in rows if r["model"] == m and r["command"] == command) for m in models]
        ratio = f"{found[-1]['seconds'] / found[0]['seconds']:.1f}×" if len(found) > 1 else ""
        cells = " | ".join(f"{r['seconds']:.1f}, {r['peak_gib']:.2f}" for r in found)
        print(f"| {command} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
