"""The corpus study report: one self-contained HTML page (figures as base64 PNG, no scripts).

`build_report(summary, arrays)` only draws: every number comes from ``summary.json`` (the
`StudyStats.summary` plus run information) and ``stats.npz`` (`StudyStats.arrays`). Figures are
also available one by one (`study_figures`) so that documentation can save them as PNG files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from attnflow.viz.page import figure_img, figure_png, page, section, table
from attnflow.viz.plot import display_token

HIGH_COLOR = "#d9480f"
CHANCE_COLOR = "#868e96"
GRID_CMAP = "magma"
TARGET_COLORS = ("#1c7ed6", "#e8590c", "#2b8a3e", "#ae3ec9", "#f08c00", "#495057")
PUNCTUATION_NAMES = {
    ".": "full stop",
    ",": "comma",
    ";": "semicolon",
    ":": "colon",
    "!": "exclamation mark",
    "?": "question mark",
}


def _layer_values(summary: Mapping[str, Any], name: str) -> np.ndarray:
    """``[layer]`` values of a layer-summary scalar (None → NaN)."""
    return np.array([np.nan if layer.get(name) is None else layer[name] for layer in summary["layers"]], dtype=float)


def _heads(arrays: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(arrays[name], dtype=float)  # [layer, head]


def distance_figure(arrays: Mapping[str, np.ndarray]) -> Figure:
    """Per layer: distance |i − j| distribution of the high-similarity pairs vs all pairs."""
    hist = np.asarray(arrays["high_distance_hist"], dtype=float).sum(axis=1)  # [layer, distance]
    baseline = np.asarray(arrays["all_distance_hist"], dtype=float)  # [distance]
    n_layers, n = hist.shape
    cols = min(4, n_layers)
    rows = -(-n_layers // cols)
    figure = Figure(figsize=(3.2 * cols, 2.4 * rows + 0.6), layout="constrained")
    axes = np.atleast_1d(figure.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)).ravel()
    distances = np.arange(n)
    base = baseline / baseline.sum() if baseline.sum() > 0 else baseline
    totals = hist.sum(axis=1, keepdims=True)
    top = 1.5 * max(float(np.max(hist / np.where(totals > 0, totals, 1))), float(base.max()), 1e-12)
    for layer in range(n_layers):
        ax = axes[layer]
        total = hist[layer].sum()
        share = hist[layer] / total if total > 0 else hist[layer]
        ax.plot(distances[1:], share[1:], color=HIGH_COLOR, lw=1.2, label="high-similarity pairs")
        ax.plot(
            distances[1:],
            base[1:],
            color=CHANCE_COLOR,
            lw=1.0,
            ls="--",
            label="chance: all pairs (n − d at distance d)",
        )
        ax.set_yscale("log")
        positive = base[1:][base[1:] > 0]
        if positive.size:  # the farthest distances hold one pair per window: keep them from squashing the rest
            ax.set_ylim(positive.min() / 4, top)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in axes[n_layers:]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8)
    figure.supxlabel("distance |i − j| (tokens)", fontsize=9)
    figure.supylabel("share of pairs", fontsize=9)
    figure.suptitle("Distance of high-similarity pairs by layer, against all pairs", fontsize=10)
    return figure


# The chance baseline of every share, exactly as `attnflow.corpus.stats` computes it; shown in the
# figures' legends and in the report's "Chance baselines" table.
BASELINES = {
    "mean_distance": "mean |i − j| over all pairs of the windows, (n + 1)/3",
    "short_range": "share of all pairs with |i − j| ≤ r",
    "same_sentence": "share of all pairs of non-special tokens that lie in one sentence",
    "repeat": "share of all pairs (special tokens included) whose two tokens are equal",
    "anchor": "share of all pairs covered by the window's most pair-covering token, mean over windows",
    "signal": "size of M over all pairs, k_M / P (the share a random H would find in M)",
    "attention_to": "share of positions holding the token (a uniform attention row)",
    "attention_position": "1 / n (a uniform attention row)",
}

TREND_PANELS = (
    ("mean distance of H", "mean_distance_high", "mean_distance_all", "mean_distance", "tokens"),
    ("short-range share (|i−j| ≤ r)", "short_range_share", "short_range_chance", "short_range", "share of H"),
    ("same-sentence share", "same_sentence_share", "same_sentence_chance", "same_sentence", "share of eligible H"),
    ("repeated-token share", "repeat_share", "repeat_chance", "repeat", "share of H"),
    ("anchor-token share", "anchor_share", "anchor_share_chance", "anchor", "share of H"),
    ("signal share (H ∩ high attention)", "signal_share", "signal_chance", "signal", "share of H"),
)

CHANCE_LABELS = {
    "mean_distance": "chance: all pairs",
    "short_range": "chance: all pairs",
    "same_sentence": "chance: all non-special pairs",
    "repeat": "chance: all pairs",
    "anchor": "chance: top token over all pairs",
    "signal": "chance: |M| / all pairs",
}


def layer_trends_figure(summary: Mapping[str, Any]) -> Figure:
    """Layer means of the key shares, each with its own chance baseline (named in the legend)."""
    layers = np.arange(len(summary["layers"]))
    figure = Figure(figsize=(11, 5.8), layout="constrained")
    axes = figure.subplots(2, 3).ravel()
    for ax, (title, name, chance, baseline, unit) in zip(axes, TREND_PANELS, strict=True):
        ax.plot(layers, _layer_values(summary, name), marker="o", color=HIGH_COLOR, label="high-similarity pairs H")
        ax.plot(
            layers,
            _layer_values(summary, chance),
            marker=".",
            ls="--",
            color=CHANCE_COLOR,
            label=CHANCE_LABELS[baseline],
        )
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_xticks(layers)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    figure.supxlabel("layer (mean over heads)", fontsize=9)
    return figure


def same_sentence_figure(summary: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Figure:
    """Same-sentence share vs chance by layer, every head as a dot."""
    share = _heads(arrays, "same_sentence_share")  # [layer, head]
    chance = _layer_values(summary, "same_sentence_chance")
    n_layers, n_heads = share.shape
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    ax = figure.subplots()
    jitter = np.linspace(-0.2, 0.2, n_heads)
    for layer in range(n_layers):
        ax.scatter(layer + jitter, share[layer], s=10, color=HIGH_COLOR, alpha=0.5)
    ax.plot(
        np.arange(n_layers),
        _layer_values(summary, "same_sentence_share"),
        marker="o",
        color=HIGH_COLOR,
        label="layer mean",
    )
    ax.plot(np.arange(n_layers), chance, ls="--", color=CHANCE_COLOR, label=CHANCE_LABELS["same_sentence"])
    ax.set_xticks(np.arange(n_layers))
    ax.set_xlabel("layer (dots: heads)")
    ax.set_ylabel("share of H inside one sentence")
    ax.legend(fontsize=8)
    return figure


def similarity_grid_figure(arrays: Mapping[str, np.ndarray], max_size: int = 64) -> Figure:
    """Layer × head grid of mean context-similarity matrices (each head on its own colour scale)."""
    mean = np.asarray(arrays["mean_similarity"], dtype=float)  # [layer, head, query, key]
    n_layers, n_heads, n, _ = mean.shape
    step = max(1, -(-n // max_size))  # block-average big matrices so the page stays small
    m = n // step
    mean = mean[:, :, : m * step, : m * step].reshape(n_layers, n_heads, m, step, m, step).mean(axis=(3, 5))
    size = 0.95
    figure = Figure(figsize=(size * n_heads + 0.6, size * n_layers + 0.6), layout="constrained")
    axes = figure.subplots(n_layers, n_heads, squeeze=False)
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer, head]
            matrix = mean[layer, head]
            finite = matrix[np.isfinite(matrix)]
            low, high = np.percentile(finite, [2, 98]) if finite.size else (0.0, 1.0)
            ax.imshow(
                matrix, cmap=GRID_CMAP, vmin=low, vmax=high if high > low else low + 1e-9, interpolation="nearest"
            )
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"h{head}", fontsize=7)
            if head == 0:
                ax.set_ylabel(f"L{layer}", fontsize=7)
    # One colour bar for all panels: each head is scaled between its own 2nd and 98th percentile.
    bar = figure.colorbar(
        ScalarMappable(Normalize(0.0, 1.0), cmap=GRID_CMAP), ax=axes, shrink=0.6, ticks=[0.0, 1.0], pad=0.01
    )
    bar.ax.set_yticklabels(["2nd\npercentile", "98th\npercentile"], fontsize=7)
    bar.set_label("mean similarity S, on each head's own scale", fontsize=8)
    figure.suptitle(
        "Mean context-similarity matrix per layer (rows) and head (columns)\n"
        "each head has its own colour scale (its 2nd to 98th percentile): compare shapes, not colours, across heads",
        fontsize=10,
    )
    return figure


def head_heatmaps_figure(arrays: Mapping[str, np.ndarray]) -> Figure:
    """Per-head maps: signal share, noise, same-sentence and repeat shares relative to chance."""
    panels = (
        ("signal share |H∩M|/|H|", _heads(arrays, "signal_share"), "viridis"),
        (
            "same-sentence share − chance",
            _heads(arrays, "same_sentence_share") - _heads(arrays, "same_sentence_chance"),
            "RdBu_r",
        ),
        ("repeat share − chance", _heads(arrays, "repeat_share") - _heads(arrays, "repeat_chance"), "RdBu_r"),
        ("anchor share", _heads(arrays, "anchor_share"), "viridis"),
    )
    n_layers = panels[0][1].shape[0]
    figure = Figure(figsize=(12, 0.32 * n_layers + 2.2), layout="constrained")
    axes = figure.subplots(1, len(panels))
    for ax, (title, values, cmap) in zip(axes, panels, strict=True):
        if cmap == "RdBu_r":
            bound = np.nanmax(np.abs(values)) if np.isfinite(values).any() else 1.0
            image = ax.imshow(values, cmap=cmap, vmin=-bound, vmax=bound, aspect="auto")
        else:
            image = ax.imshow(values, cmap=cmap, aspect="auto")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        figure.colorbar(image, ax=ax, shrink=0.8)
    return figure


def token_label(name: str) -> str:
    """A legend label for a named token: ``[CLS]`` stays, punctuation is quoted and named."""
    shown = display_token(name)
    if shown in PUNCTUATION_NAMES:
        return f"“{shown}” {PUNCTUATION_NAMES[shown]}"
    return shown if shown.startswith(("[", "<")) else f"“{shown}”"


def attention_targets_figure(summary: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Figure:
    """Mean attention received by [CLS]/[SEP]/punctuation, and self/prev/next, by layer, each
    with its chance line; tokens with the same chance share one line (e.g. [CLS] and [SEP],
    once per window each)."""
    names = [str(name) for name in np.asarray(arrays["attention_token_names"]).reshape(-1)]
    received = np.asarray(arrays["attention_to"], dtype=float).mean(axis=1)  # [layer, named]
    chance = np.asarray(arrays["attention_to_chance"], dtype=float)  # [named]
    layers = np.arange(received.shape[0])
    figure = Figure(figsize=(12, 4.0), layout="constrained")
    left, right = figure.subplots(1, 2)
    colors = [TARGET_COLORS[k % len(TARGET_COLORS)] for k in range(len(names))]
    for k, name in enumerate(names):
        left.plot(layers, received[:, k], marker="o", color=colors[k], label=token_label(name))
    for group in _same_value_groups(chance):
        color = colors[group[0]] if len(group) == 1 else CHANCE_COLOR
        who = ", ".join(token_label(names[k]) for k in group)
        left.axhline(chance[group[0]], color=color, ls=":", lw=1.0, label=f"chance of {who}: {chance[group[0]]:.3f}")
    left.set_title("attention received by a token (dotted: its share of positions)", fontsize=9)
    left.set_xlabel("layer")
    left.set_ylabel("mean attention weight received", fontsize=9)
    left.set_xticks(layers)
    left.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    for name, color in (("attention_self", "#1c7ed6"), ("attention_prev", "#e8590c"), ("attention_next", "#2b8a3e")):
        right.plot(layers, _layer_values(summary, name), marker="o", color=color, label=name.split("_")[1])
    n = int(summary.get("seq_len", 0)) or 1
    right.axhline(1.0 / n, color=CHANCE_COLOR, ls=":", lw=1.0, label=f"chance: 1/n = 1/{n}")
    right.set_title("attention to self / previous / next token", fontsize=9)
    right.set_xlabel("layer")
    right.set_ylabel("mean attention weight", fontsize=9)
    right.set_xticks(layers)
    right.legend(fontsize=8)
    return figure


def _same_value_groups(values: np.ndarray) -> list[list[int]]:
    """Indices grouped by equal value (to 1e-9 relative), NaN values left out, in first-seen order."""
    groups: list[list[int]] = []
    for k, value in enumerate(values):
        if not np.isfinite(value):
            continue
        for group in groups:
            if np.isclose(values[group[0]], value, rtol=1e-9, atol=0.0):
                group.append(k)
                break
        else:
            groups.append([k])
    return groups


def study_figures(summary: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Figure]:
    """Every figure of the report by file-friendly name."""
    return {
        "distance_by_layer": distance_figure(arrays),
        "layer_trends": layer_trends_figure(summary),
        "same_sentence": same_sentence_figure(summary, arrays),
        "similarity_grid": similarity_grid_figure(arrays),
        "head_maps": head_heatmaps_figure(arrays),
        "attention_targets": attention_targets_figure(summary, arrays),
    }


def save_figures(
    summary: Mapping[str, Any], arrays: Mapping[str, np.ndarray], folder: Path, prefix: str = "", dpi: int = 80
) -> list[Path]:
    """Write every figure of `study_figures` as ``folder/<prefix><name>.png``; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, figure in study_figures(summary, arrays).items():
        path = folder / f"{prefix}{name}.png"
        path.write_bytes(figure_png(figure, dpi=dpi))
        paths.append(path)
    return paths


