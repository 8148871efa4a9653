"""Attention flow (Abnar & Zuidema 2020): maximum flow on the layered attention graph (docs/methods.md).

The graph has nodes (l, i), l = 0 … L, i = 0 … n−1, and an edge (l+1, i) → (l, j) with capacity
Ã⁽ˡ⁾[i, j] (head-fused, residual-corrected). The raw flow F[i, j] is the maximum flow from the
output node (L, i) to the input node (0, j).

Algorithm (one compiled kernel per output row and a run of sinks, released from the GIL):

* Capacities are integers, Ã · 2⁵⁰ rounded (int64), so the max-flow arithmetic is exact and the
  only error is the rounding of each capacity (≤ 2⁻⁵¹ per edge; ~1e-14 on real inputs).
* For a sink (0, j), the other input nodes are dead ends and the other nodes of layer L are never
  reached, so they are left out; the residual graph is kept as dense ``[layer, q, k]`` arrays
  (forward residuals and, transposed, the flow that can be sent back), with per-node adjacency
  lists that skip zero-capacity edges and try the largest capacities first.
* Dinic's algorithm, with levels = distances to the sink. Every edge goes down one layer, so in
  the first phase the distances are the layers themselves: that phase runs without a search, and
  on most inputs it already reaches a trivial upper bound, min(Σ source capacities, Σ sink
  capacities), which ends the max-flow with no search at all. Otherwise BFS phases (from the sink,
  over reversed residual edges, stopping at the source) follow; the last one proves optimality.
  The DFS splits flow over a node's edges (multi-push) instead of re-walking one path at a time.
* Reuse across sinks: the max flow to sink j is the starting flow for sink j+1. The flow that
  sink j+1 cannot take is cancelled back up the graph (a pass over the layers, from the bottom),
  and the phases continue from there. When that warm start needed extra BFS phases, the next sink
  starts from zero flow instead (on some real attention maps, starting over is cheaper). The
  min cuts proved by earlier sinks' last searches are kept (their sink-independent part) and
  give upper bounds for the next sinks: a flow that reaches one needs no final search. On the
  CLS row of real attention (a sink token, with its min cut next to the source) this saves most
  of the final searches.
* ``n_jobs`` threads share the (sample, output row, run of sinks) tasks.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence, Union

import numpy as np
from numba import njit

from attnflow.methods.registry import register
from attnflow.methods.transforms import HeadFusion, Residual, accepts_torch, prepare_layers

FLOW_OPTIONS = ("head_fusion", "residual", "layer")
SCALE_BITS = 50
_SCALE = float(2**SCALE_BITS)

Rows = Union[None, int, Sequence[int], np.ndarray]
N_CUTS = 8  # min cuts remembered per output row, as upper bounds for the next sinks


@register("flow", "attention flow: max-flow on the layered attention graph", FLOW_OPTIONS)
@accepts_torch
def attention_flow(
    attentions: Any,
    head_fusion: HeadFusion = "mean",
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
        head_fusion: ``"mean"``, ``"max"``, ``"min"`` or per-head weights (``"none"`` is not
            supported: the flow graph needs one capacity per edge).
        residual: ``"half"``, ``"renorm"``, ``"none"`` or alpha in [0, 1] (docs/methods.md); the edge
            capacities are the resulting Ã⁽ˡ⁾.
        rows: output positions i to compute (an int or a sequence of ints, negatives count from
            the end); ``None`` computes all n. ``rows=[0]`` is the CLS row.
        layer: l in 1 … L: flows from the nodes (l, i), the outputs of the first l layers
            (0-based layers 0 … l−1, i.e. through Ã⁽⁰⁾ … Ã⁽ˡ⁻¹⁾ only), to the input nodes (0, j).
            ``None`` (default) is l = L, the whole model.
        normalize: divide each output row by its sum (the reference implementation's output);
            ``False`` returns the raw max-flow values, each in [0, 1] (a source sends at most its
            row sum, 1).
        n_jobs: threads over output rows (and runs of sinks when there are few rows); ``None``
            or 1: one thread; -1: all cores.

    Returns:
        float64 ``[len(rows), key]`` (``[query, key]`` with ``rows=None``; batched input gives
        ``[batch, len(rows), key]``), a torch tensor when the input is one. Entry [i, j] is the
        flow from output position rows[i] to input position j. Capacities are rounded to
        multiples of 2^-50 (int64) and the max-flow arithmetic is exact, so a flow differs from
        the real-valued one by at most 2^-51 per edge of its min cut (~1e-14 in practice).
    """
    if isinstance(head_fusion, str) and head_fusion == "none":
        raise ValueError("attention_flow needs fused heads: head_fusion='none' is not supported")
    if not isinstance(normalize, (bool, np.bool_)):
        raise ValueError(f"normalize must be True or False, got {normalize!r}")
    layers = prepare_layers(attentions, head_fusion=head_fusion, residual=residual)  # [..., layer, q, k]
    batched = layers.ndim == 4
    samples = layers if batched else layers[None]  # [batch, layer, q, k]
    n_layers, n = samples.shape[1], samples.shape[-1]
    depth = _check_layer(layer, n_layers)
    sources = _check_rows(rows, n)
    jobs = _check_n_jobs(n_jobs)

    raw = _max_flows(samples[:, :depth], sources, jobs)  # [batch, rows, key], int64 scaled by 2^50
    flows = raw / _SCALE
    if normalize:
        totals = flows.sum(axis=-1, keepdims=True)
        # A row of Ã that sums to 1 always leads somewhere, so totals are positive; only an all-zero
        # fused row (min fusion of heads with disjoint supports) gives 0, and its flows stay 0.
        flows = np.divide(flows, totals, out=np.zeros_like(flows), where=totals > 0)
    return flows if batched else flows[0]


