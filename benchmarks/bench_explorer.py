"""The explorer page of a long text: file size, build time, and page load and layer-switch times in
headless Chromium (Debian's ``chromium``, driven by Playwright, offline).

    python benchmarks/bench_explorer.py                          # mpnet, 512 tokens, raw + rollout
    python benchmarks/bench_explorer.py --model minilm --tokens 256 --loads 1

Input: the first 40 embedded Wikipedia summaries, truncated to ``--tokens`` on ``--model``, methods
``--methods``. Each of ``--loads`` fresh page loads then switches the layer to 0, L/2, L/4, 3L/4
(mpnet: 0, 6, 3, 9; first visits: the page inflates the layer's chunks), back to L/2 (cached),
with the heads fused and again with head 4 shown (the similarity chunks are cached by then). A
switch is timed inside the page with ``performance.now()``, from setting the layer selector and
dispatching its ``change`` event until the page has drawn (its ``attnflow-drawn`` event). After
the switches, the shown method's chunks of those layers are read back through the page's decoder
and checked against the Python arrays: the largest error over the 7-bit codes' bound (half a code
step of each row) must stay ≤ 1 (+ 1e-4 for float32 rounding).

Prints a table and writes ``out/bench/explorer.json``.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import attnflow
from attnflow.exploration import explore
from attnflow.runs.readers import open_corpus

SWITCH = """(layer) => new Promise((resolve) => {
  const select = document.getElementById("layer");
  document.addEventListener("attnflow-drawn", () => resolve(performance.now() - started), { once: true });
  const started = performance.now();
  select.value = String(layer);
  select.dispatchEvent(new Event("change"));
})"""
READ_BACK = """([reference, index]) => attnflowExplorer.values(reference, index).then((values) => {
  const bytes = new Uint8Array(values.buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 32768) text += String.fromCharCode.apply(null, bytes.subarray(i, i + 32768));
  return btoa(text);
})"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mpnet")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--methods", default="raw,rollout")
    parser.add_argument("--loads", type=int, default=3, help="fresh page loads (default: 3)")
    parser.add_argument("--out", default="out/bench/explorer.json")
    args = parser.parse_args()

    model = attnflow.load(args.model, device="cpu")
    text = " ".join(itertools.islice(open_corpus("wiki"), 40))
    started = time.perf_counter()
    exploration = explore(model, text, methods=args.methods.split(","), max_length=args.tokens)
    computed = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="bench-explorer-"))
    path = exploration.save(folder)
    written = time.perf_counter()
    shown = exploration.method("rollout" if "rollout" in args.methods.split(",") else args.methods.split(",")[0])
    record = {
        "model": args.model,
        "tokens": exploration.n_tokens,
        "layers": exploration.n_layers,
        "heads": exploration.n_heads,
        "methods": [view.name for view in exploration.methods],
        "file_mb": round(path.stat().st_size / 1e6, 1),
        "methods_s": round(computed - started, 1),
        "encode_and_write_s": round(written - computed, 1),
        "loads": [measure(path, exploration, shown) for _ in range(args.loads)],
    }
    shutil.rmtree(folder)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    report(record)


def measure(path: Path, exploration, shown) -> dict:
    """One fresh page load: load time, switch times (fused heads, then head 4), read-back errors."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    method = [view.name for view in exploration.methods].index(shown.name)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1300, "height": 1400}, offline=True)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        started = time.perf_counter()
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']", state="attached", timeout=300_000)
        result: dict = {"load_s": round(time.perf_counter() - started, 2)}
        page.select_option("#method", str(method))
        page.wait_for_selector("body[data-busy='0']", state="attached")
        layers = switched_layers(exploration.n_layers)
        for head in (-1, 4):
            page.select_option("#head", str(head))
            page.wait_for_selector("body[data-busy='0']", state="attached")
            result["fused" if head < 0 else f"head {head}"] = [round(page.evaluate(SWITCH, at), 1) for at in layers]
        worst = max(read_back_error(page, method, shown, layer, head) for head in (-1, 4) for layer in set(layers))
        result["error_over_bound"] = round(worst, 3)
        browser.close()
    assert not errors, errors
    assert worst <= 1 + 1e-4, f"a decoded value is off by {worst:.5f}x the quantisation bound"  # 1e-4: float32
    return result


def switched_layers(n_layers: int) -> tuple[int, ...]:
    """Layers 0, L/2, L/4, 3L/4 (first visits; the page opens on the last layer), then L/2 (cached)."""
    return (0, n_layers // 2, n_layers // 4, 3 * n_layers // 4, n_layers // 2)


def read_back_error(page, method: int, view, layer: int, head: int) -> float:
    """Largest |decoded - original| / (half a code step) over the shown chunk (exact columns: 0)."""
    at = layer - (view.first_layer or 0)
    if head < 0:
        kind, original, index = "matrices", view.matrices[at], at
    else:  # one chunk per layer and head
        kind, original, index = "heads", view.head_matrices[at, head], at * view.head_matrices.shape[1] + head
    reference = page.evaluate(f"attnflowExplorer.meta.methods[{method}].{kind}")
    encoded = page.evaluate(READ_BACK, [reference, index])
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4").reshape(original.shape)
    exact = np.zeros(original.shape[-1], dtype=bool)
    exact[reference["exact_columns"]] = True
    bound = np.abs(original[..., ~exact]).max(axis=-1, keepdims=True) / 254
    error = np.abs(decoded - original)
    error[..., exact] = 0
    return float(np.max(error / np.maximum(bound, 1e-30)))


def report(record: dict) -> None:
    print(
        f"{record['model']}: {record['tokens']} tokens, {record['layers']} layers × {record['heads']} heads, "
        f"methods {', '.join(record['methods'])}"
    )
    print(
        f"file {record['file_mb']} MB; methods {record['methods_s']} s; encode + write {record['encode_and_write_s']} s"
    )
    for key in ("fused", "head 4"):
        rows = [load[key] for load in record["loads"]]
        first = [time for row in rows for time in row[:-1]]
        cached = [row[-1] for row in rows]
        print(
            f"{key}: layer switch, first visit (layers {', '.join(map(str, switched_layers(record['layers'])[:-1]))}) "
            f"median "
            f"{statistics.median(first):.0f} ms, max {max(first):.0f} ms; "
            f"cached median {statistics.median(cached):.0f} ms"
        )
    print(
        f"page load {', '.join(str(load['load_s']) for load in record['loads'])} s; "
        f"decoded error / bound ≤ {max(load['error_over_bound'] for load in record['loads'])}"
    )


if __name__ == "__main__":
    main()
