"""`attnflow serve` offers each model only the methods its family supports (the library's rule,
`attnflow.methods.registry.unsupported_reason`), and a request that names one it does not support is
answered for the rest, the one skipped named with the reason: on a tiny GPT-2 (no post-LN: no ALTI,
no value zeroing) beside a tiny BERT classifier (every method)."""

from __future__ import annotations

import pytest

from .test_api import TEXT, one_line_error

PROMPT = "the cat sat on the"


def test_a_loaded_model_lists_the_methods_its_family_does_not_support_with_the_librarys_reason(client, tiny_loaded):
    from attnflow.errors import InputError

    record = client.post("/api/load", json={"model": "tiny-gpt2"}).json()
    assert record["loaded"] and record["target_kind"] == "next_token"
    assert set(record["unsupported"]) == {"alti", "value_zeroing"}
    assert "alti" not in record["methods"] and "rollout" in record["methods"]
    with pytest.raises(InputError) as refused:  # the library, asked directly, refuses with the same reason
        tiny_loaded("gpt2").explain(PROMPT, method="alti")
    assert str(refused.value).startswith(record["unsupported"]["alti"])
    assert "post_norm" in record["unsupported"]["alti"]
    listed = {model["name"]: model for model in client.get("/api/models").json()["models"]}
    assert listed["tiny-gpt2"]["unsupported"] == record["unsupported"]
    classifier = client.post("/api/load", json={"model": "tiny-a"}).json()
    assert classifier["unsupported"] == {} and "alti" in classifier["methods"]
    one_line_error(client.post("/api/load", json={"model": "nope"}), 404)
    one_line_error(client.post("/api/load", content=b"{}"), 415)  # JSON only, as every POST


def test_a_request_with_one_unsupported_method_answers_for_the_rest_and_names_the_one_skipped(client):
    methods = ["alti", "rollout", "grad_x_input"]
    mixed = {"text": PROMPT, "model": "tiny-gpt2", "methods": methods, "faithfulness": False}
    answer = client.post("/api/explain", json=mixed)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [e["method"] for e in body["explanations"]] == ["rollout", "grad_x_input"]
    (skipped,) = body["skipped"]
    assert skipped["method"] == "alti" and "does not support the gpt2 family" in skipped["reason"]
    generating = {"text": PROMPT, "model": "tiny-gpt2", "methods": ["auto", "value_zeroing"], "generate": 2}
    generated = client.post("/api/generate", json=generating)
    assert generated.status_code == 200, generated.text
    assert [s["method"] for s in generated.json()["skipped"]] == ["value_zeroing"]
    assert generated.json()["explanations"][0]["chosen_by"]
    bert = {"text": TEXT, "model": "tiny-a", "methods": ["alti"], "faithfulness": False}
    plain = client.post("/api/explain", json=bert)
    assert plain.status_code == 200 and plain.json()["skipped"] == []  # a BERT runs it


def test_a_request_with_only_unsupported_methods_is_refused_naming_what_works(client):
    message = one_line_error(
        client.post("/api/explain", json={"text": PROMPT, "model": "tiny-gpt2", "methods": ["alti"]}), 400
    )
    assert "does not support the gpt2 family" in message and "methods for gpt2:" in message
