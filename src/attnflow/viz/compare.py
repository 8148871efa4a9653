"""`attnflow compare` as a self-contained, script-free page: both models' saliency side by side,
their difference, Spearman ρ and the top-k overlap. Every token is escaped."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from attnflow.tokens import display_token
from attnflow.viz.page import BLUE, ORANGE, esc, page, section, table

if TYPE_CHECKING:
    from attnflow.comparison import Comparison

CSS = """
.attnflow .strip { white-space: pre-wrap; font-size: 1.05rem; line-height: 2.1; padding: .4rem .7rem;
                   border: 1px solid #e3e3e3; border-radius: 6px; background: #fcfcfc; margin-bottom: .6rem; }
.attnflow .strip .label { display: inline-block; min-width: 7.5rem; color: #555; font-size: .85rem; }
.attnflow .tok { border-radius: 3px; padding: .1rem .12rem; margin-right: .18rem; }
.attnflow .special { font-family: ui-monospace, monospace; font-size: .75rem; border: 1px dashed #aaa; }
.attnflow .metrics { font-size: 1.05rem; margin: .8rem 0; }
.attnflow .summary { margin: .3rem 0; padding: .4rem .8rem; border-left: 4px solid #d9480f; background: #fff6f0; }
.attnflow .note { color: #555; font-size: .9rem; }
"""


def model_comparison_html(comparison: "Comparison") -> str:
    """The self-contained page of `attnflow compare`: both models' maps and how they agree."""
    return page(
        f"attnflow compare: {comparison.method}",
        model_comparison_fragment(comparison, with_style=False),
        subtitle=comparison.text,
        meta={
            "model A": comparison.model_a,
            "model B": comparison.model_b,
            "method": comparison.method,
            "saliency row": comparison.row,
            "tokens": len(comparison.tokens),
        },
        css=CSS,
    )


def model_comparison_fragment(comparison: "Comparison", with_style: bool = True) -> str:
    """The comparison as an HTML fragment (notebooks; the page embeds it)."""
    rho = "undefined (constant scores)" if np.isnan(comparison.spearman) else f"{comparison.spearman:.3f}"
    hits = round(comparison.overlap * comparison.k)
    summary_a, summary_b = comparison.summaries()
    metrics = (
        f'<p class="metrics">Spearman ρ (content tokens): <b>{esc(rho)}</b> · top-{comparison.k} overlap: '
        f"<b>{hits}/{comparison.k}</b> ({100 * comparison.overlap:.0f} %)</p>"
        f'<p class="summary">A: {esc(summary_a)}</p><p class="summary">B: {esc(summary_b)}</p>'
    )
    special = np.asarray(comparison.special_mask, dtype=bool)
    scale = _scale(np.concatenate([comparison.scores_a[~special], comparison.scores_b[~special]]))
    strips = (
        _strip("A: " + comparison.model_a, comparison.tokens, special, comparison.scores_a, scale)
        + _strip("B: " + comparison.model_b, comparison.tokens, special, comparison.scores_b, scale)
        + _strip("B − A", comparison.tokens, special, comparison.difference, _scale(comparison.difference[~special]))
        + '<p class="note">A and B share one colour scale (the largest content-token score); the difference has its '
        "own: orange where B gives more relevance, blue where it gives less.</p>"
    )
    from scipy.stats import rankdata  # scipy.stats takes ~0.5 s to import: only when comparing

    content = comparison.content
    ranks_a = np.full(len(comparison.tokens), np.nan)
    ranks_b = np.full(len(comparison.tokens), np.nan)
    ranks_a[content] = rankdata(-comparison.scores_a[content])
    ranks_b[content] = rankdata(-comparison.scores_b[content])
    rows = [
        (
            i,
            display_token(token),
            comparison.scores_a[i],
            comparison.scores_b[i],
            comparison.difference[i],
            "" if special[i] else f"{ranks_a[i]:g}",
            "" if special[i] else f"{ranks_b[i]:g}",
        )
        for i, token in enumerate(comparison.tokens)
    ]
    body = (
        section("Agreement", metrics, "agreement")
        + section("Saliency side by side", strips, "saliency")
        + section("Per token", table(("index", "token", "A", "B", "B − A", "rank A", "rank B"), rows), "table")
    )
    style = f"<style>{CSS}</style>" if with_style else ""
    return f'<div class="attnflow">{style}\n{body}</div>'


def _scale(values: np.ndarray) -> float:
    largest = float(np.max(np.abs(values))) if values.size else 0.0
    return largest if largest > 0 else 1.0


def _strip(label: str, tokens: list[str], special: np.ndarray, scores: np.ndarray, scale: float) -> str:
    spans = []
    for i, token in enumerate(tokens):
        level = float(np.clip(abs(scores[i]) / scale, 0.0, 1.0))
        colour = BLUE if scores[i] < 0 else ORANGE
        text_colour = "#fff" if level > 0.6 else "#111"
        css_class = "tok special" if special[i] else "tok"
        spans.append(
            f'<span class="{css_class}" style="background: rgba({colour},{level:.3f}); color: {text_colour}" '
            f'title="{esc(f"#{i} {token}  {scores[i]:+.4g}")}">{esc(display_token(token))}</span>'
        )
    return f'<div class="strip"><span class="label">{esc(label)}</span>{"".join(spans)}</div>'
