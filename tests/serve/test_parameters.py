"""Errors name the library's parameters; the server spells them as its JSON fields and answers 400
only for bad input: a ValueError or any other exception from inside a method is a one-line 500,
logged with its traceback. A request's contrast reaches the library as part of the one Target."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from attnflow.methods.registry import register, unregister

TEXT = "the movie was terrible, but the acting was great."


def error_of(response, status: int) -> str:
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}
    return response.json()["error"]


def test_bad_input_names_the_json_field(client):
    message = error_of(client.post("/api/explain", json={"text": TEXT, "model": "tiny-a", "max_length": 1}), 400)
    assert message.startswith("max_length must be an integer") and "--" not in message
    message = error_of(
        client.post("/api/compare", json={"text": TEXT, "models": ["tiny-a", "tiny-b"], "top_k": 99}), 400
    )
    assert message.startswith("top_k must be an integer in [1,")  # the library's k, the body's top_k
    message = error_of(
        client.post("/api/explain", json={"text": TEXT, "model": "tiny-a", "methods": ["rollout"], "target": "neg"}),
        400,
    )
    assert "drop target" in message


def test_an_unexpected_value_error_is_a_500_logged_with_its_traceback(client, caplog):
    @register("serve_test_value_error", "test: raises a ValueError from its insides", takes="attentions")
    def broken(attentions):  # noqa: ARG001
        raise ValueError("operands could not be broadcast together")

    try:
        with caplog.at_level(logging.ERROR, logger="attnflow.serve"):
            message = error_of(
                client.post(
                    "/api/explain", json={"text": TEXT, "model": "tiny-a", "methods": ["serve_test_value_error"]}
                ),
                500,
            )
    finally:
        unregister("serve_test_value_error")
    assert "ValueError: operands could not be broadcast together" in message and "\n" not in message
    assert any(record.exc_info and record.exc_info[0] is ValueError for record in caplog.records)


def test_a_file_the_server_cannot_write_is_a_500_not_bad_input(client, caplog):
    """An `OutputError` is the server's own disk (a full one, here raised by a method), not the
    request: 500, logged, one line; an attnflow error about the input stays a 400."""
    from attnflow.errors import OutputError

    @register("serve_test_output_error", "test: the server's disk is full", takes="attentions")
    def full(attentions):  # noqa: ARG001
        raise OutputError("cannot write /tmp/x: ENOSPC: No space left on device; nothing was written there")

    try:
        with caplog.at_level(logging.ERROR, logger="attnflow.serve"):
            body = {"text": TEXT, "model": "tiny-a", "methods": ["serve_test_output_error"]}
            message = error_of(client.post("/api/explain", json=body), 500)
    finally:
        unregister("serve_test_output_error")
    assert message.startswith("the request failed (OutputError: cannot write /tmp/x: ENOSPC") and "\n" not in message
    assert any(record.exc_info and record.exc_info[0] is OutputError for record in caplog.records)


def test_a_refused_model_names_the_servers_options_as_its_operator_set_them(client, monkeypatch):
    """A pool's ``models``/``allow_any_model``/``allow_path`` are no request's fields: a refusal names
    them as the operator set them, the parameters in Python, the flags under `attnflow serve`."""
    from fastapi.testclient import TestClient

    import attnflow.cli.serve as serve_command
    from attnflow.cli import main
    from attnflow.serve.pool import ModelPool, ModelRefused

    pool = ModelPool(["tiny-a"], loader=lambda name: name, known=["tiny-a", "tiny-b"])
    with pytest.raises(ModelRefused) as refused:
        pool.check_name("tiny-b")
    assert "add it with models, or allow every alias with allow_any_model" in str(refused.value)
    message = error_of(client.post("/api/explain", json={"text": TEXT, "model": "./a-folder"}), 403)
    assert message == "model paths are refused ('./a-folder'): start the server with allow_path (a folder)"
    served = []
    monkeypatch.setattr(serve_command, "_serve", lambda app, *_: served.append(app))
    assert main(["serve", "--port", "9"]) == 0
    with TestClient(served[0], base_url="http://127.0.0.1") as local:
        message = error_of(local.post("/api/explain", json={"text": TEXT, "model": "./a-folder"}), 403)
    assert message == "model paths are refused ('./a-folder'): start the server with --allow-path (a folder)"


def test_a_contrast_in_the_body_explains_one_class_rather_than_the_other(client):
    body = {"text": TEXT, "model": "tiny-a", "methods": ["grad_x_input"], "options": {"signed": True}}
    contrast = client.post("/api/explain", json={**body, "target": "pos", "contrast": "neg"})
    assert contrast.status_code == 200, contrast.text
    explained = contrast.json()["explanations"][0]
    assert explained["target"]["label"] == "pos" and explained["target"]["contrast_label"] == "neg"
    pos, neg = (
        client.post("/api/explain", json={**body, "target": label}).json()["explanations"][0]["scores"]
        for label in ("pos", "neg")
    )
    np.testing.assert_allclose(explained["scores"], np.subtract(pos, neg), atol=1e-5)
    same = error_of(client.post("/api/explain", json={**body, "target": "pos", "contrast": "pos"}), 400)
    assert "contrast 'pos' is the target itself" in same
