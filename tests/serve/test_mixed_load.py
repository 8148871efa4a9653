"""The mixed load of `benchmarks/bench_serve.py` (issue 39), short and on tiny models: heavy requests
on one model, cheap ones on the other (and none): cheap p95 ≤ 1 s, no 5xx, memory ≤ 1.3× warm."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest

from .conftest import make_app, served

pytest.importorskip("uvicorn", reason="attnflow serve needs the serve extra")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


def test_cheap_requests_stay_fast_beside_heavy_ones_on_another_model(tiny_loader):
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    server = served(make_app(tiny_loader))
    base = next(server)
    try:
        result = asyncio.run(bench.mixed_load(base, ("tiny-a", "tiny-b"), 6, 2, 4.0, os.getpid()))
    finally:
        next(server, None)
    assert bench.mixed_failed(result) == [], result
    assert result["statuses"]["heavy"].get(200) and result["statuses"]["cheap"].get(200), result
    assert {400, 404} <= set(result["statuses"]["cheap"]), result  # refusals are among the cheap answers
