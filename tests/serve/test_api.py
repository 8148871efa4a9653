"""The JSON API of `attnflow serve` on tiny models: the CLI's numbers, its refusals, its limits."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from attnflow.cli import main
from attnflow.methods.registry import register, unregister

from .conftest import make_app

TEXT = "the movie was terrible, but the acting was great."
TOKEN = "s3cret-s3cret-s3cret"


def one_line_error(response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    (message,) = response.json().values()
    assert set(response.json()) == {"error"} and message and "\n" not in message
    return message


def explain(client, **body):
    return client.post("/api/explain", json={"text": TEXT, "model": "tiny-a", **body})


def assert_valid_request_succeeds(client) -> None:
    response = explain(client, methods=["rollout"])
    assert response.status_code == 200, response.text
    assert response.json()["explanations"][0]["method"] == "rollout"


def close(a, b, tolerance: float = 1e-8) -> None:
    """Equal JSON values, floats to 1e-9 relative or ``tolerance`` absolute: a probability scored in a
    batch of other inputs differs in its last float32 digits (the server scores fewer random rankings
    beside a map once it keeps them for that text), and NAOPC divides that by its bounds' span."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            try:
                close(a[key], b[key], 1e-4 if str(key).startswith("naopc") else tolerance)
            except AssertionError as error:
                raise AssertionError(f"{key}: {error}") from None
    elif isinstance(a, list) and a and not isinstance(a[0], str):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            close(x, y, tolerance)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-9, abs=tolerance)
    else:
        assert a == b


def file_content(answer: dict) -> dict:
    """An answered explanation without the strings the page shows (``display_*``): the file's JSON."""
    return {key: value for key, value in answer.items() if not key.startswith("display_")}


