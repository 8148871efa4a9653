"""An Explanation as self-contained, offline HTML: coloured tokens, top tokens, matrix heatmap.

No scripts and no remote resources (see `attnflow.viz.page`); every token, text and option
value is escaped. Hovering a token shows its index and score (a ``title`` attribute).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from attnflow.explanation import LEVEL_NOTES, faithfulness_level
from attnflow.tokens import display_token
from attnflow.viz.page import (
    BLUE,
    ORANGE,
    esc,
    faithfulness_badge,
    figure_img,
    image_png,
    img,
    page,
    section,
    table,
)
from attnflow.viz.plot import SATURATION_PERCENTILE, matrix_figure

if TYPE_CHECKING:
    from attnflow.explanation import Explanation

TOP_K = 10

CSS = """
.attnflow .text { white-space: pre-wrap; font-size: 1.15rem; line-height: 2.1; padding: .6rem .8rem;
                  border: 1px solid #e3e3e3; border-radius: 6px; background: #fcfcfc; }
.attnflow .tok { border-radius: 3px; padding: .1rem .05rem; }
.attnflow .special { font-family: ui-monospace, monospace; font-size: .75rem; color: #666;
                     border: 1px dashed #aaa; border-radius: 3px; padding: 0 .25rem; margin: 0 .2rem; }
.attnflow .unseen { color: #aaa; }
.attnflow .legend { display: flex; align-items: center; gap: .6rem; font-size: .85rem; color: #555;
                    margin: .5rem 0 1rem; }
.attnflow .scale { width: 180px; height: 12px; border: 1px solid #ccc;
                   background: linear-gradient(to right, rgba(217,72,15,0), rgba(217,72,15,1)); }
.attnflow .scale.signed { background: linear-gradient(to right, rgba(33,102,172,1), rgba(33,102,172,0) 50%,
                                                      rgba(217,72,15,0) 50%, rgba(217,72,15,1)); }
.attnflow .badge { display: inline-block; font-size: .85rem; padding: .15rem .55rem; border-radius: 999px;
                   background: #eef4ee; border: 1px solid #9cc39c; color: #1f4d1f; margin: .2rem 0 .4rem; }
.attnflow .badge.weak { background: #f7eeee; border-color: #d6a3a3; color: #6b1f1f; }
.attnflow .badge.marginal { background: #fbf6e6; border-color: #d9c27a; color: #5c4a0d; }
.attnflow .badge.indistinct { background: #f1f3f5; border-color: #adb5bd; color: #495057; }
.attnflow .choice { font-size: 1.05rem; margin: .8rem 0; padding: .5rem .8rem; border-left: 4px solid #2166ac;
                    background: #f0f5fb; }
.attnflow img.overlay { width: min(100%, 480px); height: auto; border: 1px solid #eee; }
.attnflow .note { color: #555; font-size: .9rem; }
.attnflow .summary { font-size: 1.05rem; margin: .8rem 0; padding: .5rem .8rem; border-left: 4px solid #d9480f;
                     background: #fff6f0; }
.attnflow .warning { color: #7a4b00; background: #fff6e0; border: 1px solid #f0c36d; border-radius: 6px;
                     padding: .5rem .8rem; font-size: .95rem; }
"""

_ROW_WORDS = {"cls": "row 0 (the first token, [CLS])", "mean": "the mean of all rows", "last": "the last row"}


def explanation_html(explanation: "Explanation") -> str:
    """A complete HTML page for the explanation."""
    return page(
        f"attnflow: {explanation.method} explanation",
        explanation_fragment(explanation, with_meta=False),
        subtitle=_subtitle(explanation),
        meta=_meta(explanation),
        css=CSS,
    )


def methods_comparison_html(explanations: "list[Explanation]") -> str:
    """One page with several methods' explanations of the same text or image, one section each
    (tokens coloured by score or the overlay on the image, each on its own scale, and the top
    tokens), in the order given."""
    first = explanations[0]
    parts = [f'<p class="choice">{esc(e.chosen_by)}</p>' for e in explanations if e.chosen_by]
    for explanation in by_faithfulness(explanations):
        described = target_words(explanation)
        note = f"explains {described}; " if described else "does not depend on a target; "
        note += f"scores: {_row_words(explanation.row)}"
        parts.append(
            section(
                explanation.method + (" (chosen by --method auto)" if explanation.chosen_by else ""),
                _badge(explanation)
                + f'<p class="note">{esc(note)}</p>\n'
                + _scores_view(explanation)
                + _top_table(explanation, k=5),
                f"method-{explanation.method}",
            )
        )
    methods = ", ".join(explanation.method for explanation in explanations)
    prediction = target_words(first, "prediction")
    return page(
        f"attnflow: {methods}",
        '<div class="attnflow">\n' + "\n".join(parts) + "</div>",
        subtitle=f"{first.model or 'model'} · {first.image or first.text}"
        + (f" · prediction: {prediction}" if prediction else ""),
        meta={"model": first.model or None, "methods": methods, "tokens": first.n_tokens},
        css=CSS,
    )


def by_faithfulness(explanations: "list[Explanation]") -> "list[Explanation]":
    """Explanations with a per-input faithfulness first, highest comprehensiveness first; the
    others after them, in the order given."""
    return sorted(
        explanations,
        key=lambda e: -e.faithfulness["aopc_comprehensiveness"] if e.faithfulness is not None else np.inf,
    )


BOUNDS_SEARCHED = {
    "exact": "exact (every deletion order)",
    "levels": "a search a bin at a time (inner bounds)",
    "singles": "the tokens ordered by their own drop, each removed alone (cheap, loose inner bounds; "
    "leave-one-out meets the upper one by construction)",
    "beam": "a beam search (inner bounds)",
}


def _bounds_note(faithfulness: dict[str, Any]) -> str:
    """What NAOPC is on this input, and how its bounds were found (or why they were not)."""
    bounds = faithfulness.get("bounds")
    if not bounds:
        return ""
    if bounds["search"] not in BOUNDS_SEARCHED:
        return " " + bounds.get("note", "NAOPC not computed.") + "."
    low_c, high_c = bounds["comprehensiveness"]
    low_s, high_s = bounds["sufficiency"]
    return (
        f" NAOPC places the AOPC between the lowest and highest any ranking of this input reaches "
        f"(comprehensiveness {low_c:.3f}–{high_c:.3f}, sufficiency {low_s:.3f}–{high_s:.3f}; bounds "
        f"{BOUNDS_SEARCHED[bounds['search']]})."
    )


def _badge(explanation: "Explanation") -> str:
    """The per-input faithfulness badge (empty without one), coloured by `faithfulness_level`:
    green clearly above random rankings, amber barely above, red not above, grey where deletion
    cannot tell rankings apart on this input."""
    faithfulness = explanation.faithfulness
    if faithfulness is None:
        return ""
    level = faithfulness_level(faithfulness)
    title = (
        f"On this input: {faithfulness.get('quantity', 'p(' + str(faithfulness['target']) + ')')} = "
        f"{faithfulness['probability']:.3f}; removing the top "
        + ", ".join(f"{100 * k:g} %" for k in faithfulness["bins"])
        + " of the content tokens lowers it by "
        + ", ".join(f"{drop:.3f}" for drop in faithfulness["comprehensiveness"])
        + " (comprehensiveness, higher is better); keeping only them lowers it by "
        + ", ".join(f"{drop:.3f}" for drop in faithfulness["sufficiency"])
        + f" (sufficiency, lower is better); random: the mean of {faithfulness['random']['rankings']} "
        "random rankings." + _bounds_note(faithfulness)
    )
    return (
        f'<p><span class="badge{"" if level == "clear" else " " + level}" title="{esc(title + LEVEL_NOTES[level])}">'
        f"faithfulness on this input: {esc(faithfulness_badge(faithfulness))}</span></p>\n"
    )


def explanation_fragment(explanation: "Explanation", with_meta: bool = True, said_above: Sequence[str] = ()) -> str:
    """The explanation as an HTML fragment (what notebooks show via ``_repr_html_``). ``said_above``:
    notes the notebook cell showing it already said on stderr (counted in one line, not repeated)."""
    parts = [f'<p class="warning">Warning: {esc(note)}</p>' for note in explanation.notes if note not in said_above]
    repeated = sum(note in said_above for note in explanation.notes)
    if repeated:
        plural = "s" if repeated > 1 else ""
        parts.append(f'<p class="warning">{repeated} warning{plural} above (kept on the saved page)</p>')
    if explanation.chosen_by:
        parts.append(f'<p class="choice">{esc(explanation.chosen_by)}</p>')
    parts.append(_badge(explanation))
    parts.append(f'<p class="summary">{esc(explanation.summary())}</p>')
    if explanation.grid is not None:
        parts.append(section("Saliency over the image", _image_view(explanation), "image"))
    else:
        parts.append(section("Tokens coloured by score", token_view(explanation), "tokens"))
    parts.append(section(f"Top {TOP_K} tokens", _top_table(explanation), "top"))
    if explanation.matrix is not None:
        parts.append(
            section(
                "Relevance matrix [query, key]",
                '<p class="note">Row i: how much output position i draws on each input token j '
                f"(rows sum to 1 for rollout). The scores above are {esc(_row_words(explanation.row))}.</p>\n"
                + figure_img(matrix_figure(explanation), alt="relevance matrix heatmap"),
                "matrix",
            )
        )
    elif explanation.row is not None:  # a matrix method computed for the saliency row only
        parts.append(
            section(
                "Relevance matrix [query, key]",
                f'<p class="note">{esc(explanation.method)} was computed for the saliency row only '
                f"({esc(_row_words(explanation.row))}): the full matrix over {explanation.n_tokens} tokens "
                "would take minutes, so there is no matrix to show.</p>",
                "matrix",
            )
        )
    if with_meta:
        parts.insert(0, f'<p class="note">{esc(_subtitle(explanation))}</p>')
        return f'<div class="attnflow"><style>{CSS}</style>\n' + "\n".join(parts) + "</div>"
    return '<div class="attnflow">\n' + "\n".join(parts) + "</div>"


def token_view(explanation: "Explanation") -> str:
    """The text with each token's background coloured by its score (legend above), escaped."""
    scores = explanation.scores
    special = _special(explanation)
    regular = scores[~special] if np.any(~special) else scores
    largest = float(np.abs(regular).max() if explanation.signed else regular.max()) if regular.size else 0.0
    vmax = largest if largest > 0 else 1.0
    total = float(np.abs(scores).sum() if explanation.signed else scores.sum())
    pieces = []
    text = explanation.text
    offsets = explanation.offsets if text else None  # [n, 2] character spans into the text
    use_text = offsets is not None
    cursor = 0
    for i, token in enumerate(explanation.tokens):
        title = f"#{i} {display_token(token)} (token {token!r})  score {scores[i]:.4g}"
        if special[i]:
            pieces.append(f'<span class="special" title="{esc(title)}">{esc(token)}</span>')
            continue
        start, end = (int(offsets[i][0]), int(offsets[i][1])) if offsets is not None else (0, 0)
        if use_text and end > start and end > cursor:
            start = max(start, cursor)
            if start > cursor:
                pieces.append(esc(text[cursor:start]))
            shown = text[start:end]
            cursor = end
        else:
            shown = display_token(token) + ("" if use_text else " ")
        pieces.append(_token_span(shown, scores[i] / vmax, title))
    if use_text and cursor < len(text):
        pieces.append(f'<span class="unseen" title="not seen by the model (truncated)">{esc(text[cursor:])}</span>')
    if explanation.signed:
        share = float(np.abs(scores[special]).sum()) / total if total > 0 else 0.0
        against = target_words(explanation) or "the target"
        legend = (
            f'<div class="legend"><span>−{vmax:.3g}</span><span class="scale signed"></span><span>+{vmax:.3g}</span>'
            f"<span>signed scores: orange supports {esc(against)}, blue speaks against it; special tokens (dashed) "
            f"hold {100 * share:.1f}% of |score|</span></div>"
        )
    else:
        share = float(scores[special].sum()) / total if total > 0 else 0.0
        legend = (
            f'<div class="legend"><span>0</span><span class="scale"></span><span>{vmax:.3g}</span>'
            f"<span>colour scale over the non-special tokens; special tokens (dashed) hold "
            f"{100 * share:.1f}% of the score</span></div>"
        )
    return legend + '<div class="text">' + "".join(pieces) + "</div>"


def _token_span(shown: str, level: float, title: str) -> str:
    """A token on a ``level`` in [-1, 1]: orange above 0, blue below (signed scores)."""
    colour = BLUE if level < 0 else ORANGE
    level = float(np.clip(abs(level), 0.0, 1.0))
    text_colour = "#fff" if level > 0.6 else "#111"
    return (
        f'<span class="tok" style="background: rgba({colour},{level:.3f}); color: {text_colour}" '
        f'title="{esc(title)}">{esc(shown)}</span>'
    )


def _scores_view(explanation: "Explanation") -> str:
    return _image_view(explanation) if explanation.grid is not None else token_view(explanation)


def _image_view(explanation: "Explanation") -> str:
    parts = []
    if explanation.image is not None:
        parts.append(img(image_png(explanation.overlay()), alt="saliency overlay on the image", css_class="overlay"))
    assert explanation.grid is not None, "an image view needs the patch grid"
    rows, cols = explanation.grid
    covered = (
        ""
        if explanation.image_box is None
        else (
            " The overlay covers the part of the image the model saw (box left, top, right, bottom = "
            + ", ".join(f"{edge:.0f}" for edge in explanation.image_box)
            + " px)."
        )
    )
    parts.append(
        f'<p class="note">Patch grid {rows}x{cols}; {explanation.n_prefix_tokens} prefix token(s) '
        f"(CLS, distillation, registers) left out of the grid.{esc(covered)} Colours saturate above the "
        f"{SATURATION_PERCENTILE}th percentile of the patch scores, so that a few outlier patches do not wash "
        "out the rest.</p>"
    )
    return "\n".join(parts)


def _top_table(explanation: "Explanation", k: int = TOP_K) -> str:
    if explanation.signed:
        target = target_words(explanation) or "the target"
        tables = []
        supporting = [entry for entry in explanation.top(k) if entry[2] > 0]
        for title, ranked in ((f"for {target}", supporting), ("against", explanation.against(k))):
            ranks = [(rank, index, display_token(token), score) for rank, (index, token, score) in enumerate(ranked, 1)]
            tables.append(f'<p class="note">{esc(title)}</p>' + table(("rank", "index", "token", "score"), ranks))
        return "\n".join(tables)
    total = float(explanation.scores.sum())
    rows = [
        (rank, index, display_token(token), score, 100 * score / total if total > 0 else 0.0)
        for rank, (index, token, score) in enumerate(explanation.top(k), start=1)
    ]
    return table(("rank", "index", "token", "score", "% of all"), rows)


def _special(explanation: "Explanation") -> np.ndarray:
    if explanation.special_mask is None:
        return np.zeros(explanation.n_tokens, dtype=bool)
    return explanation.special_mask


def _row_words(row: object) -> str:
    if row is None:
        return "one score per token (this method gives no matrix)"
    return _ROW_WORDS.get(row, f"row {row}") if isinstance(row, str) else f"row {row}"


def target_words(explanation: "Explanation", field: str = "target") -> str | None:
    """``negative (p = 0.83)``: what a target-dependent explanation is about (``field="prediction"``:
    what the model predicted), else None."""
    described = getattr(explanation, field)
    if described is None:
        return None
    from attnflow.targets import ResolvedTarget

    return ResolvedTarget(**described).describe()


def _subtitle(explanation: "Explanation") -> str:
    source = explanation.image if explanation.grid is not None else explanation.text
    prediction = target_words(explanation, "prediction")
    predicted = f" · prediction: {prediction}" if prediction else ""
    return f"{explanation.model or 'model'} · {explanation.method} · {source or ''}".rstrip(" ·") + predicted


def _meta(explanation: "Explanation") -> dict[str, object]:
    return {
        "model": explanation.model or None,
        "method": explanation.method,
        "options": {key: value for key, value in explanation.options.items() if value is not None} or None,
        "prediction": target_words(explanation, "prediction"),
        "explains": target_words(explanation),
        "saliency row": _row_words(explanation.row),
        "tokens": explanation.n_tokens,
        "image": explanation.image,
    }