LAYER_COLUMNS = (
    ("mean dist. H", "mean_distance_high"),
    ("mean dist. all", "mean_distance_all"),
    ("short H", "short_range_share"),
    ("short chance", "short_range_chance"),
    ("same sent. H", "same_sentence_share"),
    ("same sent. chance", "same_sentence_chance"),
    ("repeat H", "repeat_share"),
    ("repeat chance", "repeat_chance"),
    ("anchor share", "anchor_share"),
    ("anchor chance", "anchor_share_chance"),
    ("signal", "signal_share"),
    ("signal chance", "signal_chance"),
    ("entropy", "attention_entropy"),
)


def _cell(value: Any) -> Any:
    return "–" if value is None else value


def layer_table(summary: Mapping[str, Any]) -> str:
    """The study's per-layer statistics as an HTML table."""
    header = ["layer", *(label for label, _ in LAYER_COLUMNS)]
    rows = [[layer["layer"], *(_cell(layer.get(name)) for _, name in LAYER_COLUMNS)] for layer in summary["layers"]]
    return table(header, rows, numeric_format="{:.3f}")


def anchor_table(summary: Mapping[str, Any], top: int = 3) -> str:
    """Per head: anchor share, its chance, and the most frequent anchor tokens (escaped)."""
    rows = []
    for layer in summary["layers"]:
        for head in layer["heads"]:
            anchors = ", ".join(
                f"{display_token(item['token'])} ({item['count']})" for item in head.get("top_anchor_tokens", [])[:top]
            )
            rows.append(
                [
                    layer["layer"],
                    head["head"],
                    _cell(head.get("anchor_share")),
                    _cell(head.get("anchor_share_chance")),
                    _cell(head.get("repeat_share")),
                    anchors or "–",
                ]
            )
    return table(
        ["layer", "head", "anchor share", "chance", "repeat share", f"top {top} anchor tokens (windows)"],
        rows,
        "{:.3f}",
    )


