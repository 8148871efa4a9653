"""Matplotlib figures of an Explanation; headless (no pyplot, no display, no GUI backend).

Figures are built with `matplotlib.figure.Figure` directly, so nothing here touches pyplot's
global state or needs a display; ``fig.savefig(path)`` works anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from attnflow.tokens import display_token
from attnflow.viz.page import faithfulness_badge

if TYPE_CHECKING:
    from attnflow.explanation import Explanation

MAX_LABELLED_TOKENS = 64  # beyond this, axes show positions instead of token strings
MAX_LABEL_CHARS = 16
SPECIAL_COLOR = "#9e9e9e"
SCORE_COLOR = "#d9480f"
AGAINST_COLOR = "#2166ac"  # signed scores below 0
SATURATION_PERCENTILE = 99  # patch colour scales saturate above this percentile (see patch_color_range)


def plot_explanation(explanation: "Explanation") -> Figure:
    """Text: token-score bars above the matrix heatmap. Image: overlay, patch grid, matrix."""
    if explanation.grid is not None:
        return _plot_image_explanation(explanation)
    n = explanation.n_tokens
    width = float(np.clip(0.3 * n + 2.5, 7.0, 16.0))
    if explanation.matrix is None:  # attribution-only method: the scores alone
        figure = Figure(figsize=(width, 3.6), layout="constrained")
        bars_axes = figure.subplots()
        plot_scores(bars_axes, explanation.tokens, explanation.scores, explanation.special_mask, explanation.signed)
        bars_axes.set_title(f"{explanation.method} scores (one per token)", loc="left")
        figure.suptitle(_title(explanation), fontsize=11, parse_math=False)
        return figure
    figure = Figure(figsize=(width, width * 0.55 + 3.2), layout="constrained")
    bars_axes, matrix_axes = figure.subplots(2, 1, height_ratios=(1, 2.6))
    plot_scores(bars_axes, explanation.tokens, explanation.scores, explanation.special_mask, explanation.signed)
    bars_axes.set_title(f"{explanation.method} saliency, row = {explanation.row}", loc="left")
    plot_matrix(matrix_axes, explanation.matrix, explanation.tokens, row=explanation.row)
    figure.suptitle(_title(explanation), fontsize=11, parse_math=False)
    return figure


def matrix_figure(explanation: "Explanation") -> Figure:
    """The ``[query, key]`` matrix alone, as a heatmap."""
    size = float(np.clip(0.22 * explanation.n_tokens + 3.0, 5.5, 11.0))
    figure = Figure(figsize=(size + 1.2, size), layout="constrained")
    if explanation.matrix is None:
        raise ValueError(f"{explanation.method} gives one score per token and no matrix to draw")
    plot_matrix(figure.subplots(), explanation.matrix, explanation.tokens, row=explanation.row)
    return figure


def plot_scores(
    axes: Any, tokens: Sequence[str], scores: np.ndarray, special_mask: np.ndarray | None = None, signed: bool = False
) -> None:
    """Bar plot of one score per token; special tokens grey. ``signed``: bars below 0 (evidence
    against the target) blue, above 0 orange, and a line at 0."""
    n = len(tokens)
    special = np.zeros(n, dtype=bool) if special_mask is None else np.asarray(special_mask, dtype=bool)
    colors = [
        SPECIAL_COLOR if is_special else AGAINST_COLOR if score < 0 else SCORE_COLOR
        for is_special, score in zip(special, scores, strict=True)
    ]
    axes.bar(np.arange(n), scores, color=colors, width=0.8)
    axes.set_xlim(-0.6, n - 0.4)
    axes.set_ylabel("signed score (> 0: for the target)" if signed else "score")
    if signed:
        axes.axhline(0.0, color="#555", linewidth=0.8)
    # Special tokens ([CLS], [SEP]) often dwarf the words: scale to the words, label clipped bars.
    regular = scores[~special]
    if regular.size and regular.max() > 0 and scores.max() > 1.5 * regular.max():
        ceiling = 1.3 * float(regular.max())
        axes.set_ylim(min(0.0, 1.1 * float(scores.min())), ceiling)
        for index in np.flatnonzero(scores > ceiling):
            axes.text(
                index,
                ceiling * 0.97,
                f"{scores[index]:.2f}",
                ha="center",
                va="top",
                fontsize=7,
                color="white",
                rotation=90,
                parse_math=False,
            )
        axes.set_ylabel("score (clipped)")
    axes.spines[["top", "right"]].set_visible(False)
    _token_ticks(axes, "x", tokens)


def plot_matrix(axes: Any, matrix: np.ndarray, tokens: Sequence[str], row: Any = None) -> None:
    """Heatmap of a ``[query, key]`` matrix (square-root colour scale, so small shares show);
    the saliency row, when it is a single row, is outlined."""
    matrix = np.asarray(matrix, dtype=np.float64)
    n = matrix.shape[0]
    vmax = float(matrix.max()) if matrix.size and matrix.max() > 0 else 1.0
    image = axes.imshow(matrix, cmap="viridis", norm=PowerNorm(0.5, vmin=0.0, vmax=vmax), interpolation="nearest")
    axes.figure.colorbar(image, ax=axes, shrink=0.85, label="share (sqrt scale)")
    axes.set_xlabel("key (input token)")
    axes.set_ylabel("query (output position)")
    _token_ticks(axes, "x", tokens)
    _token_ticks(axes, "y", tokens)
    index = {"cls": 0, "last": n - 1}.get(row, row) if not isinstance(row, bool) else None
    if isinstance(index, (int, np.integer)):
        index = int(index) % n
        axes.add_patch(Rectangle((-0.5, index - 0.5), n, 1, fill=False, edgecolor="#ff4d4d", linewidth=1.5))


def overlay_image(
    image_path: str,
    patch_scores: np.ndarray,
    alpha: float = 0.55,
    cmap: str = "inferno",
    box: Sequence[float] | None = None,
) -> Any:
    """Blend ``[rows, cols]`` patch scores (scaled by `patch_color_range`, upsampled bilinearly)
    over the image, or over its region ``box = (left, top, right, bottom)`` (the part the model
    saw, e.g. a centre crop); returns a PIL RGB image of that region's size."""
    from PIL import Image

    with Image.open(image_path) as opened:
        base = opened.convert("RGB")
    if box is not None:
        left, top, right, bottom = (round(edge) for edge in box)
        base = base.crop((left, top, right, bottom))
    grid = np.asarray(patch_scores, dtype=np.float32)
    low, high = patch_color_range(grid)
    grid = np.clip((grid - low) / (high - low), 0.0, 1.0) if high > low else np.zeros_like(grid)
    heat = Image.fromarray(grid).resize(base.size, Image.Resampling.BILINEAR)  # mode "F"
    colored = colormaps[cmap](np.clip(np.asarray(heat), 0.0, 1.0))[..., :3]  # [height, width, rgb]
    return Image.blend(base, Image.fromarray((colored * 255).astype(np.uint8)), alpha)


