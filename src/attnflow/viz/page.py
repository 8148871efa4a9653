"""Building blocks of attnflow's self-contained HTML pages (explanations, study reports).

Every page is one file that renders offline: styles are inline, figures are embedded as base64
``data:`` URIs, and a Content-Security-Policy forbids scripts and any network fetch, so a page
opened from disk never reaches out and an escaped-away token can never run. Every string that
comes from data (tokens, texts, model names, option values) goes through `esc` — callers build
markup only from escaped pieces.

Typical use::

    from attnflow.viz.page import esc, figure_img, page, section, table
    body = section("Figures", figure_img(fig, alt="rollout matrix"))
    html = page("My report", body, meta={"model": "minilm"})
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any, Iterable, Mapping, Sequence

# No scripts, no remote resources: images only from data: URIs, styles only inline.
# Signed scores: orange supports the target, blue speaks against it (RGB, for rgba(…, alpha)).
ORANGE = "217,72,15"
BLUE = "33,102,172"
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"

BASE_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto;
       max-width: 1100px; padding: 0 1rem; color: #1d1d1f; background: #fff; line-height: 1.45; }
h1 { font-size: 1.5rem; margin-bottom: .2rem; }
h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
.subtitle { color: #666; margin-top: 0; }
table { border-collapse: collapse; font-size: .9rem; }
th, td { border: 1px solid #ddd; padding: .25rem .6rem; text-align: left; vertical-align: top; }
th { background: #f5f5f7; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img.figure { max-width: 100%; height: auto; border: 1px solid #eee; }
code { background: #f5f5f7; padding: 0 .2rem; border-radius: 3px; }
footer { margin-top: 3rem; color: #888; font-size: .8rem; }
"""


def esc(value: Any) -> str:
    """Escape any value for HTML text or a quoted attribute (``&``, ``<``, ``>``, ``"``, ``'``)."""
    return html.escape(str(value), quote=True)


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` for PNG bytes."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def figure_png(figure: Any, dpi: int = 110) -> bytes:
    """Render a matplotlib Figure to PNG bytes (no pyplot, no display needed)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def image_png(image: Any) -> bytes:
    """Encode a PIL image as PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def img(png: bytes, alt: str, css_class: str = "figure") -> str:
    """An ``<img>`` element embedding PNG bytes."""
    return f'<img class="{esc(css_class)}" alt="{esc(alt)}" src="{png_data_uri(png)}">'


def figure_img(figure: Any, alt: str, dpi: int = 110) -> str:
    """An ``<img>`` element embedding a matplotlib Figure."""
    return img(figure_png(figure, dpi=dpi), alt)


def section(title: str, body_html: str, section_id: str | None = None) -> str:
    """A titled ``<section>``; ``body_html`` must already be markup built from escaped pieces."""
    id_attr = f' id="{esc(section_id)}"' if section_id else ""
    return f"<section{id_attr}>\n<h2>{esc(title)}</h2>\n{body_html}\n</section>\n"


def table(
    header: Sequence[Any] | None,
    rows: Iterable[Sequence[Any]],
    numeric_format: str = "{:.4g}",
) -> str:
    """An HTML table (no header row when ``header`` is None); every cell is escaped, numbers
    are formatted and right-aligned."""
    head = "<thead><tr>" + "".join(f"<th>{esc(cell)}</th>" for cell in header) + "</tr></thead>" if header else ""
    body = []
    for row in rows:
        cells = []
        for cell in row:
            if isinstance(cell, float) or (hasattr(cell, "dtype") and getattr(cell, "ndim", 1) == 0):
                cells.append(f'<td class="num">{esc(numeric_format.format(float(cell)))}</td>')
            elif isinstance(cell, int) and not isinstance(cell, bool):
                cells.append(f'<td class="num">{cell}</td>')
            else:
                cells.append(f"<td>{esc(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table>\n{head}\n<tbody>\n" + "\n".join(body) + "\n</tbody>\n</table>"


def meta_table(meta: Mapping[str, Any]) -> str:
    """A two-column key/value table (values shown with ``str``; ``None`` entries are skipped)."""
    return table(None, ((key, _plain(value)) for key, value in meta.items() if value is not None))


def page(
    title: str,
    body_html: str,
    *,
    subtitle: str | None = None,
    meta: Mapping[str, Any] | None = None,
    css: str = "",
    footer: str | None = None,
) -> str:
    """A complete, self-contained HTML document.

    ``title``, ``subtitle``, ``meta`` and ``footer`` are plain text (escaped here); ``body_html``
    and ``css`` are trusted markup built by the caller from escaped pieces.
    """
    parts = [f"<h1>{esc(title)}</h1>"]
    if subtitle:
        parts.append(f'<p class="subtitle">{esc(subtitle)}</p>')
    if meta:
        parts.append(meta_table(meta))
    parts.append(body_html)
    parts.append(f"<footer>{esc(footer or _default_footer())}</footer>")
    body = "\n".join(parts)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{BASE_CSS}{css}</style>\n</head>\n"
        f"<body>\n{body}\n</body>\n</html>\n"
    )


def _plain(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(item) for item in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{key}={_plain(item)}" for key, item in value.items())
    return str(value)


def _default_footer() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"Made with attnflow {version('attnflow')}; renders offline, no scripts."
    except PackageNotFoundError:
        return "Made with attnflow; renders offline, no scripts."


def faithfulness_badge(faithfulness: dict[str, Any]) -> str:
    """``comprehensiveness 0.41, NAOPC 0.83 (random 0.12) · sufficiency 0.05, NAOPC 0.10 (random
    0.30)``: the per-input AOPC of an explanation, its normalised AOPC where the input's bounds
    differ, and random rankings' AOPC (`attnflow.evaluate.per_input`; higher and lower are better,
    respectively)."""
    mine, chance = faithfulness, faithfulness["random"]

    def normalised(metric: str) -> str:
        value = mine.get(f"naopc_{metric}")
        return "" if value is None else f", NAOPC {value:.2f}"

    return (
        f"comprehensiveness {mine['aopc_comprehensiveness']:.2f}{normalised('comprehensiveness')} "
        f"(random {chance['aopc_comprehensiveness']:.2f})"
        f" · sufficiency {mine['aopc_sufficiency']:.2f}{normalised('sufficiency')} "
        f"(random {chance['aopc_sufficiency']:.2f})"
    )
