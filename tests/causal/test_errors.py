"""Bad input to `attnflow.patch` gets one clear line (item by item)."""

from __future__ import annotations

import dataclasses

import pytest
from causal_texts import CLEAN, CORRUPT

import attnflow
from attnflow.causal import patch
from attnflow.errors import InputError
from attnflow.rows.adapters import ADAPTERS, register_adapter, unregister_adapter


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_texts_of_different_token_lengths(tiny_patch_models):
    model = tiny_patch_models["llama"]
    with pytest.raises(InputError) as error:
        patch(model, CLEAN, "the cat sat on a very big mat", progress=False)
    message = one_line(error)
    clean_length = len(model.tokenizer(CLEAN)["input_ids"])
    corrupt_length = len(model.tokenizer("the cat sat on a very big mat")["input_ids"])
    assert f"{clean_length} tokens" in message and f"corrupt text {corrupt_length}" in message
    assert "(noise)" in message and error.value.parameters == ("corrupt", "noise")  # parameters, not flags


def test_a_target_of_several_tokens(tiny_patch_models):
    with pytest.raises(InputError) as error:
        patch(tiny_patch_models["llama"], CLEAN, CORRUPT, target="cat sat", progress=False)
    assert "is 2 tokens" in one_line(error)


def test_noise_on_words_not_in_the_text(tiny_patch_models):
    with pytest.raises(InputError) as error:
        patch(tiny_patch_models["llama"], CLEAN, noise="cat,zebra", progress=False)
    message = one_line(error)
    assert "'zebra'" in message and "'cat'" not in message


def test_a_family_without_sites(tiny_model_path):
    gpt2 = next(row for row in ADAPTERS if row.family == "gpt2")
    register_adapter(type(gpt2)("sans-sites", "decoder", ("gpt2",), gpt2.stack))
    try:
        model = attnflow.load(str(tiny_model_path("gpt2")), device="cpu")
        with pytest.raises(InputError) as error:
            patch(model, CLEAN, CORRUPT, progress=False)
    finally:
        unregister_adapter("sans-sites")
    assert "sans-sites family" in one_line(error)


def test_relp_on_a_family_without_query_and_key_projections(tiny_model_path):
    gpt2 = next(row for row in ADAPTERS if row.family == "gpt2")
    register_adapter(dataclasses.replace(gpt2, family="unsplit-gpt2", fused=()))  # c_attn's q, k, v not named
    try:
        model = attnflow.load(str(tiny_model_path("gpt2")), device="cpu")
        with pytest.raises(InputError) as error:
            patch(model, CLEAN, CORRUPT, methods="exact,relp", progress=False)
    finally:
        unregister_adapter("unsplit-gpt2")
    assert "unsplit-gpt2 family" in one_line(error) and "query_key" in str(error.value)


def test_a_corruption_that_changes_nothing(tiny_patch_models):
    with pytest.raises(InputError) as error:
        patch(tiny_patch_models["llama"], CLEAN, CLEAN, progress=False)
    assert "does not change the metric" in one_line(error)
