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


# Families no test row covers: their tiny model (`attnflow.rows.tiny.build_tiny`) loads through an
# inferred row. GPT-NeoX: parallel attention and feed-forward, q, k and v fused per head.
INFERRED_FAMILIES = ("gpt_neox",)


@pytest.fixture(scope="session")
def inferred_loaded(tmp_path_factory):
    """``inferred_loaded(family) -> AttentionModel`` of a tiny model of any architecture, loaded
    once through the row inferred from it."""
    from attnflow.rows.tiny import build_tiny

    root = tmp_path_factory.mktemp("inferred")
    loaded: dict[str, attnflow.AttentionModel] = {}

    def get(family: str) -> attnflow.AttentionModel:
        if family not in loaded:
            loaded[family] = attnflow.load(str(build_tiny(family, root / family)), device="cpu", progress=False)
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def any_loaded(tiny_loaded, variant_loaded, inferred_loaded):
    """``any_loaded(family)``: a tiny model with a built-in row (`tiny_loaded`), an architectural
    variant whose row the tests register (`variant_loaded`) or one with an inferred row
    (`inferred_loaded`)."""

    def get(family: str) -> attnflow.AttentionModel:
        if family in INFERRED_FAMILIES:
            return inferred_loaded(family)
        return (variant_loaded if family in VARIANT_FAMILIES else tiny_loaded)(family)

    return get
