"""Words from subword scores, term lists and counterfactual swaps (pure functions, no model).

A *word* is a maximal run of letters, digits, apostrophes and hyphens inside the text
(`WORD` below), lower-cased. A token belongs to the word whose character span holds the token's
first character; special tokens and tokens outside every word (punctuation) belong to none. A
word's relevance in one example is the sum of its tokens' scores divided by the sum of the
absolute scores of all content tokens: each example distributes a total of 1, so examples of
different lengths and score scales weigh the same.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np

from attnflow.errors import InputError

WORD = re.compile(r"[^\W_]+(?:['’\-][^\W_]+)*")


def word_relevance(
    text: str, offsets: np.ndarray, special_mask: np.ndarray, scores: np.ndarray
) -> dict[str, tuple[int, float]]:
    """``{word: (occurrences, relevance)}`` of one example (see the module doc).

    Args:
        text: the explained text; ``offsets [token, 2]`` character spans into it;
        ``special_mask [token]``: True for special tokens; ``scores [token]``: one score per token.
    """
    content = ~np.asarray(special_mask, dtype=bool)
    scores = np.asarray(scores, dtype=np.float64)
    total = float(np.abs(scores[content]).sum())
    spans = [match.span() for match in WORD.finditer(text)]
    if not spans or total == 0.0:
        return {}
    starts = np.array([start for start, _ in spans])
    ends = np.array([end for _, end in spans])
    words: dict[str, tuple[int, float]] = {}
    token_word = np.full(len(scores), -1)
    for token in np.flatnonzero(content):
        begin, finish = int(offsets[token][0]), int(offsets[token][1])
        if finish <= begin:
            continue
        index = int(np.searchsorted(starts, begin, side="right")) - 1
        if index >= 0 and begin < ends[index]:
            token_word[token] = index
    for index in np.unique(token_word[token_word >= 0]):
        start, end = spans[index]
        word = text[start:end].lower()
        occurrences, relevance = words.get(word, (0, 0.0))
        words[word] = (occurrences + 1, relevance + float(scores[token_word == index].sum()) / total)
    return words


def check_word(word: str, what: str) -> str:
    """``word`` lower-cased, or one InputError line when it is not exactly one word."""
    cleaned = word.strip()
    if not WORD.fullmatch(cleaned):
        raise InputError(f"{what} {word!r} is not one word (letters, digits, ' or - only); give single words")
    return cleaned.lower()


def _items(value: str | Sequence[str], option: str) -> list[str]:
    """A comma-separated string, a file of such lines, or a list -> stripped non-empty items."""
    if isinstance(value, str):
        path = Path(value).expanduser()
        if path.is_file():
            value = path.read_text(encoding="utf-8").replace("\n", ",")
        elif "," not in value and any(c in value for c in "/\\"):
            raise InputError(f"{option} {value}: no such file")
        value = value.split(",")
    items = [item.strip() for item in value if item.strip()]
    if not items:
        raise InputError(f"{option} names nothing; give a comma-separated list or a file")
    return items


def parse_terms(value: str | Sequence[str]) -> list[str]:
    """``--terms a,b,...`` or a file (one or more terms a line, comma-separated) -> unique words."""
    return list(dict.fromkeys(check_word(term, "--terms: term") for term in _items(value, "--terms")))


def parse_swaps(value: str | Sequence[str]) -> list[tuple[str, str]]:
    """``--swap he:she,him:her`` or a file of such pairs -> ``[(a, b), ...]`` (each one word)."""
    pairs = []
    for item in _items(value, "--swap"):
        sides = item.split(":")
        if len(sides) != 2:
            raise InputError(f"--swap pair {item!r} is not WORD:WORD (e.g. he:she)")
        first, second = (check_word(side, f"--swap pair {item!r}: side") for side in sides)
        if first == second:
            raise InputError(f"--swap pair {item!r} swaps a word with itself")
        pairs.append((first, second))
    swapped = [word for pair in pairs for word in pair]
    repeated = sorted({word for word in swapped if swapped.count(word) > 1})
    if repeated:
        raise InputError(f"--swap: {', '.join(repeated)} appears in more than one pair")
    return pairs


def swap_table(pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Both directions of every pair: ``{"he": "she", "she": "he", ...}``."""
    return {**{a: b for a, b in pairs}, **{b: a for a, b in pairs}}


def swap_text(text: str, table: dict[str, str]) -> str | None:
    """``text`` with every word of ``table`` replaced by its partner (case kept: He -> She,
    HE -> SHE), or None when it holds none of them."""
    found = False

    def replace(match: re.Match) -> str:
        nonlocal found
        word = match.group(0)
        partner = table.get(word.lower())
        if partner is None:
            return word
        found = True
        if word.isupper() and len(word) > 1:
            return partner.upper()
        return partner.capitalize() if word[0].isupper() else partner

    swapped = WORD.sub(replace, text)
    return swapped if found else None
