"""Words from subword scores, term lists and counterfactual swaps (pure functions, no model).

The word rules, the same for the word tables, the term audit and the swaps, whatever the
tokenizer:

- A *word* is a maximal run of letters and digits, joined by inner apostrophes or hyphens
  (``don't``, ``coming-of-age``), plus a possessive apostrophe after a final ``s``
  (``characters'``; not when the word opened with a quote, ``'great'``). Punctuation around it is
  not part of it, so ``he,`` and ``(he)`` hold the word ``he``.
- A word ending in an English clitic (``'s 'd 'll 're 've 'm`` or the possessive ``'``) is one word
  whose *key* is the part before the clitic: ``he's``, ``He'd``, ``his'`` and ``film's`` count as
  *he*, *he*, *his* and *film*, the clitic's tokens with them. ``n't`` is not split off
  (``don't`` stays ``don't``: the negation is the point). The key is lower-cased, with the
  typographic apostrophe ’ read as '.

A token belongs to the word whose character span holds the token's first character; special
tokens and tokens outside every word (punctuation) belong to none. A word's relevance in one
example is the sum of its tokens' scores divided by the sum of the absolute scores of all content
tokens: each example distributes a total of 1, so examples of different lengths and score scales
weigh the same.

A swap replaces a word's key and keeps its case and its clitic (``He's`` → ``She's``). A word
with several partners (``her`` in ``his:her,him:her``: *his* or *him*?) cannot be swapped
consistently: a text holding one is reported as ambiguous, never half swapped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from attnflow.errors import InputError

APOSTROPHES = "'’"
WORD = re.compile(r"[^\W_]+(?:['’\-][^\W_]+)*(?:(?<=[sS])['’](?![^\W_]))?")
CLITICS = ("'s", "'d", "'ll", "'re", "'ve", "'m")  # after ’ is read as '; the possessive ' is handled apart
SwapTable = dict[str, tuple[str, ...]]  # a swap word's key -> its partners' keys


@dataclass(frozen=True)
class Word:
    """One word of a text: its span ``[start, end)``, the end of its key part (``key_end``: before
    the clitic, if any) and its key (lower-cased, ’ read as ')."""

    start: int
    end: int
    key_end: int
    key: str


def split_clitic(word: str) -> tuple[str, str]:
    """``(key part, clitic)`` of one word as written: ``"He's"`` → ``("He", "'s")``, ``"his'"`` →
    ``("his", "'")``, ``"don't"`` → ``("don't", "")``."""
    plain = word.replace("’", "'").lower()
    for clitic in CLITICS:
        if plain.endswith(clitic) and len(plain) > len(clitic):
            return word[: -len(clitic)], word[-len(clitic) :]
    if plain.endswith("'") and len(plain) > 1:
        return word[:-1], word[-1:]
    return word, ""


def word_key(word: str) -> str:
    """The key of one word as written: lower-cased, ’ read as ', the clitic dropped (``"It’s"`` → ``"it"``)."""
    return split_clitic(word)[0].replace("’", "'").lower()


def find_words(text: str) -> Iterator[Word]:
    """The words of ``text`` in order (the module doc's rules)."""
    for match in WORD.finditer(text):
        start, end = match.span()
        if text[end - 1] in APOSTROPHES and start > 0 and text[start - 1] in APOSTROPHES:
            end -= 1  # 'great': a closing quote, not a possessive
        base, _ = split_clitic(text[start:end])
        yield Word(start, end, start + len(base), word_key(text[start:end]))


def word_relevance(
    text: str, offsets: np.ndarray, special_mask: np.ndarray, scores: np.ndarray
) -> dict[str, tuple[int, float]]:
    """``{word key: (occurrences, relevance)}`` of one example (see the module doc).

    Args:
        text: the explained text; ``offsets [token, 2]`` character spans into it;
        ``special_mask [token]``: True for special tokens; ``scores [token]``: one score per token.
    """
    content = ~np.asarray(special_mask, dtype=bool)
    scores = np.asarray(scores, dtype=np.float64)
    total = float(np.abs(scores[content]).sum())
    found = list(find_words(text))
    if not found or total == 0.0:
        return {}
    starts = np.array([word.start for word in found])
    ends = np.array([word.end for word in found])
    token_word = np.full(len(scores), -1)
    for token in np.flatnonzero(content):
        begin, finish = int(offsets[token][0]), int(offsets[token][1])
        while begin < finish and text[begin].isspace():  # byte-level BPE spans hold the space before a word
            begin += 1
        if finish <= begin:
            continue
        index = int(np.searchsorted(starts, begin, side="right")) - 1
        if index >= 0 and begin < ends[index]:
            token_word[token] = index
    words: dict[str, tuple[int, float]] = {}
    for index in np.unique(token_word[token_word >= 0]):
        key = found[index].key
        occurrences, relevance = words.get(key, (0, 0.0))
        words[key] = (occurrences + 1, relevance + float(scores[token_word == index].sum()) / total)
    return words


def check_word(word: str, what: str, parameter: str | None = None) -> str:
    """The key of ``word`` (`word_key`), or one InputError line when it is not exactly one word
    (``what``: where it comes from, naming ``parameter`` as ``{parameter}``, `attnflow.errors`)."""
    cleaned = word.strip()
    if not WORD.fullmatch(cleaned):
        raise InputError(
            f"{what} {word!r} is not one word (letters, digits, ' or - only); give single words", parameter=parameter
        )
    return word_key(cleaned)


def _items(value: str | Sequence[str], parameter: str) -> list[str]:
    """A comma-separated string, a file of such lines, or a list -> stripped non-empty items (the
    errors name ``parameter``)."""
    if isinstance(value, str):
        path = Path(value).expanduser()
        if path.is_file():
            value = path.read_text(encoding="utf-8").replace("\n", ",")
        elif "," not in value and any(c in value for c in "/\\"):
            raise InputError(f"{{{parameter}}} {value}: no such file", parameter=parameter)
        value = value.split(",")
    items = [item.strip() for item in value if item.strip()]
    if not items:
        raise InputError(f"{{{parameter}}} names nothing; give a comma-separated list or a file", parameter=parameter)
    return items


def parse_terms(value: str | Sequence[str]) -> list[str]:
    """``--terms a,b,...`` or a file (one or more terms a line, comma-separated) -> unique word keys
    (``he's`` is the term *he*)."""
    return list(dict.fromkeys(check_word(term, "{terms}: term", "terms") for term in _items(value, "terms")))


def parse_swaps(value: str | Sequence[str]) -> list[tuple[str, str]]:
    """``--swap he:she,his:her,him:her`` or a file of such pairs -> unique ``[(a, b), ...]`` (word keys).

    A word may be in several pairs (``her`` above); `swap_text` then reports the texts holding it
    as ambiguous instead of swapping them (`ambiguous_words` names such words up front)."""
    pairs: list[tuple[str, str]] = []
    for item in _items(value, "swap"):
        sides = item.split(":")
        if len(sides) != 2:
            raise InputError(f"{{swap}} pair {item!r} is not WORD:WORD (e.g. he:she)", parameter="swap")
        first, second = (check_word(side, f"{{swap}} pair {item!r}: side", "swap") for side in sides)
        if first == second:
            raise InputError(f"{{swap}} pair {item!r} swaps a word with itself", parameter="swap")
        if (first, second) not in pairs and (second, first) not in pairs:
            pairs.append((first, second))
    return pairs


def swap_table(pairs: Sequence[tuple[str, str]]) -> SwapTable:
    """Every word's partners, both directions: ``{"he": ("she",), "her": ("his", "him"), ...}``."""
    table: SwapTable = {}
    for a, b in pairs:
        table[a] = (*table.get(a, ()), b)
        table[b] = (*table.get(b, ()), a)
    return table


def ambiguous_words(table: SwapTable) -> SwapTable:
    """The words of a swap table with more than one partner, and their partners."""
    return {word: partners for word, partners in table.items() if len(partners) > 1}


@dataclass(frozen=True)
class Swapped:
    """A text's counterfactual: ``text`` with every swap word replaced, or None when the text holds
    a word with several partners (``ambiguous``, sorted), which is then not swapped at all."""

    text: str | None
    ambiguous: tuple[str, ...] = ()


def swap_text(text: str, table: SwapTable) -> Swapped | None:
    """``text`` with every word of ``table`` replaced by its partner, case and clitic kept
    (``He's`` → ``She's``, ``HIS`` → ``HER``); None when it holds no word of the table."""
    found = [word for word in find_words(text) if word.key in table]
    if not found:
        return None
    ambiguous = sorted({word.key for word in found if len(table[word.key]) > 1})
    if ambiguous:
        return Swapped(None, tuple(ambiguous))
    parts, last = [], 0
    for word in found:
        parts += [text[last : word.start], _with_case(text[word.start : word.key_end], table[word.key][0])]
        last = word.key_end
    return Swapped("".join([*parts, text[last:]]))


def _with_case(written: str, partner: str) -> str:
    """``partner`` in the case of ``written``: HE → SHE, He → She, he → she."""
    if written.isupper() and len(written) > 1:
        return partner.upper()
    return partner[:1].upper() + partner[1:] if written[:1].isupper() else partner
