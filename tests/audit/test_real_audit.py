"""The audit on the real minilm-sentiment and Rotten Tomatoes held-out snippets (a few of them)."""

from __future__ import annotations

import numpy as np
import pytest

import attnflow
from attnflow.dataset_audit.words import find_words
from attnflow.evaluate.scorer import ClassifierScorer


def test_minilm_sentiment_on_rotten_tomatoes(minilm_sentiment, tmp_path):
    results = attnflow.audit(
        minilm_sentiment, tmp_path, task="rotten-tomatoes", samples=32, min_count=2, quiet=True, terms="film,movie"
    )
    assert results["run"]["samples"] == 32 and results["run"]["method"] == "attnlrp"
    # Oracle: accuracy of a plain forward pass over the same drawn snippets.
    from attnflow.datasets import rotten_tomatoes

    data = rotten_tomatoes()
    held_out = data.subset(data.split()[1])
    chosen = np.sort(np.random.default_rng(0).choice(len(held_out), size=32, replace=False))
    texts = [held_out.texts[i] for i in chosen]
    predicted = ClassifierScorer(minilm_sentiment).probabilities(minilm_sentiment.tokenizer(texts)["input_ids"])
    assert results["errors"]["accuracy"] == pytest.approx(np.mean(predicted.argmax(1) == held_out.labels[chosen]))
    words = {word.key for text in texts for word in find_words(text)}
    for group in results["classes"]:
        assert group["examples"] == int(np.sum(predicted.argmax(1) == results["run"]["labels"].index(group["class"])))
        for row in group["top_words"]:
            assert row["word"] in words and row["examples"] >= 2 and 0 <= row["share"] < 1
            assert row["mean"] >= max(row["signed_mean"], 0.0) - 1e-12  # the mean of positive parts
