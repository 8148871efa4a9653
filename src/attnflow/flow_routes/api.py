"""`attnflow.routes(model, text, ...)` -> `Routes`: the information flow routes of one prediction,
from one forward pass (definitions: docs/routes.md).

One forward pass records every residual stream (`attnflow.flow_routes.forward`); each layer's two
blocks (a parallel block: one) are split into their parts and every part's contribution to its whole is measured
(`attnflow.flow_routes.contributions`), checking on the way that the parts add up to the model's own
streams; the route is extracted top-down and every node gets its importance
(`attnflow.flow_routes.graph`); the logit lens reads the route's nodes and the direct effects of the
heads and feed-forward blocks (`attnflow.flow_routes.lens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnflow.errors import InputError
from attnflow.flow_routes import contributions as parts
from attnflow.flow_routes.forward import (
    PRECISION,
    ExpertParts,
    Layer,
    Recording,
    Weights,
    check_supported,
    layer_view,
    read_weights,
    record,
)
from attnflow.flow_routes.graph import (
    DEFAULT_THRESHOLD,
    Composition,
    Direct,
    Edge,
    Graph,
    attention_wholes,
    check_threshold,
    compose,
    kept_edges,
    layer_weights,
    reach,
    route_nodes,
)
from attnflow.flow_routes.lens import LENS_CHUNK, Lens, promotes, readouts
from attnflow.flow_routes.result import LENS_MODES, Routes
from attnflow.model_like import ModelLike
from attnflow.targets import Target, legacy_target

Node = tuple[str, int, int]


@dataclass
class _Fields:
    """Readout fields ``[T, d]`` (`Lens.readout_field`): of the target's logit and, in contrastive
    mode, of logit(A) − logit(B), with that difference's non-edge term (`Lens.shift_effect`)."""

    target: torch.Tensor | None = None
    contrast: torch.Tensor | None = None
    contrast_shift: float = 0.0


def routes(
    model: ModelLike,
    text: str,
    position: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    target: Target | int | str | None = None,
    contrast: int | str | None = None,
    *,
    norm: int = 1,
    lens: str = "route",
    top_k: int = 5,
    components: int = 10,
) -> Routes:
    """The information flow routes of ``model`` on ``text`` (see `Routes` for what it holds).

    Args:
        position: the top node's position (default: the last, the one predicting the next token;
            negative positions count from the end).
        threshold: τ in [0, 1): the route keeps the edges with weight > τ (0.04, Ferrando & Voita's).
        target: the token whose logit the lens and the direct effects read, a `attnflow.targets.Target`
            (or a single-token string or an id; default: the prediction at ``position``); models with a
            language-model head only. With its contrast (``Target(" Paris", contrast=" Rome")``) the
            edges into the top position's stream are kept by their share of the direct effect on
            logit(target) − logit(contrast). ``contrast=``: deprecated, the contrast in the ``target``.
        norm: p of the proximity's ‖·‖_p (1, the paper's, or 2).
        lens: the nodes the logit lens reads: ``"route"`` (the route's nodes and every node of
            the top position), ``"all"`` (every node: cost grows as layers × tokens × vocabulary),
            ``"none"``.
        top_k: tokens listed per lens readout and per promoted/suppressed list.
        components: how many heads and how many feed-forward blocks, the most important, are
            described (importance, direct effect, what they promote and suppress).
    """
    wanted = legacy_target(target, None, contrast, "routes")
    clock = _Clock()
    threshold = check_threshold(threshold)
    _check_options(model, norm, lens, top_k, components)
    input_ids, tokens = tokenise(model, text)
    position = _position(position, len(tokens))
    weights = read_weights(model)
    the_lens = _lens(model, weights, wanted)
    recording = record(model, input_ids)
    clock.lap("forward")
    final = recording.inputs[-1]
    tokens_read = _targets(model, the_lens, final[position], wanted)
    fields = _fields(the_lens, final, tokens_read.target_id, tokens_read.contrast_id)
    graph, effects, direct = _build(recording, weights, position, norm, fields, the_lens)
    clock.lap("graph")
    importance, reached = compose(graph, position, threshold, direct), reach(graph, position, direct)
    result = Routes(
        model_name=model.name,
        text=text,
        tokens=tokens,
        token_ids=input_ids[0].numpy(),
        position=position,
        threshold=threshold,
        norm=norm,
        graph=graph,
        importance=importance,
        importance_full=compose(graph, position, 0.0, direct),
        nodes=route_nodes(importance),
        edges=kept_edges(graph, importance, position, threshold, direct, reached),
        reach=reached,
        prediction=tokens_read.prediction,
        target=tokens_read.target,
        contrast=tokens_read.contrast,
        head_effects=effects[0],
        ffn_effects=effects[1],
        direct=direct,
    )
    clock.lap("route")
    if the_lens is not None and tokens_read.target_id is not None:
        result.lens = _lens_readouts(
            model, recording, the_lens, result, lens, tokens_read.target_id, tokens_read.contrast_id, top_k
        )
        _describe_edges(model.tokenizer, recording, weights, the_lens, result, fields, top_k)
    result.components = _components(model, recording, weights, the_lens, result, components, top_k)
    clock.lap("lens")
    result.seconds = clock.laps
    return result


