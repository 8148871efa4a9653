"""dinov2-s on a real photo: the one-time conversion, one traced image against onnxruntime running
the original ONNX graph, and attention flow's CLS row against its full matrix, in one run.

    python benchmarks/bench_vision.py [--skip-full-flow]

Photo: matplotlib's grace_hopper.jpg (224 x 224 centre crop -> CLS + 16 x 16 patches, n = 257).
(a) `install_dinov2_s` into a scratch cache: read the ONNX graph, map the weights, write the folder.
(b) `AttentionModel.trace_image` (attentions and head outputs, the forward pass stopped after the
    last attention layer; median of 3) against `onnxruntime` running the whole ONNX graph (backbone
    and its saliency decoder; median of 3) on the same pixels.
(c) `attention_flow(rows=[0])` (what `explain --method flow` computes on an image) against the
    full 257 x 257 matrix (`rows=None`), n_jobs = 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

import attnflow
from attnflow.capture import loading, onnx_dinov2
from attnflow.capture.images import read_image, to_rgb

PHOTO = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"


def timed(function, repeats: int = 1) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-full-flow", action="store_true", help="skip the full flow matrix (minutes)")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    with tempfile.TemporaryDirectory() as cache:
        os.environ["ATTNFLOW_CACHE"] = cache
        seconds, _ = timed(loading.install_dinov2_s)
        print(f"(a) conversion ONNX -> Hugging Face folder: {seconds:.1f} s")
    del os.environ["ATTNFLOW_CACHE"]

    import onnxruntime

    model = attnflow.load("dinov2-s", device="cpu")
    pixels = model.image_processor(to_rgb(read_image(PHOTO))[0])[0].numpy()
    trace_seconds, trace = timed(lambda: model.trace_image(PHOTO), repeats=3)
    onnx_file = loading._package_dir(onnx_dinov2.PACKAGE) / onnx_dinov2.ONNX_FILE
    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    onnx_seconds, _ = timed(lambda: session.run(None, {"input_image": pixels}), repeats=3)
    print(
        f"(b) trace_image {trace_seconds:.2f} s, onnxruntime whole graph {onnx_seconds:.2f} s "
        f"(ratio {trace_seconds / onnx_seconds:.1f})"
    )

    row_seconds, _ = timed(lambda: attnflow.attention_flow(trace.attentions, rows=[0]))
    line = f"(c) flow CLS row {row_seconds:.2f} s"
    if not args.skip_full_flow:
        full_seconds, _ = timed(lambda: attnflow.attention_flow(trace.attentions))
        n = trace.n_tokens
        line += f", full {n} x {n} matrix {full_seconds:.1f} s (ratio {full_seconds / row_seconds:.0f})"
    print(line)


if __name__ == "__main__":
    main()
