"""Words from token scores, term lists and swaps, against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from attnflow.dataset_audit.words import parse_swaps, parse_terms, swap_table, swap_text, word_relevance
from attnflow.errors import InputError


def test_subword_scores_are_summed_into_lower_cased_words_as_shares_of_the_text():
    text = "Don't stop, Don't"
    tokens = ["[CLS]", "don", "'", "t", "stop", ",", "don", "'", "t", "[SEP]"]
    offsets = [[0, 0], [0, 3], [3, 4], [4, 5], [6, 10], [10, 11], [12, 15], [15, 16], [16, 17], [0, 0]]
    special = [True] + [False] * 8 + [True]
    scores = np.array([9.0, 1.0, 0.5, 0.5, 3.0, 2.0, 1.0, -1.0, 2.0, 9.0])
    total = 1.0 + 0.5 + 0.5 + 3.0 + 2.0 + 1.0 + 1.0 + 2.0  # |scores| of the content tokens: 11
    words = word_relevance(text, np.array(offsets), np.array(special), scores)
    assert len(tokens) == len(scores)
    assert set(words) == {"don't", "stop"}  # the comma belongs to no word, the special tokens to none
    assert words["don't"][0] == 2
    assert words["don't"][1] == pytest.approx((1.0 + 0.5 + 0.5 + 1.0 - 1.0 + 2.0) / total)
    assert words["stop"] == (1, pytest.approx(3.0 / total))


def test_a_text_without_relevance_gives_no_words():
    assert word_relevance("hi", np.array([[0, 0], [0, 2]]), np.array([True, False]), np.array([1.0, 0.0])) == {}


def test_swaps_go_both_ways_and_keep_case():
    table = swap_table(parse_swaps("he:she,him:her"))
    assert swap_text("He said she saw HIM, then he left.", table) == "She said he saw HER, then she left."
    assert swap_text("the theme is hers", table) is None  # whole words only


@pytest.mark.parametrize(
    "value, message",
    [
        ("new york:paris", "is not one word"),
        ("he", "is not WORD:WORD"),
        ("he:she,she:her", "appears in more than one pair"),
        ("he:he", "swaps a word with itself"),
        ("  ,  ", "names nothing"),
    ],
)
def test_bad_swap_pairs_are_one_line(value, message):
    with pytest.raises(InputError, match=message):
        parse_swaps(value)


def test_terms_from_a_list_or_a_file(tmp_path):
    path = tmp_path / "terms.txt"
    path.write_text("He\nshe, they\n\nhe\n", encoding="utf-8")
    assert parse_terms(str(path)) == ["he", "she", "they"]
    assert parse_terms(["Cat", "dog"]) == ["cat", "dog"]
    with pytest.raises(InputError, match="not one word"):
        parse_terms("ice cream")