def prediction_importance(
    model: ModelLike,
    text: str,
    row: Any,
    threshold: float = DEFAULT_THRESHOLD,
    *,
    norm: int = 1,
    corrupt: str | None = None,
) -> np.ndarray:
    """``[L + 1, T]`` the importance of every residual node ``("in", l, j)`` — row 0 the stream
    entering the first layer, row l + 1 the stream leaving layer l — for the prediction a model
    reads at its saliency ``row`` (``model.default_row``): ``"last"``, ``"cls"`` or a position
    give that position's top node; ``"mean"`` (a mean-pooling head) gives the pooled vector, the
    mean of the last layer's nodes, whose parts (1/T)·x_i are weighed as every other whole's parts
    are, by their normalised proximity to it (docs/causal.md). The route keeps the edges above
    ``threshold``, as `routes` does. No lens, no contrast: what `attnflow.causal.versus` compares
    with activation patching.

    ``corrupt``: a counterfactual text of the same token length; each node's importance is then
    weighted by how much of it differs between the two runs, ‖x(l, j) − x̃(l, j)‖ / ‖x(l, j)‖
    (`counterfactual_weights`): a node matters to patching when the prediction reads it *and* the
    corruption changed it (docs/causal.md, "Routes with the counterfactual")."""
    threshold = check_threshold(threshold)
    _check_options(model, norm, "none", 1, 1)
    input_ids, tokens = tokenise(model, text)
    recording = record(model, input_ids)
    graph, _, _ = _build(recording, read_weights(model), len(tokens) - 1, norm, _Fields(), None)
    importance = compose(graph, _top(recording.inputs[-1], row, norm), threshold).inputs  # [L + 1, T]
    if corrupt is None:
        return importance
    return importance * counterfactual_weights(model, recording, corrupt)


def counterfactual_weights(model: ModelLike, recording: Recording, corrupt: str) -> np.ndarray:
    """``[L + 1, T]`` the share of each residual node that the corruption changes, ‖x − x̃‖ / ‖x‖:
    ``recording`` the clean run's, x̃ the stream of ``corrupt`` (same token length) at the same
    node (0 where the stream is unchanged, as at every position before the first changed token
    of a decoder)."""
    corrupt_ids, _ = tokenise(model, corrupt)
    clean = recording.inputs.to(torch.float64)  # [L + 1, T, d]
    if corrupt_ids.shape[1] != clean.shape[1]:
        raise InputError(
            f"the text is {clean.shape[1]} tokens and the corrupt text {corrupt_ids.shape[1]}: routes with a "
            "counterfactual compare node by node and need the same token length",
            parameter="corrupt",
        )
    other = record(model, corrupt_ids).inputs.to(torch.float64)
    changed = (clean - other).norm(dim=-1) / clean.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
    return changed.cpu().numpy()


@dataclass
class RouteImportance:
    """What `route_importance` returns for one prediction (``L`` layers, ``H`` heads, ``T`` tokens):
    the ``tokens`` and ``token_ids [T]``; ``importance`` and ``importance_full``, the same
    `Composition` as `Routes.importance` and `Routes.importance_full` (heads ``[L, H]``,
    feed-forward blocks ``[L, T]``, nodes); ``attentions [L, H, T, T]`` ``[layer, head, query,
    key]``, the attention weights of the same forward pass (float32); ``prediction``: the model's top
    next token there (``id``, ``token``, ``probability``, as `Routes.prediction`), None for a model
    without a language-model head."""

    tokens: list[str]
    token_ids: np.ndarray
    importance: Composition
    importance_full: Composition
    attentions: np.ndarray
    prediction: dict[str, Any] | None = None


