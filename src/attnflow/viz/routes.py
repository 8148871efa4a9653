"""The pictures of information flow routes: ``routes.html`` (interactive, self-contained) and
``routes.png`` (the route at its threshold, for papers).

Both draw positions × layers: one column per token, and going up, the stream entering each layer
(``in``) and the stream after its attention block (``mid``), the final stream on top. Every number
comes from `Routes.content` — the content of ``routes.json`` less the whole graph — so the page
shows exactly what ``routes.json`` holds: nothing is recomputed here. The page's threshold slider
reads each node's and edge's ``reach`` (the largest threshold at which it stays on the route), so
moving it shows the route at that threshold without extracting it again.

The page is built with `attnflow.viz.explorer.interactive_page`: no network (its
Content-Security-Policy allows no request), one inline script allowed by its hash, and every token
string reaches the DOM as text (``textContent``), never as HTML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from attnflow.tokens import display_token
from attnflow.viz.explorer import Chunks, asset, interactive_page
from attnflow.viz.page import figure_png
from attnflow.viz.plot import _token_ticks

if TYPE_CHECKING:
    from attnflow.flow_routes.result import Routes

# What the page needs of routes.json (the graph's arrays stay in routes.json).
PAGE_FIELDS = (
    *("model", "text", "tokens", "position", "threshold", "norm"),
    *("prediction", "target", "contrast", "route", "lens", "components"),
)
COLOURS = {"attention": "#d9480f", "ffn": "#2a7f62", "attention_residual": "#9a9a9a", "ffn_residual": "#9a9a9a"}


def routes_payload(routes: "Routes") -> dict[str, Any]:
    """The page's data: those fields of `Routes.content` (the very numbers of ``routes.json``),
    the tokens as a reader sees them, and the graph's sizes."""
    content = routes.content()
    return {
        **{name: content[name] for name in PAGE_FIELDS},
        "display": [display_token(token) for token in routes.tokens],
        "n_layers": routes.n_layers,
        "n_heads": int(routes.graph.heads.shape[1]),
        "contrastive": routes.direct is not None,
    }


def routes_html(routes: "Routes") -> str:
    """The complete ``routes.html``."""
    contrast = f" rather than {routes.contrast['token']!r}" if routes.contrast else ""
    target = f"; target {routes.target['token']!r}{contrast}" if routes.target else ""
    return interactive_page(
        title=f"attnflow routes: {routes.model_name or 'model'}",
        subtitle=f"{len(routes.tokens)} tokens · {routes.n_layers} layers · position {routes.position}{target}",
        source=routes.text,
        script=asset("routes.js"),
        style=asset("explorer.css") + asset("routes.css"),
        body=asset("routes.html"),
        meta=routes_payload(routes),
        chunks=Chunks(),
        noscript="The routes page needs JavaScript; routes.png and routes.json hold the same route.",
    )


def routes_figure(routes: "Routes") -> Figure:
    """The route at its threshold: edges with width by weight (attention orange, feed-forward
    green, residual grey), nodes shaded by importance; tokens along x, streams up the y axis."""
    n_tokens, n_layers = len(routes.tokens), routes.n_layers
    width = float(np.clip(0.55 * n_tokens + 2.5, 6.0, 30.0))
    figure = Figure(figsize=(width, float(np.clip(0.12 * (2 * n_layers + 1) + 1.6, 4.0, 14.0))), layout="constrained")
    axes = figure.subplots()
    by_kind: dict[str, tuple[list, list]] = {kind: ([], []) for kind in COLOURS}
    for edge in sorted(routes.edges, key=lambda edge: edge.weight):  # the strongest drawn last, on top
        segments, widths = by_kind[edge.kind]
        segments.append(_line(edge.kind, edge.source, edge.target))
        widths.append(0.4 + 4.0 * edge.weight)
    for kind, (segments, widths) in by_kind.items():
        if segments:
            axes.add_collection(LineCollection(segments, linewidths=widths, colors=COLOURS[kind], alpha=0.75))
    shade = np.array([value for _, value in routes.nodes])
    axes.scatter(
        [_place(node)[0] for node, _ in routes.nodes],
        [_place(node)[1] for node, _ in routes.nodes],
        s=9,
        c=np.clip(shade, 0, 1),
        cmap="Greys",
        vmin=-0.2,
        vmax=1.0,
        zorder=3,
        edgecolors="black",
        linewidths=0.3,
    )
    names = {"attention": "attention", "ffn": "feed-forward", "ffn_residual": "residual"}
    handles = [Line2D([], [], color=COLOURS[kind], linewidth=2, label=label) for kind, label in names.items()]
    axes.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)
    _token_ticks(axes, "x", routes.tokens)
    rows = np.arange(0, 2 * n_layers + 1, 2 * max(1, n_layers // 8))
    axes.set_yticks(rows, ["emb" if row == 0 else f"L{row // 2 - 1}" for row in rows])
    axes.set_xlim(-0.6, n_tokens - 0.4)
    axes.set_ylim(-0.8, 2 * n_layers + 0.8)
    axes.set_ylabel("residual stream (emb; Ln = leaving layer n)")
    target = f", target {routes.target['token']!r}" if routes.target else ""
    title = f"{routes.model_name}: route of position {routes.position}{target}, threshold {routes.threshold:g}"
    axes.set_title(title, fontsize=10, loc="left", parse_math=False)
    return figure


def _place(node: tuple[str, int, int]) -> tuple[float, float]:
    """A node's (x, y): x its position, y 2·layer for ``in``, 2·layer + 1 for ``mid``."""
    stream, layer, position = node
    return float(position), float(2 * layer + (1 if stream == "mid" else 0))


def _line(kind: str, source: tuple[str, int, int], target: tuple[str, int, int]) -> list[tuple[float, float]]:
    """An edge's polyline: straight, except the two that would lie on a residual edge — the
    feed-forward edge bends right, an attention edge from a position to itself bends left."""
    (x1, y1), (x2, y2) = _place(source), _place(target)
    bend = 0.15 if kind == "ffn" else -0.15 if kind == "attention" and x1 == x2 else 0.0
    if not bend:
        return [(x1, y1), (x2, y2)]
    return [(x1, y1), (x1 + bend, (y1 + y2) / 2), (x2, y2)]


def routes_png(routes: "Routes") -> bytes:
    """``routes.png``."""
    return figure_png(routes_figure(routes), dpi=150)
