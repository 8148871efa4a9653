"""A `GenerationExplanation` as a page and a figure: generated tokens × source tokens.

The page is self-contained (no scripts, see `attnflow.viz.page`): a heatmap table, one row per
generated token and one column per source token, every cell's numbers in its ``title`` (hover),
then each step's top sources. Tokens are shown with `display_token` and escaped. Each row is
coloured on its own scale, its largest |score| over the non-special sources: the steps' scores
differ in size (a gradient's norm, a log-probability drop), their rankings are what compares.
Negative scores (leave-one-out: a source that made t_k less likely) are blue.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from attnflow.tokens import display_token
from attnflow.viz.page import esc, page, section, table
from attnflow.viz.plot import MAX_LABEL_CHARS

POSITIVE = "217,72,15"
NEGATIVE = "37,99,235"

CSS = """
.generation table.heat { border-collapse: collapse; font-size: .8rem; }
.generation table.heat td, .generation table.heat th { border: 1px solid #eee; padding: 0; }
.generation table.heat th.source { vertical-align: bottom; padding: .2rem 0; font-weight: 500; background: #fff; }
.generation th.source span { writing-mode: vertical-rl; transform: rotate(180deg); white-space: pre; }
.generation table.heat th.step { text-align: right; padding: 0 .6rem; font-weight: 500; white-space: pre;
                                 background: #fff; }
.generation table.heat td.p { text-align: right; padding: 0 .4rem; color: #555; font-variant-numeric: tabular-nums; }
.generation td.cell { width: 1.8rem; min-width: 1.8rem; height: 1.6rem; }
.generation td.absent { background: repeating-linear-gradient(45deg, #fafafa, #fafafa 3px, #f0f0f0 3px, #f0f0f0 6px); }
.generation .special { color: #888; font-family: ui-monospace, monospace; }
.generation .generated { color: #1d4ed8; }
.generation .text { white-space: pre-wrap; font-size: 1.1rem; padding: .5rem .8rem; border: 1px solid #e3e3e3;
                    border-radius: 6px; background: #fcfcfc; }
.generation .note { color: #555; font-size: .9rem; }
.generation .warning { color: #7a4b00; background: #fff6e0; border: 1px solid #f0c36d; border-radius: 6px;
                       padding: .5rem .8rem; }
"""


def generation_html(explanation: Any) -> str:
    """The complete page of a `GenerationExplanation`."""
    return page(
        f"attnflow: {explanation.method} over {explanation.n_steps} generated tokens"
        + ("" if explanation.contrast is None else f", {explanation.explains}"),
        generation_fragment(explanation, with_style=False),
        subtitle=f"{explanation.model} · {explanation.mode} · {explanation.prompt}",
        meta=_meta(explanation),
        css=CSS,
    )


def generation_comparison_html(explanations: Sequence[Any], chosen_by: str | None = None) -> str:
    """One page with several methods' explanations of the same continuation: the text once, then
    per method (the highest mean per-step comprehensiveness first, when measured) its step × source
    heatmap and top sources, each linking to the method's own page (``METHOD/generation.html``)."""
    first = explanations[0]
    measured = all(e.faithfulness is not None for e in explanations)
    ordered = sorted(explanations, key=lambda e: -e.faithfulness["mean_aopc"]) if measured else list(explanations)
    parts = [f'<p class="note">{esc(chosen_by)}</p>'] if chosen_by else []
    parts.append(
        section(
            "Prompt and continuation",
            f'<div class="text">{esc(first.prompt)}<span class="generated">{esc(first.continuation)}</span></div>',
            "text",
        )
    )
    for explanation in ordered:
        score = (
            f"mean comprehensiveness over the steps {explanation.faithfulness['mean_aopc']:.3f}; "
            if explanation.faithfulness is not None
            else ""
        )
        link = f'<a href="{esc(explanation.method)}/generation.html">its own page</a>'
        parts.append(
            section(
                explanation.method,
                f'<p class="note">{esc(score)}{link}</p>\n' + heatmap_table(explanation) + _top_table(explanation),
                f"method-{explanation.method}",
            )
        )
    methods = ", ".join(explanation.method for explanation in explanations)
    return page(
        f"attnflow: {methods} over {first.n_steps} generated tokens",
        '<div class="generation">\n' + "\n".join(parts) + "</div>",
        subtitle=f"{first.model} · {first.mode} · {first.prompt}",
        css=CSS,
    )


def generation_fragment(explanation: Any, with_style: bool = True) -> str:
    """The page's body (what notebooks show)."""
    parts = [f'<p class="warning">Warning: {esc(note)}</p>' for note in explanation.notes]
    parts.append(
        section(
            "Prompt and continuation",
            f'<div class="text">{esc(explanation.prompt)}<span class="generated">'
            f"{esc(explanation.continuation)}</span></div>"
            f'<p class="note">{explanation.n_prompt} prompt tokens, {explanation.n_steps} '
            f"{esc(explanation.mode)} tokens (blue).</p>",
            "text",
        )
    )
    parts.append(
        section(
            "Each generated token's sources",
            '<p class="note">Row k: the scores of the sources of y<sub>k</sub> = log p(t<sub>k</sub> | prompt, '
            "t<sub>1</sub> … t<sub>k−1</sub>); each row on its own colour scale (its largest |score| over the "
            "non-special sources; orange positive, blue negative); hatched: after t<sub>k</sub>'s position "
            "(causal, no score). Hover a cell for its numbers.</p>\n" + heatmap_table(explanation),
            "matrix",
        )
    )
    parts.append(section("Top sources per step", _top_table(explanation), "top"))
    if explanation.faithfulness is not None:
        parts.append(section("Faithfulness per step", _faithfulness_table(explanation), "faithfulness"))
    body = '<div class="generation">\n' + "\n".join(parts) + "</div>"
    return f"<style>{CSS}</style>\n{body}" if with_style else body


def heatmap_table(explanation: Any) -> str:
    """``<table>``: a header of source tokens, one row per generated token (its p, then one cell per source)."""
    special = explanation.special_mask
    header = ['<th class="step">generated ↓ source →</th><th class="step">p</th>']
    for index, token in enumerate(explanation.sources):
        css = "source special" if special[index] else "source"
        header.append(
            f'<th class="{css}" title="{esc(f"source {index}: {token!r}")}"><span>{esc(_label(token))}</span></th>'
        )
    rows = ["<tr>" + "".join(header) + "</tr>"]
    for step in range(explanation.n_steps):
        scores = explanation.step_scores(step)
        scale = _row_scale(scores, special[: len(scores)])
        token = explanation.generated[step]
        probability = float(explanation.probabilities[step])
        cells = [
            f'<th class="step" title="{esc(f"step {step + 1}: {token!r}, log p = {explanation.log_probs[step]:.4g}")}">'
            f"{esc(_label(token))}</th>",
            f'<td class="p">{probability:.2f}</td>',
        ]
        for index, score in enumerate(scores):
            level = float(np.clip(abs(score) / scale, 0.0, 1.0))
            color = POSITIVE if score >= 0 else NEGATIVE
            title = (
                f"{explanation.sources[index]!r} → {token!r} (step {step + 1}): score {score:.4g}, "
                f"{100 * level:.0f}% of the row's scale; p({token!r}) = {probability:.3g}"
            )
            cells.append(f'<td class="cell" style="background: rgba({color},{level:.3f})" title="{esc(title)}"></td>')
        absent = len(explanation.sources) - len(scores)
        cells.extend(['<td class="cell absent"></td>'] * absent)
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return '<table class="heat">\n' + "\n".join(rows) + "\n</table>"


def generation_figure(explanation: Any) -> Figure:
    """The ``[step, source]`` heatmap, each row divided by its scale (see the module docstring);
    the causally absent entries are blank."""
    n, s = explanation.n_steps, len(explanation.sources)
    shown = np.full((n, s), np.nan)
    signed = False
    for step in range(n):
        scores = explanation.step_scores(step)
        shown[step, : len(scores)] = scores / _row_scale(scores, explanation.special_mask[: len(scores)])
        signed |= bool(np.any(scores < 0))
    size = (float(np.clip(0.32 * s + 3, 6, 18)), float(np.clip(0.32 * n + 2, 3, 14)))
    figure = Figure(figsize=size, layout="constrained")
    axes = figure.subplots()
    cmap = colormaps["RdBu_r" if signed else "Oranges"].copy()
    cmap.set_bad("#f2f2f2")
    image = axes.imshow(np.ma.masked_invalid(shown), cmap=cmap, vmin=-1.0 if signed else 0.0, vmax=1.0, aspect="auto")
    figure.colorbar(image, ax=axes, shrink=0.8, label="score / row scale")
    axes.set_xticks(range(s), [_label(token) for token in explanation.sources], rotation=90, fontsize=8)
    axes.set_yticks(
        range(n),
        [f"{_label(t)}  {p:.2f}" for t, p in zip(explanation.generated, explanation.probabilities, strict=True)],
        fontsize=8,
    )
    axes.set_xlabel("source token")
    axes.set_ylabel("generated token  p")
    axes.set_title(
        f"{explanation.method}: {explanation.model}, {explanation.mode} ({explanation.n_steps} tokens)"
        + ("" if explanation.contrast is None else f"\n{explanation.explains}"),
        loc="left",
        fontsize=10,
    )
    return figure


def _top_table(explanation: Any, k: int = 3) -> str:
    rows = []
    for step in range(explanation.n_steps):
        top = ", ".join(f"{_label(token)} ({score:.3g})" for _, token, score in explanation.top_sources(step, k))
        rows.append((step + 1, _label(explanation.generated[step]), float(explanation.probabilities[step]), top or "—"))
    return table(["step", "token", "p", f"top {k} sources (score)"], rows)


def _faithfulness_table(explanation: Any) -> str:
    faithfulness = explanation.faithfulness
    bins = ", ".join(f"{100 * fraction:g}%" for fraction in faithfulness["bins"])
    rows = [
        (step + 1, _label(token), float(p), *[float(q) for q in perturbed], float(aopc))
        for step, (token, p, perturbed, aopc) in enumerate(
            zip(
                explanation.generated,
                faithfulness["probability"],
                faithfulness["perturbed_probability"],
                faithfulness["aopc"],
                strict=True,
            )
        )
    ]
    header = ["step", "token", "p", *[f"p without top {100 * f:g}%" for f in faithfulness["bins"]], "AOPC"]
    return (
        f'<p class="note">p(t<sub>k</sub>) once the top {esc(bins)} of step k\'s content sources are '
        f"{esc(faithfulness['replace'])}d (as in attnflow evaluate); AOPC: the mean drop, higher is more "
        f"faithful. Mean over steps: {faithfulness['mean_aopc']:.4g}.</p>" + table(header, rows)
    )


def _row_scale(scores: np.ndarray, special: np.ndarray) -> float:
    """The largest |score| over the non-special sources (over all when every source is special); 1 for zeros."""
    regular = np.abs(scores[~special]) if np.any(~special) else np.abs(scores)
    top = float(regular.max()) if regular.size else 0.0
    return top if top > 0 else 1.0


def _label(token: str) -> str:
    shown = display_token(token)
    return shown if len(shown) <= MAX_LABEL_CHARS else shown[: MAX_LABEL_CHARS - 1] + "…"


def _meta(explanation: Any) -> dict[str, Any]:
    return {
        "model": explanation.model,
        "method": explanation.method,
        "options": explanation.options or None,
        "mode": explanation.mode,
        "prompt tokens": explanation.n_prompt,
        "generated tokens": explanation.n_steps,
        "mean p(t_k)": float(np.mean(explanation.probabilities)),
    }
