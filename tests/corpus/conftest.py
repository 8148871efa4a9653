"""Fixtures of the corpus tests: the tiny tokenizer and small corpora."""

from __future__ import annotations

from pathlib import Path

import pytest

from corpus_helpers import story


@pytest.fixture(scope="session")
def tiny_bert(tiny_model_path) -> Path:
    """Folder of the shared tiny random BERT (2 layers, 4 heads, WordPiece vocab, max 60 tokens)."""
    return tiny_model_path("bert")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_bert):
    import transformers as T

    return T.AutoTokenizer.from_pretrained(tiny_bert)


@pytest.fixture
def txt_corpus(tmp_path) -> Path:
    """A .txt corpus of 80 one-line documents (~1,700 wordpieces with the tiny tokenizer)."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(story(i) for i in range(80)) + "\n", encoding="utf-8")
    return path
