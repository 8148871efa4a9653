"""Attention flow (Abnar & Zuidema 2020): maximum flow on the layered attention graph (docs/methods.md).

The graph has nodes (l, i), l = 0 … L, i = 0 … n−1, and an edge (l+1, i) → (l, j) with capacity
Ã⁽ˡ⁾[i, j] (head-fused, residual-corrected). The raw flow F[i, j] is the maximum flow from the
output node (L, i) to the input node (0, j).

The max-flow kernels (integer capacities, Dinic's algorithm on bit sets, compiled by numba, warm
starts across sinks) live in `attnflow.methods.flow_kernels`, whose docstring describes them.
"""

from __future__ import annotations

import os
from typing import Any, Sequence, Union

import numpy as np

from attnflow.errors import InputError
from attnflow.methods import options
from attnflow.methods.flow_kernels import SCALE, max_flows
from attnflow.methods.registry import register
from attnflow.methods.transforms import (
    HeadFusion,
    Residual,
    accepts_torch,
    choose_fusion,
    normalise_rows,
    prepare_layers,
)

Rows = Union[None, int, Sequence[int], np.ndarray]


@register(
    "flow",
    "attention flow: max-flow on the layered attention graph",
    takes="attentions",
    options=(options.HEAD_FUSION, options.HEAD_WEIGHTS, options.RESIDUAL, options.LAYER),
    rows=True,
    per_head=True,
    cost="expensive",
)
@accepts_torch
def attention_flow(
    attentions: Any,
    head_fusion: HeadFusion = "mean",
    weights: Any = None,
    residual: Residual = "half",
    rows: Rows = None,
    layer: int | None = None,
    normalize: bool = True,
    n_jobs: int | None = None,
) -> np.ndarray:
    """Maximum flow from each output position to each input position through the attention graph.

    Args:
        attentions: ``[layer, head, query, key]`` or ``[batch, layer, head, query, key]`` softmax
            weights (numpy or torch; rows sum to 1, no NaN, no negative weights).
        head_fusion: ``"mean"``, ``"max"``, ``"min"`` or per-head weights: one graph whose
            capacities are the fused maps; ``"none"``: per-head flow, one graph per head through
            that head's own layers (Ã_h⁽ˡ⁾ = the residual applied to head h of layer l, as
            head-specific rollout composes them), and a head axis in the result.
        weights: per-head weights instead of ``head_fusion`` (normalised to sum 1).
        residual: ``"half"``, ``"renorm"``, ``"none"`` or alpha in [0, 1] (docs/methods.md); the
            edge capacities are the resulting Ã⁽ˡ⁾.
        rows: output positions i to compute (an int or a sequence of ints, negatives count from
            the end); ``None`` computes all n. ``rows=[0]`` is the CLS row.
        layer: l in 1 … L: flows from the nodes (l, i), the outputs of the first l layers
            (0-based layers 0 … l−1, i.e. through Ã⁽⁰⁾ … Ã⁽ˡ⁻¹⁾ only), to the input nodes (0, j).
            ``None`` (default) is l = L, the whole model.
        normalize: divide each output row by its sum (the reference implementation's output);
            ``False`` returns the raw max-flow values, each in [0, 1] (a source sends at most its
            row sum, 1).
        n_jobs: threads over graphs (samples, heads), output rows and runs of sinks; ``None`` or
            1: one thread; -1: all cores.

    Returns:
        float64 ``[len(rows), key]`` (``[query, key]`` with ``rows=None``; batched input gives
        ``[batch, len(rows), key]``; ``head_fusion="none"`` adds a head axis after the batch
        axis: ``[(batch,) head, len(rows), key]``), a torch tensor when the input is one. Entry
        [i, j] is the flow from output position rows[i] to input position j. Capacities are
        rounded to multiples of 2^-50 (int64) and the max-flow arithmetic is exact, so a flow
        differs from the real-valued one by at most 2^-51 per edge of its min cut (~1e-14 in
        practice).
    """
    if not isinstance(normalize, (bool, np.bool_)):
        raise InputError(f"normalize must be True or False, got {normalize!r}")
    head_fusion = choose_fusion(head_fusion, weights)
    per_head = isinstance(head_fusion, str) and head_fusion == "none"
    layers = prepare_layers(attentions, head_fusion=head_fusion, residual=residual)  # [..., layer, (head,) q, k]
    if per_head:
        layers = np.moveaxis(layers, -3, -4)  # [..., head, layer, q, k]: each head its own graph
    graphs = layers.reshape((-1, *layers.shape[-3:]))  # [graph, layer, q, k]
    n_layers, n = graphs.shape[1], graphs.shape[-1]
    depth = _check_layer(layer, n_layers)
    sources = _check_rows(rows, n)
    jobs = _check_n_jobs(n_jobs)

    raw = max_flows(graphs[:, :depth], sources, jobs)  # [graph, rows, key], int64 scaled by 2^50
    flows = raw.reshape(layers.shape[:-3] + raw.shape[1:]) / SCALE  # [(batch,) (head,) rows, key]
    if normalize:
        # A row of Ã that sums to 1 always leads somewhere, so totals are positive; only an all-zero
        # fused row (min fusion of heads with disjoint supports) gives 0, and its flows stay 0.
        flows = normalise_rows(flows)
    return flows


def _check_layer(layer: Any, n_layers: int) -> int:
    if layer is None:
        return n_layers
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) or not 1 <= layer <= n_layers:
        raise InputError(
            f"layer must be an integer in [1, {n_layers}] (flows from the outputs of that many layers), got {layer!r}"
        )
    return int(layer)


def _check_rows(rows: Rows, n: int) -> np.ndarray:
    if rows is None:
        return np.arange(n, dtype=np.int64)
    picked = np.atleast_1d(np.asarray(rows))
    if picked.ndim != 1 or (picked.size and not np.issubdtype(picked.dtype, np.integer)):
        raise InputError(f"rows must be an int or a 1-D sequence of ints, got {rows!r}")
    if np.any((picked < -n) | (picked >= n)):
        raise InputError(f"rows must lie in [-{n}, {n - 1}] for {n} tokens, got {picked.tolist()}")
    return np.where(picked < 0, picked + n, picked).astype(np.int64)


def _check_n_jobs(n_jobs: Any) -> int:
    if n_jobs is None:
        return 1
    if isinstance(n_jobs, (bool, np.bool_)) or not isinstance(n_jobs, (int, np.integer)) or n_jobs == 0 or n_jobs < -1:
        raise InputError(f"n_jobs must be a positive integer, -1 (all cores) or None, got {n_jobs!r}")
    if n_jobs == -1:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return int(n_jobs)
