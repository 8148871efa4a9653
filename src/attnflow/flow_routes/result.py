"""`Routes`: what `attnflow.routes` returns, its JSON form (``routes.json``) and its summary lines."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import numpy as np

from attnflow.flow_routes.graph import Composition, Direct, Edge, Graph, Reach
from attnflow.staging import staged_output
from attnflow.tokens import display_token

OUTPUT_FILE = "routes.json"
OUTPUT_FILES = (OUTPUT_FILE, "routes.html", "routes.png")  # what `Routes.save` writes
LENS_MODES = ("route", "all", "none")  # the nodes the logit lens reads (see `attnflow.flow_routes.api.routes`)
# The page and the figure, from attnflow.viz (which reads a Routes; this module imports no view): the
# package root connects them.
_VIEWS: dict[str, Callable[..., Any]] = {}
DIGITS = 6  # decimals kept of the arrays in routes.json (shares and importances lie in [0, 1])
SIGNIFICANT = 6  # significant digits kept of every other number (probabilities, logits, effects)
SEPARATORS = (",", ":")  # routes.json without spaces
Node = tuple[str, int, int]


def is_routes_file(name: str) -> bool:
    """Whether a folder entry is what `Routes.save` writes."""
    return name in OUTPUT_FILES


@dataclass
class Routes:
    """The information flow routes of one prediction (``L`` layers, ``H`` heads, ``T`` tokens).

    Attributes:
        model_name, text, tokens (``T`` token strings), token_ids ``[T]``.
        position: the top node's position; threshold: τ; norm: p of the proximity's ‖·‖_p.
        graph: the whole contribution graph before any threshold (`attnflow.flow_routes.graph.Graph`:
            ``heads [L, H, T, T]`` ``[layer, head, query, key]``, ``attention [L, T, T]``,
            ``attention_residual``, ``attention_bias``, ``ffn``, ``ffn_residual``, ``ffn_bias``
            ``[L, T]``).
        importance: the route's composition (`Composition`: ``inputs [L + 1, T]`` the stream
            entering each layer, row L the top; ``mids [L, T]``; ``heads [L, H]``; ``ffn [L, T]``);
            > 0 exactly on the route. importance_full: the same with τ = 0 (every edge).
        nodes: ``((stream, layer, position), importance)`` of the route's nodes, most important
            first (stream ``"in"``: entering the layer; ``"mid"``: after its attention block).
        edges: the route's edges (`Edge`), most important first; each with its reach and, for a
            language model, the direct effects of the edges through blocks and the tokens the
            most important of them promote (docs/routes.md).
        reach: every node's reach (`Reach`): the route at a threshold τ' ≥ τ is the nodes and
            edges whose reach exceeds τ'.
        prediction: the model's top token at ``position`` (``id``, ``token``, ``probability``);
            target / contrast: ``id``, ``token``, ``logit``, ``probability``, ``rank`` there. None
            for models without a language-model head (so are the lens and the effects).
        head_effects ``[L, H, T]`` / ffn_effects ``[L, T]``: each head's and each feed-forward
            block's direct effect on the target's logit at each position.
        direct: contrastive mode, the direct effects on logit(target) − logit(contrast) along the
            top position's stream (`Direct`), else None.
        lens: node -> its logit-lens readout (``top`` tokens; the target's and contrast's
            ``rank``, ``probability``, ``logit``).
        components: the most important heads and feed-forward blocks: ``kind``, ``layer``,
            (``head``), ``position``, ``importance``, ``importance_full``, ``effect`` on the
            target's logit (contrastive mode, at the top position: ``contrast_effect`` on the
            logit difference), the tokens it ``promotes`` and ``suppresses``.
        seconds: the time of the forward pass (with the checks before it), the graph, the route
            (extraction and importance) and the lens (with the components' descriptions).
    """

    model_name: str
    text: str
    tokens: list[str]
    token_ids: np.ndarray
    position: int
    threshold: float
    norm: int
    graph: Graph
    importance: Composition
    importance_full: Composition
    nodes: list[tuple[Node, float]]
    edges: list[Edge]
    prediction: dict[str, Any] | None = None
    target: dict[str, Any] | None = None
    contrast: dict[str, Any] | None = None
    head_effects: np.ndarray | None = None
    ffn_effects: np.ndarray | None = None
    direct: Direct | None = None
    lens: dict[Node, dict[str, Any]] = field(default_factory=dict)
    components: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    reach: Reach | None = None

    @property
    def n_layers(self) -> int:
        return self.graph.n_layers

    @property
    def top(self) -> Node:
        """The top node: the stream leaving the last layer at ``position``."""
        return ("in", self.n_layers, self.position)

    def __repr__(self) -> str:
        """One line (the graph's arrays are for `to_dict` and the page): the model, the top position,
        the prediction, the route's size and its most important input tokens."""
        from attnflow.notebook import SHOWN_ITEMS, compact_repr

        sources = self.importance.inputs[0]  # [T]: the importance of each input token
        top = [j for j in np.argsort(-sources)[:SHOWN_ITEMS] if sources[j] > 0]
        predicted = self.prediction
        prediction = None if predicted is None else f"{predicted['token']!r} p={predicted['probability']:.3f}"
        return compact_repr(
            "Routes",
            {
                "model": self.model_name,
                "position": self.token(self.position),
                "prediction": prediction,
                "layers": self.n_layers,
                "heads": self.graph.heads.shape[1],
                "nodes": len(self.nodes),
                "edges": len(self.edges),
                "inputs": "[" + ", ".join(f"{self.token(j)} {sources[j]:.3f}" for j in top) + "]",
            },
        )

    def _repr_html_(self) -> str:
        """In a notebook: the prediction, the route's size, the most important input tokens, the
        strongest edges and components (`save` writes the interactive page and the figure)."""
        from attnflow.notebook import view

        return view("routes", self)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready Python objects: the content of ``routes.json`` (numbers: the
        arrays rounded to 6 decimals, every other number to 6 significant digits)."""
        return self.content() | {"graph": {"layers": [self._layer(layer) for layer in range(self.n_layers)]}}

    def content(self) -> dict[str, Any]:
        """``routes.json`` but the graph's layers (the bulk: L·H·T² numbers)."""
        reach = self.reach
        nodes = [
            {
                "node": list(node),
                "importance": value,
                **(
                    {}
                    if reach is None
                    else {"reach": float((reach.inputs if node[0] == "in" else reach.mids)[node[1:]])}
                ),
            }
            for node, value in self.nodes
        ]
        return {
            "model": self.model_name,
            "text": self.text,
            "tokens": list(self.tokens),
            "token_ids": [int(i) for i in self.token_ids],
            "position": self.position,
            "threshold": self.threshold,
            "norm": self.norm,
            "parallel": self.graph.parallel,
            "prediction": _significant(self.prediction),
            "target": _significant(self.target),
            "contrast": _significant(self.contrast),
            "route": _significant({"nodes": nodes, "edges": [edge.to_dict() for edge in self.edges]}),
            "importance": _composition(self.importance),
            "importance_full": _composition(self.importance_full),
            "direct_effects": None
            if self.head_effects is None or self.ffn_effects is None
            else {"heads": _numbers(self.head_effects), "ffn": _numbers(self.ffn_effects)},
            "contrastive": None if self.direct is None else _direct(self.direct),
            "lens": _significant([{"node": list(node), **readout} for node, readout in self.lens.items()]),
            "components": _significant(self.components),
            "seconds": _significant(self.seconds),
        }

    def _layer(self, layer: int) -> dict[str, Any]:
        graph = self.graph
        per_layer = ("attention_residual", "attention_bias", "ffn", "ffn_residual", "ffn_bias")
        return {
            "heads": _numbers(graph.heads[layer]),
            "attention": _numbers(graph.attention[layer]),
            **{name: _numbers(getattr(graph, name)[layer]) for name in per_layer},
        }

    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write ``directory/routes.json``, ``routes.html`` (the interactive page) and
        ``routes.png`` (the route, for papers) together, atomically; earlier ones are replaced only
        with ``overwrite=True`` (FileExistsError otherwise). Returns the path of routes.json."""
        directory = Path(directory)
        with staged_output(directory, is_routes_file, overwrite) as scratch:
            with open(scratch / OUTPUT_FILE, "w", encoding="utf-8") as handle:
                self.write_json(handle)
            (scratch / "routes.html").write_text(_VIEWS["html"](self), encoding="utf-8")
            (scratch / "routes.png").write_bytes(_VIEWS["png"](self))
        return directory / OUTPUT_FILE

    def write_json(self, handle: TextIO) -> None:
        """``routes.json`` to a text stream, compactly (no spaces), the graph one layer at a time
        (never the whole graph as Python objects at once)."""
        head = json.dumps(self.content() | {"graph": None}, separators=SEPARATORS)
        assert head.endswith(',"graph":null}')  # the last key
        handle.write(head[: -len("null}")] + '{"layers":[')
        for layer in range(self.n_layers):
            handle.write(("," if layer else "") + json.dumps(self._layer(layer), separators=SEPARATORS))
        handle.write("]}}")

    def to_json(self) -> str:
        """``routes.json`` as a string."""
        buffer = io.StringIO()
        self.write_json(buffer)
        return buffer.getvalue()

    def token(self, position: int) -> str:
        """The token at ``position`` as a reader sees it, with its position."""
        return f"{display_token(self.tokens[position])!r}({position})"

    def summary(self, count: int = 5) -> str:
        """A few console lines: the prediction, the route's size, the most important input tokens and
        nodes off the top position, the strongest edges through blocks, the most important heads and
        feed-forward blocks with what they promote, and the lens at the top node."""
        lines = [self._prediction_line()]
        lines.append(
            f"route (threshold {self.threshold:g}, norm {self.norm}): {len(self.nodes)} nodes, {len(self.edges)} edges"
        )
        sources = self.importance.inputs[0]
        ranked = [j for j in np.argsort(-sources)[:count] if sources[j] > 0]
        lines.append("input tokens by importance: " + ", ".join(f"{self.token(j)} {sources[j]:.3f}" for j in ranked))
        aside = [(node, value) for node, value in self.nodes if node[2] != self.position][:count]
        if aside:
            named = (f"{stream} L{layer} {self.token(i)} {value:.3f}" for (stream, layer, i), value in aside)
            lines.append("nodes off the top position by importance: " + ", ".join(named))
        blocks = [edge for edge in self.edges if not edge.kind.endswith("residual")]
        lines.append("strongest edges through attention and feed-forward blocks:")
        lines += [f"  {self._edge_line(edge)}" for edge in blocks[:count]]
        for kind, title in (("head", "heads"), ("ffn", "feed-forward blocks")):
            chosen = [entry for entry in self.components if entry["kind"] == kind][:count]
            if chosen:
                lines.append(f"top {title} by importance:")
                lines += [f"  {self._component_line(entry)}" for entry in chosen]
        lines += self._lens_lines(count)
        return "\n".join(lines)

    def _prediction_line(self) -> str:
        where = f"position {self.token(self.position)}"
        if self.prediction is None:
            return f"route of the representation at {where} (no language-model head: no prediction)"
        line = f"prediction at {where}: {self.prediction['token']!r} (p = {self.prediction['probability']:.3f})"
        if self.target is not None and self.target["id"] != self.prediction["id"]:
            line += (
                f"; target {self.target['token']!r} (rank {self.target['rank']}, p = {self.target['probability']:.3f})"
            )
        if self.contrast is not None and self.target is not None and self.direct is not None:
            difference = self.target["logit"] - self.contrast["logit"]
            line += (
                f"; contrastive route: {self.target['token']!r} rather than {self.contrast['token']!r} "
                f"(logit difference {difference:+.3f})"
            )
        return line

    def _edge_line(self, edge: Edge) -> str:
        where = f"L{edge.layer} {edge.kind}"
        if edge.kind == "attention":
            heads = np.argsort(-np.asarray(edge.heads or []))[:3]
            named = ", ".join(f"H{h} {edge.heads[h]:.2f}" for h in heads if edge.heads and edge.heads[h] > 0)
            return (
                f"{where} {self.token(edge.source[2])} -> {self.token(edge.target[2])}: weight {edge.weight:.3f}, "
                f"importance {edge.importance:.3f} ({named})"
            )
        return f"{where} at {self.token(edge.target[2])}: weight {edge.weight:.3f}, importance {edge.importance:.3f}"

    def _component_line(self, entry: dict[str, Any]) -> str:
        name = f"L{entry['layer']}.H{entry['head']}" if entry["kind"] == "head" else f"L{entry['layer']} FFN"
        line = f"{name} at {self.token(entry['position'])}: importance {entry['importance']:.3f}"
        if "effect" in entry and self.target is not None:
            line += f", direct effect on {self.target['token']!r} {entry['effect']:+.3f}"
        if "contrast_effect" in entry and self.contrast is not None:
            line += f", on the logit difference {entry['contrast_effect']:+.3f}"
        if "promotes" in entry:
            line += "; promotes " + ", ".join(repr(token["token"]) for token in entry["promotes"])
            line += "; suppresses " + ", ".join(repr(token["token"]) for token in entry["suppresses"])
        return line

    def _lens_lines(self, count: int) -> list[str]:
        readout = self.lens.get(self.top)
        if readout is None:
            return []
        tops = ", ".join(f"{token['token']!r} {token['probability']:.3f}" for token in readout["top"][:count])
        lines = [f"lens at the top node: {tops}"]
        first = self.first_top_stream()
        if first is not None and self.target is not None:
            lines.append(f"the target {self.target['token']!r} is the lens's top token {self._from_stream(first)}")
        return lines

    def first_top_stream(self) -> int | None:
        """The first stream down the top position (0: entering layer 0, l + 1: leaving layer l) from
        which on the logit lens's top token is the target in every stream up to the top, or None
        (no lens there, or the target is not the top token even at the top)."""
        ranks = [
            self.lens.get(("in", layer, self.position), {}).get("target", {}).get("rank")
            for layer in range(self.n_layers + 1)
        ]
        return next((layer for layer in range(len(ranks)) if all(rank == 0 for rank in ranks[layer:])), None)

    def _from_stream(self, first: int) -> str:
        """Where the lens's top token stays the target, from the stream entering layer ``first`` on,
        named as `attnflow patch --versus` names residual rows (``Ln``: leaving layer n)."""
        last = self.n_layers - 1
        if first == 0:
            return "in every stream, from the embeddings on"
        if first == self.n_layers:
            return f"only in the final stream (leaving layer {last}, L{last})"
        return f"from the stream leaving layer {first - 1} (L{first - 1}) on"


def _significant(value: Any) -> Any:
    """``value`` with every float rounded to `SIGNIFICANT` significant digits (dicts and lists walked)."""
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT}g}")
    if isinstance(value, dict):
        return {key: _significant(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_significant(item) for item in value]
    return value


def _numbers(array: np.ndarray) -> Any:
    return np.round(np.asarray(array, dtype=np.float64), DIGITS).tolist()


def _arrays(source: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: _numbers(getattr(source, name)) for name in names}


def _composition(composition: Composition) -> dict[str, Any]:
    return _arrays(composition, ("inputs", "mids", "heads", "ffn"))


def _direct(direct: Direct) -> dict[str, Any]:
    return {
        **_arrays(direct, ("attention", "heads", "ffn", "head_effects", "ffn_effects")),
        "embedding_effect": direct.embedding_effect,
        "bias_effect": direct.bias_effect,
        "total": direct.total,
    }
