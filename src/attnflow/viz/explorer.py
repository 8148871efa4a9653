"""The explorer page: one self-contained HTML file with inline data and a small vanilla-JS viewer.

Layout of the file:

* a ``<script type="application/json" id="attnflow-meta">`` block: tokens, special mask, offsets,
  the methods (names, what they have, summary sentences, diagnostics) and references to data chunks;
* one ``<script type="application/octet-stream" id="cN">`` block per data chunk: base64 of the
  zlib-deflated bytes of ``scales`` (float32, one per vector along the last axis), ``exact``
  (float32, the vectors' entries in the reference's ``exact_columns``: the special tokens' keys)
  and ``codes`` (int8, one per value: ``value ≈ code × scale / 127``; see `quantize`), all
  little-endian. The page inflates a chunk with the browser's ``DecompressionStream`` when it
  first shows it. Chunks are per layer view, and per head where there are heads: ``[query, key]``
  fused and per-head matrices (one scale per row), ``[pair]`` context similarities of a head (the
  strict upper triangle, row-major: S is symmetric with a zero diagonal; one scale) and their
  mean over heads (what the page shows with the heads fused);
* the viewer script and styles, read from ``viz/assets/explorer.js`` and ``explorer.css``, after
  ``data.js``, the chunk decoder the explorer shares with its generation view
  (`attnflow.viz.generation_explorer`, which builds its page with `interactive_page` too).

The page reaches nothing outside itself: its Content-Security-Policy allows no network at all and
only the one inline script, by its sha256 hash, so a token can never run code even if it were
inserted as markup (the script inserts every token as text, never as HTML).
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from attnflow.methods.diagnostics import COLLAPSE_THRESHOLD, DIFFUSION_THRESHOLD
from attnflow.tokens import display_token
from attnflow.viz.page import esc, faithfulness_badge

if TYPE_CHECKING:
    from attnflow.exploration import Exploration

ASSETS = Path(__file__).parent / "assets"
# Data chunks: codes in [-127, 127] (7 bits of magnitude: on mpnet's attention 8 bits cost 1.25-1.4x
# the bytes); zlib level 6 (the default) is 6x faster than level 9 for 3 % more bytes.
CODE_LEVELS = 127
COMPRESSION_LEVEL = 6


@lru_cache(maxsize=None)
def asset(name: str) -> str:
    """The text of ``viz/assets/NAME`` (the viewer's script and styles)."""
    return (ASSETS / name).read_text(encoding="utf-8")


def content_security_policy(script: str) -> str:
    """No network, no plugins; the one inline script allowed by its sha256 hash; inline styles."""
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )


