"""Shared fixtures: tiny random-weight models of every family (see tiny_models.py) and the real
embedded minilm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_models import build_tiny_classifier, build_tiny_model

# No hub here: make transformers fail at once instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """``tiny_model_path(family) -> Path`` of a saved tiny random model (built once per session)."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_model(family, root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_classifier_path(tmp_path_factory):
    """``tiny_classifier_path(family) -> Path`` of a saved tiny random sequence classifier."""
    root = tmp_path_factory.mktemp("tiny-classifiers")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_classifier(family, root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def minilm_sentiment():
    """The real embedded classifier (minilm + mean pooling + trained head) on the CPU."""
    import attnflow

    return attnflow.load("minilm-sentiment", device="cpu")


@pytest.fixture(scope="session")
def minilm():
    """The real embedded all-MiniLM-L6-v2 on the CPU."""
    import attnflow

    return attnflow.load("minilm", device="cpu")
