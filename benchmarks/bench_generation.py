"""Explaining a generation: the batched steps against a per-step loop (issue 21).

    OMP_NUM_THREADS=1 python benchmarks/bench_generation.py [--model smollm2] [--tokens 32] [--prompt TEXT]

The prompt (default "Photosynthesis is the process by which": smollm2 continues it for 32 tokens
without an end-of-sequence token; "The capital of France is" ends after 30) is continued greedily
by ``--tokens`` tokens once; then,
each in a fresh subprocess (so that each peak memory is its own), both explain every generated
token with grad_rollout and grad_x_input (one capture serves both methods):

- batched: `attnflow.generation.explain_continuation`: ``--steps-per-pass`` consecutive steps
  share one forward pass over the sources of the last of them, and one backward pass per step,
  batched (a comma list runs each; default "32,8": all 32 steps in one pass, and the library's
  default of 8);
- per-step loop (what inseq does): for each step, one forward + one backward pass over the prefix
  alone (the same capture, one step at a time), then the same methods.

Each child times its part after a warm-up step and reports the wall time, the process CPU time
(on a shared machine the fairer of the two), the peak RSS above its RSS before the timed part
(sampled every 5 ms) and its matrices; the parent prints the speed-ups and the largest difference
between each batched run's matrices and the loop's. Target: batched >= 4x faster, same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

PROMPT = "Photosynthesis is the process by which"
METHODS = {"grad_rollout": {}, "grad_x_input": {}}


class PeakMemory:
    """The largest RSS above the starting one while the block runs (a sampling thread)."""

    def __enter__(self) -> "PeakMemory":
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def child(model_name: str, mode: str, ids_file: Path, out: Path, steps_per_pass: int) -> None:
    """Explain the saved continuation one way (``mode``), timed; print the result as JSON, save the matrices."""
    from attnflow.explanation import explain
    from attnflow.generation import Continuation, explain_continuation, step_traces
    from attnflow.methods.registry import get_method
    from attnflow.model import load

    model = load(model_name, device="cpu", progress=False)
    saved = json.loads(ids_file.read_text())
    sequence = Continuation(
        prompt=saved["prompt"],
        ids=np.asarray(saved["ids"]),
        special=np.asarray(saved["special"]),
        n_prompt=saved["n_prompt"],
        mode="greedy",
    )
    n, p = sequence.n_steps, sequence.n_prompt
    needs = frozenset().union(*(get_method(name).needs for name in METHODS))

    def batched() -> dict[str, np.ndarray]:
        explained = explain_continuation(model, sequence, METHODS, steps_per_pass=steps_per_pass)
        return {explanation.method: explanation.matrix for explanation in explained}

    def loop() -> dict[str, np.ndarray]:
        matrices = {name: np.zeros((n, len(sequence.sources))) for name in METHODS}
        for step in range(n):  # one forward + one backward over the prefix of step k
            (trace,) = step_traces(model, sequence, [step], needs)
            for name in METHODS:
                matrices[name][step, : p + step] = explain(trace, method=name, row="last", model=model).scores
        return matrices

    run = batched if mode == "batched" else loop
    (warm,) = step_traces(model, sequence, [0], needs)  # warm-up: one step
    del warm
    with PeakMemory() as memory:
        started, started_cpu = time.perf_counter(), time.process_time()
        matrices = run()
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    np.savez(out, **matrices)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_extra_mib": memory.extra_mib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--steps-per-pass", default="32,8", help="batched runs: steps per pass (comma list)")
    parser.add_argument("--child", choices=("batched", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child, args.ids, args.out, int(args.steps_per_pass))
        return

    from attnflow.generation import prepare_continuation
    from attnflow.model import load

    model = load(args.model, device="cpu", progress=False)
    started = time.perf_counter()
    sequence = prepare_continuation(model, args.prompt, max_new_tokens=args.tokens)
    generation_seconds = time.perf_counter() - started
    print(
        f"model {args.model}, {sequence.n_prompt} prompt tokens, {sequence.n_steps} generated in "
        f"{generation_seconds:.2f} s: {model.tokenizer.decode(sequence.targets.tolist())!r}"
    )
    print(f"torch threads: {os.environ.get('OMP_NUM_THREADS', 'default')}")
    del model
    with tempfile.TemporaryDirectory() as folder:
        ids_file = Path(folder) / "ids.json"
        ids_file.write_text(
            json.dumps(
                {
                    "prompt": args.prompt,
                    "ids": sequence.ids.tolist(),
                    "special": sequence.special.tolist(),
                    "n_prompt": sequence.n_prompt,
                }
            )
        )
        runs = [("batched", int(k)) for k in args.steps_per_pass.split(",")] + [("loop", 1)]
        results, matrices = {}, {}
        for mode, steps_per_pass in runs:
            name = f"batched, {steps_per_pass} steps/pass" if mode == "batched" else "per-step loop"
            out = Path(folder) / f"{mode}{steps_per_pass}.npz"
            command = [sys.executable, __file__, "--model", args.model, "--child", mode, "--ids", str(ids_file)]
            command += ["--out", str(out), "--steps-per-pass", str(steps_per_pass)]
            completed = subprocess.run(command, capture_output=True, text=True, check=True)
            results[name] = json.loads(completed.stdout.strip().splitlines()[-1])
            with np.load(out) as saved:
                matrices[name] = {method: saved[method] for method in METHODS}
    loop = results["per-step loop"]
    for name, result in results.items():
        print(
            f"{name:>26}: {result['seconds']:7.2f} s wall, {result['cpu_seconds']:7.2f} s CPU, "
            f"peak RSS above the loaded model {result['peak_extra_mib']:7.1f} MiB"
        )
    for name, result in results.items():
        if name == "per-step loop":
            continue
        print(
            f"{name}: {loop['seconds'] / result['seconds']:.2f}x faster than the loop (wall), "
            f"{loop['cpu_seconds'] / result['cpu_seconds']:.2f}x (CPU)"
        )
        for method in METHODS:
            a, b = matrices[name][method], matrices["per-step loop"][method]
            difference, largest = np.abs(a - b).max(), np.abs(b).max()
            print(f"    {method}: max |batched - loop| = {difference:.3g} (largest score {largest:.3g})")


if __name__ == "__main__":
    main()
