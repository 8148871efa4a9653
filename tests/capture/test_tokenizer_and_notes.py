"""A model folder whose tokenizer cannot read text is refused; what capture warns about
(truncation, unknown tokens, RGB conversion) reaches the Explanation's notes and explanation.json."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from PIL import Image

import attnflow
from attnflow.cli import main
from attnflow.errors import ModelLoadError

LONG_TEXT = " ".join(["movie"] * 30)
EMOJI = "😀 🎉 🙈"  # not in the tiny WordPiece vocabulary: three [UNK]


@pytest.fixture
def bare_bert(tiny_model_path, tmp_path):
    """The tiny BERT's weights and config (160 embedding rows), without any tokenizer file."""
    folder = tmp_path / "bare"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_path("bert") / name, folder / name)
    return folder


def test_a_model_folder_without_its_tokenizer_is_refused_in_one_line(bare_bert, tmp_path, capsys):
    with pytest.raises(ModelLoadError) as refused:
        attnflow.load(str(bare_bert), device="cpu")
    message = str(refused.value)
    assert "\n" not in message
    assert f"the tokenizer files vocab.txt, tokenizer.json are missing from {bare_bert}" in message
    assert "5 tokens (all special) for an embedding matrix of 160 rows" in message
    out = tmp_path / "out"
    assert main(["explain", "the movie was great", "--model", str(bare_bert), "--out", str(out), "-q"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"attnflow: error: {message}"]
    assert not out.exists()


def test_a_tokenizer_far_smaller_than_the_embedding_matrix_is_refused(bare_bert):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "movie", "was", "great"]
    BertTokenizerFast(vocab={token: index for index, token in enumerate(vocab)}).save_pretrained(bare_bert)
    with pytest.raises(ModelLoadError, match="its tokenizer knows 9 tokens for an embedding matrix of 160 rows"):
        attnflow.load(str(bare_bert), device="cpu")


def test_capture_warnings_are_the_explanations_notes(tiny_model_path, caplog):
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    with caplog.at_level(logging.WARNING, logger="attnflow"):
        long, short, unknown = model.explain([LONG_TEXT, "the movie", EMOJI], method="rollout", max_length=10)
    logged = [record.getMessage() for record in caplog.records]
    assert long.notes == ["text of 32 tokens truncated to 10 (the maximum; see --max-length)"]  # 30 words + 2
    assert short.notes == []
    assert len(unknown.notes) == 1 and unknown.notes[0].startswith(f"text {EMOJI!r}: all of its 3 tokens are")
    assert logged == long.notes + unknown.notes  # the console says the same, once each
    assert json.loads(long.to_json())["notes"] == long.notes


def test_explanation_json_keeps_the_truncation_warning(tiny_model_path, tmp_path, caplog):
    out = tmp_path / "out"
    argv = ["explain", LONG_TEXT, "--model", str(tiny_model_path("bert")), "--max-length", "10", "--out", str(out)]
    with caplog.at_level(logging.WARNING, logger="attnflow"):
        assert main([*argv, "-q"]) == 0
    warnings = [record.getMessage() for record in caplog.records]  # what the console shows
    assert warnings == ["text of 32 tokens truncated to 10 (the maximum; see --max-length)"]
    assert json.loads((out / "explanation.json").read_text())["notes"] == warnings
    assert "truncated to 10" in (out / "explanation.html").read_text()


def test_an_image_converted_to_rgb_says_so_in_the_notes(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("vit")), device="cpu")
    explanation = attnflow.explain(model.trace_image(Image.new("L", (16, 16), 128)), method="rollout")
    assert explanation.notes == ["the image: grayscale image converted to RGB"]
