"""The page of routes over a dataset (`attnflow.flow_routes.dataset`): ``report.html``, built from
``summary.json`` alone. Per domain, the heads that carry most of the predictions with what they
do, measured from their attention (and the chance levels to read it against), a layer × head
heatmap of mean importance, the feed-forward blocks per layer; with several domains, the heads
whose importance differs most. The page renders offline, without scripts; every prompt, token and
name is escaped. Numbers shown in tables carry their full value in a ``data-value`` attribute."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnflow.flow_routes.dataset import floats
from attnflow.flow_routes.head_roles import SCORES, SUBWORD
from attnflow.statistics import Z95
from attnflow.viz.page import esc, figure_img, page, section

CSS = (
    "figure.heatmap { margin: 1rem 0; } pre.prompt { background: #f5f5f7; padding: .4rem .6rem; "
    "white-space: pre-wrap; font-size: .8rem; max-height: 10rem; overflow: auto; } "
    "td.role, td.num { white-space: nowrap; }"
)


def report_html(summary: dict[str, Any]) -> str:
    """The report page of a `summarise` summary."""
    domains = summary["domains"] + ([summary["all"]] if "all" in summary else [])
    body = [section("How to read this page", _reading(summary))]
    for domain in domains:
        body.append(section(f"{domain['name']}: the top heads", _heads_table(domain), f"heads-{domain['name']}"))
    body.append(section("Heads by their measured role", _roles(domains), "roles"))
    body.append(section("Mean importance of every head", _heatmaps(domains), "heatmaps"))
    body.append(section("Feed-forward blocks", _ffn(domains), "ffn"))
    for difference in summary.get("differences", []):
        title = f"{difference['domain']} against {difference['against']}: the largest differences"
        body.append(section(title, _differences_table(difference), "differences"))
    body.append(section("Prompts", _examples(summary["domains"]), "prompts"))
    meta = {
        "model": summary["model"],
        "threshold τ": summary["threshold"],
        "norm p": summary["norm"],
        "max tokens": summary["max_tokens"],
        "prompts": summary["prompts"],
        "seconds per prompt": summary.get("seconds_per_prompt"),
    }
    names = ", ".join(domain["name"] for domain in summary["domains"])
    return page(
        f"Information flow routes over a dataset: {summary['model']}",
        "\n".join(body),
        subtitle=f"{summary['prompts']} predictions ({names}); each prompt's next token",
        meta=meta,
        css=CSS,
    )


def _reading(summary: dict[str, Any]) -> str:
    return (
        "<p>Each prompt's prediction (its next token, at the last position) gets the routes "
        "<code>attnflow routes</code> gives it: a head's <b>importance</b> is the share of the prediction that "
        f"flows through it on the route (τ = {esc(summary['threshold'])}), <b>with every edge</b> the same "
        "without the threshold; a feed-forward block's is summed over positions. The tables give the mean over "
        "prompts ± 1.96 standard errors (a 95 % interval). What a head does is measured from its attention "
        "weights on the same prompts, as the mean over the query positions i ≥ 2 of the share it gives to the "
        "<b>first token</b> (position 0, an attention sink when large), the <b>previous token</b> (i − 1), "
        "<b>itself</b> (i) and <b>other tokens</b> (the rest: these four sum to 1), and its <b>subword</b> "
        "score: the share of the previous piece (i − 1) from the queries that continue a word (no space or "
        "punctuation between the two pieces). A head is named by a share ≥ 0.5; <i>subword merging</i> when its "
        "subword score is ≥ 0.5 and 0.2 above its previous-token score; <i>mixed</i> otherwise, with its two "
        "largest shares. The row <i>even attention</i> is each share for attention spread evenly over the keys "
        "each query sees: the level a share means nothing below.</p>"
    )


def head_name(layer: int, head: int) -> str:
    """``L23.H4``: head 4 of layer 23 (both from 0)."""
    return f"L{layer}.H{head}"


def _cell(value: float | None, se: float | None = None) -> str:
    if value is None:
        return '<td class="num">–</td>'
    shown = f"{value:.3f}" if se is None else f"{value:.3f} ± {Z95 * se:.3f}"
    return f'<td class="num" data-value="{esc(repr(float(value)))}">{esc(shown)}</td>'


SCORE_HEADINGS = {"first_token": "first token", "previous_token": "previous token", "self": "itself"}
SCORE_HEADINGS |= {"elsewhere": "other tokens", SUBWORD: "subword"}


def _heads_table(domain: dict[str, Any]) -> str:
    header = "".join(
        f"<th>{esc(cell)}</th>"
        for cell in ("head", "importance", "with every edge", *SCORE_HEADINGS.values(), "role (measured)")
    )
    rows = []
    for entry in domain["top_heads"]:
        cells = _cell(entry["importance"], entry["importance_se"]) + _cell(
            entry["importance_full"], entry["importance_full_se"]
        )
        cells += "".join(_cell(entry[score]) for score in SCORES)
        rows.append(
            f'<tr data-layer="{entry["layer"]}" data-head="{entry["head"]}">'
            f"<td>{head_name(entry['layer'], entry['head'])}</td>{cells}"
            f'<td class="role">{esc(entry["role"])}</td></tr>'
        )
    chance = domain["chance"]
    rows.append(
        '<tr class="chance"><td colspan="3"><i>even attention</i></td>'
        + "".join(_cell(chance.get(score)) for score in SCORES)
        + "<td></td></tr>"
    )
    note = (
        f"<p>{domain['prompts']} prompts of {domain['tokens']:.1f} tokens on average.</p>"
        if domain.get("tokens") is not None
        else ""
    )
    return f'{note}<table class="heads"><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _roles(domains: list[dict[str, Any]]) -> str:
    """Per domain, the heads each role names (the largest shares first) and how they rank by importance."""
    parts = [
        "<p>Every head named by one role (not the mixed ones), the largest share of that kind first, with "
        "its mean importance and its rank among all heads by importance (1: the most important).</p>"
    ]
    for domain in domains:
        rows = []
        for role, listed in domain.get("by_role", {}).items():
            for entry in listed:
                rows.append(
                    f'<tr data-role="{esc(role)}" data-layer="{entry["layer"]}" data-head="{entry["head"]}">'
                    f"<td>{esc(role)}</td><td>{head_name(entry['layer'], entry['head'])}</td>"
                    + _cell(entry["score"])
                    + _cell(entry["importance"])
                    + f'<td class="num">{entry["rank"]}</td></tr>'
                )
        header = "<tr><th>role</th><th>head</th><th>share</th><th>importance</th><th>rank</th></tr>"
        parts.append(
            f"<h3>{esc(domain['name'])}</h3>"
            f'<table class="roles"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'
        )
    return "\n".join(parts)


def _heatmaps(domains: list[dict[str, Any]]) -> str:
    from matplotlib.figure import Figure

    figures = []
    for domain in domains:
        mean = np.asarray(floats(domain["heads"]["importance"]["mean"]), dtype=float)
        figure = Figure(figsize=(max(4.0, 0.45 * mean.shape[1] + 2), max(2.5, 0.18 * mean.shape[0] + 1.2)))
        axes = figure.add_subplot()
        image = axes.imshow(mean, cmap="Oranges", vmin=0, aspect="auto", origin="lower")
        figure.colorbar(image, ax=axes, label="mean importance")
        axes.set_xlabel("head")
        axes.set_ylabel("layer")
        axes.set_title(f"{domain['name']}: mean importance per head", fontsize=10)
        alt = f"{domain['name']}: mean importance, layer by head"
        figures.append(f'<figure class="heatmap">{figure_img(figure, alt=alt)}</figure>')
    return "\n".join(figures)


def _ffn(domains: list[dict[str, Any]]) -> str:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 3.2))
    axes = figure.add_subplot()
    rows = []
    for domain in domains:
        statistic = domain["ffn"]["importance"]
        mean = np.asarray(floats(statistic["mean"]), dtype=float)
        half = Z95 * np.nan_to_num(np.asarray(floats(statistic["se"]), dtype=float))
        layers = np.arange(mean.size)
        axes.plot(layers, mean, marker="o", markersize=3, label=domain["name"])
        axes.fill_between(layers, mean - half, mean + half, alpha=0.2)
        for entry in domain["top_ffn"]:
            rows.append(
                f'<tr data-layer="{entry["layer"]}"><td>{esc(domain["name"])}</td><td>L{entry["layer"]}</td>'
                + _cell(entry["importance"], entry["importance_se"])
                + _cell(entry["importance_full"], entry["importance_full_se"])
                + "</tr>"
            )
    axes.set_xlabel("layer")
    axes.set_ylabel("mean importance (± 95 %)")
    axes.legend(fontsize=8)
    header = "<tr><th>domain</th><th>feed-forward block</th><th>importance</th><th>with every edge</th></tr>"
    table = f'<table class="ffn"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'
    return f"{figure_img(figure, alt='mean importance of each feed-forward block by layer')}{table}"


def _differences_table(difference: dict[str, Any]) -> str:
    first, other = difference["against"], difference["domain"]
    header = "".join(f"<th>{esc(cell)}</th>" for cell in ("head", first, other, f"{other} − {first}", "± 95 %", "z"))
    rows = []
    for entry in difference["heads"]:
        half = None if entry["se"] is None else Z95 * entry["se"]
        rows.append(
            f'<tr data-layer="{entry["layer"]}" data-head="{entry["head"]}">'
            f"<td>{head_name(entry['layer'], entry['head'])}</td>"
            + _cell(entry[first])
            + _cell(entry[other])
            + _cell(entry["difference"])
            + _cell(half)
            + _cell(entry["z"])
            + "</tr>"
        )
    return f'<table class="differences"><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _examples(domains: list[dict[str, Any]]) -> str:
    """The first prompts of each domain, each with the model's prediction after it (where the
    summary has one: `attnflow.flow_routes.dataset.described_predictions`)."""
    parts = []
    for domain in domains:
        predictions = domain.get("predictions") or [None] * len(domain["examples"])
        shown = "".join(
            f'<pre class="prompt">{esc(text)}</pre>' + _predicted(predicted)
            for text, predicted in zip(domain["examples"], predictions, strict=False)
        )
        parts.append(
            f"<h3>{esc(domain['name'])}</h3><p>The first prompts, as run, and the next token each "
            f"predicts (every one: prompts.jsonl).</p>{shown}"
        )
    return "\n".join(parts)


def _predicted(predicted: dict[str, Any] | None) -> str:
    if predicted is None:
        return ""
    return (
        f'<p class="prediction">predicts {esc(repr(predicted["prediction"]))} (p = {predicted["probability"]:.3f})</p>'
    )
