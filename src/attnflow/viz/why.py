"""``why.html``: the reading of `attnflow.why` on top, each piece of evidence below it, linked.

The page is built from why.json's content (a dict), offline and without scripts (the page CSP of
`attnflow.viz.page`): a click on a token opens its panel (CSS ``:target``) with its attribution, its
route importance and its patching row, and marks its row and column in every table below
(``:has``). Every token, text and name is escaped; every number shown carries its full value in
``data-value``."""

from __future__ import annotations

from typing import Any

from attnflow.viz.page import esc, page, section

CSS = """
.reading p { font-size: 1.05rem; max-width: 60rem; }
.reading h3 { margin-bottom: .2rem; font-size: 1rem; }
.tokens a { display: inline-block; margin: .15rem; padding: .1rem .35rem; border: 1px solid #ccc;
            border-radius: 4px; text-decoration: none; color: inherit; font-family: monospace; }
.detail { display: none; border: 1px solid #e0b400; background: #fffbea; padding: .4rem .8rem; margin: .5rem 0; }
.detail:target { display: block; }
.note { color: #555; font-size: .9rem; }
.agree-no { color: #b00020; font-weight: 600; }
"""


def why_html(data: dict[str, Any]) -> str:
    """The page of one why.json content."""
    return page(
        f"Why: {data['model']}",
        _body(data),
        subtitle=data["text"],
        meta={"model": data["model"], "text": data["text"]},
        css=_css(data),
    )


def why_fragment(data: dict[str, Any]) -> str:
    """The page's evidence sections and their style, without the document around them and without
    the reading (which `attnflow serve`'s page writes above them as text): ``/api/why``'s ``page``."""
    return f'<style>{_css(data)}</style>\n<div class="why">\n{_body(data, ids="why-", reading=False)}</div>\n'


def _css(data: dict[str, Any]) -> str:
    return CSS + "".join(
        f'body:has(#token-{i}:target) [data-token="{i}"] {{ background: #ffe08a; }}\n'
        for i in range(len(data["shown_tokens"]))
    )


def _body(data: dict[str, Any], ids: str = "", reading: bool = True) -> str:
    """The sections (the reading first unless not ``reading``), their ids prefixed by ``ids`` (for
    a page that holds them beside ids of its own)."""
    tokens = data["shown_tokens"]
    body = [section("The reading", _reading(data), ids + "reading")] if reading else []
    body += [
        section(
            "Tokens (click one: its attribution, route importance and patching row)", _tokens(data), ids + "tokens"
        ),
        section("Agreement between the kinds of evidence", _agreement(data), ids + "agreement"),
        section("Which input tokens matter, by each kind of evidence", _scores(data), ids + "scores"),
    ]
    if data["evidence"]["attribution"] is not None:
        body.append(
            section("Attribution and its faithfulness on this input", _faithfulness(data), ids + "faithfulness")
        )
    if data["evidence"]["routes"] is not None:
        body.append(section("Route and logit lens at the predicting position", _routes(data), ids + "routes"))
    if data["evidence"]["patching"] is not None:
        body.append(section("Residual patching", _patching(data, tokens), ids + "patching"))
    body.append(section("Plan and budget", _plan(data), ids + "plan"))
    return "\n".join(body)


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return '<td class="num" data-value="">–</td>'
    return f'<td class="num" data-value="{esc(repr(value))}">{esc(f"{float(value):.{digits}f}")}</td>'


def _reading(data: dict[str, Any]) -> str:
    parts = [f"<h3>{esc(entry['question'])}</h3><p>{esc(entry['text'])}</p>" for entry in data["paragraphs"]]
    return '<div class="reading">' + "".join(parts) + "</div>"


def _tokens(data: dict[str, Any]) -> str:
    links = "".join(
        f'<a href="#token-{i}" data-token="{i}">{esc(token)}</a>' for i, token in enumerate(data["shown_tokens"])
    )
    return f'<p class="tokens">{links}</p>' + "".join(_panel(data, i) for i in range(len(data["shown_tokens"])))


def _panel(data: dict[str, Any], i: int) -> str:
    """Token ``i``'s panel: each kind of evidence's score of it, and its patching row over layers."""
    rows = "".join(
        f'<tr data-evidence="{esc(name)}"><td>{esc(name)}</td>{_number(scores[i])}</tr>'
        for name, scores in data["token_scores"].items()
    )
    patching = data["evidence"]["patching"]
    row = ""
    if patching is not None:
        cells = "".join(_number(values[i], 2) for values in patching["residual"])
        row = (
            f'<p class="note">Patching row (effect of restoring this token\'s stream, emb then each layer):</p>'
            f'<table class="patch-row"><tr>{cells}</tr></table>'
        )
    title = esc(data["shown_tokens"][i])
    return (
        f'<div class="detail" id="token-{i}"><strong>{title}</strong> (position {i})'
        f'<table class="token-scores">{rows}</table>{row}</div>'
    )


