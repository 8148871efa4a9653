"""Unlabelled texts for `--file`: the formats, and one line for a bad file."""

from __future__ import annotations

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
