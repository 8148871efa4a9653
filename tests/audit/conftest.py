"""Fixtures of the audit tests: the planted task and its trained tiny classifier (built once)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from planted import planted_texts, train_planted_classifier


@pytest.fixture(scope="session")
def planted_model(tmp_path_factory) -> Path:
    """Folder of a tiny BERT classifier trained on the planted task (accuracy 1.0 on held-out texts)."""
    return train_planted_classifier(tmp_path_factory.mktemp("planted") / "model")


def write_task(path: Path, texts: list[str], labels: list[int]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows(zip(texts, labels, strict=True))
    return path


@pytest.fixture(scope="session")
def planted_task(tmp_path_factory):
    """``(csv path, texts, labels, flips)`` of 300 held-out planted texts (see planted.py)."""
    texts, labels, flips = planted_texts(300, seed=2)
    path = write_task(tmp_path_factory.mktemp("planted-task") / "task.csv", texts, labels)
    return path, texts, labels, flips