def _check_layer(layer: Any, n_layers: int) -> int:
    if layer is None:
        return n_layers
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) or not 1 <= layer <= n_layers:
        raise ValueError(
            f"layer must be an integer in [1, {n_layers}] (flows from the outputs of that many layers), got {layer!r}"
        )
    return int(layer)


def _check_rows(rows: Rows, n: int) -> np.ndarray:
    if rows is None:
        return np.arange(n, dtype=np.int64)
    picked = np.atleast_1d(np.asarray(rows))
    if picked.ndim != 1 or (picked.size and not np.issubdtype(picked.dtype, np.integer)):
        raise ValueError(f"rows must be an int or a 1-D sequence of ints, got {rows!r}")
    if np.any((picked < -n) | (picked >= n)):
        raise ValueError(f"rows must lie in [-{n}, {n - 1}] for {n} tokens, got {picked.tolist()}")
    return np.where(picked < 0, picked + n, picked).astype(np.int64)


def _check_n_jobs(n_jobs: Any) -> int:
    if n_jobs is None:
        return 1
    if isinstance(n_jobs, (bool, np.bool_)) or not isinstance(n_jobs, (int, np.integer)) or n_jobs == 0 or n_jobs < -1:
        raise ValueError(f"n_jobs must be a positive integer, -1 (all cores) or None, got {n_jobs!r}")
    if n_jobs == -1:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return int(n_jobs)


def _graph(layers: np.ndarray) -> tuple[np.ndarray, ...]:
    """Integer capacities and adjacency of one sample's ``[layer, q, k]`` matrices Ã.

    Returns ``cap [layer, q, k]`` int64 (Ã · 2^50), ``cap_t [layer, k, q]`` (its transpose, so
    that column scans are contiguous), ``fwd_adj [layer, q, k]`` (per row, the keys by decreasing
    capacity), ``fwd_deg [layer, q]`` (non-zero edges per row), ``bwd_adj [layer, k, q]`` and
    ``bwd_deg [layer, k]`` (the same per column).
    """
    cap = np.rint(layers * _SCALE).astype(np.int64)
    cap_t = np.ascontiguousarray(cap.transpose(0, 2, 1))
    nonzero = cap > 0
    fwd_adj = np.argsort(-cap, axis=-1).astype(np.int32)  # zero capacities sort last
    bwd_adj = np.argsort(-cap_t, axis=-1).astype(np.int32)
    fwd_deg = nonzero.sum(axis=-1, dtype=np.int64)
    bwd_deg = nonzero.sum(axis=-2, dtype=np.int64)
    return cap, cap_t, fwd_adj, fwd_deg, bwd_adj, bwd_deg


