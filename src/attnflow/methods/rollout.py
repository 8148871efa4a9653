"""Attention rollout (Abnar & Zuidema 2020) with every variant of docs/methods.md, and raw attention."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnflow.errors import InputError
from attnflow.methods import options
from attnflow.methods.registry import register
from attnflow.methods.transforms import (
    HeadFusion,
    Residual,
    accepts_torch,
    choose_fusion,
    fuse_heads,
    prepare_layers,
    validate_attentions,
)


@register(
    "rollout",
    "attention rollout: product of residual-corrected, head-fused layers",
    takes="attentions",
    options=(
        options.HEAD_FUSION,
        options.HEAD_WEIGHTS,
        options.RESIDUAL,
        options.START_LAYER,
        options.THRESHOLD,
        options.TOP_K,
        options.DISCARD_RATIO,
        options.PRUNE_ON,
    ),
    layerwise=True,
    per_head=True,
)
@accepts_torch
def rollout(
    attentions: Any,
    head_fusion: HeadFusion = "mean",
    weights: Any = None,
    residual: Residual = "half",
    start_layer: int = 0,
    threshold: float | None = None,
    top_k: int | None = None,
    discard_ratio: float | None = None,
    prune_on: str = "attention",
    layerwise: bool = False,
    aggregate_heads: bool = False,
) -> np.ndarray:
    """Compose the layers' attention: R = Ã⁽ᴸ⁻¹⁾ ⋯ Ã⁽ˢ⁾ with Ã fused, residual-corrected, pruned.

    Args:
        attentions: ``[layer, head, query, key]`` or ``[batch, layer, head, query, key]``
            softmax weights (numpy or torch).
        head_fusion: ``"mean"``, ``"max"``, ``"min"`` or ``"none"`` (head-specific rollout:
            each head composed with itself across layers).
        weights: per-head weights instead of ``head_fusion``; normalised to sum 1.
        residual: ``"half"``, ``"renorm"``, ``"none"`` or alpha in [0, 1].
        start_layer: first layer composed (0-based); earlier layers are skipped.
        threshold / top_k / discard_ratio: per-row pruning of each layer before composing
            (threshold and discard_ratio in [0, 1); every row keeps its largest entry).
        prune_on: ``"attention"`` (default): prune the head-fused attention, then add the
            residual and renormalise the rows; ``"residual"``: prune Ã after the residual
            (strong pruning then keeps only the diagonal: a `PruningCollapseWarning` says so).
        layerwise: also return every intermediate R⁽ˡ⁾.
        aggregate_heads: with ``head_fusion="none"``, average the per-head rollouts.

    Returns:
        ``[query, key]`` (batched: ``[batch, query, key]``); with ``head_fusion="none"``
        ``[head, query, key]``; with ``layerwise`` a leading ``layer`` axis holding R⁽ˢ⁾ … R⁽ᴸ⁻¹⁾
        (``[layer - start_layer, ..., query, key]``, batch axis first when batched). Row i is the
        share of output position i attributable to input j; rows sum to 1.
    """
    fusion = choose_fusion(head_fusion, weights)
    layers = prepare_layers(
        attentions,
        head_fusion=fusion,
        residual=residual,
        threshold=threshold,
        top_k=top_k,
        discard_ratio=discard_ratio,
        prune_on=prune_on,
    )  # [..., layer, (head,) q, k]
    batched = np.asarray(attentions).ndim == 5
    layer_axis = 1 if batched else 0
    n_layers = layers.shape[layer_axis]
    if isinstance(start_layer, bool) or int(start_layer) != start_layer or not 0 <= start_layer < n_layers:
        raise InputError(f"start_layer must be an integer in [0, {n_layers - 1}], got {start_layer}")
    layers = np.moveaxis(layers, layer_axis, 0)  # [layer, (batch,) (head,) q, k]
    n = layers.shape[-1]
    joint = np.broadcast_to(np.eye(n), layers.shape[1:]).copy()
    history = []  # kept only when asked for: at 2,048 tokens each R is 32 MiB a layer
    for layer in layers[start_layer:]:
        joint = layer @ joint  # R⁽ˡ⁾ = Ã⁽ˡ⁾ R⁽ˡ⁻¹⁾
        if layerwise:
            history.append(joint)
    if aggregate_heads and fusion == "none":
        history = [h.mean(axis=-3) for h in history]
        joint = joint.mean(axis=-3)
    if layerwise:
        stacked = np.stack(history)  # [layer, (batch,) ..., q, k]
        return np.moveaxis(stacked, 0, 1) if batched else stacked
    return joint


@register(
    "raw",
    "raw attention of one layer (default: last), fused over heads",
    takes="attentions",
    options=(options.HEAD_FUSION, options.HEAD_WEIGHTS, options.LAYER),
    layerwise=True,
    per_head=True,
)
@accepts_torch
def raw_attention(
    attentions: Any, head_fusion: HeadFusion = "mean", weights: Any = None, layer: int = -1, layerwise: bool = False
) -> np.ndarray:
    """The attention map of one layer, fused over heads: ``[..., layer, head, q, k]`` -> ``[..., q, k]``.

    ``weights``: per-head weights instead of ``head_fusion``. ``layerwise=True`` returns every
    layer instead (``layer`` is then ignored): ``[..., layer, q, k]``. With ``head_fusion="none"``
    the head axis stays: ``[..., (layer,) head, q, k]``.
    """
    array = validate_attentions(attentions)
    head_fusion = choose_fusion(head_fusion, weights)
    if layerwise:
        return fuse_heads(array, head_fusion)
    n_layers = array.shape[-4]
    if not -n_layers <= layer < n_layers:
        raise InputError(f"layer must lie in [-{n_layers}, {n_layers - 1}], got {layer}")
    return fuse_heads(np.take(array, layer, axis=-4), head_fusion)
