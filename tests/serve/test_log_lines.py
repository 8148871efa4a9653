"""What `attnflow serve` logs when a request gives up: a client that goes away, or one over the time
limit, is one line in the server's log, never a traceback (the work it abandoned finishes with
`Cancelled`, and that exception must not reach asyncio's "never retrieved" report)."""

from __future__ import annotations

import gc
import logging
import time

import httpx
import numpy as np
import pytest

from attnflow.methods.registry import register, unregister

from .conftest import make_app, served
from .test_api import TEXT

SPIN_S = 10.0


@pytest.fixture
def spinning():
    """A method that runs forward passes of its model until its request is stopped (the pool's
    hook raises `Cancelled` at the next pass), or `SPIN_S`."""
    import torch

    @register("serve_test_spinning", "test: forward passes until stopped", takes="model", needs=("attentions", "model"))
    def spin(model, trace):
        ids = torch.tensor([[1, 2, 3, 4]])
        began = time.monotonic()
        while time.monotonic() - began < SPIN_S:
            with torch.no_grad():
                model.hf_model(input_ids=ids, attention_mask=torch.ones_like(ids))
            time.sleep(0.005)
        return np.eye(trace.attentions.shape[-1])

    yield
    unregister("serve_test_spinning")


def _stopped_lines(records: list[logging.LogRecord]) -> list[str]:
    return [record.getMessage() for record in records if record.name == "attnflow.serve"]


@pytest.mark.usefixtures("spinning")
def test_twenty_disconnects_and_a_timeout_log_one_line_each_and_no_traceback(tiny_loader, caplog):
    caplog.set_level(logging.DEBUG)
    body = {"text": TEXT, "model": "tiny-a", "methods": ["serve_test_spinning"], "faithfulness": False}
    for url in served(make_app(tiny_loader, time_limit_s=2.0)):
        with httpx.Client(base_url=url, timeout=30) as client:
            warm = client.post("/api/explain", json={**body, "methods": ["rollout"]})
            assert warm.status_code == 200, warm.text  # loaded and measured
            caplog.clear()
            for i in range(20):
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                    client.post("/api/explain", json={**body, "request_id": f"gone-{i}"}, timeout=0.3)
                deadline = time.monotonic() + 10
                while client.get(f"/api/progress/gone-{i}").json()["running"]:
                    assert time.monotonic() < deadline, f"request gone-{i} kept running"
                    time.sleep(0.02)
            timed_out = client.post("/api/explain", json={**body, "request_id": "slow"})
            assert timed_out.status_code == 504, timed_out.text
            time.sleep(0.5)  # the abandoned work ends (its next forward pass raises)
            assert client.post("/api/explain", json={**body, "methods": ["rollout"]}).status_code == 200
        gc.collect()  # asyncio reports an exception never retrieved when its future is collected
    tracebacks = [r for r in caplog.records if r.exc_info or r.stack_info or "never retrieved" in r.getMessage()]
    assert not tracebacks, [r.getMessage() for r in tracebacks[:3]]
    lines = _stopped_lines(caplog.records)
    assert len([line for line in lines if "disconnected" in line]) == 20, lines
    assert len([line for line in lines if "time limit" in line]) == 1, lines
    assert len(lines) == 21, lines
    assert all("\n" not in line for line in lines)
