"""What a head does, measured from its attention weights on one text (pure numpy; the definitions
are in docs/routes.md, "Across a dataset").

For every head, the mean over the query positions i ≥ 2 (where the first token, the previous
token and the query itself are three different keys) of the attention weight it gives to:

- ``first_token``: position 0 (the first token: an attention sink when it takes much);
- ``previous_token``: position i − 1;
- ``self``: position i itself;
- ``elsewhere``: every other key, 1 minus the three above (attention rows sum to 1);
- ``subword``: position i − 1, over the queries i ≥ 2 that continue a word (`continues_word`):
  the attention a subword-merging head gives to the previous piece of the same word.

`chance` gives the same shares for attention spread evenly over the keys each query sees (1 / the
number of visible keys each), the baseline to read them against. `role_of` names a head's role from
its mean scores.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

ROLES = ("first_token", "previous_token", "self", "elsewhere")  # they sum to 1 for every query
SUBWORD = "subword"
SCORES = (*ROLES, SUBWORD)
FIRST_QUERY = 2  # queries before it have the first token, the previous token or themselves in common
MAJORITY = 0.5  # a head is named by a share it gives at least this much attention to
SUBWORD_MARGIN = 0.2  # subword merging: the previous piece within words this much above the previous token overall
NAMES = {
    "first_token": "first token (sink)",
    "previous_token": "previous token",
    "self": "itself",
    "elsewhere": "other tokens",
    SUBWORD: "subword merging",
}


def _is_word(character: str) -> bool:
    return character.isalnum() or character == "_"


def continues_word(text: str, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """``[T]`` whether each token continues the word of the token before it, from the tokenizer's
    character ``offsets`` into ``text`` (special tokens have an empty span): its span starts where
    the previous token's ends (or inside it: one character split into bytes), and the characters on
    both sides of that boundary are word characters (letters, digits, ``_``). A token that starts
    with a space, or follows punctuation, starts a word."""
    found = np.zeros(len(offsets), dtype=bool)
    for i in range(1, len(offsets)):
        (previous_start, previous_end), (start, end) = offsets[i - 1], offsets[i]
        if end <= start or previous_end <= previous_start or not previous_start <= start <= previous_end:
            continue
        if start == previous_end:
            found[i] = _is_word(text[start]) and _is_word(text[start - 1])
        else:
            found[i] = _is_word(text[start])  # the same character, split into byte-level pieces
    return found


def attention_scores(attentions: np.ndarray, continues: np.ndarray) -> dict[str, np.ndarray | None]:
    """``{score: [L, H]}`` for one text, from ``attentions [L, H, T, T]`` ``[layer, head, query,
    key]`` and ``continues [T]`` (`continues_word`); None for a score no query measures (a text
    under 3 tokens; ``subword``: no query i ≥ 2 that continues a word)."""
    n_tokens = attentions.shape[-1]
    queries = np.arange(FIRST_QUERY, n_tokens)
    if queries.size == 0:
        return dict.fromkeys(SCORES)
    rows = attentions[:, :, queries, :].astype(np.float64)  # [L, H, Q, T]
    first = rows[..., 0].mean(-1)
    previous = rows[..., np.arange(queries.size), queries - 1].mean(-1)
    itself = rows[..., np.arange(queries.size), queries].mean(-1)
    found: dict[str, np.ndarray | None] = {"first_token": first, "previous_token": previous, "self": itself}
    found["elsewhere"] = 1.0 - first - previous - itself
    pieces = np.flatnonzero(continues[queries])
    found[SUBWORD] = rows[..., pieces, queries[pieces] - 1].mean(-1) if pieces.size else None
    return found


def chance(attentions: np.ndarray, continues: np.ndarray) -> dict[str, float | None]:
    """The scores of `attention_scores` for attention spread evenly over the keys each query sees
    (a key is visible when some head of some layer gives it a weight > 0: masked keys get exactly 0)."""
    n_tokens = attentions.shape[-1]
    queries = np.arange(FIRST_QUERY, n_tokens)
    if queries.size == 0:
        return dict.fromkeys(SCORES)
    visible = np.asarray((attentions > 0).any(axis=(0, 1)))[queries].astype(np.float64)  # [Q, T]
    even = visible / visible.sum(-1, keepdims=True)
    first = float(even[:, 0].mean())
    previous = float(even[np.arange(queries.size), queries - 1].mean())
    itself = float(even[np.arange(queries.size), queries].mean())
    found: dict[str, float | None] = {"first_token": first, "previous_token": previous, "self": itself}
    found["elsewhere"] = 1.0 - first - previous - itself
    pieces = np.flatnonzero(continues[queries])
    found[SUBWORD] = float(even[pieces, queries[pieces] - 1].mean()) if pieces.size else None
    return found


def role_of(scores: Mapping[str, float | None]) -> str:
    """A head's role from its mean scores: ``subword merging`` when it gives at least `MAJORITY`
    of its attention to the previous piece of the word a query continues and that is
    `SUBWORD_MARGIN` above its previous-token score over all queries; otherwise the share among
    `ROLES` it gives at least `MAJORITY` to (``previous token``, ``first token (sink)``,
    ``itself``, ``other tokens``); otherwise ``mixed`` with its two largest shares."""
    subword, previous = scores.get(SUBWORD), scores.get("previous_token")
    if subword is not None and previous is not None and subword >= MAJORITY and subword - previous >= SUBWORD_MARGIN:
        return NAMES[SUBWORD]
    shares = sorted(((value, name) for name in ROLES if (value := scores.get(name)) is not None), reverse=True)
    if not shares:
        return "unmeasured"
    if shares[0][0] >= MAJORITY:
        return NAMES[shares[0][1]]
    return "mixed: " + ", ".join(f"{NAMES[name]} {value:.2f}" for value, name in shares[:2])