def patch_color_range(patch_scores: np.ndarray) -> tuple[float, float]:
    """``(low, high)`` of the colour scale for patch scores: the minimum and the 99th percentile.

    A few patches can hold far more than the rest — DINOv2 without registers routes attention to
    high-norm "artifact" patches in low-information regions (Darcet et al. 2023) — and a max-scaled
    map would show only them; above the 99th percentile the colour saturates (at most ~3 of 256
    patches), and figures mark it on the colour bar.
    """
    scores = np.asarray(patch_scores, dtype=np.float64)
    return float(scores.min()), float(np.percentile(scores, SATURATION_PERCENTILE))


def _plot_image_explanation(explanation: "Explanation") -> Figure:
    has_image = explanation.image is not None
    has_matrix = explanation.matrix is not None
    columns = 1 + has_image + has_matrix
    figure = Figure(figsize=(5.0 * columns, 5.0), layout="constrained")
    axes = list(np.atleast_1d(figure.subplots(1, columns)))
    if has_image:
        overlay_axes = axes.pop(0)
        overlay_axes.imshow(np.asarray(explanation.overlay()))
        overlay_axes.set_title(f"{_title(explanation)} saliency over the image", parse_math=False)
        overlay_axes.axis("off")
    grid_axes = axes[0]
    assert explanation.grid is not None, "an image figure needs the patch grid"
    patch_scores = explanation.patch_scores
    assert patch_scores is not None
    low, high = patch_color_range(patch_scores)
    top = max(high, low + 1e-12)
    patches = grid_axes.imshow(patch_scores, cmap="inferno", interpolation="nearest", vmin=low, vmax=top)
    saturated = high < float(patch_scores.max())
    label = f"score (saturates above the {SATURATION_PERCENTILE}th percentile)" if saturated else "score"
    figure.colorbar(patches, ax=grid_axes, shrink=0.8, label=label, extend="max" if saturated else "neither")
    rows, cols = explanation.grid
    grid_axes.set_title(f"patch grid {rows}x{cols}, row = {explanation.row}")
    grid_axes.set_xticks([])
    grid_axes.set_yticks([])
    if explanation.matrix is not None:
        plot_matrix(axes[1], explanation.matrix, explanation.tokens, row=explanation.row)
    if not has_image:
        axes[-1].set_title(_title(explanation), parse_math=False)
    return figure


