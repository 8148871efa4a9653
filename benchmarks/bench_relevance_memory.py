"""Peak memory of `norm` and `alti` against a bare forward pass with attentions (32 × 128 tokens).

Each measurement runs in a fresh process (peak RSS from ``resource.getrusage``) on the same 32
windows of 128 minilm tokens cut from the embedded Wikipedia text: the bare forward pass
(``output_attentions=True``, no grad), then ``minilm-sentiment.explain(texts, method=...)`` with all
32 texts in one batch. Printed: peak RSS, and peak minus the process's RSS after loading the model.

    python benchmarks/bench_relevance_memory.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

CHILD = r"""
import json, resource, sys, psutil, torch
import attnflow
from attnflow.runs.readers import open_corpus
torch.set_num_threads(2)
model = attnflow.load("minilm-sentiment", device="cpu")
ids = []
for document in open_corpus("wiki"):
    ids += model.tokenizer(document, add_special_tokens=False)["input_ids"]
    if len(ids) >= 32 * 126:
        break
texts = [model.tokenizer.decode(ids[i * 126 : (i + 1) * 126]) for i in range(32)]
loaded = psutil.Process().memory_info().rss
what = sys.argv[1]
if what == "forward":
    batch = model.tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        model.model(**batch, output_attentions=True)
    tokens = int(batch["attention_mask"].sum())
else:
    explanations = model.explain(texts, method=what, batch_size=32, max_length=128)
    tokens = sum(e.n_tokens for e in explanations)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"what": what, "peak": peak, "loaded": loaded, "tokens": tokens}))
"""


def measure(what: str) -> dict:
    output = subprocess.run([sys.executable, "-c", CHILD, what], capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    results = {what: measure(what) for what in ("forward", "norm", "alti")}
    base = results["forward"]
    print(f"32 windows, {base['tokens']} tokens; minilm-sentiment on the CPU")
    for what, result in results.items():
        extra = result["peak"] - result["loaded"]
        print(
            f"{what:<8} peak RSS {result['peak'] / 2**20:7.0f} MiB ({result['peak'] / base['peak']:.2f}x forward); "
            f"above the loaded model {extra / 2**20:6.0f} MiB ({extra / max(base['peak'] - base['loaded'], 1):.2f}x forward)"
        )


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