def route_importance(
    model: ModelLike, text: str, threshold: float = DEFAULT_THRESHOLD, *, norm: int = 1
) -> RouteImportance:
    """The importance of every node, head and feed-forward block for the prediction at the last
    position of ``text``, with the route at ``threshold`` and with every edge — exactly
    `routes(model, text, threshold=threshold, norm=norm)`'s ``importance`` and
    ``importance_full`` — and the attention weights of the same forward pass, without the route's
    edges, reach, lens and descriptions: what `attnflow routes --data` adds up over a dataset."""
    threshold = check_threshold(threshold)
    _check_options(model, norm, "none", 1, 1)
    input_ids, tokens = tokenise(model, text)
    recording = record(model, input_ids)
    position = len(tokens) - 1
    weights = read_weights(model)
    graph, _, _ = _build(recording, weights, position, norm, _Fields(), None)
    nothing = legacy_target(None, None, None, "route_importance")
    predicted = _targets(model, _lens(model, weights, nothing), recording.inputs[-1][position], nothing)
    return RouteImportance(
        tokens=tokens,
        token_ids=input_ids[0].numpy(),
        importance=compose(graph, position, threshold),
        importance_full=compose(graph, position, 0.0),
        attentions=recording.attentions.cpu().numpy(),
        prediction=predicted.prediction,
    )


def _top(final: torch.Tensor, row: Any, p: int) -> int | np.ndarray:
    """The top node's position for a saliency row, or the top weights of a mean-pooled prediction."""
    n_tokens = final.shape[0]
    if row == "mean":
        parts_of_mean = final.to(PRECISION) / n_tokens  # [T, d]
        nearness = parts.proximity(parts_of_mean.sum(0), parts_of_mean, p).cpu().numpy()  # [T]
        total = nearness.sum()
        return nearness / total if total > 0 else np.zeros(n_tokens)
    return _position({"last": n_tokens - 1, "cls": 0}.get(row, row), n_tokens)


class _Clock:
    """Seconds of each step: ``lap(name)`` records the time since the previous lap."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self._last = now - self._last, now


def _check_options(model: ModelLike, norm: Any, lens: Any, top_k: Any, components: Any) -> None:
    check_supported(model)
    if norm not in parts.NORMS or isinstance(norm, bool):
        raise InputError(f"{{norm}} must be one of {parts.NORMS}, got {norm!r}", parameter="norm")
    if lens not in LENS_MODES:
        raise InputError(f"{{lens}} must be one of {', '.join(LENS_MODES)}, got {lens!r}", parameter="lens")
    for name, value in (("top_k", top_k), ("components", components)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{{{name}}} must be an integer >= 1, got {value!r}", parameter=name)


def tokenise(model: ModelLike, text: Any) -> tuple[torch.Tensor, list[str]]:
    """``input_ids [1, T]`` and the token strings; an empty text or one over the model's context
    is refused (no truncation: a route over a cut text would explain another text)."""
    from attnflow.capture.texts import check_texts

    (text,) = check_texts(text)
    if model.tokenizer is None:
        raise InputError(f"{model.name} reads no text: information-flow routes explain texts")
    input_ids = model.tokenizer(text, return_tensors="pt", verbose=False)["input_ids"]  # too long: our own error
    if input_ids.shape[1] > model.max_length:
        raise InputError(
            f"the text is {input_ids.shape[1]} tokens: more than {model.name} reads ({model.max_length}); shorten it"
        )
    return input_ids, model.tokenizer.convert_ids_to_tokens(input_ids[0].tolist())


def _position(position: Any, n_tokens: int) -> int:
    if position is None:
        return n_tokens - 1
    if (
        isinstance(position, bool)
        or not isinstance(position, (int, np.integer))
        or not -n_tokens <= position < n_tokens
    ):
        raise InputError(
            f"{{position}} must be an integer in [{-n_tokens}, {n_tokens - 1}] for {n_tokens} tokens, got {position!r}",
            parameter="position",
        )
    return int(position) % n_tokens


def _lens(model: ModelLike, weights: Weights, target: Target) -> Lens | None:
    """The logit lens of a model with a language-model head; None (and no target or contrast
    allowed) for the others."""
    if weights.final_norm is None or weights.final_norm_module is None or weights.unembedding is None:
        if target.given:
            raise InputError(
                f"{model.name} has no language-model head: its routes have no target or contrast; drop them "
                "({target}, {contrast})",
                parameter=("target", "contrast"),
            )
        return None
    return Lens(weights.final_norm_module, weights.final_norm, weights.unembedding, weights.softcap)


def _targets(model: ModelLike, lens: Lens | None, top: torch.Tensor, target: Target) -> _Tokens:
    """The model's prediction at the top node and the target and contrast tokens there (the target
    defaults to the prediction); empty for models without a language-model head."""
    if lens is None:
        return _Tokens()
    objective = target.objective(model)
    logits = lens.logits(top[None])[0]
    probabilities = logits.softmax(dim=-1)
    predicted = int(logits.argmax())
    target_id = predicted if objective.fixed_index is None else objective.fixed_index
    if objective.contrast_index == target_id:
        raise InputError(
            f"the {{contrast}} {target.contrast!r} is the target itself: choose another token", parameter="contrast"
        )

    def describe(index: int) -> dict[str, Any]:
        return {
            "id": index,
            "token": model.tokenizer.decode([index]),
            "logit": float(logits[index]),
            "probability": float(probabilities[index]),
            "rank": int((logits > logits[index]).sum()),
        }

    found = _Tokens(describe(predicted), describe(target_id), target_id)
    if objective.contrast_index is not None:
        found.contrast, found.contrast_id = describe(objective.contrast_index), objective.contrast_index
    return found


@dataclass
class _Tokens:
    """The prediction, the target and the contrast (`Routes.prediction`, ...) and their ids."""

    prediction: dict[str, Any] | None = None
    target: dict[str, Any] | None = None
    target_id: int | None = None
    contrast: dict[str, Any] | None = None
    contrast_id: int | None = None


def _fields(lens: Lens | None, final: torch.Tensor, target: int | None, contrast: int | None) -> _Fields:
    if lens is None or target is None:
        return _Fields()
    final = final.to(PRECISION)
    fields = _Fields(target=lens.readout_field(final, lens.direction(target)))
    if contrast is not None:
        fields.contrast = lens.readout_field(final, lens.direction(target, contrast))
        fields.contrast_shift = lens.shift_effect(target, contrast)
    return fields


def linearised_blocks(layer: Layer) -> tuple[parts.Linearised, parts.Linearised]:
    """One layer's attention and feed-forward blocks, their norms linearised on this input."""
    attention = parts.linearise_attention(
        layer.inputs, layer.attention_output, layer.output_bias, layer.attention_norm, layer.attention_norm_first
    )
    ffn = parts.linearise_ffn(layer.mid, layer.ffn_output, layer.ffn_norm)
    if layer.gates is None:
        return attention, ffn
    return parts.gated(attention, *layer.gates[:3]), parts.gated(ffn, *layer.gates[3:])


