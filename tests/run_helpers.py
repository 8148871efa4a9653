"""What the tests of the run engine share: the texts and prompt pairs they run on, and the
comparison of two runs' numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

TEXTS = ["the cat sat on the mat", "the dog ran to the cat", "hello world this is a story", "we ran", "a good film"]
# the clock's, not the model's
TIMES = ("seconds", "seconds_per_sample", "seconds_per_prompt", "wall_seconds", "elapsed_s")


def assert_same_json(first, second) -> None:
    """Equal structures, floats within float32 noise (the other process's batches)."""
    if isinstance(first, dict):
        assert first.keys() == second.keys()
        for key in first:
            if key not in TIMES:
                assert_same_json(first[key], second[key])
    elif (
        isinstance(first, list)
        and first
        and isinstance(first[0], (int, float, list))
        and not isinstance(first[0], bool)
    ):
        np.testing.assert_allclose(
            np.asarray(first, dtype=float), np.asarray(second, dtype=float), rtol=1e-5, atol=1e-7
        )
    elif isinstance(first, list):
        assert len(first) == len(second)
        for a, b in zip(first, second, strict=True):
            assert_same_json(a, b)
    elif isinstance(first, float):
        assert first == pytest.approx(second, rel=1e-5, abs=1e-7, nan_ok=True)
    else:
        assert first == second


def write_pairs(path: Path) -> Path:
    rows = [
        {"clean": "the cat sat on the mat", "corrupt": "the dog sat on the mat"},
        {"clean": "the dog ran", "noise": "dog"},
        {"clean": "hello world this is", "corrupt": "hello there this is"},
        {"clean": "the cat sat", "corrupt": "the cat sat on the mat"},  # of another length: left out
        {"clean": "we ran to the cat", "noise": "ran"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def kill_at_first_checkpoint(argv: list[str], out: Path, timeout: float = 300) -> dict:
    """Run ``attnflow *argv --out out`` in another interpreter, SIGKILL it once ``out`` holds a
    checkpoint and return that checkpoint. The process computes with this one's thread count (the
    same sums in the same order) and this interpreter's import path."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch

    command = [sys.executable, "-c", "import sys; from attnflow.cli import main; sys.exit(main())", *argv]
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    process = subprocess.Popen([*command, "--out", str(out)], env=environment)
    deadline = time.monotonic() + timeout
    while not (out / "checkpoint.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    return json.loads((out / "checkpoint.json").read_text())