def _token_ticks(axes: Any, axis: str, tokens: Sequence[str]) -> None:
    n = len(tokens)
    if n > MAX_LABELLED_TOKENS:
        return  # the default locator shows positions
    labels = [_shorten(display_token(token)) for token in tokens]
    fontsize = 9 if n <= 24 else 7 if n <= 40 else 6
    # parse_math=False: a token such as "$x$" is shown as typed, never as mathtext.
    if axis == "x":
        axes.set_xticks(
            np.arange(n), labels, rotation=60, ha="right", rotation_mode="anchor", fontsize=fontsize, parse_math=False
        )
    else:
        axes.set_yticks(np.arange(n), labels, fontsize=fontsize, parse_math=False)


def _shorten(label: str) -> str:
    return label if len(label) <= MAX_LABEL_CHARS else label[: MAX_LABEL_CHARS - 1] + "…"


def _title(explanation: "Explanation") -> str:
    model = f"{explanation.model}: " if explanation.model else ""
    target = ""
    if explanation.target is not None:
        from attnflow.targets import ResolvedTarget

        target = f" — explains {ResolvedTarget(**explanation.target).describe()}"
    title = f"{model}{explanation.method}{target}"
    if explanation.faithfulness is not None:
        title += f"\nfaithfulness on this input: {faithfulness_badge(explanation.faithfulness)}"
    return title


def deletion_curves_figure(names: Sequence[str], curves: Sequence[dict[str, Any]]) -> Figure:
    """The faithfulness benchmark's deletion curves: one line per method (``curves[i]`` holds
    ``x``, ``mean`` and ``se`` of method ``names[i]``), ± one standard error shaded; ``random``
    dashed black. The legend sits beside the plot, never over the curves."""
    figure = Figure(figsize=(9, 4.5), layout="constrained")  # the layout makes room for the legend
    axis = figure.add_subplot()
    palette = colormaps["tab20"]
    for index, (name, curve) in enumerate(zip(names, curves, strict=True)):
        x, mean, se = (np.asarray(curve[key]) for key in ("x", "mean", "se"))
        colour = "black" if name == "random" else palette(index % 20)  # distinct colours for up to 20 methods
        axis.plot(x, mean, label=name, color=colour, linestyle="--" if name == "random" else "-")
        axis.fill_between(x, mean - se, mean + se, alpha=0.12, color=colour)
    axis.set_xlabel("fraction of content tokens removed (most relevant first)")
    axis.set_ylabel("probability of the predicted class")
    axis.set_title("Deletion curves (lower is better)")
    figure.legend(fontsize=7, ncol=1 + len(names) // 16, loc="outside right upper")
    return figure


def metrics_figure(
    names: Sequence[str], summaries: Sequence[dict[str, Any]], metrics: Sequence[tuple[str, str]]
) -> Figure:
    """Horizontal bars of each method's mean ± standard error, one panel per ``(metric, title)``
    (``summaries[i][metric]`` holds ``mean`` and ``se`` of method ``names[i]``); ``random`` grey."""
    figure = Figure(figsize=(4 * len(metrics), 0.3 * len(names) + 1.5))
    axes = figure.subplots(1, len(metrics), sharey=True, squeeze=False)[0]
    for axis, (metric, title) in zip(axes, metrics, strict=True):
        means = [summary[metric]["mean"] for summary in summaries]
        errors = [summary[metric]["se"] for summary in summaries]
        colours = ["0.5" if name == "random" else "C0" for name in names]
        axis.barh(range(len(names)), means, xerr=errors, color=colours, capsize=2)
        axis.set_title(title)
    axes[0].set_yticks(range(len(names)), names)
    axes[0].invert_yaxis()
    figure.tight_layout()
    return figure