def _build(
    recording: Recording, weights: Weights, position: int, p: int, fields: _Fields, lens: Lens | None
) -> tuple[Graph, tuple[np.ndarray | None, np.ndarray | None], Direct | None]:
    """Every layer's contributions (the `Graph`), the direct effects on the target's logit
    (``[L, H, T]`` per head, ``[L, T]`` per feed-forward block) and, in contrastive mode, the
    direct effects along the top position's stream (`Direct`)."""
    n_layers, n_heads, n_tokens = recording.attentions.shape[:3]
    heads = np.empty((n_layers, n_heads, n_tokens, n_tokens), dtype=np.float32)
    per_position = {name: np.empty((n_layers, n_tokens), dtype=np.float32) for name in _PER_POSITION}
    head_effects = np.zeros((n_layers, n_heads, n_tokens)) if fields.target is not None else None
    ffn_effects = np.zeros((n_layers, n_tokens)) if fields.target is not None else None
    contrastive = _ContrastiveSums(n_layers, n_heads, n_tokens) if fields.contrast is not None else None
    moe = recording.experts
    shared = moe is not None and moe[0].shared is not None
    experts = None if moe is None else np.zeros((n_layers, moe[0].n_experts + shared, n_tokens), dtype=np.float32)
    for index in range(n_layers):
        layer = layer_view(recording, weights, index)
        block, ffn_block = linearised_blocks(layer)
        raw = parts.head_outputs(layer.attention, layer.values, layer.output_weights, layer.factors)  # [T, H, d]
        head_parts = block.part(raw)
        vectors = parts.head_vectors(layer.values, layer.output_weights, layer.factors)  # [T, H, d] or per query
        ffn_part = ffn_block.part(layer.ffn_output)
        expert_table = None if experts is None else experts[index]
        shares = _layer_shares(layer, index, (block, head_parts, vectors), (ffn_block, ffn_part), p, expert_table)
        heads[index] = shares[0].cpu().numpy()
        for name, value in zip(_PER_POSITION, shares[1:], strict=True):
            per_position[name][index] = value.cpu().numpy()
        if head_effects is not None and ffn_effects is not None and fields.target is not None:
            head_effects[index] = torch.einsum("ihd,id->hi", head_parts, fields.target).cpu().numpy()
            ffn_effects[index] = (ffn_part * fields.target).sum(-1).cpu().numpy()
        if contrastive is not None and fields.contrast is not None:
            at = parts.at_query(vectors, position)  # [T, H, d]
            contrastive.add(index, position, fields.contrast[position], block, at, layer.attention, ffn_block, ffn_part)
    direct = None
    if contrastive is not None and fields.contrast is not None and lens is not None:
        embedding = float(fields.contrast[position] @ recording.inputs[0, position].to(PRECISION))
        direct = contrastive.direct(embedding, fields.contrast_shift)
    graph = Graph(heads=heads, **per_position, parallel=weights.parallel, experts=experts, shared_expert=shared)
    return graph, (head_effects, ffn_effects), direct


