"""Stopping `attnflow serve` as a user does: the command in its own process, on a tiny model and a
free port, a slow request in flight (a method that never reaches a check), then Ctrl-C (SIGINT)
or SIGTERM: the client gets one 503 line, the process exits within 5 s, nothing on stderr is a
traceback; a second Ctrl-C exits at once; Ctrl-C while ``--preload`` loads the first model too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="attnflow serve needs the serve extra")
ROOT = Path(__file__).resolve().parents[2]
EXIT_S = 5.0
# The command as a user runs it, with one test method registered first: it sleeps without ever
# reaching a check (no step, no forward pass), the worst case for stopping. SLOW_LOAD: the first
# load sleeps the same way, after saying so on stderr.
DRIVER = """
import sys, time
import numpy as np
from attnflow.cli import main
from attnflow.methods.registry import register

@register("serve_test_slow", "test: sleeps 60 s without a check", takes="attentions")
def slow(attentions):
    time.sleep(60)
    return np.eye(attentions.shape[-1])

if sys.argv[1] == "slow-load":
    import attnflow.serve.pool as pool
    loaded = pool._load
    def slow_load(name, **options):
        print("loading started", file=sys.stderr, flush=True)
        time.sleep(60)
        return loaded(name, **options)
    pool._load = slow_load
sys.exit(main(["serve", *sys.argv[2:]]))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(model: Path, mode: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-c", DRIVER, mode, "--model", str(model), "--port", str(port), *extra]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return server, f"http://127.0.0.1:{port}"


def call(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def wait_until(condition, seconds: float, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if condition():
                return
        except (OSError, ValueError):
            pass
        assert server.poll() is None, server.communicate()[1]
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(0.1)


def stopped(server: subprocess.Popen, signals: list[int], pause: float = 0.2) -> tuple[float, str]:
    """Send ``signals`` (``pause`` apart); the seconds from the first to the exit, and stderr."""
    began = time.monotonic()
    for number, sig in enumerate(signals):
        if number:
            time.sleep(pause)
        server.send_signal(sig)
    try:
        _, stderr = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        raise AssertionError("the server did not exit within 30 s") from None
    return time.monotonic() - began, stderr


def assert_quiet(stderr: str) -> None:
    for word in ("Traceback", "KeyboardInterrupt", "CancelledError", "Error"):
        assert word not in stderr, stderr


@pytest.mark.parametrize(
    "signals",
    [
        pytest.param([signal.SIGINT], id="ctrl-c"),
        pytest.param([signal.SIGTERM], id="sigterm", marks=pytest.mark.slow),  # make test-all: a server each
        pytest.param([signal.SIGINT, signal.SIGINT], id="twice", marks=pytest.mark.slow),
    ],
)
def test_a_signal_with_a_request_in_flight_answers_503_and_exits_in_5_s(tiny_classifier_path, signals):
    server, base = start(tiny_classifier_path("bert"), "serve")
    wait_until(lambda: call(base + "/api/models")[0] == 200, 120, server)
    answer: dict = {}
    body = {"text": "the movie was great", "methods": ["serve_test_slow"], "faithfulness": False, "request_id": "slow"}
    client = threading.Thread(target=lambda: answer.setdefault("reply", call(base + "/api/explain", body)))
    client.start()
    wait_until(lambda: call(base + "/api/progress/slow")[1].get("step") == "serve_test_slow", 60, server)
    seconds, stderr = stopped(server, signals)
    client.join(10)
    if len(signals) == 1:
        assert seconds <= EXIT_S, (seconds, stderr)
        status, reply = answer["reply"]
        assert status == 503 and "the server is stopping" in reply["error"] and "\n" not in reply["error"]
        assert server.returncode == 0
    else:  # the second one does not wait for the method's thread
        assert seconds <= 1.5, (seconds, stderr)
        assert server.returncode == 128 + signal.SIGINT
    assert_quiet(stderr)


def test_ctrl_c_while_the_first_model_loads_exits_in_5_s(tiny_classifier_path):
    server, _ = start(tiny_classifier_path("bert"), "slow-load", "--preload")
    assert server.stderr is not None
    wait_until(lambda: "loading started" in server.stderr.readline(), 120, server)
    seconds, stderr = stopped(server, [signal.SIGINT])
    assert seconds <= EXIT_S, (seconds, stderr)
    assert_quiet(stderr)