def quantize(array: np.ndarray, exact_columns: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """7-bit codes of a finite array ``[..., column]``, one scale per vector along the last axis.

    Returns, in the order of a chunk's bytes, ``scales`` (little-endian float32, ``[...]``: the
    largest magnitude of each vector outside the exact columns), ``exact`` (little-endian float32,
    ``[..., len(exact_columns)]``: those columns' entries) and ``codes`` (int8, ``[..., column]``,
    0 in the exact columns). A value decodes as ``code × scale / 127``, off by at most
    ``scale / 254``: 0.4 % of the largest entry of its row, so a row keeps that precision when a
    special token (an exact column) holds most of its mass. An all-zero vector has scale 0.
    """
    array = np.asarray(array, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError("the explorer stores finite values only; this array has NaN or infinite entries")
    exact_columns = list(exact_columns)
    quantized = np.ones(array.shape[-1], dtype=bool)
    quantized[exact_columns] = False
    scales = np.where(quantized, np.abs(array), 0.0).max(axis=-1, initial=0.0).astype("<f4")
    safe = np.where(scales > 0, scales, 1).astype(np.float64)[..., None]
    codes = np.where(quantized, np.clip(np.rint(array / safe * CODE_LEVELS), -CODE_LEVELS, CODE_LEVELS), 0)
    return scales, array[..., exact_columns].astype("<f4"), codes.astype(np.int8)


class Chunks:
    """Collects quantised, deflated base64 chunks and hands out references
    ``{"shape", "split", "chunks", "exact_columns"}``."""

    def __init__(self) -> None:
        self.blocks: list[str] = []

    def add(self, array: np.ndarray, exact_columns: Sequence[int] = (), split: int = 1) -> dict[str, Any]:
        """One chunk per entry of the first ``split`` axes of ``array``, row-major (split 2 on
        ``[view, head, ...]``: chunk ``view × heads + head``), so the page inflates what it shows."""
        shape = np.shape(array)
        ids = []
        for part in np.reshape(array, (-1, *shape[split:])):
            packed = b"".join(np.ascontiguousarray(a).tobytes() for a in quantize(part, exact_columns))
            ids.append(f"c{len(self.blocks)}")
            self.blocks.append(base64.b64encode(zlib.compress(packed, COMPRESSION_LEVEL)).decode("ascii"))
        return {"shape": list(shape), "split": split, "chunks": ids, "exact_columns": list(exact_columns)}

    def html(self) -> str:
        return "\n".join(
            f'<script type="application/octet-stream" id="c{index}">{block}</script>'
            for index, block in enumerate(self.blocks)
        )


def explorer_payload(exploration: "Exploration") -> tuple[dict[str, Any], Chunks]:
    """The metadata (JSON-serialisable) and the data chunks of the page."""
    chunks = Chunks()
    special_columns = np.flatnonzero(exploration.special_mask).tolist()  # kept exact: they often hold most of a row
    methods = []
    for view in exploration.methods:
        entry: dict[str, Any] = {
            "name": view.name,
            "description": view.description,
            "first_layer": view.first_layer,
            "summaries": view.summaries,
            "diagnostics": view.diagnostics,
            "note": view.note,
            "matrices": None if view.matrices is None else chunks.add(view.matrices, special_columns),
            "heads": None if view.head_matrices is None else chunks.add(view.head_matrices, special_columns, split=2),
            "scores": None if view.scores is None else np.asarray(view.scores, dtype=np.float64).tolist(),
            "signed": view.signed,
            "faithfulness": None if view.faithfulness is None else faithfulness_badge(view.faithfulness),
        }
        methods.append(entry)
    similarity = None
    if exploration.similarity is not None:
        n = exploration.n_tokens
        upper = np.triu_indices(n, k=1)
        pairs = exploration.similarity[..., upper[0], upper[1]]  # [layer, head, pair]
        similarity = {"heads": chunks.add(pairs, split=2), "mean": chunks.add(pairs.mean(axis=1))}  # mean: fused
    meta = {
        "model": exploration.model,
        "text": exploration.text,
        "tokens": list(exploration.tokens),
        "display": [display_token(token) for token in exploration.tokens],
        "special": np.asarray(exploration.special_mask, dtype=bool).tolist(),
        "offsets": None if exploration.offsets is None else np.asarray(exploration.offsets).tolist(),
        "n_layers": exploration.n_layers,
        "layer_labels": exploration.layer_labels,  # a hybrid's attention layers: their block indices
        "n_heads": exploration.n_heads,
        "row": exploration.row,
        "causal": exploration.causal,
        "methods": methods,
        "similarity": similarity,
        "skipped": exploration.skipped,
        "opens_on": exploration.opens_on,
        "opened_why": exploration.opened_why,
        "thresholds": {"diffusion": DIFFUSION_THRESHOLD, "collapse": COLLAPSE_THRESHOLD},
    }
    return meta, chunks


def script_json(value: Any) -> str:
    """JSON that is safe inside a ``<script>`` block: ``<``, ``>`` and ``&`` written as escapes."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def explorer_html(exploration: "Exploration") -> str:
    """The complete explorer page."""
    meta, chunks = explorer_payload(exploration)
    return interactive_page(
        title=f"attnflow explorer: {exploration.model or 'model'}",
        subtitle=f"{exploration.n_tokens} tokens · {exploration.n_layers} layers × {exploration.n_heads} heads",
        source=exploration.text,
        script=page_script("explorer.js"),
        style=asset("explorer.css"),
        body=asset("explorer.html"),
        meta=meta,
        chunks=chunks,
    )


def page_script(name: str) -> str:
    """The one inline script of an interactive page: the shared chunk decoder, then ``viz/assets/NAME``."""
    return asset("data.js") + asset(name)


NOSCRIPT = "The explorer needs JavaScript; the static report is <code>attnflow explain</code>."


def interactive_page(
    *,
    title: str,
    subtitle: str,
    source: str,
    script: str,
    style: str,
    body: str,
    meta: Any,
    chunks: Chunks,
    noscript: str | None = None,
) -> str:
    """A self-contained page: header, the ``body`` markup, the metadata block ``attnflow-meta``,
    the data chunks and ``script`` (the only script the Content-Security-Policy allows).
    ``noscript``: the plain text shown without JavaScript (default: the explorer's markup)."""
    warning = NOSCRIPT if noscript is None else esc(noscript)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(content_security_policy(script))}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{style}</style>\n</head>\n<body>\n"
        f'<header><h1>{esc(title)}</h1><p class="subtitle">{esc(subtitle)}</p>'
        f'<p class="source">{esc(source)}</p></header>\n'
        f'<noscript><p class="warning">{warning}</p></noscript>\n'
        f"{body}\n"
        f'<script type="application/json" id="attnflow-meta">{script_json(meta)}</script>\n'
        f"{chunks.html()}\n"
        f"<script>{script}</script>\n</body>\n</html>\n"
    )


def explorer_iframe(exploration: "Exploration", height: int = 1150) -> str:
    """The page inside a sandboxed iframe (see `sandboxed_iframe`)."""
    return sandboxed_iframe(explorer_html(exploration), height)


def sandboxed_iframe(html: str, height: int) -> str:
    """A page inside a sandboxed ``<iframe srcdoc>`` (notebooks: its ids, styles and script stay
    apart from the notebook's and from other pages)."""
    return (
        f'<iframe srcdoc="{esc(html)}" sandbox="allow-scripts" '
        f'style="width: 100%; height: {int(height)}px; border: 1px solid #ddd;"></iframe>'
    )