def _expert_shares(
    index: int, layer: Layer, moe: ExpertParts, block: parts.Linearised, p: int, table: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixture of experts' contributions: each chosen expert's share (and the shared expert's,
    last) written into ``table [E (+ 1), T]``; returns the feed-forward block's ``ffn`` (their
    sum), ``residual`` and ``bias`` shares ``[T]``. Checks that the parts add up to the stream."""
    columns = _expert_columns(moe, block)  # [T, k (+ 1), d]
    summed = block.residual + columns.sum(1) + block.bias
    parts.check_whole("mixture of experts", index, layer.out, summed, layer.computed_in)
    shares, residual, bias = parts.expert_contributions(layer.out, block, columns, p)  # [T, k (+ 1)]
    _fill_experts(moe, shares, table)
    return shares.sum(dim=1), residual, bias


def _expert_columns(moe: ExpertParts, block: parts.Linearised) -> torch.Tensor:
    """``[T, k (+ 1), d]``: each chosen expert's part as it reaches the whole (and the shared expert's, last)."""
    columns = block.part(moe.parts)  # [T, k, d]
    if moe.shared is not None:
        columns = torch.cat([columns, block.part(moe.shared)[:, None]], dim=1)  # [T, k + 1, d]
    return columns


def _fill_experts(moe: ExpertParts, shares: torch.Tensor, table: np.ndarray) -> None:
    """Each chosen expert's share ``shares [T, k (+ 1)]`` written into ``table [E (+ 1), T]`` at its expert."""
    found = shares.cpu().numpy()
    positions = np.arange(found.shape[0])
    for slot, chosen in enumerate(moe.indices.T.cpu().numpy()):
        table[chosen, positions] = found[:, slot]
    if moe.shared is not None:
        table[-1] = found[:, -1]


_PER_POSITION = ("attention_residual", "attention_bias", "ffn", "ffn_residual", "ffn_bias")


def _layer_shares(
    layer: Layer,
    index: int,
    attention: tuple[parts.Linearised, torch.Tensor, parts.Vectors],
    ffn: tuple[parts.Linearised, torch.Tensor],
    p: int,
    expert_table: np.ndarray | None = None,
) -> tuple[torch.Tensor, ...]:
    """One layer's normalised shares, ``heads [H, T, T]`` then the `_PER_POSITION` arrays ``[T]``,
    each whole checked against the model's own stream. ``attention``: the linearised block, its
    heads' parts ``[T, H, d]`` as they reach the whole and f_h(j) ``[T, H, d]``; ``ffn``: the
    linearised feed-forward block and its part ``[T, d]``. A sequential block has two wholes (the
    streams after each update); a parallel one has one, the stream leaving it, of which the
    feed-forward output is a part beside the residual, the heads and the bias term (its
    ``ffn_residual`` and ``ffn_bias`` shares are 0: no such parts). A mixture of experts' shares
    go into ``expert_table [E (+ 1), T]`` (`_expert_shares`)."""
    block, head_parts, vectors = attention
    ffn_block, ffn_part = ffn
    summed = block.residual + head_parts.sum(1) + block.bias
    if layer.parallel:  # the feed-forward block reads the stream entering the layer, and adds to the same whole
        entering = "feed-forward block's input (the stream entering a parallel block)"
        parts.check_whole(entering, index, layer.mid, layer.inputs, layer.computed_in)
        # A mixture of experts: one part per chosen expert (and the shared expert's) beside the heads.
        split = layer.experts is not None and expert_table is not None
        columns = _expert_columns(layer.experts, ffn_block) if split and layer.experts is not None else None
        if columns is not None:
            parts.check_whole("mixture of experts", index, ffn_part, columns.sum(1), layer.computed_in)
        parts.check_whole("parallel block", index, layer.out, summed + ffn_part, layer.computed_in)
        ffn_parts = ffn_part if columns is None else columns
        *found, through_ffn = parts.attention_contributions(layer.out, block, vectors, layer.attention, p, ffn_parts)
        if columns is not None and layer.experts is not None and expert_table is not None:
            _fill_experts(layer.experts, through_ffn, expert_table)
            through_ffn = through_ffn.sum(dim=1)
        none = torch.zeros_like(through_ffn)
        return *found, through_ffn, none, none
    parts.check_whole("attention block", index, layer.mid, summed, layer.computed_in)
    heads, residual, bias, _ = parts.attention_contributions(layer.mid, block, vectors, layer.attention, p)
    ffn_summed = ffn_block.residual + ffn_part + ffn_block.bias
    parts.check_whole("feed-forward block", index, layer.out, ffn_summed, layer.computed_in)
    if layer.experts is not None and expert_table is not None:
        return heads, residual, bias, *_expert_shares(index, layer, layer.experts, ffn_block, p, expert_table)
    return heads, residual, bias, *parts.ffn_contributions(layer.out, ffn_block, ffn_part, p)