def cli_json(capsys, *argv: str):
    capsys.readouterr()
    assert main(["explain", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_answers_what_the_cli_prints(client, tiny_folders, capsys):
    """auto (its candidates, per-input faithfulness, its choice) and rollout: the same JSON as the CLI."""
    response = explain(client, methods=["auto", "rollout"], options={"discard_ratio": 0.2})
    assert response.status_code == 200, response.text
    served = response.json()["explanations"]
    printed = cli_json(
        capsys, TEXT, "--model", str(tiny_folders["tiny-a"]), "--method", "auto,rollout", "--discard-ratio", "0.2"
    )
    for answer, expected in zip(served, printed, strict=True):
        close({**expected, "model": "tiny-a"}, file_content(answer))
    assert served[0]["chosen_by"].startswith("--method auto chose") and "faithfulness" in served[1]


def test_rollout_matrix_equals_an_explicit_product_of_layers(client, tiny_loader):
    """Independent oracle: Ã = ½·mean over heads + ½·I, rows normalised, multiplied layer by layer."""
    answer = explain(client, methods=["rollout"]).json()["explanations"][0]
    attentions = tiny_loader("tiny-a").trace([TEXT])[0].attentions  # [layer, head, query, key]
    n = attentions.shape[-1]
    product = np.eye(n)
    for layer in range(attentions.shape[0]):
        mixed = 0.5 * attentions[layer].mean(axis=0) + 0.5 * np.eye(n)
        product = (mixed / mixed.sum(axis=1, keepdims=True)) @ product
    np.testing.assert_allclose(np.asarray(answer["matrix"]), product, atol=1e-6)
    np.testing.assert_allclose(answer["scores"], product[0], atol=1e-6)  # the classifier's row: cls
    assert answer["tokens"][0] == "[CLS]" and answer["row"] == "cls"


def test_the_downloads_are_the_files_the_cli_writes(client, tiny_folders, tmp_path, capsys):
    result = explain(client, methods=["grad_x_input"]).json()
    main(
        [
            "explain",
            TEXT,
            "--model",
            str(tiny_folders["tiny-a"]),
            "--method",
            "grad_x_input",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    capsys.readouterr()
    written = json.loads((tmp_path / "explanation.json").read_text(encoding="utf-8"))
    served = client.get(f"/api/results/{result['id']}/grad_x_input.json")
    assert served.status_code == 200 and "attachment" in served.headers["content-disposition"]
    close({**written, "model": "tiny-a"}, served.json())
    html = client.get(f"/api/results/{result['id']}/grad_x_input.html").text
    assert html.count("<!DOCTYPE html>") == 1 and "grad_x_input" in html
    png = client.get(f"/api/results/{result['id']}/grad_x_input.png")
    assert png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
    one_line_error(client.get(f"/api/results/{result['id']}/rollout.json"), 404)


def test_methods_and_models_list_the_registry_and_the_pool(client):
    from attnflow.methods.registry import available_methods, get_method

    methods = client.get("/api/methods").json()["methods"]
    assert [m["name"] for m in methods] == available_methods()
    for record in methods:
        spec = get_method(record["name"])
        assert (record["signed"], record["cost"], record["uses_target"]) == (spec.signed, spec.cost, spec.uses_target)
        assert [o["flag"] for o in record["options"]] == [o.flag for o in spec.options]
    explain(client, methods=["rollout"])
    listed = {m["name"]: m for m in client.get("/api/models").json()["models"]}
    assert listed["tiny-a"]["loaded"] and listed["tiny-a"]["default"] and listed["tiny-a"]["target_kind"] == "class"
    assert "rollout" in listed["tiny-a"]["methods"] and "grad_x_input" in listed["tiny-a"]["auto_candidates"]
    paths = client.get("/openapi.json").json()["paths"]  # the OpenAPI description (/docs shows it)
    for route in ("/api/explain", "/api/generate", "/api/compare", "/api/explore", "/api/models", "/api/methods"):
        assert route in paths
    assert "methods" in client.get("/openapi.json").json()["components"]["schemas"]["ExplainRequest"]["properties"]


def test_compare_and_generate_answer_the_library_numbers(client, tiny_loader):
    from attnflow.comparison import compare
    from attnflow.generation import explain_continuation, prepare_continuation

    answer = client.post("/api/compare", json={"text": TEXT, "models": ["tiny-a", "tiny-b"], "top_k": 3}).json()
    comparison = answer["comparison"]
    assert comparison["spearman"] == pytest.approx(1.0)  # two instances of the same weights
    expected = compare(tiny_loader("tiny-a"), tiny_loader("tiny-b"), TEXT, k=3).to_dict()
    close({**expected, "model_a": "tiny-a", "model_b": "tiny-b"}, comparison)

    body = {"text": "the cat sat", "model": "tiny-gpt2", "methods": ["rollout", "gradient"], "generate": 3}
    served = client.post("/api/generate", json=body).json()["explanations"]
    model = tiny_loader("tiny-gpt2")
    sequence = prepare_continuation(model, "the cat sat", max_new_tokens=3)
    library = explain_continuation(model, sequence, {"rollout": {}, "gradient": {}})
    for answer, explanation in zip(served, library, strict=True):
        close({**explanation.to_dict(), "model": "tiny-gpt2"}, file_content(answer))
    one_line_error(client.post("/api/generate", json={**body, "generate": 1000}), 413)


def test_explore_gives_the_explorer_page_of_the_text(client):
    answer = client.post("/api/explore", json={"text": TEXT, "model": "tiny-a", "methods": ["rollout", "raw"]}).json()
    page = client.get(answer["url"])
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "attnflow explorer: tiny-a" in page.text and "Content-Security-Policy" in page.text
    one_line_error(client.get("/api/explorer/unknown"), 404)


def test_routes_answer_routes_json_and_keep_its_page(client, tiny_loader):
    import attnflow

    body = {"text": "the cat sat on the mat", "model": "tiny-gpt2", "threshold": 0.01, "target": "cat"}
    answer = client.post("/api/routes", json=body).json()
    expected = attnflow.routes(tiny_loader("tiny-gpt2"), body["text"], threshold=0.01, target="cat").to_dict()
    served = answer["routes"]
    assert served.pop("seconds").keys() == expected.pop("seconds").keys()
    close(expected, served)
    assert served["target"]["token"] == "cat" and answer["model"] == "tiny-gpt2"
    page = client.get(answer["url"])
    assert page.status_code == 200 and "attnflow routes: tiny-gpt2" in page.text and "<script src" not in page.text
    assert "/api/routes" in client.get("/openapi.json").json()["paths"]


BAD_ROUTES = {
    "threshold 1": ({"threshold": 1}, 422, "threshold"),
    "position out of range": ({"position": 99}, 400, "position must be an integer"),
    "position of the wrong type": ({"position": "last"}, 422, "position"),
    "empty text": ({"text": " "}, 400, "empty"),
    "a target without a language-model head": ({"model": "tiny-a", "target": "cat"}, 400, "no language-model head"),
    "a contrast equal to the target": ({"target": "cat", "contrast": "cat"}, 400, "the target itself"),
}


@pytest.mark.parametrize("case", BAD_ROUTES, ids=list(BAD_ROUTES))
def test_a_bad_routes_request_is_one_line_and_the_next_succeeds(client, case):
    body, status, says = BAD_ROUTES[case]
    sent = {"text": "the cat sat", "model": "tiny-gpt2", **body}
    assert says in one_line_error(client.post("/api/routes", json=sent), status)
    one_line_error(client.post("/api/routes", content=b"text=hi", headers={"content-type": "text/plain"}), 415)
    assert client.post("/api/routes", json={"text": "the cat sat", "model": "tiny-gpt2"}).status_code == 200


# ----- bad requests: one clear line each, and the server keeps serving ---------------------------------------


BAD_REQUESTS = {
    "empty text": ({"text": ""}, 400, "empty"),
    "blank text": ({"text": "   \n"}, 400, "empty"),
    "text too long": ({"text": "a " * 3000}, 413, "at most 5000"),
    "wrong type": ({"text": 5}, 422, "text"),
    "unknown model": ({"text": TEXT, "model": "nope"}, 404, "unknown model 'nope'"),
    "unknown method": ({"text": TEXT, "methods": ["nope"]}, 400, "unknown method 'nope'"),
    "../ model path": ({"text": TEXT, "model": "../../etc"}, 403, "paths are refused"),
    "absolute model path": ({"text": TEXT, "model": "/tmp"}, 403, "paths are refused"),
    "bad option": ({"text": TEXT, "methods": ["rollout"], "options": {"discard_ratio": "x"}}, 400, "discard_ratio"),
    "option nobody takes": ({"text": TEXT, "methods": ["raw"], "options": {"discard_ratio": 0.1}}, 400, "not taken"),
    "bad request id": ({"text": TEXT, "request_id": "../x"}, 422, "request_id"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_a_bad_request_is_one_line_and_the_next_succeeds(client, case):
    body, status, says = BAD_REQUESTS[case]
    assert says in one_line_error(client.post("/api/explain", json={"model": "tiny-a", **body}), status)
    assert_valid_request_succeeds(client)


def test_bodies_that_are_not_json_or_too_large_are_refused(client):
    big = json.dumps({"text": "a" * (1 << 20)})
    assert "limit" in one_line_error(client.post("/api/explain", content=big, headers=_JSON), 413)
    chunked = iter([b'{"text": "', b"a" * (1 << 20), b'"}'])  # no Content-Length: counted as it arrives
    one_line_error(client.post("/api/explain", content=chunked, headers=_JSON), 413)
    assert "not valid JSON" in one_line_error(client.post("/api/explain", content=b'{"text": ', headers=_JSON), 400)
    one_line_error(client.post("/api/explain", content=b"text=hi", headers={"content-type": "text/plain"}), 415)
    assert_valid_request_succeeds(client)


def test_script_text_comes_back_as_data(client):
    response = explain(client, text="<script>alert(1)</script>", methods=["rollout"])
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.headers["x-content-type-options"] == "nosniff"
    assert "".join(response.json()["explanations"][0]["tokens"]).count("<") == 2
    assert "access-control-allow-origin" not in response.headers  # no CORS
    asked = {"origin": "http://evil.test", "access-control-request-method": "POST"}
    preflight = client.options("/api/explain", headers=asked)
    assert "access-control-allow-origin" not in preflight.headers


_JSON = {"content-type": "application/json"}


# ----- token, host ----------------------------------------------------------------------------------------


def test_a_non_local_bind_needs_a_token_and_requests_without_it_get_401(tiny_loader):
    from fastapi.testclient import TestClient

    from attnflow.errors import AttnflowError

    with pytest.raises(AttnflowError, match="give token") as refused:
        make_app(tiny_loader, host="0.0.0.0")
    assert refused.value.parameter == "token"  # `attnflow serve` says --token-file PATH or ATTNFLOW_TOKEN
    with TestClient(make_app(tiny_loader, host="0.0.0.0", token=TOKEN)) as client:
        assert "token" in one_line_error(explain(client, methods=["rollout"]), 401)
        one_line_error(client.get("/api/models", headers={"authorization": "Bearer wrong"}), 401)
        one_line_error(client.get("/"), 401)
        assert client.get("/api/models", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert client.get(f"/?token={TOKEN}").status_code == 200  # sets the page's cookie
        assert client.get("/api/models").status_code == 200
        client.cookies.clear()
        one_line_error(client.get("/api/models"), 401)


def test_a_query_token_sets_the_cookie_only_when_it_is_the_token(tiny_loader):
    from fastapi.testclient import TestClient

    with TestClient(make_app(tiny_loader, token=TOKEN)) as client:
        valid = {"authorization": f"Bearer {TOKEN}"}
        answered = client.get("/?token=wrong", headers=valid)  # the header lets it in; the query is not the token
        assert answered.status_code == 200 and "set-cookie" not in answered.headers and not client.cookies
        one_line_error(client.get("/?token=%20%20%20"), 401)
        assert "attnflow_token" in client.get(f"/?token={TOKEN}").headers["set-cookie"]


@pytest.mark.parametrize("token", ["", "   ", "short", "sixteen chars!!!", "a" * 15])
def test_blank_short_or_spaced_tokens_are_refused_saying_the_minimum(token):
    from attnflow.errors import AttnflowError
    from attnflow.serve import ServeConfig

    with pytest.raises(AttnflowError, match="at least 16 characters without spaces"):
        ServeConfig(host="0.0.0.0", token=token)
    assert ServeConfig(host="0.0.0.0", token="a" * 16).token == "a" * 16


def test_the_token_comes_from_a_file_or_the_environment_not_only_argv(tmp_path, monkeypatch, capsys):
    from attnflow.cli import build_parser
    from attnflow.cli.serve import _token

    monkeypatch.delenv("ATTNFLOW_TOKEN", raising=False)
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n", encoding="utf-8")
    assert _token(build_parser().parse_args(["serve", "--token-file", str(secret)])) == TOKEN
    monkeypatch.setenv("ATTNFLOW_TOKEN", TOKEN)
    assert _token(build_parser().parse_args(["serve"])) == TOKEN
    secret.write_text("   \n", encoding="utf-8")  # a blank file: refused before anything loads
    assert main(["serve", "--host", "0.0.0.0", "--token-file", str(secret), "--port", "9"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    monkeypatch.setenv("ATTNFLOW_TOKEN", "short")
    assert main(["serve", "--host", "0.0.0.0", "--port", "9"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err


def test_the_bearer_scheme_is_case_insensitive_and_the_address_token_opens_only_the_page(tiny_loader):
    from fastapi.testclient import TestClient

    with TestClient(make_app(tiny_loader, token=TOKEN)) as client:
        for scheme in ("Bearer", "bearer", "BEARER"):  # RFC 7235: the scheme is case-insensitive
            answered = client.get("/api/models", headers={"authorization": f"{scheme} {TOKEN}"})
            assert answered.status_code == 200, (scheme, answered.text)
        one_line_error(client.get("/api/models", headers={"authorization": f"Basic {TOKEN}"}), 401)
        one_line_error(client.get(f"/api/models?token={TOKEN}"), 401)  # API routes: never from the address
        one_line_error(client.post(f"/api/explain?token={TOKEN}", json={"text": TEXT, "model": "tiny-a"}), 401)
        assert not client.cookies
        assert client.get(f"/?token={TOKEN}").status_code == 200  # the page: it becomes the cookie
        assert client.get("/api/models").status_code == 200


def test_cancel_refuses_a_body_less_cross_site_post(client, blocking_method):
    """A cross-site form (or ``navigator.sendBeacon``) posts without a JSON content type: refused
    (415) before it reaches the job, which keeps running; the page's own JSON cancel stops it."""
    started, release = blocking_method
    body = {"methods": ["serve_test_blocking", "rollout"], "request_id": "csrf", "faithfulness": False}
    thread, answer = in_thread(lambda: explain(client, **body))
    assert started.wait(10)
    one_line_error(client.post("/api/cancel/csrf"), 415)
    forms = {"content-type": "application/x-www-form-urlencoded", "origin": "http://evil.example"}
    one_line_error(client.post("/api/cancel/csrf", content=b"", headers=forms), 415)
    assert not client.get("/api/progress/csrf").json()["cancelled"]
    assert client.post("/api/cancel/csrf", json={}).json()["cancelled"]
    release.set()
    thread.join(10)
    one_line_error(answer["response"], 409)


def test_an_empty_token_variable_is_no_token_and_a_local_server_starts(monkeypatch):
    from attnflow.cli import build_parser
    from attnflow.cli.serve import _token

    monkeypatch.setenv("ATTNFLOW_TOKEN", "")
    assert _token(build_parser().parse_args(["serve"])) is None  # as unset: 127.0.0.1 needs none
    assert main(["serve", "--host", "0.0.0.0", "--port", "9"]) == 2  # a public bind still needs one


def test_a_local_server_answers_only_local_host_names(tiny_loader):
    from fastapi.testclient import TestClient

    with TestClient(make_app(tiny_loader, allowed_hosts=("127.0.0.1", "localhost"))) as client:
        assert "Host" in one_line_error(client.get("/api/models"), 400)  # TestClient's host: testserver
        assert client.get("http://127.0.0.1/api/models").status_code == 200


# ----- methods that block, run long or raise ----------------------------------------------------------------


def in_thread(call):
    answer = {}
    thread = threading.Thread(target=lambda: answer.setdefault("response", call()))
    thread.start()
    return thread, answer


def test_a_request_cancelled_mid_method_stops_and_the_next_succeeds(client, blocking_method):
    started, release = blocking_method
    body = {"methods": ["serve_test_blocking", "rollout"], "request_id": "cancel-me"}
    thread, answer = in_thread(lambda: explain(client, **body))
    assert started.wait(10)
    progress = client.get("/api/progress/cancel-me").json()
    assert progress["step"] == "serve_test_blocking" and progress["running"] and not progress["cancelled"]
    assert client.post("/api/cancel/cancel-me", json={}).json()["cancelled"]
    release.set()
    thread.join(10)
    assert "cancelled by the client" in one_line_error(answer["response"], 409)
    one_line_error(client.post("/api/cancel/cancel-me", json={}), 404)  # finished
    assert client.get("/api/progress/cancel-me").json() == {"id": "cancel-me", "running": False}
    assert_valid_request_succeeds(client)


def test_a_request_over_the_time_limit_is_answered_504_and_the_next_succeeds(tiny_loader, blocking_method):
    from fastapi.testclient import TestClient

    _started, release = blocking_method
    with TestClient(make_app(tiny_loader, time_limit_s=0.5)) as client:
        assert_valid_request_succeeds(client)  # loads the model within the limit
        began = time.perf_counter()
        response = explain(client, methods=["serve_test_blocking", "rollout"])
        assert time.perf_counter() - began < 4
        assert "time limit (0.5 s)" in one_line_error(response, 504)
        release.set()
        assert_valid_request_succeeds(client)


def test_a_method_that_raises_is_one_line_500_and_the_server_keeps_serving(client):
    @register("serve_test_broken", "test: raises", takes="attentions")
    def broken(attentions):  # noqa: ARG001
        raise RuntimeError("boom\nsecond line")

    try:
        message = one_line_error(explain(client, methods=["serve_test_broken"]), 500)
        assert "RuntimeError: boom second line" in message
    finally:
        unregister("serve_test_broken")
    assert_valid_request_succeeds(client)


def test_one_thread_at_a_time_in_a_model_and_least_recently_used_models_go(tiny_loader):
    from fastapi.testclient import TestClient

    active, most = [0], [0]
    guard = threading.Lock()

    @register("serve_test_counting", "test: counts threads inside", takes="attentions")
    def counting(attentions):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05)
        with guard:
            active[0] -= 1
        return np.eye(attentions.shape[-1])

    try:
        with TestClient(make_app(tiny_loader, max_models=1)) as client:
            threads = [in_thread(lambda: explain(client, methods=["serve_test_counting"]))[0] for _ in range(4)]
            for thread in threads:
                thread.join(20)
            assert most[0] == 1 and active[0] == 0
            loads = len(tiny_loader.loads)
            assert explain(client, model="tiny-b", methods=["rollout"]).status_code == 200
            assert client.get("/api/models").json()["loaded"] == ["tiny-b"]  # tiny-a went
            assert explain(client, model="tiny-a", methods=["rollout"]).status_code == 200
            assert tiny_loader.loads[loads:] == ["tiny-b", "tiny-a"]
    finally:
        unregister("serve_test_counting")


def test_a_client_that_disconnects_stops_its_request_and_the_next_succeeds(tiny_loader, blocking_method):
    """Raw ASGI: the body arrives, the method starts, then the client's disconnect message."""
    import asyncio

    from fastapi.testclient import TestClient

    started, release = blocking_method
    app = make_app(tiny_loader)
    body = json.dumps(
        {"text": TEXT, "model": "tiny-a", "methods": ["serve_test_blocking", "rollout"], "request_id": "gone"}
    ).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/explain",
        "raw_path": b"/api/explain",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json")],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 5000),
    }

    async def scenario() -> tuple[list[dict], str | None]:
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        gone = asyncio.Event()

        async def receive():
            if pending:
                return pending.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        answering = asyncio.create_task(app(scope, receive, send))
        assert await asyncio.to_thread(started.wait, 10)
        job = app.state.jobs["gone"]
        gone.set()
        await asyncio.wait_for(answering, 10)
        return sent, job.reason

    sent, reason = asyncio.run(scenario())
    assert reason == "the client disconnected"
    assert sent[0]["status"] == 409
    release.set()
    with TestClient(app) as client:
        assert_valid_request_succeeds(client)


def test_over_the_memory_limit_idle_models_are_unloaded_but_one_stays(tiny_loader):
    from fastapi.testclient import TestClient

    with TestClient(make_app(tiny_loader, max_models=3, max_rss_mb=1)) as client:  # always over 1 MiB
        for model in ("tiny-a", "tiny-b"):
            assert explain(client, model=model, methods=["raw"]).status_code == 200
        assert client.get("/api/models").json()["loaded"] == ["tiny-b"]


def test_the_command_refuses_a_non_local_bind_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("ATTNFLOW_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "9"]) == 2
    assert "give a token (--token-file PATH or ATTNFLOW_TOKEN" in capsys.readouterr().err


def test_cancelling_stops_an_expensive_method_between_two_forward_passes(client):
    """A method that runs forward pass after forward pass (as leave-one-out and SHAP do) stops at the
    next one after the cancel, long before its end; the hook that counts them goes with the request."""
    import torch

    started = threading.Event()

    @register("serve_test_forwards", "test: 400 forward passes", takes="model", needs=("model",), scores_only=True)
    def forwards(model, trace):
        ids = torch.tensor([list(trace.token_ids)])
        for number in range(400):
            with torch.no_grad():
                model.model(input_ids=ids)
            if number == 2:
                started.set()
            time.sleep(0.01)
        return np.zeros(trace.n_tokens)

    try:
        thread, answer = in_thread(lambda: explain(client, methods=["serve_test_forwards"], request_id="many"))
        assert started.wait(20)
        assert client.get("/api/progress/many").json()["forward_passes"] >= 3
        began = time.perf_counter()
        client.post("/api/cancel/many", json={})
        thread.join(20)
        assert time.perf_counter() - began < 3  # the 400 passes would take over 4 s
        assert "stopped at serve_test_forwards: cancelled by the client" in one_line_error(answer["response"], 409)
    finally:
        unregister("serve_test_forwards")
    model = client.app.state.pool.model_if_loaded("tiny-a")
    assert not model.model._forward_pre_hooks  # no hook left behind
    assert_valid_request_succeeds(client)


def test_generate_takes_auto_and_defaults_to_it_as_the_command_line_does(client, tiny_folders, capsys):
    prompt = "the cat sat"
    argv = ["explain", prompt, "--model", str(tiny_folders["tiny-gpt2"]), "--generate", "2", "--json", "--quiet"]
    assert main([*argv, "--device", "cpu"]) == 0
    shown = json.loads(capsys.readouterr().out)
    body = {"text": prompt, "model": "tiny-gpt2", "generate": 2}
    for asked in ({"methods": ["auto"]}, {}):
        response = client.post("/api/generate", json={**body, **asked})
        assert response.status_code == 200, response.text
        (served,) = response.json()["explanations"]
        assert served["method"] == shown["method"] and served["chosen_by"] == shown["chosen_by"]
        close(shown["matrix"], served["matrix"])
    message = one_line_error(client.post("/api/generate", json={**body, "methods": ["nope"]}), 400)
    assert "unknown method 'nope'" in message and "or auto" in message


def test_answers_carry_the_tokens_as_a_reader_sees_them(client):
    from attnflow.tokens import display_token

    (explained,) = explain(client, methods=["rollout"]).json()["explanations"]
    assert explained["display_tokens"] == [display_token(token) for token in explained["tokens"]]
    body = {"text": "the cat sat", "model": "tiny-gpt2", "methods": ["rollout"], "generate": 2}
    (generated,) = client.post("/api/generate", json=body).json()["explanations"]
    assert generated["display_sources"] == [display_token(token) for token in generated["sources"]]
    assert generated["display_generated"] == [display_token(token) for token in generated["generated"]]


def test_faithfulness_false_skips_the_badges(client):
    answer = explain(client, methods=["auto", "rollout"], faithfulness=False).json()["explanations"]
    assert all("faithfulness" not in explanation for explanation in answer)
    assert "faithfulness turned off" in answer[0]["chosen_by"]
