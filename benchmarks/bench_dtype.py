"""How far each method's map moves when the model runs in 16 bits: bfloat16 (or float16) against float32.

For each registered method the model supports, the same inputs are explained twice, once with the
model loaded in float32 (``attnflow.load(name, dtype="float32")``) and once in the low precision,
and the two maps are compared per input on the content tokens (special tokens left out):

- Spearman ρ of the two score vectors (the saliency row for matrix methods), averaged over the
  inputs; an input where either vector is constant has no ρ and is counted apart (``undefined``);
- top-5 overlap: the share of float32's 5 highest-scoring content tokens that are among the low
  precision's 5 (`attnflow.methods.agreement`).

The agreement is also given without the inputs whose explained target differs (``target differs``:
a prediction so close to a tie that 16 bits pick another class or next token, so the map explains
something else). Also printed: the method's time in each precision, float32 and the low precision
run back to back for each method (the machine's other jobs make single timings noisy), and whether
its declaration flags it as untrustworthy in 16 bits (``MethodSpec.low_precision``).

Inputs: minilm-sentiment on the first ``--samples`` held-out Rotten Tomatoes reviews
(`attnflow.datasets`, the split the head never trained on); smollm2 on held-out next-token windows
of ``--window`` tokens (`attnflow.datasets.next_token_windows`), the target the model's own next token.

    OMP_NUM_THREADS=1 python benchmarks/bench_dtype.py --model minilm-sentiment --samples 50
    OMP_NUM_THREADS=1 python benchmarks/bench_dtype.py --model smollm2 --samples 30 --window 24
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import numpy as np

TOP_K = 5


def inputs(model, samples: int, window: int) -> list[str]:
    from attnflow.datasets import next_token_windows, rotten_tomatoes

    if model.target_kind == "next_token":
        return list(next_token_windows(model.tokenizer, window=window).texts[:samples])
    data = rotten_tomatoes()
    return [data.texts[i] for i in data.split()[1][:samples]]


def explained(model, method: str, texts: list[str], batch_size: int) -> dict:
    """One method on every text: the content-token scores, the target each explains, the seconds."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explanations = model.explain(texts, method=method, batch_size=batch_size)
    return {
        "scores": [np.asarray(e.scores)[~np.asarray(e.special_mask)] for e in explanations],
        "targets": [None if e.target is None else (e.target.get("index"), e.target.get("label")) for e in explanations],
        "seconds": time.perf_counter() - start,
    }


def run(name: str, dtype: str, methods: list[str], texts: list[str], batch_size: int) -> tuple[dict, dict]:
    """Both precisions, method by method: float32 then ``dtype`` back to back (both models loaded),
    so that the machine's load drifts less between the two timings of a method."""
    import attnflow
    from attnflow.methods.registry import get_method

    full = attnflow.load(name, device="cpu", progress=False)
    low = attnflow.load(name, device="cpu", dtype=dtype, progress=False)
    reference: dict = {}
    other: dict = {}
    for method in methods:
        if not get_method(method).supports(full.adapter):
            continue
        reference[method] = explained(full, method, texts, batch_size)
        other[method] = explained(low, method, texts, batch_size)
    return reference, other


def agreement(reference: dict, other: dict) -> dict:
    """Spearman and top-5 overlap per input; ``same target`` leaves out the inputs whose explained
    target (the predicted class or next token) differs between the precisions."""
    from attnflow.methods.agreement import spearman, top_k_overlap

    rhos, overlaps = [], []
    for a, b in zip(reference["scores"], other["scores"], strict=True):
        rhos.append(spearman(a, b))
        overlaps.append(top_k_overlap(a, b, min(TOP_K, a.size)))
    rho = np.asarray(rhos)
    flipped = np.array([x != y for x, y in zip(reference["targets"], other["targets"], strict=True)])
    defined = rho[np.isfinite(rho)]
    same = rho[np.isfinite(rho) & ~flipped]
    return {
        "spearman_mean": float(defined.mean()) if defined.size else float("nan"),
        "spearman_min": float(defined.min()) if defined.size else float("nan"),
        "undefined": int((~np.isfinite(rho)).sum()),
        "below_half": int((defined < 0.5).sum()),
        "target_differs": int(flipped.sum()),
        "spearman_same_target": float(same.mean()) if same.size else float("nan"),
        "top5_overlap": float(np.mean(overlaps)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-sentiment")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="the low precision")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--window", type=int, default=24, help="causal LMs: tokens per next-token window")
    parser.add_argument("--methods", default="all", help="comma-separated, or all (default)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    import torch

    import attnflow
    from attnflow.methods.registry import available_methods, get_method

    torch.manual_seed(0)
    methods = available_methods() if args.methods == "all" else args.methods.split(",")
    probe = attnflow.load(args.model, device="cpu", progress=False)
    texts = inputs(probe, args.samples, args.window)
    del probe
    print(f"# {' '.join(['python', *sys.argv])}")
    print(f"# {args.model}: {len(texts)} held-out inputs; {args.dtype} against float32 on the CPU")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    reference, low = run(args.model, args.dtype, methods, texts, args.batch_size)
    rows = []
    print()
    print(
        f"| method | Spearman ρ, mean (min) | inputs with ρ < 0.5 | target differs | ρ, same target "
        f"| top-{TOP_K} overlap | float32 s | {args.dtype} s | flagged |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for method, found in reference.items():
        numbers = agreement(found, low[method])
        row = {"method": method, **numbers, "seconds_float32": found["seconds"]}
        row[f"seconds_{args.dtype}"] = low[method]["seconds"]
        row["flagged"] = bool(get_method(method).low_precision)
        rows.append(row)
        undefined = f" ({numbers['undefined']} undefined)" if numbers["undefined"] else ""
        print(
            f"| `{method}` | {numbers['spearman_mean']:.3f} ({numbers['spearman_min']:.3f}){undefined} "
            f"| {numbers['below_half']} | {numbers['target_differs']} | {numbers['spearman_same_target']:.3f} "
            f"| {numbers['top5_overlap']:.3f} | {found['seconds']:.1f} | {low[method]['seconds']:.1f} "
            f"| {'yes' if row['flagged'] else ''} |"
        )
    total32 = sum(r["seconds_float32"] for r in rows)
    total16 = sum(r[f"seconds_{args.dtype}"] for r in rows)
    print(f"\nall methods: float32 {total32:.1f} s, {args.dtype} {total16:.1f} s ({total16 / total32:.2f}x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"model": args.model, "dtype": args.dtype, "inputs": len(texts), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