class _ContrastiveSums:
    """The signed direct effects on logit(A) − logit(B) of the parts written into the top
    position's stream, gathered layer by layer, then turned into shares (`Direct`)."""

    def __init__(self, n_layers: int, n_heads: int, n_tokens: int) -> None:
        self.heads = np.zeros((n_layers, n_heads, n_tokens))
        self.ffn = np.zeros(n_layers)
        self.biases = np.zeros(n_layers)

    def add(
        self,
        layer: int,
        position: int,
        field: torch.Tensor,
        block: parts.Linearised,
        vectors: torch.Tensor,
        attention: torch.Tensor,
        ffn_block: parts.Linearised,
        ffn_part: torch.Tensor,
    ) -> None:
        """One layer: DE(h, j) = A_h[p, j] · G_p · (c_p ⊙ f̃_h(j)), the FFN's G_p · part, the biases'."""
        tilde = parts.centre(vectors) if block.centres else vectors
        reading = field if block.scale is None else block.scale[position] * field
        self.heads[layer] = (attention[:, position, :] * torch.einsum("jhd,d->hj", tilde, reading)).cpu().numpy()
        self.ffn[layer] = float(ffn_part[position] @ field)
        self.biases[layer] = float((block.bias[position] + ffn_block.bias[position]) @ field)

    def direct(self, embedding: float, shift: float) -> Direct:
        edges = np.abs(self.heads.sum(axis=1))  # [L, T]
        total = edges.sum() + np.abs(self.ffn).sum() + np.abs(self.biases).sum() + abs(embedding) + abs(shift)
        divisor = total if total > 0 else 1.0
        return Direct(
            attention=edges / divisor,
            heads=np.abs(self.heads) / divisor,
            ffn=np.abs(self.ffn) / divisor,
            head_effects=self.heads,
            ffn_effects=self.ffn,
            embedding_effect=embedding,
            bias_effect=float(self.biases.sum()) + shift,
        )


def _lens_readouts(
    model: ModelLike,
    recording: Recording,
    lens: Lens,
    result: Routes,
    mode: str,
    target: int,
    contrast: int | None,
    top_k: int,
) -> dict[Node, dict[str, Any]]:
    """The logit lens at the nodes ``mode`` names (see `routes`)."""
    if mode == "none":
        return {}
    n_layers, n_tokens = recording.n_layers, len(result.tokens)
    mid_layers = range(0 if result.graph.parallel else n_layers)  # parallel blocks: no stream between updates
    if mode == "all":
        chosen = [("in", layer, i) for layer in range(n_layers + 1) for i in range(n_tokens)]
        chosen += [("mid", layer, i) for layer in mid_layers for i in range(n_tokens)]
    else:
        column = [("in", layer, result.position) for layer in range(n_layers + 1)]
        column += [("mid", layer, result.position) for layer in mid_layers]
        chosen = list(dict.fromkeys([*column, *(node for node, _ in result.nodes)]))
    streams = {"in": recording.inputs, "mid": recording.mids}
    vectors = torch.stack([streams[stream][layer, i] for stream, layer, i in chosen])
    found = readouts(lens, model.tokenizer, vectors, target, contrast, top_k)
    return dict(zip(chosen, found, strict=True))


