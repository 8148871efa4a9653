"""The contribution graph, route extraction (Ferrando & Voita's Algorithm 1) and importance.

Nodes are residual vectors: ``("in", l, i)``, the stream entering layer l at position i
(``("in", L, i)`` leaves the last layer: the top, what the unembedding reads), and ``("mid", l,
i)``, the stream after layer l's attention block. Edges carry the contributions of
`attnflow.flow_routes.contributions`:

- attention ``("in", l, j) -> ("mid", l, i)``, weight ``attention[l, i, j]`` = Σ_h heads[l, h, i, j];
- attention residual ``("in", l, i) -> ("mid", l, i)``, weight ``attention_residual[l, i]``;
- feed-forward ``("mid", l, i) -> ("in", l + 1, i)``, weight ``ffn[l, i]`` (a mixture of experts:
  Σ_e experts[l, e, i], each chosen expert's share, the shared expert's included);
- feed-forward residual ``("mid", l, i) -> ("in", l + 1, i)``, weight ``ffn_residual[l, i]``.

A parallel block (`Graph.parallel`) has no ``mid`` node: its one whole is ``("in", l + 1, i)``,
and its edges are attention ``("in", l, j) -> ("in", l + 1, i)``, attention residual and
feed-forward ``("in", l, i) -> ("in", l + 1, i)`` (the feed-forward block reads the stream
entering the layer); ``ffn_residual`` and ``ffn_bias`` are 0.

Extraction: from the top node at the chosen position, go down keeping every edge with weight > τ
that leaves a node already reached; the route is the subgraph reached. Importance: 1 at the top; a
node's importance is Σ over its kept edges to reached nodes above of importance(above) × weight.
Every reached node has importance > 0 and every other node 0, so one vectorised pass down the
layers gives both (`compose`). With τ = 0 the same pass is the un-thresholded composition.
Pure numpy: nothing here reads a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_THRESHOLD = 0.04  # τ of Ferrando & Voita


@dataclass
class Graph:
    """The whole contribution graph, before any threshold (``L`` layers, ``H`` heads, ``T`` tokens):
    ``heads [L, H, T, T]`` ``[layer, head, query, key]``, ``attention_residual``,
    ``attention_bias``, ``ffn``, ``ffn_residual``, ``ffn_bias``: ``[L, T]``. For each layer and
    position, the attention block's shares (residual + Σ heads + bias) sum to 1, and so do the
    feed-forward block's (ffn + residual + bias), except for a whole no part comes near (all 0).
    ``parallel``: every block is parallel (one whole per position: attention residual + Σ heads +
    attention bias + ffn sum to 1; no ``mid`` nodes). ``experts [L, E (+ 1), T]``
    ``[layer, expert, position]``: a mixture of experts' shares of each feed-forward whole, per expert
    (0 where it is not chosen; the shared expert's last when ``shared_expert``), summing to ``ffn``;
    None for a plain feed-forward block."""

    heads: np.ndarray
    attention_residual: np.ndarray
    attention_bias: np.ndarray
    ffn: np.ndarray
    ffn_residual: np.ndarray
    ffn_bias: np.ndarray
    parallel: bool = False
    experts: np.ndarray | None = None
    shared_expert: bool = False
    _attention: np.ndarray | None = field(default=None, repr=False)

    @property
    def attention(self) -> np.ndarray:
        """``[L, T, T]`` ``[layer, query, key]``: the attention edges, summed over heads."""
        if self._attention is None:
            self._attention = self.heads.sum(axis=1)
        return self._attention

    @property
    def n_layers(self) -> int:
        return int(self.heads.shape[0])

    def expert_name(self, layer: int, column: int) -> str:
        """``L1.E3`` (layer 1's expert 3), ``L1.S`` (its shared expert): column ``column`` of ``experts``."""
        assert self.experts is not None
        shared = self.shared_expert and column == self.experts.shape[1] - 1
        return f"L{layer}.S" if shared else f"L{layer}.E{column}"

    @property
    def n_tokens(self) -> int:
        return int(self.heads.shape[-1])


@dataclass
class Direct:
    """Contrastive mode: the parts written into the top position's residual stream, by their
    direct effect on logit(A) − logit(B) (`attnflow.flow_routes.lens.direct_effects`): shares of D, the
    sum of the absolute direct effects of every edge and non-edge term of that stream, for the
    attention edges ``attention [L, T]`` (|Σ_h DE(h, j)| / D), each head's part ``heads [L, H, T]``
    (|DE(h, j)| / D) and the feed-forward blocks ``ffn [L]``; the signed effects (logits)
    ``head_effects [L, H, T]``, ``ffn_effects [L]``, ``embedding_effect`` (the stream entering
    the first layer) and ``bias_effect`` (the non-edge terms: biases, the norms' shifts, the
    unembedding's bias). All of them add up to logit(A) − logit(B) at the top position (before any
    soft-capping)."""

    attention: np.ndarray
    heads: np.ndarray
    ffn: np.ndarray
    head_effects: np.ndarray
    ffn_effects: np.ndarray
    embedding_effect: float
    bias_effect: float

    @property
    def total(self) -> float:
        """Σ of every signed direct effect: the logit difference itself."""
        return float(self.head_effects.sum() + self.ffn_effects.sum() + self.embedding_effect + self.bias_effect)


@dataclass
class Composition:
    """Importance of every node and component for one top node: ``inputs [L + 1, T]`` (the stream
    entering each layer; row L the top), ``mids [L, T]``, ``heads [L, H]`` (Σ over the kept
    attention edges of importance(query node) × the head's share), ``ffn [L, T]``, ``experts [L,
    E (+ 1)]`` (a mixture of experts: Σ over the kept feed-forward edges of importance(upper node)
    × the expert's share; None without one)."""

    inputs: np.ndarray
    mids: np.ndarray
    heads: np.ndarray
    ffn: np.ndarray
    experts: np.ndarray | None = None


def check_threshold(threshold: Any) -> float:
    """τ as a float in [0, 1); an InputError (a ValueError) that names the parameter otherwise."""
    from attnflow.errors import InputError

    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise InputError(f"{{threshold}} must be a number in [0, 1), got {threshold!r}", parameter="threshold")
    return float(threshold)


def compose(graph: Graph, position: int | np.ndarray, threshold: float, direct: Direct | None = None) -> Composition:
    """Importance of every node for the top node at ``position``, keeping edges with weight >
    ``threshold`` (see the module docstring). ``direct``: contrastive mode, where the edges into
    the top position's stream are weighted by their share of the direct effect on the logit
    difference, that stream's own residual edges by 1, and its nodes have importance 1.

    ``position`` may also be a weight per position ``[T]`` for a prediction read from several top
    nodes at once (a mean-pooling head: 1 / T each). Which edges are kept does not depend on the
    top, so the composition is linear in it: the weighted sum of the one-position compositions
    (not in contrastive mode, which has one top position)."""
    n_layers, n_heads, n_tokens = graph.n_layers, graph.heads.shape[1], graph.n_tokens
    inputs, mids = np.zeros((n_layers + 1, n_tokens)), np.zeros((n_layers, n_tokens))
    heads, ffn = np.zeros((n_layers, n_heads)), np.zeros((n_layers, n_tokens))
    experts = None if graph.experts is None else np.zeros(graph.experts.shape[:2])
    if isinstance(position, np.ndarray):
        if direct is not None or position.shape != (n_tokens,):
            raise ValueError(f"top weights must be [{n_tokens}] (one per position) and not contrastive")
        inputs[n_layers] = position
        position = -1  # read by the contrastive re-weighting only, which is excluded here
    else:
        inputs[n_layers, position] = 1.0
    for layer in reversed(range(n_layers)):
        weights = layer_weights(graph, layer, position, direct)
        kept = {name: np.where(value > threshold, value, 0.0) for name, value in weights.items()}
        ffn[layer] = inputs[layer + 1] * kept["ffn"]
        if experts is not None:
            experts[layer] = np.where(kept["ffn"] > 0, weights["experts"], 0.0) @ inputs[layer + 1]
        if graph.parallel:  # one whole, the stream leaving the block; the feed-forward edge leaves ("in", l, i)
            whole, through_ffn = inputs[layer + 1], ffn[layer]
        else:
            mids[layer] = ffn[layer] + inputs[layer + 1] * kept["ffn_residual"]
            if direct is not None:
                mids[layer, position] = 1.0
            whole, through_ffn = mids[layer], np.zeros(n_tokens)
        mask = kept["attention"] > 0  # [query, key]
        heads[layer] = np.einsum("i,hij->h", whole, np.where(mask, weights["heads"], 0.0))
        inputs[layer] = whole * kept["attention_residual"] + whole @ kept["attention"] + through_ffn
        if direct is not None:
            inputs[layer, position] = 1.0
    return Composition(inputs, mids, heads, ffn, experts)


@dataclass
class Reach:
    """For every node, the largest threshold at which it stays on the route: the route at any
    τ' ≥ τ is the nodes and edges whose reach exceeds τ' (`reach`). ``inputs [L + 1, T]``,
    ``mids [L, T]``; 0 off the route."""

    inputs: np.ndarray
    mids: np.ndarray


def reach(graph: Graph, position: int, direct: Direct | None = None) -> Reach:
    """Each node's reach: the largest, over the paths from the top node down to it, of the smallest
    edge weight on the path (1 at the top, and in contrastive mode along the top position's
    stream, whose nodes are always on the route). Extraction keeps a node at τ exactly when some
    path to it has every weight > τ, that is when its reach is > τ; an edge is kept at τ when its
    weight and its upper node's reach both are: its reach is the smaller of the two. Routes are
    nested (a higher τ keeps a subset), so one number per node and edge gives the route at every
    τ, with no extraction run again (the page's threshold slider)."""
    n_layers, n_tokens = graph.n_layers, graph.n_tokens
    inputs, mids = np.zeros((n_layers + 1, n_tokens)), np.zeros((n_layers, n_tokens))
    inputs[n_layers, position] = 1.0
    for layer in reversed(range(n_layers)):
        weights = layer_weights(graph, layer, position, direct)
        if graph.parallel:  # one whole, the stream leaving the block; the feed-forward edge leaves ("in", l, i)
            whole, through_ffn = inputs[layer + 1], np.minimum(weights["ffn"], inputs[layer + 1])
        else:
            mids[layer] = np.minimum(np.maximum(weights["ffn"], weights["ffn_residual"]), inputs[layer + 1])
            if direct is not None:
                mids[layer, position] = 1.0
            whole, through_ffn = mids[layer], np.zeros(n_tokens)
        through_attention = np.minimum(weights["attention"], whole[:, None]).max(axis=0)  # over queries
        inputs[layer] = np.maximum.reduce(
            [np.minimum(weights["attention_residual"], whole), through_attention, through_ffn]
        )
        if direct is not None:
            inputs[layer, position] = 1.0
    return Reach(inputs, mids)


def attention_wholes(graph: Graph, composition: Composition | Reach, layer: int) -> np.ndarray:
    """``[T]`` the nodes that layer ``layer``'s attention edges lead to, as ``composition`` holds
    them: the ``mid`` nodes, or (a parallel block) the nodes leaving the layer."""
    return composition.inputs[layer + 1] if graph.parallel else composition.mids[layer]


def layer_weights(graph: Graph, layer: int, position: int, direct: Direct | None) -> dict[str, np.ndarray]:
    """One layer's edge weights; contrastive mode re-weights the edges into the top position."""
    weights = {
        "heads": graph.heads[layer].astype(np.float64),  # [H, query, key]
        "attention": graph.attention[layer].astype(np.float64),  # [query, key]
        "attention_residual": graph.attention_residual[layer].astype(np.float64),
        "ffn": graph.ffn[layer].astype(np.float64),
        "ffn_residual": graph.ffn_residual[layer].astype(np.float64),
    }
    if graph.experts is not None:
        weights["experts"] = graph.experts[layer].astype(np.float64)  # [expert, position]
    if direct is not None:
        if graph.experts is not None:  # the experts keep their proportions of the re-weighted edge
            share = weights["ffn"][position]
            weights["experts"][:, position] *= direct.ffn[layer] / share if share > 0 else 0.0
        weights["heads"][:, position] = direct.heads[layer]
        weights["attention"][position] = direct.attention[layer]
        weights["attention_residual"][position] = 1.0
        weights["ffn"][position] = direct.ffn[layer]
        weights["ffn_residual"][position] = 1.0
    return weights


@dataclass
class Edge:
    """One kept edge: ``kind`` (``attention``, ``attention_residual``, ``ffn``, ``ffn_residual``),
    ``layer``, from the node ``source`` to the node ``target`` (``(stream, layer, position)``,
    stream ``"in"`` or ``"mid"``), its ``weight``, the importance it carries down,
    importance(target) × weight, and its ``reach`` (the largest threshold that keeps it: `reach`);
    attention edges also each head's share (``heads [H]``), feed-forward edges of a mixture of
    experts each expert's (``experts``: `Graph.expert_name` -> share, the chosen ones only).
    ``effects``: what `attnflow.routes` adds for a language model (direct effects, the tokens it
    promotes; docs/routes.md)."""

    kind: str
    layer: int
    source: tuple[str, int, int]
    target: tuple[str, int, int]
    weight: float
    importance: float
    heads: list[float] | None = None
    experts: dict[str, float] | None = None
    reach: float = 0.0
    effects: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind,
            "layer": self.layer,
            "source": list(self.source),
            "target": list(self.target),
            "weight": self.weight,
            "importance": self.importance,
            "reach": self.reach,
        }
        if self.heads is not None:
            data["heads"] = self.heads
        if self.experts is not None:
            data["experts"] = self.experts
        return data | self.effects


def kept_edges(
    graph: Graph,
    composition: Composition,
    position: int,
    threshold: float,
    direct: Direct | None = None,
    reached: Reach | None = None,
) -> list[Edge]:
    """The edges of the route: weight > ``threshold`` and leaving a reached node above, strongest
    importance first, each with its reach (``reached``: the nodes' `reach`, computed if None)."""
    edges: list[Edge] = []
    reached = reach(graph, position, direct) if reached is None else reached
    for layer in range(graph.n_layers):
        weights = layer_weights(graph, layer, position, direct)
        above, whole = composition.inputs[layer + 1], attention_wholes(graph, composition, layer)
        # a parallel block has no mid node: its edges join the streams entering and leaving the layer
        upper, feeds = (("in", layer + 1), ("in", layer)) if graph.parallel else (("mid", layer), ("mid", layer))
        for i in map(int, np.flatnonzero(above > 0)):
            for kind in ("ffn", "ffn_residual"):
                weight = float(weights[kind][i])
                if weight > threshold:
                    edge = Edge(kind, layer, (*feeds, i), ("in", layer + 1, i), weight, float(above[i] * weight))
                    if kind == "ffn" and graph.experts is not None:
                        chosen = np.flatnonzero(weights["experts"][:, i])
                        edge.experts = {
                            graph.expert_name(layer, int(e)): float(weights["experts"][e, i]) for e in chosen
                        }
                    edges.append(edge)
        for i in map(int, np.flatnonzero(whole > 0)):
            weight = float(weights["attention_residual"][i])
            if weight > threshold:
                edges.append(
                    Edge("attention_residual", layer, ("in", layer, i), (*upper, i), weight, float(whole[i] * weight))
                )
            for j in map(int, np.flatnonzero(weights["attention"][i] > threshold)):
                weight = float(weights["attention"][i, j])
                shares = [float(share) for share in weights["heads"][:, i, j]]
                edges.append(
                    Edge("attention", layer, ("in", layer, j), (*upper, i), weight, float(whole[i] * weight), shares)
                )
    for edge in edges:
        stream, layer, i = edge.target
        edge.reach = min(edge.weight, float((reached.inputs if stream == "in" else reached.mids)[layer, i]))
    return sorted(edges, key=lambda edge: -edge.importance)


def route_nodes(composition: Composition) -> list[tuple[tuple[str, int, int], float]]:
    """``((stream, layer, position), importance)`` of every reached node, most important first (on
    a tie, the higher node first)."""
    nodes = []
    for stream, importance in (("in", composition.inputs), ("mid", composition.mids)):
        nodes += [
            ((stream, int(layer), int(i)), float(importance[layer, i])) for layer, i in np.argwhere(importance > 0)
        ]
    return sorted(nodes, key=lambda node: (-node[1], -node[0][1], node[0][0] != "in", node[0][2]))
