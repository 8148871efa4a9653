"""Tiny models for the routes tests, each loaded once per session."""

from __future__ import annotations

import pytest

import attnflow


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path):
    """``tiny_loaded(family) -> AttentionModel``: the tiny random model of a family, loaded once."""
    loaded: dict[str, attnflow.AttentionModel] = {}

    def get(family: str) -> attnflow.AttentionModel:
        if family not in loaded:
            loaded[family] = attnflow.load(str(tiny_model_path(family)), device="cpu", progress=False)
        return loaded[family]

    return get
