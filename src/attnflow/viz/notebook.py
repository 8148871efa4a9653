"""The notebook views of the result objects (`attnflow.notebook`: ``_repr_html_``): a small HTML
summary each, no scripts and no figures (``save`` writes the pages), every string escaped.
`PatchResult` has its own (`attnflow.causal.report.report_fragment`), built from the same pieces."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from attnflow.notebook import SHOWN_ITEMS
from attnflow.tokens import display_token
from attnflow.trace import ARRAY_FIELDS
from attnflow.viz.page import esc, meta_table, table

SHOWN_TOKENS = 40  # the tokens a trace's view lists


def fragment(kind: str, meta: Mapping[str, Any], *tables: tuple[str, str]) -> str:
    """``<div class="attnflow-KIND">``: the key/value table ``meta``, then each ``(caption, table
    markup)`` under its escaped caption."""
    parts = [meta_table(meta)] + [f"<p><b>{esc(caption)}</b></p>{markup}" for caption, markup in tables if markup]
    return f'<div class="attnflow-{esc(kind)}">{"".join(parts)}</div>'


def trace_fragment(trace: Any) -> str:
    """A `Trace`: the model and text, its tokens, each captured array's shape and the target."""
    tokens = " ".join(display_token(token) for token in trace.tokens[:SHOWN_TOKENS])
    more = f" … (+{trace.n_tokens - SHOWN_TOKENS})" if trace.n_tokens > SHOWN_TOKENS else ""
    target = trace.target.to_dict() if hasattr(trace.target, "to_dict") else trace.target
    meta = {"model": trace.model_name, "text": trace.text, "tokens": f"{trace.n_tokens}: {tokens}{more}"}
    meta["target"] = target
    shapes = [
        (name, " × ".join(str(size) for size in getattr(trace, name).shape))
        for name in ARRAY_FIELDS
        if getattr(trace, name) is not None
    ]
    return fragment("trace", meta, ("captured arrays", table(["field", "shape"], shapes)))


def routes_fragment(routes: Any) -> str:
    """`Routes`: the prediction, the route's size, its most important input tokens, its strongest
    edges through blocks and its most important components."""
    sources = routes.importance.inputs[0]  # [T]
    inputs = [(routes.token(j), float(sources[j])) for j in np.argsort(-sources)[: 2 * SHOWN_ITEMS] if sources[j] > 0]
    blocks = [edge for edge in routes.edges if not edge.kind.endswith("residual")][: 2 * SHOWN_ITEMS]
    edges = []
    for edge in blocks:
        source, target = routes.token(edge.source[2]), routes.token(edge.target[2])
        edges.append((edge.layer, edge.kind, source, target, edge.weight, edge.importance))
    components = [
        (
            f"L{entry['layer']}.H{entry['head']}" if entry["kind"] == "head" else f"L{entry['layer']} FFN",
            routes.token(entry["position"]),
            float(entry["importance"]),
        )
        for entry in routes.components[: 2 * SHOWN_ITEMS]
    ]
    prediction = routes.prediction
    meta = {
        "model": routes.model_name,
        "text": routes.text,
        "position": routes.token(routes.position),
        "prediction": None if prediction is None else f"{prediction['token']!r} (p = {prediction['probability']:.3f})",
        "route": f"{len(routes.nodes)} nodes, {len(routes.edges)} edges (threshold {routes.threshold:g})",
    }
    return fragment(
        "routes",
        meta,
        ("input tokens by importance", table(["token", "importance"], inputs)),
        ("strongest edges through blocks", table(["layer", "kind", "from", "to", "weight", "importance"], edges)),
        ("components by importance", table(["component", "at", "importance"], components)),
    )


def results_fragment(results: Any) -> str:
    """A run's results (`attnflow.notebook.Results`: audit, evaluate, corpus): the run's scalar
    settings, the headline table of its kind and what each top-level key holds."""
    run = results.get("run") if isinstance(results.get("run"), dict) else results
    meta = {"results of": results.kind, **{key: value for key, value in run.items() if _scalar(value)}}
    headline = {"evaluate": _evaluate_table, "audit": _audit_table}.get(results.kind, lambda _: "")(results)
    keys = [(key, _holds(value)) for key, value in results.items() if key != "run"]
    return fragment(results.kind, meta, ("headline", headline), ("keys", table(["key", "holds"], keys)))


def _evaluate_table(results: Mapping[str, Any]) -> str:
    rows = []
    for method, record in (results.get("methods") or {}).items():
        rows.append(
            (
                method,
                *(_mean(record.get(metric)) for metric in ("comprehensiveness", "sufficiency", "agreement_loo")),
                _mean(record.get("seconds_per_sample")),
            )
        )
    return table(["method", "comprehensiveness", "sufficiency", "agreement with leave-one-out", "s per sample"], rows)


def _audit_table(results: Mapping[str, Any]) -> str:
    rows = [
        (entry.get("class"), entry.get("examples"), ", ".join(str(word["word"]) for word in entry["top_words"][:5]))
        for entry in results.get("classes") or []
        if "top_words" in entry
    ]
    return table(["class", "examples", "top words by mean relevance"], rows)


def _mean(value: Any) -> Any:
    """A metric's mean (a number, or the ``mean`` of its dict); "" when absent."""
    if isinstance(value, dict):
        value = value.get("mean")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def _holds(value: Any) -> str:
    if isinstance(value, dict):
        names = list(value)
        more = ", …" if len(names) > SHOWN_ITEMS else ""
        return f"{len(names)} entries: {', '.join(map(str, names[:SHOWN_ITEMS]))}{more}"
    if isinstance(value, list):
        return f"{len(value)} items"
    return str(value)