def _max_flows(samples: np.ndarray, sources: np.ndarray, jobs: int) -> np.ndarray:
    """Raw integer flows ``[batch, len(sources), key]`` for ``[batch, layer, q, k]`` matrices."""
    n_samples, n = samples.shape[0], samples.shape[-1]
    out = np.zeros((n_samples, len(sources), n), dtype=np.int64)
    # With fewer rows than threads, split each row's sinks into runs so that every thread has work.
    n_runs = 1 if jobs == 1 or len(sources) >= 4 * jobs else min(n, math.ceil(2 * jobs / max(len(sources), 1)))
    tasks = [(r, run) for r in range(len(sources)) for run in np.array_split(np.arange(n, dtype=np.int64), n_runs)]
    pool = ThreadPoolExecutor(max_workers=jobs) if jobs > 1 and len(tasks) > 1 else None
    try:
        for b in range(n_samples):  # one sample's graph at a time: memory does not grow with the batch
            graph = _graph(samples[b])

            def solve(task: tuple[int, np.ndarray], b: int = b, graph: tuple = graph) -> None:
                r, run = task
                _source_flows(*graph, sources[r], run, out[b, r])

            if pool is None:
                for task in tasks:
                    solve(task)
            else:
                list(pool.map(solve, tasks))  # list() re-raises a worker's exception here
    finally:
        if pool is not None:
            pool.shutdown()
    return out


# ---------------------------------------------------------------------------------------------
# Compiled kernel. Node (l, i) has id l * n + i. Residuals of the edges of block l (from layer
# l+1 to layer l): rf[l, a, b] forward on (l+1, a) -> (l, b); rb[l, b, a] = its flow, i.e. the
# residual of the reverse edge (l, b) -> (l+1, a). The sink (0, sink) has id `sink`.
# Line coverage cannot see compiled code; NUMBA_DISABLE_JIT=1 runs these functions as Python.


@njit(cache=True, nogil=True)
def _distances(
    cap, cap_t, rf, rb, fwd_adj, fwd_deg, bwd_adj, bwd_deg, source, sink, level, queue
):  # pragma: no cover
    """BFS from the sink over reversed residual edges: ``level`` = distance to the sink.

    Stops once the source is labelled (nodes farther away cannot be on a shortest path).
    Returns False when the source cannot reach the sink. The residual of the edge
    (l+1, a) -> (l, b) is cap_t[l, b, a] - rb[l, b, a], so every scan reads a contiguous row.
    """
    n_layers = rf.shape[0]
    n = rf.shape[1]
    s = n_layers * n + source
    level[:] = -1
    level[sink] = 0
    queue[0] = sink
    head = 0
    tail = 1
    while head < tail:
        v = queue[head]
        head += 1
        vl = v // n
        vi = v - vl * n
        lv = level[v] + 1
        if vl == n_layers - 1:  # only the source feeds this layer
            if cap_t[vl, vi, source] - rb[vl, vi, source] > 0:
                level[s] = lv  # BFS order: every node nearer to the sink is labelled already
                return True
        else:
            for k in range(bwd_deg[vl, vi]):  # (vl+1, a) -> (vl, vi) with room left
                a = bwd_adj[vl, vi, k]
                w = (vl + 1) * n + a
                if level[w] < 0 and cap_t[vl, vi, a] - rb[vl, vi, a] > 0:  # level first: it is in cache
                    level[w] = lv
                    queue[tail] = w
                    tail += 1
        if vl >= 2:
            for k in range(fwd_deg[vl - 1, vi]):  # (vl-1, c) -> (vl, vi): cancels flow on (vl, vi) -> (vl-1, c)
                c = fwd_adj[vl - 1, vi, k]
                w = (vl - 1) * n + c
                if level[w] < 0 and cap[vl - 1, vi, c] - rf[vl - 1, vi, c] > 0:
                    level[w] = lv
                    queue[tail] = w
                    tail += 1
    return False


