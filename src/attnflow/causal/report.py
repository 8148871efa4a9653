"""The patching report: ``patch.json`` (every number) and ``patch.html`` (heatmaps layer × position
per site kind and layer × head, each approximation's agreement with exact patching, the strongest
sites, the time each method took). The page renders offline, without scripts; every token and
text is escaped. Numbers shown in tables carry their full value in a ``data-value`` attribute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from attnflow.causal.sites import site_kind
from attnflow.staging import atomic_file
from attnflow.viz.page import esc, figure_img, meta_table, page, section

# The page reads a `attnflow.causal.api.PatchResult` (typed Any here: api imports this module).
PatchResult = Any
TOP_SITES = 5
CSS = "figure.heatmap { margin: 1rem 0; } figure.heatmap figcaption { color: #555; font-size: .9rem; }"


def write_report(result: PatchResult, out: Path) -> Path:
    """Write ``patch.json`` and ``patch.html`` into ``out`` (created if needed); returns the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "patch.json") as handle:
        handle.write(json.dumps(result.to_dict(), indent=1, allow_nan=True).encode("utf-8"))
    html_path = out / "patch.html"
    with atomic_file(html_path) as handle:
        handle.write(report_html(result).encode("utf-8"))
    return html_path


def _meta(result: PatchResult) -> dict[str, Any]:
    """The inputs and the metric of one result, as the page's key/value table shows them."""
    corruption = (
        {"corrupt text": result.corrupt_text}
        if result.corrupt_text is not None
        else {"noise on": ", ".join(result.noise_words), "noise samples": result.samples}
    )
    return {
        "clean text": result.clean_text,
        **corruption,
        "metric": result.metric,
        "m(clean)": result.clean_metric,
        "m(corrupted)": result.corrupt_metric,
        "direction": result.direction,
    }


def report_fragment(result: PatchResult) -> str:
    """A notebook's view of one result (no page around it, no figures): the inputs, the metric and
    the strongest sites."""
    check = _check_table(result) if result.check else ""
    return f'<div class="attnflow-patch">{meta_table(_meta(result))}{check}{_top_table(result)}</div>'


def report_html(result: PatchResult) -> str:
    """The report page of one `PatchResult`."""
    meta = _meta(result)
    body = [section("How to read this page", _reading(result))]
    if result.correlations:
        body.append(section("Approximations against exact patching", _agreement_table(result), "agreement"))
    if result.check:
        body.append(section("Sampled check of the estimates", _check_table(result), "check"))
    for method, effects in result.effects.items():
        figures = "\n".join(_heatmap(result, method, kind, values) for kind, values in effects.items())
        body.append(section(f"{method}: effects", figures, f"effects-{method}"))
    body.append(section("Strongest sites", _top_table(result), "strongest"))
    body.append(section("Time", _number_table(["method", "seconds"], list(result.seconds.items()), "seconds"), "time"))
    return page(
        f"Activation patching: {result.model}",
        "\n".join(body),
        subtitle=f"{result.direction}; {result.metric}",
        meta=meta,
        css=CSS,
    )


def _reading(result: PatchResult) -> str:
    if result.direction == "denoising":
        what = (
            "the corrupted input is run with one site set to its value on the clean input; effect = "
            "(m<sub>patched</sub> − m<sub>corrupted</sub>) / (m<sub>clean</sub> − m<sub>corrupted</sub>): "
            "1 = this site alone restores the answer, 0 = it restores nothing"
        )
    else:
        what = (
            "the clean input is run with one site set to its corrupted value; effect = "
            "(m<sub>clean</sub> − m<sub>patched</sub>) / (m<sub>clean</sub> − m<sub>corrupted</sub>): "
            "1 = corrupting this site alone destroys the answer"
        )
    knockout = ""
    if any("knockout" in effects for effects in result.effects.values()):
        knockout = (
            " An attention knockout cell blocks one attention edge (key → the target query) in a window of "
            "layers on the clean input: effect = (m<sub>clean</sub> − m<sub>blocked</sub>) / "
            "(m<sub>clean</sub> − m<sub>corrupted</sub>), whatever the direction; the approximations do not "
            "estimate it."
        )
    return (
        f"<p>Each cell is one site: {what}. Red is positive, blue negative. AtP, AtP* and RelP "
        "estimate the same numbers from one backward pass; their Pearson and Spearman correlation with "
        f"the exact values says when the fast answer can be trusted.{knockout}</p>"
    )


