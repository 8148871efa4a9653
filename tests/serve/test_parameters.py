"""Errors name the library's parameters; the server spells them as its JSON fields and answers 400
only for bad input: a ValueError or any other exception from inside a method is a one-line 500,
logged with its traceback. A request's contrast reaches the library as part of the one Target."""

from __future__ import annotations

import logging

import numpy as np

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