def _components(
    model: ModelLike,
    recording: Recording,
    weights: Weights,
    lens: Lens | None,
    result: Routes,
    count: int,
    top_k: int,
) -> list[dict[str, Any]]:
    """The ``count`` most important heads and feed-forward blocks: where each matters most, its
    importance (thresholded and not), its direct effect on the target's logit (in contrastive mode,
    at the top position, also on the logit difference) and what it promotes and suppresses there."""
    described: list[dict[str, Any]] = []
    vectors: list[torch.Tensor] = []
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind, table, full in (
        ("head", result.importance.heads, result.importance_full.heads),
        ("ffn", result.importance.ffn, result.importance_full.ffn),
    ):
        for flat in np.argsort(-table, axis=None)[:count]:
            layer, index = (int(n) for n in np.unravel_index(flat, table.shape))
            if table[layer, index] <= 0:
                break
            where = _head_position(result, layer, index) if kind == "head" else index
            entry = {"kind": kind, "layer": layer, **({"head": index} if kind == "head" else {}), "position": where}
            entry |= {"importance": float(table[layer, index]), "importance_full": float(full[layer, index])}
            described.append(entry | _effects(result, kind, layer, index, where))
            if lens is not None:  # what the part promotes: its vector through the unembedding
                head_parts, ffn_part = _layer_parts(recording, weights, layer, cache)
                vectors.append(head_parts[where, index] if kind == "head" else ffn_part[where])
    if lens is not None and described:
        finals = recording.inputs[-1, [entry["position"] for entry in described]].to(PRECISION)
        effects = lens.token_effects(torch.stack(vectors), finals)  # [component, V]
        for entry, tokens in zip(described, promotes(model.tokenizer, effects, top_k), strict=True):
            entry.update(tokens)
    return described


EDGE_TOKENS = 1000  # the edges through blocks, the most important first, whose promoted tokens are listed


def _describe_edges(
    tokenizer: Any, recording: Recording, weights: Weights, lens: Lens, result: Routes, fields: _Fields, k: int
) -> None:
    """Each route edge through a block (attention, feed-forward) gets its direct effect on the
    target's logit read at its upper node's position i (`Edge.effects`: ``effect``; attention
    edges also ``head_effects``, one per head; in contrastive mode, at the top position, the
    ``contrast_effect`` on the logit difference); the `EDGE_TOKENS` most important of them also
    the ``k`` tokens their part promotes and suppresses (through the final norm fixed at i)."""
    through = [edge for edge in result.edges if edge.kind in ("attention", "ffn")]
    if fields.target is None or not through:
        return
    listed: list[tuple[Edge, torch.Tensor, int]] = []  # (edge, its part [d], i): the most important first
    for layer in sorted({edge.layer for edge in through}):
        view = layer_view(recording, weights, layer)
        block, ffn_block = linearised_blocks(view)
        vectors = parts.head_vectors(view.values, view.output_weights, view.factors)  # [T, H, d] or per query
        for edge in (edge for edge in through if edge.layer == layer):
            i, j = edge.target[2], edge.source[2]
            if edge.kind == "attention":
                part = _part_at(block, view.attention[:, i, j, None] * parts.at_query(vectors, i)[j], i)  # [H, d]
                per_head = part @ fields.target[i]
                edge.effects = {"effect": float(per_head.sum()), "head_effects": per_head.tolist()}
                part = part.sum(0)
            else:
                part = _part_at(ffn_block, view.ffn_output[i], i)
                edge.effects = {"effect": float(part @ fields.target[i])}
            edge.effects |= _contrast_effect(result, edge)
            listed.append((edge, part, i))
    rank = {id(edge): number for number, edge in enumerate(through)}
    listed.sort(key=lambda found: rank[id(found[0])])
    for start in range(0, min(len(listed), EDGE_TOKENS), LENS_CHUNK):
        chunk = listed[start : min(start + LENS_CHUNK, EDGE_TOKENS)]
        finals = recording.inputs[-1, [i for _, _, i in chunk]].to(PRECISION)
        effects = lens.token_effects(torch.stack([part for _, part, _ in chunk]), finals)  # [edge, V]
        for (edge, _, _), tokens in zip(chunk, promotes(tokenizer, effects, k), strict=True):
            edge.effects |= tokens


def _part_at(block: parts.Linearised, raw: torch.Tensor, i: int) -> torch.Tensor:
    """``raw [..., d]`` computed at position i, as it reaches the block's whole there."""
    part = parts.centre(raw) if block.centres else raw
    return part if block.scale is None else part * block.scale[i]