def _value_cell(value: float) -> str:
    return f'<td class="num" data-value="{esc(repr(float(value)))}">{esc(f"{float(value):.3f}")}</td>'


def _agreement_table(result: PatchResult) -> str:
    rows = []
    for method, kinds in result.correlations.items():
        for kind, values in kinds.items():
            rows.append(
                f'<tr data-method="{esc(method)}" data-kind="{esc(kind)}"><td>{esc(method)}</td><td>{esc(kind)}</td>'
                + _value_cell(values["pearson"])
                + _value_cell(values["spearman"])
                + "</tr>"
            )
    header = "<tr><th>method</th><th>sites</th><th>Pearson r</th><th>Spearman ρ</th></tr>"
    return f'<table class="agreement"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'


def _check_table(result: PatchResult) -> str:
    """The sampled check (`PatchResult.check`): what was patched and at what cost, each estimate's
    r and ρ with exact on the sample per site kind (a row below the threshold marked), the warnings."""
    check = result.check
    cost = (
        "read from the full exact sweep above, at no cost"
        if check["from_full_sweep"]
        else f"{check['seconds']:.2f} s of exact patching"
    )
    note = (
        f'<p class="note">Exact patching of {check["size"]} sites of each kind ({check["strongest"]} the '
        f"estimates' strongest, the rest drawn at random with seed {check['seed']}, each weighted by the "
        f"sites it stands for, so that r and ρ estimate those over every site; {esc(cost)}): an estimate "
        f"whose Pearson r with exact on them is below {check['threshold']} is marked; do not read its map as "
        "the patching effects.</p>"
    )
    rows = []
    for method, kinds in check["correlations"].items():
        for kind, values in kinds.items():
            low = values["pearson"] < check["threshold"]
            rows.append(
                f'<tr data-method="{esc(method)}" data-kind="{esc(kind)}" data-low="{str(low).lower()}">'
                f"<td>{esc(method)}</td><td>{esc(kind)}</td><td>{values['sites']}</td>"
                + _value_cell(values["pearson"])
                + _value_cell(values["spearman"])
                + f"<td>{'below the threshold' if low else ''}</td></tr>"
            )
    header = "<tr><th>method</th><th>sites</th><th>sampled</th><th>Pearson r</th><th>Spearman ρ</th><th></th></tr>"
    warnings = "".join(f'<p class="warning">{esc(line)}</p>' for line in result.check_warnings)
    return f'{note}<table class="check"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>{warnings}'


def _top_table(result: PatchResult) -> str:
    from attnflow.causal.labels import FINAL_ROW_NOTE, layer_label, strongest_sites
    from attnflow.tokens import display_token

    rows = []
    for method, effects in result.effects.items():
        for kind, values in effects.items():
            for layer, index in strongest_sites(kind, values, TOP_SITES):
                by_position = site_kind(kind).column == "position"
                where = f"{index}: {display_token(result.tokens[index])}" if by_position else f"head {index}"
                rows.append(
                    f'<tr data-method="{esc(method)}" data-kind="{esc(kind)}" data-layer="{layer}" '
                    f'data-index="{index}"><td>{esc(method)}</td><td>{esc(kind)}</td>'
                    f"<td>{esc(layer_label(kind, layer))}</td><td>{esc(where)}</td>"
                    f"{_value_cell(values[layer, index])}</tr>"
                )
    header = "<tr><th>method</th><th>sites</th><th>layer</th><th>position / head</th><th>effect</th></tr>"
    note = (
        f'<p class="note">Layers: L<i>n</i> is layer <i>n</i> (from 0); a residual site is the stream entering '
        f"layer 0 (emb) or leaving layer <i>n</i> (L<i>n</i>), as in <code>--versus</code>. Residual sites: "
        f"{esc(FINAL_ROW_NOTE)}.</p>"
    )
    return f'{note}<table class="strongest"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'


