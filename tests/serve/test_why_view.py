"""``/api/why`` of `attnflow serve` on tiny models: the library's `attnflow.why` (its agreement and
reading), every number of the reading in its ``shown``, the time limit as its budget (evidence
dropped, never a timeout), and the refusals of the other routes."""

from __future__ import annotations

import pytest

from question.why_oracle import check_reading

from .conftest import make_app
from .test_api import one_line_error

TEXT = "the cat sat on the mat"


def ask(client, **body):
    return client.post("/api/why", json={"text": TEXT, "model": "tiny-gpt2", **body})


def test_why_answers_the_librarys_reading_with_its_numbers_shown_and_keeps_its_page(client, tiny_loader):
    import attnflow

    response = ask(client)
    assert response.status_code == 200, response.text
    answer = response.json()
    served = answer["why"]
    expected = attnflow.why(tiny_loader("tiny-gpt2"), TEXT).to_dict()
    assert served["agreement"] == expected["agreement"]
    assert [entry["text"] for entry in served["paragraphs"]] == [entry["text"] for entry in expected["paragraphs"]]
    assert served["paragraphs"] and check_reading(served)
    assert {step["evidence"] for step in served["plan"]["steps"]} == {"attribution", "routes", "patching", "knockout"}
    assert served["plan"]["budget"] is not None and 0 < served["plan"]["budget"] <= 60  # the time limit left
    assert 'id="why-agreement"' in answer["page"] and "<html" not in answer["page"]  # the sections, no document
    assert 'id="why-reading"' not in answer["page"]  # the page above writes the reading as text
    page = client.get(answer["url"])
    assert page.status_code == 200 and "Why: tiny-gpt2" in page.text
    assert "/api/why" in client.get("/openapi.json").json()["paths"]


def test_a_tight_time_limit_drops_evidence_instead_of_timing_out(tiny_loader, monkeypatch):
    from fastapi.testclient import TestClient

    from attnflow import costs

    slow = costs.Rates(pass_s=0.2, token_s=0.01)  # why's plan on a slow machine: routes and patching do not fit
    monkeypatch.setattr(costs, "calibrate", lambda _model: slow)
    with TestClient(make_app(tiny_loader, time_limit_s=20)) as client:
        response = ask(client)
    assert response.status_code == 200, response.text
    plan = response.json()["why"]["plan"]
    assert 0 < plan["budget"] <= 20 and plan["dropped"]
    assert {step["status"] for step in plan["steps"] if step["evidence"] in plan["dropped"]} <= {"dropped", "replaced"}


BAD_WHY = {
    "empty text": ({"text": " "}, 400, "empty"),
    "text too long": ({"text": "a " * 3000}, 413, "at most 5000"),
    "text of the wrong type": ({"text": 5}, 422, "text"),
    "unknown model": ({"model": "nope"}, 404, "unknown model 'nope'"),
    "model path": ({"model": "../../etc"}, 403, "paths are refused"),
    "a contrast equal to the target": ({"target": " cat", "contrast": " cat"}, 400, "the target itself"),
    "a counterfactual of another length": ({"corrupt": "the dog"}, 400, "token"),
    "an empty counterfactual": ({"corrupt": ""}, 400, "empty"),
    "bad request id": ({"request_id": "../x"}, 422, "request_id"),
}


@pytest.mark.parametrize("case", BAD_WHY, ids=list(BAD_WHY))
def test_a_bad_why_request_is_one_line_and_the_next_succeeds(client, case):
    body, status, says = BAD_WHY[case]
    assert says in one_line_error(ask(client, **body), status)
    one_line_error(client.post("/api/why", content=b"text=hi", headers={"content-type": "text/plain"}), 415)
    assert client.post("/api/routes", json={"text": "the cat sat", "model": "tiny-gpt2"}).status_code == 200
