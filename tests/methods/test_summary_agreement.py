"""The summary sentence and the agreement measures, on hand-made cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnflow.methods.agreement import spearman, top_k, top_k_overlap
from attnflow.methods.summary import explanation_subject, row_subject, subject, summarize, words

TEXT = "the terrible acting"
TOKENS = ["[CLS]", "the", "terr", "##ible", "acting", "[SEP]"]
OFFSETS = [[0, 0], [0, 3], [4, 8], [8, 12], [13, 19], [0, 0]]
SPECIAL = [True, False, False, False, False, True]


def test_words_join_touching_pieces_only():
    assert words(TOKENS, SPECIAL, TEXT, OFFSETS) == [("the", [1]), ("terrible", [2, 3]), ("acting", [4])]
    # punctuation touching a word stays apart; without text, tokens are cleaned of markers
    assert [w for w, _ in words(["great", "."], None, "great.", [[0, 5], [5, 6]])] == ["great", "."]
    assert [w for w, _ in words(["Ġthe", "##x", "▁y"])] == ["the", "x", "y"]


def test_summary_names_the_best_words_and_their_share():
    scores = [0.3, 0.05, 0.1, 0.15, 0.2, 0.2]  # words: the .05, terrible .25, acting .2; specials .5
    sentence = summarize(TOKENS, scores, "the class negative", SPECIAL, TEXT, OFFSETS)
    assert sentence == (
        "'terrible' and 'acting' carry 45 % of the relevance for the class negative (special tokens: 50 %)"
    )
    one = summarize(TOKENS, [0, 0, 0.5, 0.3, 0.1, 0], "x", SPECIAL, TEXT, OFFSETS)
    assert one == "'terrible' carries 89 % of the relevance for x (special tokens: 0 %)"
    assert summarize(TOKENS, np.zeros(6), "x", SPECIAL) == "no token carries positive relevance for x"
    only_special = summarize(TOKENS, [1, 0, 0, 0, 0, 0], "x", SPECIAL)
    assert only_special == "special tokens carry 100 % of the relevance for x"
    # the same word at several places is named once
    repeated = summarize([".", "a", ".", "."], [0.3, 0.1, 0.3, 0.3], "x")
    assert repeated == "'.' ×3 carry 90 % of the relevance for x"
    # negative scores count as no relevance
    assert summarize(["a", "b"], [-1.0, 1.0], "x") == "'b' carries 100 % of the relevance for x"
    with pytest.raises(ValueError):
        summarize(TOKENS, [1.0], "x")


def test_subjects():
    assert row_subject("mean", TOKENS) == "the mean-pooled output (all rows averaged)"
    assert row_subject("cls", TOKENS) == "the first token [CLS]"
    assert row_subject("last", TOKENS) == "the last token '[SEP]'"
    assert row_subject(3, TOKENS) == "token #3 'ible'"

    class WithTarget:
        row, tokens, target = "mean", TOKENS, {"kind": "class", "label": "negative"}

    assert explanation_subject(WithTarget()) == "the class negative"
    assert subject(None, TOKENS, {"kind": "next_token", "label": "ĠParis"}) == "the next token 'Paris'"
    assert subject(None, TOKENS, {"kind": "similarity", "label": "a good film"}) == "the similarity to 'a good film'"
    assert subject(None, TOKENS) == "the output"


def test_spearman_by_hand():
    # ranks differ by d = (0, 1, -1, 0): rho = 1 - 6 * 2 / (4 * (16 - 1)) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties share their average rank: ranks (1.5, 1.5, 3) vs (1, 2, 3): 1.5 / sqrt(1.5 * 2)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(1.5 / math.sqrt(3))
    assert spearman([4, 3, 2, 1], [1, 2, 3, 4]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="length"):
        spearman([1, 2], [1, 2, 3])


def test_top_k_overlap_by_hand():
    a, b = [5, 4, 3, 2, 1], [1, 2, 3, 4, 5]
    assert top_k_overlap(a, b, 2) == 0.0
    assert top_k_overlap(a, b, 3) == pytest.approx(1 / 3)
    assert top_k_overlap(a, a, 5) == 1.0
    assert top_k([1, 2, 2, 0], 2).tolist() == [1, 2]  # ties: the earlier position first
    with pytest.raises(ValueError, match="k must"):
        top_k_overlap(a, b, 6)