def _number_table(header: list[str], rows: list[tuple[str, float]], css_class: str) -> str:
    head = "".join(f"<th>{esc(cell)}</th>" for cell in header)
    body = "".join(f"<tr><td>{esc(name)}</td>{_value_cell(value)}</tr>" for name, value in rows)
    return f'<table class="{esc(css_class)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _heatmap(result: PatchResult, method: str, kind: str, values: np.ndarray) -> str:
    row = site_kind(kind)
    options = result.options
    title = row.heading(options.position_of(row), result.tokens, options.window, result.token_mixers)
    figure = heatmap_figure(result, kind, values, f"{method}: {title}")
    alt = f"{method} {kind} effects, layer by {row.column}"
    caption = esc(f"{method} · {title} · shape {list(values.shape)}")
    return (
        f'<figure class="heatmap" data-method="{esc(method)}" data-kind="{esc(kind)}">'
        f"{figure_img(figure, alt=alt)}<figcaption>{caption}</figcaption></figure>"
    )


def heatmap_figure(result: PatchResult, kind: str, values: np.ndarray, title: str) -> Any:
    """A layer × position (or layer × head) heatmap of one result's effects, centred on 0."""
    from attnflow.tokens import display_token

    by_position = site_kind(kind).column == "position"
    columns = [display_token(t)[:12] for t in result.tokens] if by_position else None
    return effect_heatmap(values, title, columns, kind)


