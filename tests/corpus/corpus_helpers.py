"""Helpers shared by the corpus tests (small corpora, array comparison)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SENTENCES = (
    "the cat sat on the mat.",
    "the dog ran to the cat!",
    "hello world, this is a story.",
    "she said hi there, and they sat.",
    "it was a very good film but the ending was bad.",
    "we ran.",
)


def story(index: int, sentences: int = 3) -> str:
    """A deterministic little document of ``sentences`` sentences."""
    return " ".join(SENTENCES[(index + k) % len(SENTENCES)] for k in range(sentences)) + f" story {index}."


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as saved:
        return {name: saved[name] for name in saved.files}


def assert_same_arrays(first: dict, second: dict, exact: bool = True) -> None:
    assert sorted(first) == sorted(second)
    for name in first:
        a, b = first[name], second[name]
        if a.dtype.kind in "fc":
            if exact:
                np.testing.assert_array_equal(a, b, err_msg=name)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9, equal_nan=True, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


def tiny_options(model: Path, data: Path, **changes):
    """`StudyOptions` of a small CPU study of ``model`` on ``data`` (``changes`` override the defaults)."""
    from attnflow.corpus.engine import StudyOptions

    options = dict(model=str(model), data=str(data), samples=24, seq_len=32, batch_size=4, device="cpu", quiet=True)
    options.update(changes)
    return StudyOptions(**options)
