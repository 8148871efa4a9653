"""Faults on a real multi-node Ray cluster: two `ray start` nodes on this machine (loopback only),
one worker process killed mid-run; the corpus study, `evaluate` and `patch --file` still give the
local engine's numbers. One cluster serves the module's tests.

The cluster authenticates with a token of its own (Ray's token authentication): every node and
the driver (this process) get ``RAY_AUTH_MODE=token`` and the same ``RAY_AUTH_TOKEN``, whatever
token may lie in ``~/.ray/auth_token``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

import attnflow
from attnflow.cli import main
from attnflow.corpus.engine import run_study
from attnflow.runs.engine import RayBackend

from corpus_helpers import assert_same_arrays, load_npz, tiny_options

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # ~3 min on 2 shared cores: two `ray start` nodes, three runs of two actors


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


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node and a second node, 1 CPU each, on 127.0.0.1, both requiring a fresh token (this
    process, the driver, requires it too while the module runs); stopped (by process id) at the end.
    A private runtime the session started is shut down first: the driver joins the cluster."""
    if ray.is_initialized():
        ray.shutdown()
    token = secrets.token_hex(32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "token")
        patch.setenv("RAY_AUTH_TOKEN", token)
        reread_auth_settings()
        try:
            yield from _started_cluster(token)
        finally:
            if ray.is_initialized():
                ray.shutdown()
    reread_auth_settings()


def _started_cluster(token: str):
    ray_command = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="afray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    source = str(Path(attnflow.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, *sys.path]), "RAY_USAGE_STATS_ENABLED": "0"}
    env["OMP_NUM_THREADS"] = "1"
    assert env["RAY_AUTH_TOKEN"] == token  # every node requires it
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
        start_node([str(ray_command), "start", "--head", *head, *common], env)
        start_node([str(ray_command), "start", f"--address={address}", *common], env)
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


def kill_a_worker_at(monkeypatch, temp_dir: str, batch_number: int) -> list[int]:
    """Kill one actor's process (SIGKILL) when the driver has given out ``batch_number`` batches,
    some of them still in flight; returns the killed process ids (one, once it happened)."""
    killed: list[int] = []
    process_batch, given = RayBackend.process, [0]

    def process_then_kill(backend, batch):
        process_batch(backend, batch)
        given[0] += 1
        if given[0] == batch_number and not killed:
            workers, deadline = [], time.monotonic() + 120
            while len(workers) < 2 and time.monotonic() < deadline:  # the actors may still be loading
                workers = [p for p in cluster_processes(temp_dir) if "StepWorker" in " ".join(p.cmdline())]
                time.sleep(0.2)
            assert len(workers) == 2, "one actor per node"
            workers[0].kill()
            killed.append(workers[0].pid)

    monkeypatch.setattr(RayBackend, "process", process_then_kill)
    return killed


def test_a_killed_worker_does_not_change_the_statistics(
    ray_cluster, tiny_bert, txt_corpus, tmp_path, monkeypatch, caplog
):
    address, temp_dir = ray_cluster
    options = dict(samples=40, stride=20, batch_size=2, checkpoint_every=4)
    local = run_study(tiny_options(tiny_bert, txt_corpus, **options), tmp_path / "local")
    killed = kill_a_worker_at(monkeypatch, temp_dir, 6)  # 5 given since the checkpoint, some still in flight
    with caplog.at_level(logging.WARNING, logger="attnflow.runs.actors"):
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


def test_evaluate_with_a_killed_worker_equals_the_local_run(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    from run_helpers import assert_same_json

    address, temp_dir = ray_cluster
    argv = ["evaluate", "--model", str(tiny_model_path("llama")), "--task", "next-token", "--window", "5",
            "--samples", "8", "--methods", "grad_x_input,random", "--sanity-samples", "2", "--sanity-layers", "1",
            "--bounds", "singles", "--device", "cpu", "--quiet"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "local")]) == 0
    killed = kill_a_worker_at(monkeypatch, temp_dir, 3)
    ray_options = ["--engine", "ray", "--ray-address", address, "--workers", "2", "--checkpoint-every", "4"]
    assert main([*argv, *ray_options, "--out", str(tmp_path / "ray")]) == 0
    assert killed
    local, distributed = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("local", "ray"))
    assert_same_json(local["methods"], distributed["methods"])


def test_patch_file_with_a_killed_worker_equals_the_local_run(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    from run_helpers import assert_same_json, write_pairs

    address, temp_dir = ray_cluster
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    argv = ["patch", "--file", str(pairs), "--model", str(tiny_model_path("llama")), "--sites", "heads",
            "--method", "exact,atp", "--samples", "2", "--device", "cpu", "--quiet"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "local")]) == 0
    killed = kill_a_worker_at(monkeypatch, temp_dir, 3)
    ray_options = ["--engine", "ray", "--ray-address", address, "--workers", "2", "--checkpoint-every", "5"]
    assert main([*argv, *ray_options, "--out", str(tmp_path / "ray")]) == 0
    assert killed
    local, distributed = ((tmp_path / name / "pairs.jsonl").read_text().splitlines() for name in ("local", "ray"))
    assert_same_json([json.loads(row) for row in local], [json.loads(row) for row in distributed])
