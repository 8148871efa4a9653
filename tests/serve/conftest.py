"""An `attnflow serve` app on tiny random classifiers (two aliases, same tokenizer), in-process."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="attnflow serve needs the serve extra (pip install -e .[serve])")
pytest.importorskip("httpx", reason="FastAPI's TestClient needs httpx (pip install -e .[test])")

TINY = ("tiny-a", "tiny-b", "tiny-gpt2")


@pytest.fixture(scope="session")
def tiny_folders(tiny_classifier_path, tiny_model_path):
    """Alias -> folder: tiny-a and tiny-b are the same tiny BERT classifier, tiny-gpt2 a tiny causal LM."""
    classifier = tiny_classifier_path("bert")
    return {"tiny-a": classifier, "tiny-b": classifier, "tiny-gpt2": tiny_model_path("gpt2")}


@pytest.fixture(scope="session")
def tiny_loader(tiny_folders):
    """``loader(name)``: a fresh instance of the alias's tiny model; ``loader.loads`` lists the loads."""
    import attnflow

    loads: list[str] = []

    def load(name: str):
        loads.append(name)
        model = attnflow.load(str(tiny_folders[name]), device="cpu", progress=False)
        model.name = name  # as an alias loads
        return model

    load.loads = loads
    return load


def served(app):
    """Serve ``app`` with uvicorn on a free port of 127.0.0.1, in a thread: yields its base URL, then stops it."""
    import time

    import uvicorn

    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running.started, "uvicorn did not start"
    port = running.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


def make_app(loader, **config):
    from attnflow.serve import ModelPool, ServeConfig, create_app

    pool_options = {key: config.pop(key) for key in ("allow_path", "max_models", "max_rss_mb") if key in config}
    pool = ModelPool(list(TINY), loader=loader, known=TINY, **pool_options)
    return create_app(pool, ServeConfig(**config))


@pytest.fixture(scope="module")
def client(tiny_loader):
    from fastapi.testclient import TestClient

    with TestClient(make_app(tiny_loader)) as test_client:
        yield test_client


@pytest.fixture
def blocking_method():
    """A registered method that says when it started and holds its model until released (or 10 s)."""
    from attnflow.methods.registry import register, unregister

    started, release = threading.Event(), threading.Event()

    @register("serve_test_blocking", "test: waits to be released", takes="attentions")
    def blocking(attentions):
        started.set()
        release.wait(10)
        return np.eye(attentions.shape[-1])

    yield started, release
    release.set()
    unregister("serve_test_blocking")
