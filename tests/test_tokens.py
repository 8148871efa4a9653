"""Readable token text: against transformers' own byte-level table and a byte-level BPE tokenizer's decoder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from attnflow.explanation import Explanation
from attnflow.tokens import display_token


@pytest.mark.parametrize(
    "token, shown",
    [
        ("Ġupon", "upon"),
        ("▁upon", "upon"),
        ("##ing", "ing"),
        ("Ċ", "\\n"),
        ("ĊĊ", "\\n\\n"),
        ("ĉ", "\\t"),
        ("Ã©t", "ét"),
        ("é", "é"),
        ("<0x0A>", "\\n"),
        ("Ġ", "␣"),
        ("[CLS]", "[CLS]"),
        ("<s>", "<s>"),
        ("<|im_start|>", "<|im_start|>"),
        ("##", "##"),
        ("$x$", "$x$"),
        ("ðŁĺ", "�"),
    ],
)
def test_display_token(token, shown):
    assert display_token(token) == shown


def test_every_byte_level_character_against_transformers_table():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    for byte, character in bytes_to_unicode().items():
        expected = bytes([byte]).decode("latin-1") if byte < 128 else None
        if expected is not None and expected.isprintable() and expected != " ":
            assert display_token(character) == expected


def test_byte_level_tokens_match_the_tokenizers_own_decoder():
    """A byte-level BPE tokenizer (character vocabulary, no merges): each token decoded by the
    tokenizer itself, leading space dropped, equals display_token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {character: index for index, character in enumerate(bytes_to_unicode().values())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = "Once upon a time, café naïve — 東京"
    for token_id in tokenizer.encode(text).ids:
        token = tokenizer.id_to_token(token_id)
        decoded = tokenizer.decode([token_id])
        if "\ufffd" not in decoded and decoded.strip():
            assert display_token(token) == decoded.strip(), token


def test_page_and_figure_show_readable_tokens_json_keeps_raw(tmp_path):
    tokens = ["Once", "Ġupon", "Ġa", "Ġtime"]
    n = len(tokens)
    explanation = Explanation(
        tokens=tokens,
        matrix=np.full((n, n), 1 / n),
        scores=np.arange(1.0, n + 1) / 10,
        method="rollout",
        options={},
        row="last",
    )
    paths = explanation.save(tmp_path)
    page = paths["html"].read_text()
    assert "<td>upon</td>" in page and "<td>Ġupon</td>" not in page  # the top-tokens table
    labels = [label.get_text() for label in explanation.plot().axes[0].get_xticklabels()]
    assert labels == ["Once", "upon", "a", "time"]
    assert json.loads(paths["json"].read_text())["tokens"] == tokens
