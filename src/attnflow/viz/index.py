"""The index page of an `attnflow explain --file` run: one row per text, linking its explanation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from attnflow.tokens import display_token
from attnflow.viz.page import esc, page

if TYPE_CHECKING:
    from attnflow.explanation import Explanation

TEXT_CHARS = 160  # longer texts are shortened on the index (the explanation page has them whole)
TOP_TOKENS = 3

CSS = """
td.text { max-width: 40rem; }
td.warn { color: #7a4b00; }
"""


def index_html(entries: Sequence[tuple[str, "Explanation"]], source: str = "") -> str:
    """A self-contained page listing ``(folder, explanation)`` pairs; every text is escaped and each
    row links ``folder/explanation.html`` and names its method (``auto → gim`` where --method auto
    chose it for that text). Top tokens of signed methods carry their sign (+ for the target,
    − against it); those of non-negative ones (relevance, norms) none. With a model that predicts
    (a classifier, a causal LM), a column shows each text's prediction."""
    from attnflow.targets import ResolvedTarget

    predicts = any(explanation.prediction for _, explanation in entries)
    rows = []
    for folder, explanation in entries:
        text = explanation.text if len(explanation.text) <= TEXT_CHARS else explanation.text[: TEXT_CHARS - 1] + "…"
        notes = (
            f' <span class="warn" title="{esc(" | ".join(explanation.notes))}">(warning)</span>'
            if explanation.notes
            else ""
        )
        prediction = ResolvedTarget(**explanation.prediction).describe() if explanation.prediction else ""
        rows.append(
            f'<tr><td class="num"><a href="{esc(folder)}/explanation.html">{esc(folder)}</a></td>'
            f'<td class="text">{esc(text)}</td>'
            + (f"<td>{esc(prediction)}</td>" if predicts else "")
            + f"<td>{esc(_method(explanation))}</td>"
            + f'<td>{esc(_top_tokens(explanation))}{notes}</td><td class="num">{explanation.n_tokens}</td></tr>'
        )
    explanations = [explanation for _, explanation in entries]
    prediction_header = "<th>prediction</th>" if predicts else ""
    body = (
        f"<table>\n<thead><tr><th>#</th><th>text</th>{prediction_header}<th>method</th>"
        "<th>top tokens (signed methods: + for the target, − against it)</th><th>tokens</th></tr>"
        "</thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"
    )
    methods = {explanation.method for explanation in explanations}
    first = explanations[0] if explanations else None
    meta = {
        "source": source or None,
        "texts": len(entries),
        "model": first.model if first is not None else None,
        "method": _methods(explanations) if explanations else None,
        "options": (
            {k: v for k, v in first.options.items() if v is not None}
            if first is not None and len(methods) == 1
            else None
        ),
    }
    return page(
        "attnflow: explanations",
        body,
        subtitle="one explanation per text; click a number to open it",
        meta=meta,
        css=CSS,
    )


def _method(explanation: "Explanation") -> str:
    return f"auto → {explanation.method}" if explanation.chosen_by else explanation.method


def _methods(explanations: Sequence["Explanation"]) -> str:
    """The run's method for the page's header: ``rollout``, or ``auto (gradient, attnlrp)`` with
    the methods auto chose, in order of first use."""
    chosen = list(dict.fromkeys(explanation.method for explanation in explanations))
    if any(explanation.chosen_by for explanation in explanations):
        return f"auto ({', '.join(chosen)})"
    return ", ".join(chosen)


def _top_tokens(explanation: "Explanation") -> str:
    """``bad +0.800, film +0.100; against: good −0.600`` (signed) or ``bad 0.500, film 0.200``."""
    if not explanation.signed:
        return ", ".join(f"{display_token(token)} {score:.3f}" for _, token, score in explanation.top(TOP_TOKENS))
    supporting = ", ".join(
        f"{display_token(token)} {score:+.3f}" for _, token, score in explanation.top(TOP_TOKENS) if score > 0
    )
    against = ", ".join(f"{display_token(token)} −{-score:.3f}" for _, token, score in explanation.against(1))
    return (supporting or "-") + (f"; against: {against}" if against else "")