@njit(cache=True, nogil=True)
def _blocking_flow(
    rf, rb, fwd_adj, fwd_deg, bwd_adj, bwd_deg, source, sink, level, forward_only, limit, work
):  # pragma: no cover
    """Push up to ``limit`` units along edges that go one step nearer to the sink (``level``).

    A DFS with current arcs that splits a node's flow over its edges (multi-push).

    ``work`` holds the per-node current arc and the DFS stack (node, edge, budget, pushed).
    Returns the flow pushed. Exhausted nodes get level -1 (dead for the rest of the phase).
    """
    n_layers = rf.shape[0]
    n = rf.shape[1]
    cur, st_node, st_kind, st_blk, st_a, st_b, budget, got = work
    cur[:] = 0
    depth = 0
    st_node[0] = n_layers * n + source
    budget[0] = limit
    got[0] = 0
    while True:
        u = st_node[depth]
        if u == sink:
            d = budget[depth]
        else:
            ul = u // n
            ui = u - ul * n
            lu = level[u]
            k = cur[u]
            v = -1
            r = 0
            # Edges in order: forward ones (down a layer; from layer 1 only the one into the
            # sink), then in the general phases reverse ones (back up a layer, along flow).
            n_fwd = 1 if ul == 1 else fwd_deg[ul - 1, ui]
            n_edges = n_fwd
            if not forward_only and 1 <= ul <= n_layers - 2:
                n_edges += bwd_deg[ul, ui]
            while k < n_edges:
                if k < n_fwd:
                    kind = 0
                    blk = ul - 1
                    a = ui
                    b = sink if ul == 1 else fwd_adj[blk, ui, k]
                    r = rf[blk, a, b]
                    w = blk * n + b
                else:
                    kind = 1
                    blk = ul
                    a = bwd_adj[ul, ui, k - n_fwd]
                    b = ui
                    r = rb[blk, b, a]
                    w = (ul + 1) * n + a
                if r > 0:
                    lw = level[w]
                    if lw == lu - 1:
                        v = w
                        st_kind[depth] = kind
                        st_blk[depth] = blk
                        st_a[depth] = a
                        st_b[depth] = b
                        break
                k += 1
            cur[u] = k
            if v >= 0:  # descend, asking for what this node still has to place
                ask = min(budget[depth] - got[depth], r)
                depth += 1
                st_node[depth] = v
                budget[depth] = ask
                got[depth] = 0
                continue
            level[u] = -1
            d = got[depth]
        # Hand d units back up the stack until a node still has budget left to place.
        while True:
            if depth == 0:
                return d
            asked = budget[depth]
            depth -= 1
            blk = st_blk[depth]
            a = st_a[depth]
            b = st_b[depth]
            left = 0
            if d > 0:
                if st_kind[depth] == 0:
                    left = rf[blk, a, b] - d
                    rf[blk, a, b] = left
                    rb[blk, b, a] += d
                else:
                    left = rb[blk, b, a] - d
                    rb[blk, b, a] = left
                    rf[blk, a, b] += d
                got[depth] += d
            if left == 0 or d < asked:
                cur[st_node[depth]] += 1  # edge saturated or child blocked: next edge
            if got[depth] < budget[depth]:
                break
            d = got[depth]


@njit(cache=True, nogil=True)
def _move_sink(cap, rf, rb, bwd_adj, bwd_deg, source, old_sink, new_sink, surplus):  # pragma: no cover
    """Turn a flow into ``old_sink`` into a valid flow into ``new_sink``; returns its value.

    Edge (1, a) -> sink keeps min(its flow, new capacity); the excess is cancelled upward, layer
    by layer, along edges that carry flow, until it is taken off the source's edges.
    """
    n_layers = cap.shape[0]
    n = cap.shape[1]
    value = 0
    for a in range(n):
        f = rb[0, old_sink, a]
        rb[0, old_sink, a] = 0
        rf[0, a, old_sink] = cap[0, a, old_sink]
        keep = min(f, cap[0, a, new_sink])
        rb[0, new_sink, a] = keep
        rf[0, a, new_sink] = cap[0, a, new_sink] - keep
        value += keep
        surplus[a] = f - keep  # surplus[a]: excess of node (l, a) on the layer being cancelled
    for layer in range(1, n_layers):
        for b in range(n):
            s = surplus[b]
            if s == 0:
                continue
            surplus[b] = 0
            if layer == n_layers - 1:  # only the source feeds the top layer
                rb[layer, b, source] -= s
                rf[layer, source, b] += s
                continue
            for k in range(bwd_deg[layer, b]):
                a = bwd_adj[layer, b, k]
                f = rb[layer, b, a]
                if f == 0:
                    continue
                take = min(s, f)
                rb[layer, b, a] = f - take
                rf[layer, a, b] += take
                surplus[n + a] += take
                s -= take
                if s == 0:
                    break
        for a in range(n):  # the next layer's excess becomes the current one
            surplus[a] = surplus[n + a]
            surplus[n + a] = 0
    for a in range(n):
        surplus[a] = 0  # excess of the source layer (L == 1) is simply dropped
    return value