def _agreement(data: dict[str, Any]) -> str:
    rows = "".join(
        f'<tr data-first="{esc(pair["first"])}" data-second="{esc(pair["second"])}"><td>{esc(pair["first"])}</td>'
        f"<td>{esc(pair['second'])}</td>{_number(pair['spearman'])}{_number(pair['top_k_overlap'], 2)}"
        f"<td>{pair['k']}</td></tr>"
        for pair in data["agreement"]["tokens"]
    )
    html = (
        '<p class="note">Which tokens matter: Spearman ρ of the two rankings (special tokens left out) and '
        "the share of their top-k tokens in common. Disagreement is shown as it is, never averaged.</p>"
        '<table class="token-agreement"><thead><tr><th>evidence</th><th>against</th><th>Spearman ρ</th>'
        f"<th>top-k overlap</th><th>k</th></tr></thead><tbody>{rows}</tbody></table>"
    )
    layers = data["agreement"]["layers"]
    if layers is not None:
        cells = "".join(
            f'<tr data-layer-of="{esc(name)}"><td>{esc(name)}</td><td class="num">'
            f"{esc('–' if layer is None else 'emb' if layer < 0 else layer)}</td></tr>"
            for name, layer in layers["layers"].items()
        )
        verdict = (
            "too few name a layer"
            if layers["same"] is None
            else "the same layer"
            if layers["same"]
            else f'<span class="agree-no">not the same layer (spread {layers["spread"]})</span>'
        )
        html += (
            "<p class=\"note\">Which layer (the stream leaving it): the lens's first top layer, patching's "
            f"handover, the route's strongest move into the predicting position: {verdict}.</p>"
            f'<table class="layer-agreement"><tbody>{cells}</tbody></table>'
        )
    return html


def _scores(data: dict[str, Any]) -> str:
    names = list(data["token_scores"])
    head = "<tr><th>#</th><th>token</th>" + "".join(f"<th>{esc(name)}</th>" for name in names) + "</tr>"
    rows = "".join(
        f'<tr data-token="{i}"><td>{i}</td><td><a href="#token-{i}">{esc(token)}</a></td>'
        + "".join(_number(data["token_scores"][name][i]) for name in names)
        + "</tr>"
        for i, token in enumerate(data["shown_tokens"])
    )
    return f'<table class="scores"><thead>{head}</thead><tbody>{rows}</tbody></table>'


def _faithfulness(data: dict[str, Any]) -> str:
    from attnflow.viz.page import faithfulness_badge

    attribution = data["evidence"]["attribution"]
    lines = []
    for entry in (attribution, attribution.get("leave_one_out")):
        if entry is None:
            continue
        badge = "not measured" if entry["faithfulness"] is None else faithfulness_badge(entry["faithfulness"])
        lines.append(f"<li><code>{esc(entry['method'])}</code>: {esc(badge)} ({esc(entry['level'] or '–')})</li>")
    chosen = f'<p class="note">{esc(attribution["chosen_by"])}</p>' if attribution.get("chosen_by") else ""
    return f"<ul>{''.join(lines)}</ul>{chosen}"


