"""One plain-language sentence about a saliency vector ("'terrible' and 'acting' carry 41 % ...").

The single place that words a summary: `attnflow explain` (CLI and HTML), the explorer and
`attnflow compare` all call `summarize` / `explanation_summary`.

Rule: tokens are grouped into words (sub-word pieces whose character spans touch with letters or
digits on both sides of the seam, e.g. ``terr`` + ``##ible``), a word's relevance is the sum of its
tokens' positive scores, and the sentence names the best words (at most ``max_words``, each with at
least half the best word's relevance; a word chosen at several places is named once, "'.' ×3")
with their share of all positive relevance, special tokens included in the total; the special
tokens' own share follows in brackets.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from attnflow.errors import InputError
from attnflow.tokens import display_token

_ROW_SUBJECTS = {"mean": "the mean-pooled output (all rows averaged)"}


def words(
    tokens: Sequence[str], special_mask: Any = None, text: str = "", offsets: Any = None
) -> list[tuple[str, list[int]]]:
    """``[(word, [token indices])]`` of the non-special tokens, in order (see the module docstring)."""
    n = len(tokens)
    special = np.zeros(n, dtype=bool) if special_mask is None else np.asarray(special_mask, dtype=bool)
    spans = None if not text or offsets is None else np.asarray(offsets, dtype=np.int64).reshape(n, 2)
    grouped: list[tuple[str, list[int]]] = []
    previous_end = None
    for i in range(n):
        if special[i]:
            previous_end = None
            continue
        if spans is not None and spans[i, 1] > spans[i, 0]:
            start, end = int(spans[i, 0]), int(spans[i, 1])
            joins = (
                grouped
                and previous_end == start
                and text[start - 1 : start].isalnum()
                and text[start : start + 1].isalnum()
            )
            if joins:
                grouped[-1][1].append(i)
                word_start = spans[grouped[-1][1][0], 0]
                grouped[-1] = (text[word_start:end], grouped[-1][1])
            else:
                grouped.append((text[start:end], [i]))
            previous_end = end
        else:
            grouped.append((display_token(tokens[i]), [i]))
            previous_end = None
    return grouped


def summarize(
    tokens: Sequence[str],
    scores: Any,
    subject: str,
    special_mask: Any = None,
    text: str = "",
    offsets: Any = None,
    max_words: int = 3,
) -> str:
    """The summary sentence for ``[token]`` scores explaining ``subject`` (e.g. "the class negative")."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if scores.size != len(tokens):
        raise InputError(f"{scores.size} scores for {len(tokens)} tokens")
    positive = np.clip(np.nan_to_num(scores, nan=0.0), 0.0, None)
    total = float(positive.sum())
    if total <= 0:
        return f"no token carries positive relevance for {subject}"
    units = [(word, float(positive[indices].sum())) for word, indices in words(tokens, special_mask, text, offsets)]
    units.sort(key=lambda unit: -unit[1])  # stable: the earlier word first among ties
    best = units[0][1] if units else 0.0
    chosen = [unit for unit in units[:max_words] if unit[1] > 0 and unit[1] >= 0.5 * best]
    sentence = ""
    if chosen:
        counts: dict[str, int] = {}
        for word, _ in chosen:  # a word chosen more than once is named once: "'.' ×3"
            counts[word] = counts.get(word, 0) + 1
        names = [f"'{word}'" + (f" ×{count}" if count > 1 else "") for word, count in counts.items()]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        share = sum(value for _, value in chosen) / total
        verb = "carries" if len(chosen) == 1 else "carry"
        sentence = f"{listed} {verb} {_percent(share)} of the relevance for {subject}"
    if special_mask is not None and np.any(special_mask):
        special_share = float(positive[np.asarray(special_mask, dtype=bool)].sum()) / total
        if not chosen:
            return f"special tokens carry {_percent(special_share)} of the relevance for {subject}"
        sentence += f" (special tokens: {_percent(special_share)})"
    return sentence


def row_subject(row: Any, tokens: Sequence[str]) -> str:
    """How a sentence names the saliency row: ``"mean"``, ``"cls"``, ``"last"`` or an index."""
    if row in _ROW_SUBJECTS:
        return _ROW_SUBJECTS[row]
    if row == "cls":
        return f"the first token {display_token(tokens[0])}"
    index = len(tokens) - 1 if row == "last" else int(row)
    position = "the last token" if row == "last" else f"token #{index}"
    return f"{position} '{display_token(tokens[index])}'"


def subject(row: Any, tokens: Sequence[str], target: Any = None) -> str:
    """What scores explain, in words: the target when there is one ("the class negative": the
    predicted class or the one --target names, so not called "the prediction",
    "the next token 'Paris'", "the similarity to 'a good film'"), else the saliency row, else
    "the output" (attribution-only scores without a target). ``target`` is a
    `attnflow.targets.ResolvedTarget` or its dict."""
    if target is not None:
        read = target.get if isinstance(target, dict) else lambda key: getattr(target, key, None)
        kind, label = read("kind"), read("label")
        if label is not None:
            if kind == "next_token":
                return f"the next token '{display_token(label)}'"
            if kind == "similarity":
                return f"the similarity to '{label}'"
            return f"the class {label}"
    return "the output" if row is None else row_subject(row, tokens)


def explanation_subject(explanation: Any) -> str:
    """What an Explanation explains (see `subject`)."""
    return subject(explanation.row, explanation.tokens, getattr(explanation, "target", None))


def baseline_prefix(method: str) -> str:
    """What a summary sentence starts with: ``"random scores (a baseline, not a finding): "`` for a
    baseline method (`MethodSpec.baseline`), else nothing."""
    from attnflow.methods.registry import get_method

    try:
        baseline = get_method(method).baseline
    except ValueError:  # an explanation read back from a file of a method not registered here
        baseline = False
    return f"{method} scores (a baseline, not a finding): " if baseline else ""


def explanation_summary(explanation: Any, max_words: int = 3) -> str:
    """`summarize` applied to an Explanation (its scores, special tokens, text and offsets); for a
    baseline method (``random``) the sentence says it is one (`baseline_prefix`)."""
    return baseline_prefix(explanation.method) + summarize(
        explanation.tokens,
        explanation.scores,
        explanation_subject(explanation),
        special_mask=explanation.special_mask,
        text=explanation.text,
        offsets=explanation.offsets,
        max_words=max_words,
    )


def _percent(share: float) -> str:
    return f"{100 * share:.0f} %"