@njit(cache=True, nogil=True)
def _source_side_cut(cap, level, source, side, limit):  # pragma: no cover
    """Remember the min cut found by a failed search, to bound the flows to later sinks.

    S = the nodes that cannot reach the sink (``level < 0``). Returns the capacity of the edges
    from S to the other nodes of layers 1 … L−1, which does not depend on the sink, and marks in
    ``side`` the nodes of layer 1 in S (their edges into the next sink complete the cut). Returns
    -1 (nothing remembered) when S holds more than half the nodes (such cuts rarely fit another
    sink and cost as much as a search to add up) or when the cut exceeds ``limit`` (the source's
    capacity, already a bound; stopping there also keeps the sum far from int64 overflow).
    """
    n_layers = cap.shape[0]
    n = cap.shape[1]
    if n_layers == 1:
        return -1
    in_s = 0
    for u in range(n, n_layers * n):
        if level[u] < 0:
            in_s += 1
    if 2 * in_s > (n_layers - 1) * n:
        return -1
    total = 0
    for b in range(n):  # the source's edges into layer L-1
        if level[(n_layers - 1) * n + b] >= 0:
            total += cap[n_layers - 1, source, b]
    for layer in range(2, n_layers):
        for a in range(n):
            if level[layer * n + a] < 0:
                for b in range(n):
                    if level[(layer - 1) * n + b] >= 0:
                        total += cap[layer - 1, a, b]
                if total > limit:  # each node adds at most its row sum, ~2^50
                    return -1
    for a in range(n):
        side[a] = level[n + a] < 0
    return total


@njit(cache=True, nogil=True)
def _source_flows(cap, cap_t, fwd_adj, fwd_deg, bwd_adj, bwd_deg, source, sinks, out):  # pragma: no cover
    """Max flow from (L, source) to each (0, sink) in ``sinks``, written to ``out[sink]``.

    ``cap [layer, q, k]`` are the integer capacities; see ``_graph`` for the adjacency arrays.
    """
    n_layers = cap.shape[0]
    n = cap.shape[1]
    n_nodes = (n_layers + 1) * n
    rf = cap.copy()
    rb = np.zeros_like(cap)
    level = np.empty(n_nodes, np.int64)
    queue = np.empty(n_nodes, np.int64)
    surplus = np.zeros(2 * n, np.int64)
    stack = n_nodes + 1  # a DFS path visits each distance to the sink at most once
    work = (
        np.zeros(n_nodes, np.int64),  # current arc per node
        np.empty(stack, np.int64),  # DFS stack: node
        np.empty(stack, np.int64),  # edge kind (0 forward, 1 reverse), block, tail row, head column
        np.empty(stack, np.int64),
        np.empty(stack, np.int64),
        np.empty(stack, np.int64),
        np.empty(stack, np.int64),  # budget
        np.empty(stack, np.int64),  # pushed so far
    )
    out_capacity = 0
    for b in range(n):
        out_capacity += cap[n_layers - 1, source, b]
    flow = 0
    previous = -1
    start_cold = False
    # Min cuts of earlier sinks, reused as upper bounds (see _source_side_cut), a ring of them.
    cut_base = np.full(N_CUTS, -1, np.int64)
    cut_side = np.zeros((N_CUTS, n), np.bool_)
    n_cuts = 0
    for index in range(sinks.shape[0]):
        sink = sinks[index]
        in_capacity = 0
        for a in range(n):
            in_capacity += cap[0, a, sink]
            if in_capacity > out_capacity:  # no larger sums: no int64 overflow for any n
                break
        bound = min(out_capacity, in_capacity)
        for c in range(N_CUTS):
            if cut_base[c] >= 0:
                cut = cut_base[c]
                for a in range(n):
                    if cut_side[c, a]:
                        cut += cap[0, a, sink]
                        if cut > bound:
                            break
                bound = min(bound, cut)
        warm = previous >= 0 and not start_cold
        if warm:
            flow = _move_sink(cap, rf, rb, bwd_adj, bwd_deg, source, previous, sink, surplus)
        elif previous >= 0:
            rf[:] = cap
            rb[:] = 0
            flow = 0
        previous = sink
        if flow < bound:  # first phase on forward edges only: distances are the layers, no search
            for layer in range(n_layers + 1):
                level[layer * n : (layer + 1) * n] = layer
            flow += _blocking_flow(
                rf, rb, fwd_adj, fwd_deg, bwd_adj, bwd_deg, source, sink, level, True, bound - flow, work
            )
        start_cold = False
        while flow < bound:
            if not _distances(cap, cap_t, rf, rb, fwd_adj, fwd_deg, bwd_adj, bwd_deg, source, sink, level, queue):
                slot = n_cuts % N_CUTS
                cut_base[slot] = _source_side_cut(cap, level, source, cut_side[slot], out_capacity)
                n_cuts += cut_base[slot] >= 0
                break  # no augmenting path: the flow is maximum
            start_cold = warm
            flow += _blocking_flow(
                rf, rb, fwd_adj, fwd_deg, bwd_adj, bwd_deg, source, sink, level, False, bound - flow, work
            )
        out[sink] = flow
