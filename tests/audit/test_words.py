"""Words from token scores, term lists and swaps, against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from attnflow.dataset_audit.words import (
    find_words,
    parse_swaps,
    parse_terms,
    swap_table,
    swap_text,
    word_relevance,
)
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
    assert set(words) == {"don't", "stop"}  # n't stays: the comma belongs to no word, the special tokens to none
    assert words["don't"][0] == 2
    assert words["don't"][1] == pytest.approx((1.0 + 0.5 + 0.5 + 1.0 - 1.0 + 2.0) / total)
    assert words["stop"] == (1, pytest.approx(3.0 / total))


def test_byte_level_bpe_spans_holding_the_space_before_a_word_count_for_that_word():
    """GPT-2-style tokens ("Ġcat") whose character span starts at the space before the word (as
    smollm2's and Qwen's tokenizers give them) belong to the word after the space."""
    text = "The Acropolis of Athens"
    spans = [[0, 3], [3, 6], [6, 13], [13, 16], [16, 23]]  # The, ĠAc, ropolis, Ġof, ĠAthens
    scores = np.array([1.0, 2.0, 3.0, 4.0, -10.0])
    words = word_relevance(text, np.array(spans), np.zeros(5, dtype=bool), scores)
    shares = {"the": 0.05, "acropolis": 0.25, "of": 0.2, "athens": -0.5}  # (1 | 2 + 3 | 4 | -10) / 20
    assert words == {word: (1, pytest.approx(share)) for word, share in shares.items()}


def test_a_clitic_counts_with_its_word_under_the_word_s_key():
    text = "He's sure; he’d know (he)."
    # tokens: he ' s sure ; he ’ d know ( he ) .  (a BERT-like split of the clitics)
    spans = [(0, 2), (2, 3), (3, 4), (5, 9), (9, 10), (11, 13), (13, 14), (14, 15), (16, 20), (21, 22), (22, 24)]
    spans += [(24, 25), (25, 26)]
    scores = np.array([0.5, 0.25, 0.25, 1.0, 0.5, 1.0, -0.5, 0.5, 1.0, 0.5, 2.0, 0.5, 0.5])
    words = word_relevance(text, np.array(spans), np.zeros(len(spans), dtype=bool), scores)
    total = np.abs(scores).sum()
    assert set(words) == {"he", "sure", "know"}
    assert words["he"] == (3, pytest.approx((0.5 + 0.25 + 0.25 + 1.0 - 0.5 + 0.5 + 2.0) / total))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("He's here, isn't he?", [("He's", "he"), ("here", "here"), ("isn't", "isn't"), ("he", "he")]),
        ("the characters' fate", [("the", "the"), ("characters'", "characters"), ("fate", "fate")]),
        ("his' and James' car", [("his'", "his"), ("and", "and"), ("James'", "james"), ("car", "car")]),
        ("called it 'films' here", [("called", "called"), ("it", "it"), ("films", "films"), ("here", "here")]),
        ("It’s the film’s coming-of-age", [("It’s", "it"), ("the", "the"), ("film’s", "film"),
                                           ("coming-of-age", "coming-of-age")]),
        ("I'm sure you'll, we've, they're", [("I'm", "i"), ("sure", "sure"), ("you'll", "you"), ("we've", "we"),
                                             ("they're", "they")]),
    ],
)  # fmt: skip
def test_word_rules(text, expected):
    assert [(text[word.start : word.end], word.key) for word in find_words(text)] == expected


def test_swaps_go_both_ways_keep_case_clitic_and_punctuation():
    table = swap_table(parse_swaps("he:she,him:her"))
    assert swap_text("He said she saw HIM, then he left.", table).text == "She said he saw HER, then she left."
    assert swap_text("He's sure she’d know (he). HE'S", table).text == "She's sure he’d know (she). SHE'S"
    assert swap_text("the theme is hers", table) is None  # whole words only


def test_an_ambiguous_word_is_reported_and_the_text_not_half_swapped():
    pairs = parse_swaps("he:she,his:her,him:her")
    table = swap_table(pairs)
    assert table["her"] == ("his", "him") and table["his"] == ("her",)
    # The case of the issue: "he's" alone would be swapped, "her" cannot be.
    text = "at her 12th Oscar nomination by proving that he's now... choosing her roles"
    swapped = swap_text(text, table)
    assert swapped.text is None and swapped.ambiguous == ("her",)
    assert swap_text("proving that he's now choosing his roles", table).text == (
        "proving that she's now choosing her roles"
    )


def test_a_pair_given_twice_or_both_ways_is_one_pair():
    assert parse_swaps("he:she,she:he,He:She") == [("he", "she")]
    assert parse_swaps("he's:she's") == [("he", "she")]  # the words' keys


@pytest.mark.parametrize(
    "value, message",
    [
        ("new york:paris", "is not one word"),
        ("he", "is not WORD:WORD"),
        ("he:he", "swaps a word with itself"),
        ("he's:he", "swaps a word with itself"),
        ("  ,  ", "names nothing"),
    ],
)
def test_bad_swap_pairs_are_one_line(value, message):
    with pytest.raises(InputError, match=message):
        parse_swaps(value)


def test_terms_from_a_list_or_a_file(tmp_path):
    path = tmp_path / "terms.txt"
    path.write_text("He\nshe, they\n\nhe's\n", encoding="utf-8")
    assert parse_terms(str(path)) == ["he", "she", "they"]
    assert parse_terms(["Cat", "dog"]) == ["cat", "dog"]
    with pytest.raises(InputError, match="not one word"):
        parse_terms("ice cream")
