"""float32 against bfloat16 `explain` time on one model, both loaded once and run interleaved (so a
machine whose load changes meanwhile slows both alike); the median of ``--repeats`` per method.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dtype_speed.py            # smollm2, ~5 min loaded
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

PROMPT = "The Eiffel Tower stands in the city of Paris, the capital of"


def main() -> None:
    import torch

    import attnflow

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--methods", default="rollout,grad_x_input,attnlrp")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    methods = args.methods.split(",")
    cpu = {name: getattr(torch.cpu, name)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")}
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {cpu}, load {os.getloadavg()}")
    models = {dtype: attnflow.load(args.model, device="cpu", dtype=dtype) for dtype in ("float32", "bfloat16")}
    for model in models.values():
        model.explain(PROMPT, method=methods[-1])  # warm-up
    seconds: dict[tuple[str, str], list[float]] = {(dtype, method): [] for dtype in models for method in methods}
    for _ in range(args.repeats):
        for method in methods:
            for dtype, model in models.items():
                start = time.perf_counter()
                model.explain(PROMPT, method=method)
                seconds[(dtype, method)].append(time.perf_counter() - start)
    for method in methods:
        full, half = (statistics.median(seconds[(dtype, method)]) for dtype in models)
        print(f"{method}: float32 {full:.3f} s, bfloat16 {half:.3f} s, ratio {half / full:.2f}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