def build_report(summary: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    """The complete report.html text."""
    figures = study_figures(summary, arrays)
    model = summary.get("model", {})
    model_name = model.get("name") if isinstance(model, Mapping) else model
    config = summary.get("config", {})
    corpus = summary.get("corpus", {})
    meta = {
        "model": f"{model_name} ({summary.get('n_layers')} layers × {summary.get('n_heads')} heads)",
        "windows": summary.get("samples"),
        "tokens per window": summary.get("seq_len"),
        "stride": config.get("stride"),
        "corpus": corpus.get("source"),
        "high-similarity rule": config.get("high"),
        "high-attention set M": f"top {config.get('attention_top_percent')} % of pairs by max(A_ij, A_ji)",
        "short range": f"|i − j| ≤ {config.get('short_range')}",
        "engine": config.get("engine"),
        "elapsed": f"{summary.get('elapsed_s', 0):.0f} s" if summary.get("elapsed_s") is not None else None,
    }
    intro = (
        "<p>Context similarity S = Z Zᵀ of each head's output vectors Z (diagonal zeroed), "
        "aggregated over all windows. H is each matrix's set of high-similarity pairs, M the pairs "
        "with high attention. Every share is shown next to a chance baseline computed from the same "
        "windows; the baselines differ, and each is stated below. Definitions: docs/methods.md "
        "(context similarity) and the docstring of attnflow/corpus/stats.py (the statistics).</p>"
    )
    baselines = table(
        ["statistic", "chance baseline"],
        [
            ["mean distance of H", BASELINES["mean_distance"]],
            ["short-range share", BASELINES["short_range"]],
            ["same-sentence share (pairs of two non-special tokens only)", BASELINES["same_sentence"]],
            ["repeated-token share", BASELINES["repeat"]],
            ["anchor-token share", BASELINES["anchor"]],
            ["signal share |H ∩ M| / |H|", BASELINES["signal"]],
            ["attention received by [CLS], [SEP], punctuation", BASELINES["attention_to"]],
            ["attention to self / previous / next token", BASELINES["attention_position"]],
        ],
    )
    body = [
        intro,
        section("Chance baselines", baselines, "baselines"),
        section("Layer summary", layer_table(summary), "layers"),
        section("Layer trends", figure_img(figures["layer_trends"], "layer trends of shares against chance"), "trends"),
        section(
            "Distance distributions",
            figure_img(figures["distance_by_layer"], "distance histograms by layer"),
            "distance",
        ),
        section(
            "Same-sentence share", figure_img(figures["same_sentence"], "same-sentence share vs chance"), "sentences"
        ),
        section(
            "Mean similarity matrices",
            figure_img(figures["similarity_grid"], "layer by head grid of mean similarity", dpi=80),
            "matrices",
        ),
        section(
            "Signal, noise and specialisation per head", figure_img(figures["head_maps"], "per-head heatmaps"), "heads"
        ),
        section(
            "Attention to special tokens and punctuation",
            figure_img(figures["attention_targets"], "attention received by layer"),
            "attention",
        ),
        section("Anchor tokens", anchor_table(summary), "anchors"),
    ]
    title = f"Corpus study: {model_name}"
    return page(title, "\n".join(body), subtitle="attnflow corpus report", meta=meta, css=_CSS)


_CSS = "table { margin-bottom: 1rem; } section { margin-bottom: 1.5rem; }"
