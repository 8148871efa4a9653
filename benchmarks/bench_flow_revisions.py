"""The flow kernel of this checkout against the same file at other git revisions, on the same inputs.

    python benchmarks/bench_flow_revisions.py REV [REV ...] [--repeats 5] [--full]

Each revision's kernel module (``src/attnflow/methods/flow_kernels.py``, or ``flow.py`` at revisions
before the kernels had a module of their own) is loaded as a module of its own (read with
``git show``; its registration as a method and numba's on-disk cache are left out) and run on
the prepared layers of the inputs of ``bench_flow.py``: the random and the sharp/local
(adversarial) input of its default seed, and the first three 128-token Wikipedia windows through
minilm and mpnet. The kernels are timed interleaved (every revision on one input, then the next
input, ``--repeats`` rounds, best process CPU time kept), so that machine drift hits them alike;
their raw flows must be identical, else the run stops. This is how the per-step table of
BENCHMARKS.md ("Fourth pass") was measured: the CLS row, and with ``--full`` the full matrix.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from attnflow.methods import flow_kernels as current
from attnflow.methods.transforms import prepare_layers
from bench_flow import softmax_attentions, wiki_windows, window_attentions  # beside this file

KERNEL_PATHS = ("src/attnflow/methods/flow_kernels.py", "src/attnflow/methods/flow.py")  # newest layout first


def benchmark_inputs():
    """Prepared ``[layer, q, k]`` layers by name, drawn as ``bench_flow.py`` draws them."""
    import attnflow

    rng = np.random.default_rng(0)  # bench_flow's default seed, in its order of draws
    softmax_attentions(rng, 64)  # (a) networkx
    inputs = {"random": prepare_layers(softmax_attentions(rng, 128))}  # (b)
    softmax_attentions(rng, 128, n_heads=1, sigma=3.0)  # (c) sharp, one head
    inputs["adversarial"] = prepare_layers(softmax_attentions(rng, 128, sigma=4.0, sink=4.0, locality=0.5))
    for name in ("minilm", "mpnet"):
        model = attnflow.load(name, device="cpu")
        for index, ids in enumerate(wiki_windows(model, 128, 3)):
            inputs[f"{name} {index}"] = prepare_layers(window_attentions(model, ids))
    return inputs


def kernel_at(revision, folder):
    """The flow module of ``revision``, loaded under a name of its own."""
    for kernel_path in KERNEL_PATHS:
        shown = subprocess.run(["git", "show", f"{revision}:{kernel_path}"], capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    source = source.replace("cache=True", "cache=False")  # one module name per file: no shared cache
    source = "\n".join(line for line in source.split("\n") if not line.startswith('@register("flow"'))
    path = os.path.join(folder, f"flow_{len(os.listdir(folder))}.py")
    with open(path, "w") as handle:
        handle.write(source)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def solver(module):
    """A kernel module's raw max-flow function (``max_flows``; ``_max_flows`` at older revisions)."""
    return getattr(module, "max_flows", None) or module._max_flows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revisions", nargs="+", help="git revisions to compare with this checkout (e.g. HEAD~3)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the best time is kept")
    parser.add_argument("--full", action="store_true", help="the full 128 x 128 matrix instead of the CLS row")
    args = parser.parse_args(argv)
    inputs = benchmark_inputs()
    rows = np.arange(128) if args.full else np.array([0])
    with tempfile.TemporaryDirectory() as folder:
        kernels = [("this checkout", current)] + [(rev, kernel_at(rev, folder)) for rev in args.revisions]
        for _, kernel in kernels:  # compile
            solver(kernel)(inputs["random"][None, :, :8, :8] * 0 + 1 / 8, np.array([0]), 1)
        reference = {name: current.max_flows(layers[None], rows, 1) for name, layers in inputs.items()}
        best = {}
        for _ in range(args.repeats):
            for name, layers in inputs.items():
                for label, kernel in kernels:
                    start = time.process_time()
                    flows = solver(kernel)(layers[None], rows, 1)
                    elapsed = time.process_time() - start
                    if not np.array_equal(flows, reference[name]):
                        sys.exit(f"{label} gives other flows than this checkout on {name}")
                    best[label, name] = min(best.get((label, name), np.inf), elapsed)
    unit, scale = ("s", 1.0) if args.full else ("ms", 1000.0)
    what = "full 128 x 128 matrix" if args.full else "CLS row"
    print(f"{what}, kernel only (max_flows, n_jobs=1), best of {args.repeats} interleaved rounds, CPU time:")
    print(f"{'input':14}" + "".join(f"{label:>16}" for label, _ in kernels))
    for name in inputs:
        print(f"{name:14}" + "".join(f"{best[label, name] * scale:13.2f} {unit:2}" for label, _ in kernels))


if __name__ == "__main__":
    main()