def _routes(data: dict[str, Any]) -> str:
    routes = data["evidence"]["routes"]
    rows = []
    for entry in routes["lens"]:
        layer = entry["node"][1]
        top = ", ".join(f"{token['token']!r} {token['probability']:.2f}" for token in entry.get("top", [])[:3])
        rank = entry.get("target", {}).get("rank")
        rows.append(
            f'<tr data-stream="{layer}"><td>{esc("emb" if layer == 0 else f"L{layer - 1}")}</td>'
            f'<td>{esc(top)}</td><td class="num">{esc(rank)}</td></tr>'
        )
    lens = (
        '<table class="lens"><thead><tr><th>stream leaving</th><th>lens top tokens</th><th>answer\'s rank</th>'
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
    parts = []
    for entry in routes["components"][:8]:
        name = f"L{entry['layer']}.H{entry['head']}" if entry["kind"] == "head" else f"L{entry['layer']} FFN"
        promotes = ", ".join(repr(token["token"]) for token in entry.get("promotes", [])[:3])
        parts.append(
            f"<tr><td>{esc(name)}</td>{_number(entry['importance'])}{_number(entry.get('effect'))}"
            f"<td>{esc(promotes)}</td></tr>"
        )
    components = (
        '<p class="note">The most important heads and feed-forward blocks (importance on the route, direct '
        "effect on the answer's logit, the tokens each writes most towards; these lists are often noisy).</p>"
        '<table class="components"><thead><tr><th>part</th><th>importance</th><th>direct effect</th>'
        f"<th>promotes</th></tr></thead><tbody>{''.join(parts)}</tbody></table>"
    )
    return lens + components


def _patching(data: dict[str, Any], tokens: list[str]) -> str:
    patching = data["evidence"]["patching"]
    corruption = (
        f"the counterfactual text {patching['corrupt_text']!r}"
        if patching["corrupt_text"] is not None
        else f"noise on {', '.join(patching['noise_words'])} ({patching['samples']} draws)"
    )
    head = "<tr><th>stream</th>" + "".join(
        f'<th data-token="{i}"><a href="#token-{i}">{esc(token)}</a></th>' for i, token in enumerate(tokens)
    )
    rows = "".join(
        f'<tr data-row="{row}"><td>{esc("emb" if row == 0 else f"L{row - 1}")}</td>'
        + "".join(_number(value, 2).replace("<td ", f'<td data-token="{i}" ', 1) for i, value in enumerate(values))
        + "</tr>"
        for row, values in enumerate(patching["residual"])
    )
    knockout = patching["knockout"]
    blocked = ""
    if knockout is not None:
        effect = "–" if knockout["effect"] is None else f"{knockout['effect']:.3f}"
        blocked = (
            f'<p class="knockout">Knockout of the edge {esc(tokens[knockout["source"]])} → '
            f"{esc(tokens[knockout['target']])} at layer {knockout['layer']}: effect "
            f"{esc(effect)}.</p>"
        )
    return (
        f'<p class="note">{esc(patching["method"])} patching; metric {esc(patching["metric"])}; corruption: '
        f"{esc(corruption)}. Each cell: the share of the answer restored by the clean stream there alone.</p>"
        f'<table class="residual"><thead>{head}</thead><tbody>{rows}</tbody></table>{blocked}'
    )


def _plan(data: dict[str, Any]) -> str:
    plan = data["plan"]
    rows = "".join(
        f'<tr data-status="{esc(step["status"])}"><td>{esc(step["evidence"])}</td><td>{esc(step["what"])}</td>'
        f"{_number(step['estimated_seconds'], 1)}{_number(data['seconds'].get(step['evidence']), 1)}"
        f"<td>{esc(step['status'])}{esc(': ' + step['reason'] if step['reason'] else '')}</td></tr>"
        for step in plan["steps"]
    )
    budget = "none" if plan["budget"] is None else f"{plan['budget']:g} s"
    return (
        f'<p class="note">Budget: {esc(budget)}; the most expensive evidence is dropped first.</p>'
        '<table class="plan"><thead><tr><th>evidence</th><th>what</th><th>estimated s</th><th>took s</th>'
        f"<th>status</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def why_png(data: dict[str, Any]) -> bytes:
    """``why.png``: each kind of evidence's token scores side by side (each scaled by its largest
    |score|, so their rankings compare), the reading's answer in the title."""
    import numpy as np
    from matplotlib.figure import Figure

    from attnflow.viz.page import figure_png

    tokens, scores = data["shown_tokens"], data["token_scores"]
    figure = Figure(figsize=(max(6.0, 0.55 * len(tokens) + 2), 3.6))
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(scores))
    for index, (name, values) in enumerate(scores.items()):
        array = np.nan_to_num(np.asarray(values, dtype=np.float64))
        largest = np.abs(array).max()
        axes.bar(np.arange(len(tokens)) + index * width, array / largest if largest > 0 else array, width, label=name)
    axes.set_xticks(np.arange(len(tokens)) + 0.4 - width / 2, tokens, rotation=60, ha="right", fontsize=8)
    axes.axhline(0, color="#888", linewidth=0.6)
    axes.set_ylabel("score / its largest |score|")
    answer = data["shown"].get("answer", {}).get("text", "")
    axes.set_title(f"{data['model']}: {data['text']} → {answer}", fontsize=9)
    axes.legend(fontsize=7, ncol=len(scores), loc="upper left")
    return figure_png(figure, dpi=130)
