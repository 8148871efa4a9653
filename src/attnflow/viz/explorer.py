"""The explorer page: one self-contained HTML file with inline data and a small vanilla-JS viewer.

Layout of the file:

* a ``<script type="application/json" id="attnflow-meta">`` block: tokens, special mask, offsets,
  the methods (names, what they have, summary sentences, diagnostics) and references to data chunks;
* one ``<script type="application/octet-stream" id="cN">`` block per data chunk: base64 of
  little-endian float16 values divided by the chunk's scale (its largest magnitude, kept in the
  metadata), so no value overflows float16 and the page decodes a chunk only when it shows it.
  Chunks are per layer view: ``[query, key]`` fused matrices, ``[head, query, key]`` per-head
  matrices, and ``[head, pair]`` context similarities (the strict upper triangle, row-major: S is
  symmetric with a zero diagonal);
* the viewer script and styles, read from ``viz/assets/explorer.js`` and ``explorer.css``.

The page reaches nothing outside itself: its Content-Security-Policy allows no network at all and
only the one inline script, by its sha256 hash, so a token can never run code even if it were
inserted as markup (the script inserts every token as text, never as HTML).
"""

from __future__ import annotations

import base64
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from attnflow.methods.diagnostics import COLLAPSE_THRESHOLD, DIFFUSION_THRESHOLD
from attnflow.methods.summary import clean_token
from attnflow.viz.html import faithfulness_badge
from attnflow.viz.page import esc

if TYPE_CHECKING:
    from attnflow.exploration import Exploration

ASSETS = Path(__file__).parent / "assets"


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


class _Chunks:
    """Collects float16 base64 chunks and hands out references ``{"shape", "chunks", "scales"}``."""

    def __init__(self) -> None:
        self.blocks: list[str] = []

    def add(self, array: np.ndarray) -> dict[str, Any]:
        """One chunk per entry of the leading axis of ``array`` (``[view, ...]``)."""
        array = np.asarray(array, dtype=np.float64)
        ids, scales = [], []
        for part in array:
            scale = float(np.max(np.abs(part))) if part.size else 0.0
            scale = scale if scale > 0 and np.isfinite(scale) else 1.0
            encoded = np.asarray(part / scale, dtype="<f2").tobytes()
            ids.append(f"c{len(self.blocks)}")
            scales.append(scale)
            self.blocks.append(base64.b64encode(encoded).decode("ascii"))
        return {"shape": list(array.shape), "chunks": ids, "scales": scales}

    def html(self) -> str:
        return "\n".join(
            f'<script type="application/octet-stream" id="c{index}">{block}</script>'
            for index, block in enumerate(self.blocks)
        )


def explorer_payload(exploration: "Exploration") -> tuple[dict[str, Any], _Chunks]:
    """The metadata (JSON-serialisable) and the data chunks of the page."""
    chunks = _Chunks()
    methods = []
    for view in exploration.methods:
        entry: dict[str, Any] = {
            "name": view.name,
            "description": view.description,
            "first_layer": view.first_layer,
            "summaries": view.summaries,
            "diagnostics": view.diagnostics,
            "note": view.note,
            "matrices": None if view.matrices is None else chunks.add(view.matrices),
            "heads": None if view.head_matrices is None else chunks.add(view.head_matrices),
            "scores": None if view.scores is None else np.asarray(view.scores, dtype=np.float64).tolist(),
            "signed": view.signed,
            "faithfulness": None if view.faithfulness is None else faithfulness_badge(view.faithfulness),
        }
        methods.append(entry)
    similarity = None
    if exploration.similarity is not None:
        n = exploration.n_tokens
        upper = np.triu_indices(n, k=1)
        similarity = chunks.add(exploration.similarity[..., upper[0], upper[1]])  # [layer, head, pair]
    meta = {
        "model": exploration.model,
        "text": exploration.text,
        "tokens": list(exploration.tokens),
        "display": [clean_token(token) for token in exploration.tokens],
        "special": np.asarray(exploration.special_mask, dtype=bool).tolist(),
        "offsets": None if exploration.offsets is None else np.asarray(exploration.offsets).tolist(),
        "n_layers": exploration.n_layers,
        "n_heads": exploration.n_heads,
        "row": exploration.row,
        "causal": exploration.causal,
        "methods": methods,
        "similarity": similarity,
        "skipped": exploration.skipped,
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
    script = asset("explorer.js")
    title = f"attnflow explorer: {exploration.model or 'model'}"
    shape = f"{exploration.n_tokens} tokens · {exploration.n_layers} layers × {exploration.n_heads} heads"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(content_security_policy(script))}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{asset('explorer.css')}</style>\n</head>\n<body>\n"
        f'<header><h1>{esc(title)}</h1><p class="subtitle">{esc(shape)}</p>'
        f'<p class="source">{esc(exploration.text)}</p></header>\n'
        '<noscript><p class="warning">The explorer needs JavaScript; the static report is '
        "<code>attnflow explain</code>.</p></noscript>\n"
        f"{asset('explorer.html')}\n"
        f'<script type="application/json" id="attnflow-meta">{script_json(meta)}</script>\n'
        f"{chunks.html()}\n"
        f"<script>{script}</script>\n</body>\n</html>\n"
    )


def explorer_iframe(exploration: "Exploration", height: int = 1150) -> str:
    """The page inside a sandboxed ``<iframe srcdoc>`` (notebooks: its ids, styles and script
    stay apart from the notebook's and from other explorers)."""
    return (
        f'<iframe srcdoc="{esc(explorer_html(exploration))}" sandbox="allow-scripts" '
        f'style="width: 100%; height: {int(height)}px; border: 1px solid #ddd;"></iframe>'
    )
