"""`attnflow serve` under clients that control its resources: bad requests answered at once, one
queue per model, estimates that refuse what cannot finish, caps on options and kept pages, only
the offered models, loads that stop, and every error as one JSON line."""

from __future__ import annotations

import time

import pytest

from .conftest import TINY, make_app
from .test_api import TEXT, explain, in_thread, one_line_error

QUICK = {"faithfulness": False}


def wait_for(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def timed(call):
    began = time.perf_counter()
    response = call()
    return response, time.perf_counter() - began


def test_a_busy_model_delays_neither_another_model_nor_bad_requests(tiny_loader, blocking_method):
    """Five requests hold or wait for tiny-a (more than the old shared executor's four threads):
    tiny-b, the catalogue and refusals still answer at once; tiny-a's queue then runs in order."""
    from fastapi.testclient import TestClient

    started, release = blocking_method
    app = make_app(tiny_loader)
    with TestClient(app) as client:
        assert explain(client, model="tiny-b", methods=["rollout"], **QUICK).status_code == 200  # loaded
        body = {"methods": ["serve_test_blocking"], **QUICK}
        waiting = [in_thread(lambda i=i: explain(client, request_id=f"held-{i}", **body)) for i in range(5)]
        assert started.wait(20)
        wait_for(lambda: len(app.state.jobs) == 5)
        response, seconds = timed(lambda: explain(client, model="tiny-b", methods=["rollout"], **QUICK))
        assert response.status_code == 200 and seconds < 5, seconds
        refusals = {
            404: {"model": "nope"},
            400: {"methods": ["nope"]},
            413: {"text": "a " * 3000},
        }
        for status, body in refusals.items():
            refused, seconds = timed(lambda body=body: explain(client, **body))
            one_line_error(refused, status)
            assert seconds < 2, (status, seconds)
        assert client.get("/api/models").status_code == 200
        steps = {i: client.get(f"/api/progress/held-{i}").json()["step"] for i in range(5)}
        assert sorted(steps.values()) == ["serve_test_blocking"] + ["waiting for tiny-a"] * 4  # one runs, four wait
        queued = next(i for i, step in steps.items() if step.startswith("waiting"))
        cancelled = client.post(f"/api/cancel/held-{queued}", json={})
        assert cancelled.status_code == 200  # a waiting one leaves the queue at once
        waiting[queued][0].join(5)
        assert "cancelled by the client" in one_line_error(waiting[queued][1]["response"], 409)
        release.set()
        for number, (thread, answer) in enumerate(waiting):
            thread.join(30)
            assert number == queued or answer["response"].status_code == 200


def test_option_caps_are_refused_before_queueing(client):
    cases = [
        (["leave_one_out"], {"batch_size": 65}, "at most 64"),
        (["shap"], {"max_evals": 5000}, "at most 4096"),
        (["integrated_gradients"], {"n_steps": 257}, "at most 256"),
    ]
    for methods, options, says in cases:
        message = one_line_error(explain(client, methods=methods, options=options), 400)
        assert says in message and str(next(iter(options))) in message
    assert explain(client, methods=["leave_one_out"], options={"batch_size": 64}, **QUICK).status_code == 200


def test_only_offered_models_load_and_they_stay_before_others(tiny_loader):
    from fastapi.testclient import TestClient

    from attnflow.serve import ModelPool, ServeConfig, create_app

    loads = len(tiny_loader.loads)
    with TestClient(create_app(ModelPool(["tiny-a"], loader=tiny_loader, known=TINY))) as client:
        message = one_line_error(explain(client, model="tiny-b", methods=["rollout"]), 404)
        assert "not offered" in message and "allow every alias with allow_any_model" in message  # its own spelling
        assert tiny_loader.loads[loads:] == []  # nothing loaded, nothing evicted
    pool = ModelPool(["tiny-a"], loader=tiny_loader, known=TINY, max_models=1, allow_any_model=True)
    with TestClient(create_app(pool, ServeConfig())) as client:
        for model in ("tiny-a", "tiny-b"):
            assert explain(client, model=model, methods=["rollout"], **QUICK).status_code == 200
        assert client.get("/api/models").json()["loaded"] == ["tiny-a"]  # the offered default stays


def test_a_timed_out_load_stops_and_leaves_nothing_half_written(tiny_loader, tmp_path):
    """A first load that writes a cache block by block: the 504 stops it at its next block; the
    temporary folder goes, the cache folder never appears, the model is not kept."""
    from fastapi.testclient import TestClient

    from attnflow.serve import ModelPool, ServeConfig, create_app
    from attnflow.staging import building, checkpoint

    written: list[int] = []
    cache = tmp_path / "cache"

    def slow_load(name):
        with building(cache / name) as folder:
            folder.mkdir()
            for block in range(200):  # 10 s unless stopped
                (folder / f"block-{block}").write_bytes(b"x" * 4096)
                written.append(block)
                checkpoint()
                time.sleep(0.05)
        return tiny_loader(name)

    pool = ModelPool(["tiny-a"], loader=slow_load, known=TINY)
    with TestClient(create_app(pool, ServeConfig(time_limit_s=1.0))) as client:
        assert "during loading tiny-a" in one_line_error(explain(client, methods=["rollout"]), 504)
        time.sleep(1.0)
        count = len(written)
        time.sleep(0.5)
        assert len(written) == count < 40, (count, len(written))  # stopped soon after the 1 s limit
        assert list(cache.iterdir()) == [] and pool.loaded() == []


def test_an_interrupted_join_of_model_pieces_leaves_no_file(tmp_path):
    """The library's own first-load writes (pieces joined, then renamed into place) stop at a checkpoint."""
    from attnflow.capture.loading import _build_atomically, _join
    from attnflow.staging import interruptible

    pieces = []
    for number in range(3):
        piece = tmp_path / f"piece-{number}"
        piece.write_bytes(bytes([number]) * (5 << 20))  # two 4 MiB blocks each
        pieces.append(piece)
    target = tmp_path / "cache" / "model"
    checks = []

    def check():
        checks.append(1)
        if len(checks) == 3:
            raise RuntimeError("stopped")

    with interruptible(check), pytest.raises(RuntimeError, match="stopped"):
        _build_atomically(target, lambda folder: (folder.mkdir(), _join(pieces, folder / "joined.bin")))
    left = [entry.name for entry in (tmp_path / "cache").iterdir()]
    assert left == ["model.lock"]  # the lock file one process at a time builds under; no folder, no scratch
    _build_atomically(target, lambda folder: (folder.mkdir(), _join(pieces, folder / "joined.bin")))
    assert (target / "joined.bin").stat().st_size == 15 << 20  # uninterrupted: the whole file


# ----- estimates --------------------------------------------------------------------------------------


def _set_rates(app, model: str, token_s: float) -> None:
    from attnflow.costs import Rates

    app.state.costs.set_rates(model, Rates(pass_s=0.001, token_s=token_s))


def test_a_request_that_cannot_finish_in_time_is_refused_at_once_with_what_fits(tiny_loader, blocking_method):
    from fastapi.testclient import TestClient

    started, release = blocking_method
    app = make_app(tiny_loader, time_limit_s=10.0)
    long_text = " ".join(["the movie was terrible but the acting was great"] * 8)
    with TestClient(app) as client:
        assert explain(client, methods=["rollout"], **QUICK).status_code == 200  # loaded, measured
        _set_rates(app, "tiny-a", token_s=0.005)  # as a slow machine would measure
        thread, _ = in_thread(lambda: explain(client, methods=["serve_test_blocking"], **QUICK))
        assert started.wait(20)  # tiny-a is busy: a refusal must not wait for it
        asked = {"text": long_text, "methods": ["rollout", "leave_one_out"], **QUICK}
        refused, seconds = timed(lambda: explain(client, **asked))
        message = one_line_error(refused, 413)
        assert seconds < 2 and "time limit of 10 s" in message and "leave_one_out" in message
        assert "what would fit: a text of at most" in message and "the request without leave_one_out" in message
        release.set()
        thread.join(30)
        fits = int(message.split("a text of at most ")[1].split()[0])
        answer = explain(client, **asked, max_length=fits)
        assert answer.status_code == 200, answer.text
        assert answer.json()["estimated_s"] <= 10


def test_the_first_request_on_a_model_is_estimated_once_it_has_loaded(tiny_loader):
    from fastapi.testclient import TestClient

    app = make_app(tiny_loader, time_limit_s=5.0)
    _set_rates(app, "tiny-a", token_s=1.0)  # nothing fits: even the trace takes longer
    with TestClient(app) as client:
        message = one_line_error(explain(client, methods=["rollout"]), 413)
        assert "what would fit: nothing on this model" in message or "a text of at most" in message


def test_a_queue_that_cannot_reach_a_request_in_time_refuses_it_with_retry_after(tiny_loader, blocking_method):
    from fastapi.testclient import TestClient

    started, release = blocking_method
    app = make_app(tiny_loader, time_limit_s=10.0)
    body = {"methods": ["leave_one_out"], **QUICK}
    with TestClient(app) as client:
        assert explain(client, **body).status_code == 200
        _set_rates(app, "tiny-a", token_s=0.001)
        estimate = explain(client, **body).json()["estimated_s"]
        _set_rates(app, "tiny-a", token_s=0.001 * 6 / estimate)  # each such request: about 6 s
        holding, _ = in_thread(lambda: explain(client, methods=["serve_test_blocking"], **QUICK))
        assert started.wait(20)
        queued, answer = in_thread(lambda: explain(client, **body))  # 6 s ahead of the next one
        wait_for(lambda: len(app.state.jobs) == 2)
        refused = explain(client, **body)
        assert "try again in" in one_line_error(refused, 429)
        assert int(refused.headers["retry-after"]) >= 1
        release.set()
        for thread in (holding, queued):
            thread.join(30)
        assert answer["response"].status_code == 200


def test_routes_are_estimated_before_they_run_like_the_other_work(tiny_loader):
    from fastapi.testclient import TestClient

    app = make_app(tiny_loader, time_limit_s=5.0)
    body = {"text": " ".join(["the cat sat on the mat"] * 6), "model": "tiny-gpt2"}
    with TestClient(app) as client:
        answered = client.post("/api/routes", json=body)  # loaded, measured
        assert answered.status_code == 200 and answered.json()["estimated_s"] is not None, answered.text
        _set_rates(app, "tiny-gpt2", token_s=0.2)  # as a slow machine would measure: only a shorter text fits
        message = one_line_error(client.post("/api/routes", json=body), 413)
        assert "time limit of 5 s" in message and "(a shorter text)" in message
        assert "the request without" not in message  # the routes are the request: nothing to leave out
        fits = int(message.split("a text of at most ")[1].split()[0])
        shorter = client.post("/api/routes", json={**body, "text": "the cat sat on the mat"})
        assert shorter.status_code == 200 and shorter.json()["estimated_s"] <= 5 and 8 <= fits < 38


# ----- kept pages, errors ----------------------------------------------------------------------------------


def test_explorer_pages_are_kept_within_a_byte_budget(tiny_loader):
    from fastapi.testclient import TestClient

    body = {"text": TEXT, "model": "tiny-a", "methods": ["rollout"]}
    with TestClient(make_app(tiny_loader)) as client:
        size = len(client.get(client.post("/api/explore", json=body).json()["url"]).content)
    with TestClient(make_app(tiny_loader, max_kept_bytes=int(1.5 * size))) as client:
        first = client.post("/api/explore", json=body).json()["url"]
        second = client.post("/api/explore", json=body).json()["url"]
        one_line_error(client.get(first), 404)  # two would pass the budget: the first went
        assert client.get(second).status_code == 200
    with TestClient(make_app(tiny_loader, max_kept_bytes=size // 2)) as client:
        assert "more than this server keeps" in one_line_error(client.post("/api/explore", json=body), 413)


def test_starlette_answers_are_one_json_line_too(client):
    assert "no such route: GET /api/nope" in one_line_error(client.get("/api/nope"), 404)
    assert "takes POST, not GET" in one_line_error(client.get("/api/explain"), 405)
    garbled = client.post("/api/explain", content=b'{"text": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert "the body could not be read as JSON" in one_line_error(garbled, 400)


def test_each_models_work_runs_on_its_share_of_the_cpu_threads(tiny_loader):
    """Six CPU threads, three offered models: each model's work runs on two (heavy work on one
    leaves the others theirs); ``threads_per_model`` sets it; the server's own thread keeps its own."""
    import threading

    import numpy as np
    import torch
    from fastapi.testclient import TestClient

    from attnflow.methods.registry import register, unregister

    seen: dict[int, list[int]] = {}

    @register("serve_test_threads", "test: records the CPU threads it runs on", takes="attentions")
    def threads(attentions):
        seen.setdefault(threading.get_ident(), []).append(torch.get_num_threads())
        return np.eye(attentions.shape[-1])

    original = torch.get_num_threads()
    torch.set_num_threads(6)
    try:
        for config, expected in (({}, 2), ({"threads_per_model": 1}, 1)):
            seen.clear()
            with TestClient(make_app(tiny_loader, **config)) as client:
                for model in ("tiny-a", "tiny-b", "tiny-a"):
                    answered = explain(client, model=model, methods=["serve_test_threads"], **QUICK)
                    assert answered.status_code == 200, answered.text
            assert len(seen) == 2 and all(counts == [expected] * len(counts) for counts in seen.values()), seen
            assert torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(original)
        unregister("serve_test_threads")