def effect_heatmap(values: np.ndarray, title: str, column_labels: list[str] | None, kind: str) -> Any:
    """A heatmap ``[layer, column]`` centred on 0; columns labelled (positions) or numbered (heads),
    rows named as everywhere else (`attnflow.causal.api.layer_label`: ``emb``, ``L0`` …)."""
    from matplotlib.figure import Figure

    from attnflow.causal.labels import layer_label

    rows, columns = values.shape
    figure = Figure(figsize=(max(4.0, 0.45 * columns + 2), max(2.5, 0.18 * rows + 1.2)))
    axes = figure.add_subplot()
    limit = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 1.0
    limit = limit or 1.0
    image = axes.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", origin="lower")
    figure.colorbar(image, ax=axes, label="effect")
    ticks = np.arange(0, rows, max(1, rows // 8))
    axes.set_yticks(ticks, [layer_label(kind, int(row)) for row in ticks])
    stream = site_kind(kind).stream
    axes.set_ylabel("residual stream (emb: entering layer 0, Ln: leaving layer n)" if stream else "layer")
    if column_labels is None:
        axes.set_xlabel(site_kind(kind).column)
    else:
        axes.set_xticks(
            np.arange(columns), column_labels, rotation=60, ha="right", rotation_mode="anchor", parse_math=False
        )
    axes.set_title(title, fontsize=10)
    return figure


def summary_html(summary: dict[str, Any]) -> str:
    """The page of a file of pairs (`attnflow.causal.dataset.summarise`): how to read it, the pairs,
    the approximations' agreement with exact patching (with its 95 % interval over pairs), mean
    effects per method and site kind (positions counted back from the predicting one) and the
    strongest sites with their 95 % intervals."""
    body = [
        section("How to read this page", _summary_reading(summary)),
        section("Pairs", _pairs_table(summary), "pairs"),
    ]
    if summary["correlations"]:
        body.append(section("Approximations against exact patching", _summary_agreement(summary), "agreement"))
    body.append(section("Strongest sites, with 95 % intervals over pairs", _interval_table(summary), "intervals"))
    for method, kinds in summary["effects"].items():
        figures = []
        for kind, values in kinds.items():
            mean = np.asarray(values["mean"], dtype=float)
            by_position = site_kind(kind).column == "position"
            labels = [f"{j - mean.shape[1] + 1}" for j in range(mean.shape[1])] if by_position else None
            figure = effect_heatmap(mean, f"{method}: mean {site_kind(kind).title}", labels, kind)
            figures.append(
                f'<figure class="heatmap" data-method="{esc(method)}" data-kind="{esc(kind)}">'
                f"{figure_img(figure, alt=f'{method} {kind} mean effects')}</figure>"
            )
        body.append(section(f"{method}: mean effects", "\n".join(figures)))
    if summary["failed"]:
        failed = "".join(f"<li>{esc(row['clean_text'])}: {esc(row['error'])}</li>" for row in summary["failed"])
        body.append(section("Pairs left out", f"<ul>{failed}</ul>"))
    return page(
        "Activation patching over prompt pairs",
        "\n".join(body),
        subtitle=f"{summary['pairs']} pairs; positions counted back from the predicting one (0)",
        css=CSS,
    )


def _summary_reading(summary: dict[str, Any]) -> str:
    return (
        f"<p>Each pair is patched as <code>attnflow patch</code> patches one (its own page would show the same "
        f"numbers): the effect of a site is (m<sub>patched</sub> − m<sub>corrupted</sub>) / (m<sub>clean</sub> − "
        f"m<sub>corrupted</sub>) when denoising, 1 = that site alone restores the answer. This page averages the "
        f"{summary['pairs']} pairs listed below. Prompts of different lengths are aligned on the position that "
        "predicts (column 0; −1 the one before it …), so a cell is the mean over the pairs long enough to have it "
        "(its count is in summary.json, with every cell's mean and interval). A 95 % interval is the mean ± "
        "1.96 standard errors over pairs (none with one pair). Layers: L<i>n</i> is layer <i>n</i>; a residual "
        "site is the stream entering layer 0 (emb) or leaving layer <i>n</i>. The approximations (AtP, AtP*, "
        "RelP) estimate the same effects from one backward pass; their correlation with the exact effects "
        "says when the fast answer can be trusted: per pair (mean ± interval) and pooled over every site of "
        "every pair.</p>"
    )


def _pairs_table(summary: dict[str, Any]) -> str:
    rows = []
    for pair in summary.get("pair_list", []):
        corruption = (
            pair["corrupt_text"] if pair["corrupt_text"] is not None else "noise on " + ", ".join(pair["noise_words"])
        )
        rows.append(
            f'<tr data-index="{pair["index"]}"><td class="num">{pair["index"] + 1}</td>'
            f"<td>{esc(pair['clean_text'])}</td><td>{esc(corruption)}</td><td>{esc(pair['metric'])}</td>"
            f"{_value_cell(pair['clean_metric'])}{_value_cell(pair['corrupt_metric'])}</tr>"
        )
    header = "<tr><th>#</th><th>clean</th><th>corrupted</th><th>metric</th><th>m(clean)</th><th>m(corrupted)</th></tr>"
    return f'<table class="pairs"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'


def _summary_agreement(summary: dict[str, Any]) -> str:
    rows = []
    for method, kinds in summary["correlations"].items():
        for kind, values in kinds.items():
            half = values["pearson_ci95"]
            spread = f"± {half:.3f}" if half is not None and np.isfinite(half) else "n = 1: no interval"
            rows.append(
                f'<tr data-method="{esc(method)}" data-kind="{esc(kind)}"><td>{esc(method)}</td><td>{esc(kind)}</td>'
                + _value_cell(values["pearson_mean"])
                + f"<td>{esc(spread)}</td>"
                + _value_cell(values["pooled_pearson"])
                + _value_cell(values["pooled_spearman"])
                + "</tr>"
            )
    header = (
        "<tr><th>method</th><th>sites</th><th>Pearson r (mean over pairs)</th><th>95 % interval</th>"
        "<th>Pearson r (pooled)</th><th>Spearman ρ (pooled)</th></tr>"
    )
    return f'<table class="agreement"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'


def _interval_table(summary: dict[str, Any]) -> str:
    from attnflow.causal.labels import layer_label, strongest_sites

    rows = []
    for method, kinds in summary["effects"].items():
        for kind, values in kinds.items():
            mean = np.asarray(values["mean"], dtype=float)
            half = np.asarray(values["ci95"], dtype=float)
            count = np.asarray(values["count"])
            for layer, index in strongest_sites(kind, mean, TOP_SITES):
                by_position = site_kind(kind).column == "position"
                where = f"position {index - mean.shape[1] + 1}" if by_position else f"head {index}"
                bounds = (
                    _value_cell(mean[layer, index] - half[layer, index])
                    + _value_cell(mean[layer, index] + half[layer, index])
                    if np.isfinite(half[layer, index])
                    else '<td colspan="2">n = 1: no interval</td>'
                )
                rows.append(
                    f'<tr data-method="{esc(method)}" data-kind="{esc(kind)}" data-layer="{layer}" '
                    f'data-index="{index}"><td>{esc(method)}</td><td>{esc(kind)}</td>'
                    f"<td>{esc(layer_label(kind, layer))}</td><td>{esc(where)}</td>"
                    f"{_value_cell(mean[layer, index])}{bounds}"
                    f'<td class="num">{int(count[layer, index])}</td></tr>'
                )
    header = (
        "<tr><th>method</th><th>sites</th><th>layer</th><th>position / head</th><th>mean effect</th>"
        "<th>95 % low</th><th>95 % high</th><th>pairs</th></tr>"
    )
    return f'<table class="intervals"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'


TOP_EDGES = 10  # edges printed by `attnflow patch --edges`; the page lists twice as many


def versus_html(comparison: Any, rhos: dict[str, np.ndarray], model: str) -> str:
    """The page of `attnflow patch --versus` (one pair): per residual row, the Spearman ρ between
    exact patching and each method's prediction (`attnflow.causal.versus.LayerComparison`), and the
    exact effects it is compared with."""
    from attnflow.causal.labels import layer_label

    methods = list(rhos)
    header = "<tr><th>residual</th>" + "".join(f"<th>{esc(method)}</th>" for method in methods) + "</tr>"
    rows = []
    for row in range(len(comparison.effects)):
        cells = "".join(
            _value_cell(rhos[method][row]) if np.isfinite(rhos[method][row]) else '<td class="num">–</td>'
            for method in methods
        )
        rows.append(f'<tr data-row="{row}"><td>{esc(layer_label("residual", row))}</td>{cells}</tr>')
    table = f'<table class="versus"><thead>{header}</thead><tbody>{"".join(rows)}</tbody></table>'
    reading = (
        "<p>Each residual row is the stream at one depth (emb: entering layer 0; L<i>n</i>: leaving layer "
        "<i>n</i>). Exact patching restores that row's clean value at one position of the corrupted run and "
        "measures how much of the answer comes back (1 = all of it). Each method predicts, from the clean run "
        "alone, which positions matter at that depth; the cell is the Spearman correlation over positions "
        "between that prediction and the exact effects: near 1 the method follows the interventions, near 0 "
        "or below it does not. – : undefined (a constant side, or no composed layer at emb).</p>"
    )
    from attnflow.tokens import display_token

    labels = [display_token(token)[:12] for token in comparison.tokens]
    figure = effect_heatmap(comparison.effects, "exact residual patching (denoising)", labels, "residual")
    body = [
        section("How to read this page", reading),
        section("Spearman ρ per residual row", table, "versus"),
        section("Exact effects", figure_img(figure, alt="exact residual effects, row by position"), "effects"),
    ]
    meta = {"clean text": comparison.clean_text, "corrupt text": comparison.corrupt_text, "row": comparison.row}
    return page(f"Methods against activation patching: {model}", "\n".join(body), meta=meta, css=CSS)


def edges_html(result: Any, model: str) -> str:
    """The page of `attnflow patch --edges` (`attnflow.causal.edges.EdgeScores`): the strongest
    edges and the faithfulness of the top-k circuits."""
    rows = "".join(
        f'<tr data-up="{esc(result.upstream[up])}" data-down="{esc(result.downstream[down])}">'
        f"<td>{esc(result.upstream[up])}</td><td>{esc(result.downstream[down])}</td>"
        f"{_value_cell(result.scores[up, down])}</tr>"
        for up, down in result.top_edges(2 * TOP_EDGES)
    )
    header = "<tr><th>upstream</th><th>downstream</th><th>score</th></tr>"
    edges = f'<table class="edges"><thead>{header}</thead><tbody>{rows}</tbody></table>'
    circuits = _number_table(
        ["circuit", "faithfulness"],
        [(f"top {k} edges", value) for k, value in result.faithfulness.items()],
        "circuits",
    )
    reading = (
        "<p>An edge joins a component that writes into the residual stream (emb: the embeddings, "
        "a<i>l</i>.h<i>h</i>: head <i>h</i> of layer <i>l</i>, m<i>l</i>: the MLP of layer <i>l</i>) to one "
        "that reads it later (a<i>l</i>: the attention block of layer <i>l</i>, m<i>l</i>, logits). Its score "
        f"({esc(result.method)}) estimates how much of the answer (m<sub>clean</sub> − m<sub>corrupted</sub> "
        "= 1) the edge carries; the sign says whether it helps or hurts. A circuit's faithfulness is measured "
        "by patching: the clean run with every edge outside the top-k given its corrupted value; 1 = the "
        "circuit alone carries the answer.</p>"
    )
    body = [
        section("How to read this page", reading),
        section(f"The {2 * TOP_EDGES} strongest edges", edges, "edges"),
        section("Circuits of the top-k edges", circuits, "circuits"),
    ]
    meta = {"method": result.method, "m(clean)": result.clean_metric, "m(corrupted)": result.corrupt_metric}
    return page(f"Edges and circuits: {model}", "\n".join(body), meta=meta, css=CSS)
