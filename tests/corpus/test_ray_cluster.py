"""Faults on a real multi-node Ray cluster: two `ray start` nodes on this machine (loopback only),
one worker process killed mid-study; the study still gives the local engine's statistics.

The cluster authenticates with a token of its own (Ray's token authentication): every node and
the driver (this process) get ``RAY_AUTH_MODE=token`` and the same ``RAY_AUTH_TOKEN``, whatever
token may lie in ``~/.ray/auth_token``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

import attnflow
from attnflow.corpus import ray_engine
from attnflow.corpus.engine import run_study

from corpus_helpers import assert_same_arrays, load_npz, tiny_options

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # ~85 s on 2 shared cores: two `ray start` nodes and four actor starts


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node_ports() -> list[str]:
    """Every fixed port a node would otherwise take from Ray's defaults (shared with other users)."""
    names = (
        "node-manager-port",
        "object-manager-port",
        "metrics-export-port",
        "runtime-env-agent-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
    )
    return [f"--{name}={free_port()}" for name in names]


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the cluster rooted at ``temp_dir``: those naming it, and their descendants."""
    roots = []
    for process in psutil.process_iter(["cmdline"]):
        if any(temp_dir in part for part in process.info["cmdline"] or ()):
            roots.append(process)
    found = {process.pid: process for process in roots}
    for process in roots:
        try:
            found.update({child.pid: child for child in process.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def start_node(command: list[str], env: dict[str, str]) -> None:
    """``ray start`` a node on its own ports; a refusal fails the test with Ray's own words."""
    result = subprocess.run([*command, *node_ports()], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-3000:]}"


def reread_auth_settings() -> None:
    """Ray reads the authentication mode and token once per process: make this process (the
    driver) read them from its environment again."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture
def cluster_token(monkeypatch):
    """A fresh token for the test cluster, required by this process while the test runs."""
    token = secrets.token_hex(32)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    reread_auth_settings()
    yield token
    monkeypatch.undo()
    reread_auth_settings()


@pytest.fixture
def ray_cluster(cluster_token):
    """A head node and a second node, 1 CPU each, on 127.0.0.1, both requiring ``cluster_token``;
    stopped (by process id) at the end."""
    ray = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="afray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    source = str(Path(attnflow.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": source, "RAY_USAGE_STATS_ENABLED": "0"}
    assert env["RAY_AUTH_TOKEN"] == cluster_token  # every node requires it
    common = [
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
        "--num-gpus=0",
        "--object-store-memory=78643200",
        "--disable-usage-stats",
    ]
    port = free_port()
    address = f"127.0.0.1:{port}"
    try:
        head = [f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
        start_node([str(ray), "start", "--head", *head, *common], env)
        start_node([str(ray), "start", f"--address={address}", *common], env)
        yield address, temp_dir
    finally:
        processes = cluster_processes(temp_dir)
        for process in processes:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(processes, timeout=10)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_killed_worker_does_not_change_the_statistics(
    ray_cluster, tiny_bert, txt_corpus, tmp_path, monkeypatch, caplog
):
    address, temp_dir = ray_cluster
    options = dict(samples=40, stride=20, batch_size=2, checkpoint_every=4)
    local = run_study(tiny_options(tiny_bert, txt_corpus, **options), tmp_path / "local")

    killed: list[int] = []
    process_batch = ray_engine.RayBackend.process

    def process_then_kill(backend, batch):
        process_batch(backend, batch)
        if batch.first == 10 and not killed:  # the 6th batch: 5 given since the checkpoint, some still in flight
            workers = [
                process for process in cluster_processes(temp_dir) if "StudyWorker" in " ".join(process.cmdline())
            ]
            assert len(workers) == 2, "one actor per node"
            workers[0].kill()
            killed.append(workers[0].pid)

    monkeypatch.setattr(ray_engine.RayBackend, "process", process_then_kill)
    with caplog.at_level(logging.WARNING, logger="attnflow.corpus.ray_engine"):
        distributed = run_study(
            tiny_options(tiny_bert, txt_corpus, **options, engine="ray", workers=2, ray_address=address),
            tmp_path / "ray",
        )
    assert killed and not psutil.pid_exists(killed[0])
    assert any("a Ray worker died" in record.getMessage() for record in caplog.records)
    assert distributed["samples"] == local["samples"] == 40
    assert_same_arrays(
        load_npz(tmp_path / "local" / "stats.npz"), load_npz(tmp_path / "ray" / "stats.npz"), exact=False
    )