def _contrast_effect(result: Routes, edge: Edge) -> dict[str, float]:
    """In contrastive mode, an edge into the top position's stream: its direct effect on the logit
    difference (`Direct`); nothing otherwise."""
    direct = result.direct
    if direct is None or edge.target[2] != result.position:
        return {}
    if edge.kind == "attention":
        return {"contrast_effect": float(direct.head_effects[edge.layer, :, edge.source[2]].sum())}
    return {"contrast_effect": float(direct.ffn_effects[edge.layer])}


def _effects(result: Routes, kind: str, layer: int, index: int, where: int) -> dict[str, float]:
    """A component's direct effect on the target's logit at ``where`` and, in contrastive mode at
    the top position, on the logit difference (``index``: the head, or the position of an FFN)."""
    found = {}
    heads, ffn = result.head_effects, result.ffn_effects
    if heads is not None and ffn is not None:
        found["effect"] = float(heads[layer, index, where] if kind == "head" else ffn[layer, where])
    if result.direct is not None and where == result.position:
        direct = result.direct
        found["contrast_effect"] = float(
            direct.head_effects[layer, index].sum() if kind == "head" else direct.ffn_effects[layer]
        )
    return found


def _head_position(result: Routes, layer: int, head: int) -> int:
    """The query position where a head carries the most importance on the route."""
    weights = layer_weights(result.graph, layer, result.position, result.direct)
    kept = np.where(weights["attention"] > result.threshold, weights["heads"][head], 0.0)  # [query, key]
    return int(np.argmax(attention_wholes(result.graph, result.importance, layer) * kept.sum(axis=1)))


def _layer_parts(recording: Recording, weights: Weights, index: int, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's heads' parts ``[T, H, d]`` and feed-forward part ``[T, d]``, as they reach their wholes."""
    if index not in cache:
        layer = layer_view(recording, weights, index)
        block, ffn_block = linearised_blocks(layer)
        raw = parts.head_outputs(layer.attention, layer.values, layer.output_weights, layer.factors)
        cache[index] = (block.part(raw), ffn_block.part(layer.ffn_output))
    return cache[index]


@torch.no_grad()
def stream_lens(model: ModelLike, text: str, position: int = -1, top_k: int = 5) -> list[dict[str, Any]]:
    """The logit lens down one position's residual stream, from one forward pass of ``model``
    (an `attnflow.AttentionModel` of a causal LM) on ``text``: row 0 the stream entering the first
    layer, row l + 1 the stream leaving layer l (``[L + 1]`` entries), each read as the model reads
    its last one (the final norm and the unembedding, `Lens.logits`): its ``top_k`` tokens with their
    probabilities and the model's prediction's rank, probability and logit (``"target"``, `readouts`).
    It needs the row's blocks (``Sites.block``) and final norm (``Streams.final_norm``) only, not
    attention as every layer's only token mixer: it reads a hybrid stack, whose routes are refused."""
    from attnflow.flow_routes.forward import _find_one, _norm_of_row
    from attnflow.rows.adapters import find_layers
    from attnflow.rows.hook_points import HookPoint, hooks

    row = model.adapter
    final = None if row.streams is None or row.sites is None or row.norms is None else row.streams.final_norm
    unembedding = model.hf_model.get_output_embeddings()
    if final is None or not isinstance(unembedding, torch.nn.Module):
        raise InputError(
            f"the logit lens needs a causal LM whose adapter row names its blocks, its norms and its final norm; "
            f"the {row.family} row does not{row.note}"
        )
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"].to(model.device)  # [1, token]
    if not -ids.shape[1] <= position < ids.shape[1]:
        raise InputError(f"{{position}} {position} is outside the {ids.shape[1]} tokens", parameter="position")
    blocks = [module for _, module in find_layers(model.hf_model, row.sites.block)]
    streams: list[torch.Tensor] = []  # [1, token, d_model] each: entering layer 0, then leaving each layer
    points = [(HookPoint(blocks[0], "input"), streams.append)]
    points += [(HookPoint(block, "output"), streams.append) for block in blocks]
    with hooks(points):
        logits = model.hf_model(input_ids=ids).logits  # [1, token, V]
    module = _find_one(model.hf_model, final)
    lens = Lens(
        module, _norm_of_row(model, [module]), unembedding, getattr(model.config, "final_logit_softcapping", None)
    )
    vectors = torch.stack([stream[0, position] for stream in streams])  # [L + 1, d_model]
    prediction = int(logits[0, position].argmax())
    return readouts(lens, model.tokenizer, vectors, prediction, None, top_k)
