"""Tiny models for the routes tests, each loaded once per session."""

from __future__ import annotations

import pytest

import attnflow

from tiny_models import VARIANT_FAMILIES


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path):
    """``tiny_loaded(family) -> AttentionModel``: the tiny random model of a family, loaded once."""
    loaded: dict[str, attnflow.AttentionModel] = {}

    def get(family: str) -> attnflow.AttentionModel:
        if family not in loaded:
            loaded[family] = attnflow.load(str(tiny_model_path(family)), device="cpu", progress=False)
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def any_loaded(tiny_loaded, variant_loaded):
    """``any_loaded(family)``: a tiny model with a built-in row (`tiny_loaded`) or an architectural
    variant whose row the tests register (`variant_loaded`)."""
    return lambda family: (variant_loaded if family in VARIANT_FAMILIES else tiny_loaded)(family)
