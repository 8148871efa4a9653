"""The compiled max-flow kernels of `attnflow.methods.flow` (attention flow).

Algorithm (one compiled kernel per output row and a run of sinks, released from the GIL):

* Capacities are integers, Ã · 2⁵⁰ rounded (int64), so the max-flow arithmetic is exact and the
  only error is the rounding of each capacity (≤ 2⁻⁵¹ per edge; ~1e-14 on real inputs).
* For a sink (0, j), the other input nodes are dead ends and the other nodes of layer L are never
  reached, so they are left out; the residual graph is kept as dense ``[layer, q, k]`` arrays
  (forward residuals and, transposed, the flow that can be sent back). Which residuals are
  positive is mirrored in bit sets (one uint64 word per 64 nodes, per row and per column), and so
  is which nodes are still alive in the current phase: the searches and the DFS find the next
  usable edge with a word AND and a trailing-zero count, jumping over saturated edges and dead
  nodes 64 at a time (on real attention most tested edges lead to a dead node). The DFS first
  tries each node's few largest capacities (``N_HEAVY``), then the rest by key.
* Dinic's algorithm, with levels = distances to the sink. Every edge goes down one layer, so in
  the first phase the distances are the layers themselves: that phase runs without a search, and
  on most inputs it already reaches a trivial upper bound, min(Σ source capacities, Σ sink
  capacities), which ends the max-flow with no search at all. Otherwise BFS phases (from the sink,
  over reversed residual edges, stopping at the source) follow; the last one proves optimality.
  The DFS splits flow over a node's edges (multi-push) instead of re-walking one path at a time;
  a node of layer 2 pushes into the sink through its children at distance 1 at once (their only
  admissible edge goes there), without descending into them. The first phase has a DFS of its
  own, which knows every step goes one layer down (no distances, edge kinds or layers to look up
  per step). In the searched phases a
  node's distance to the sink and its layer have the same parity (every edge goes one layer up
  or down), and the search sorts the labelled nodes by distance into bit sets (see
  `_distances`): the DFS finds the nodes one step nearer to the sink with a word AND instead of
  testing the distance of every live node.
* Reuse across sinks: a sink starts warm or cold, whichever kind is chosen; the other kind is
  retried on one sink after ``EXPLORE`` sinks, then after twice as many each time it costs more
  than the chosen kind's running mean (steps per sink; a search step counts ``SEARCH_COST`` DFS
  steps), and chosen when it costs less. A switch is on trial until the next retry: when the new
  kind's running mean exceeds the old one's, the old kind comes back (one cheap sink can mislead:
  the cost of a warm start varies a lot from sink to sink). Costs are compared only
  between neighbouring sinks, since they drift along a row (on the adversarial input the sinks
  far from the source need several searches each).
  Warm: the max flow to the previous sink, moved to the new one in a pass over the layers from
  the bottom: what the new sink cannot take becomes excess, which each node first pushes on to
  the new sink along forward edges and only then cancels one layer up, so that the flow of the
  upper layers is kept. Cold: zero flow (the edges that carry flow get their capacity back, the
  bit sets are copied from the empty flow's). Neither kind wins on every input (a moved flow
  can need extra search phases), hence the choice per run of sinks. The min cuts
  proved by earlier sinks' last searches are kept and give upper bounds for the next sinks: a
  flow that reaches one needs no final search. A kept cut is its source side S above layer 1;
  for each new sink, every node of layer 1 joins S or not, whichever cuts less (its edge into the
  sink, or the edges from S into it). On the CLS row of real attention (a sink token, with its
  min cut next to the source) this gives the exact max-flow value of nearly every sink and saves
  their final searches.
* ``n_jobs`` threads share the (graph, output row, run of sinks) tasks; a graph is one sample, or
  one head of a sample with ``head_fusion="none"``. Memory: the graph (capacities, ``[layer, q,
  k]`` int64) plus, per thread, the residual arrays (two more), the bit sets (``L n² / 2`` bytes)
  and the bit sets by distance (``(L + 1)² n² / 16`` bytes, allocated untouched; a search touches
  the few rows in use): it does not depend on the number of rows, sinks, samples or heads.

Alternatives measured and not kept (a push-relabel variant, wave blocking flows, ...) are in
benchmarks/HISTORY.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

SCALE_BITS = 50
SCALE = float(2**SCALE_BITS)  # capacities are the head-fused, residual-corrected weights times this, as int64
N_HEAVY = 4  # edges per node tried first, by decreasing capacity, before the others by key
N_CUTS = 8  # min cuts remembered per output row, as upper bounds for the next sinks
EXPLORE = 16  # sinks between retries of the kind of start (warm or cold) not chosen; doubled while it loses
COST_DECAY = 0.25  # weight of the last sink in the running mean cost of the chosen kind of start
SEARCH_COST = 2  # DFS steps one search step (a node taken from the BFS queue) counts for, in those costs
_NO_LIMIT = 2**62  # sums of capacities saturate here: above any flow (at most n 2^50), below int64 overflow
COMPILE_TIME = "about a minute"  # numba compiling the kernels once (benchmarks/bench_startup.py measures it)

log = logging.getLogger(__name__)


def _graph(layers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Integer capacities of one graph's ``[layer, q, k]`` matrices Ã, their non-zero pattern as bits.

    Returns ``cap [layer, q, k]`` int64 (Ã · 2^50), ``nonzero [layer n + q, words]`` (bit k of row q
    set when cap[layer, q, k] > 0; 64 keys per uint64 word), ``nonzero_t [layer n + k, words]``
    (the same per column) and ``heavy [layer, q, N_HEAVY]`` (each row's largest capacities, keys
    by decreasing capacity, ties by key, -1 past the non-zero ones).
    """
    return _build_graph(np.ascontiguousarray(layers, dtype=np.float64), min(N_HEAVY, layers.shape[-1]))


def max_flows(graphs: np.ndarray, sources: np.ndarray, jobs: int) -> np.ndarray:
    """Raw integer flows ``[graph, len(sources), key]`` for ``[graph, layer, q, k]`` matrices.

    Graphs (samples, heads) are solved ``jobs`` at a time, each built just before: memory grows
    with the threads, never with the batch or the number of heads.
    """
    n_graphs, n = graphs.shape[0], graphs.shape[-1]
    out = np.zeros((n_graphs, len(sources), n), dtype=np.int64)
    group = max(1, min(jobs, n_graphs))
    # With fewer (graph, row) pairs than threads, split each row's sinks into runs so that every
    # thread has work.
    pairs = group * len(sources)
    n_runs = 1 if jobs == 1 or pairs >= 4 * jobs else min(n, math.ceil(2 * jobs / max(pairs, 1)))
    runs = np.array_split(np.arange(n, dtype=np.int64), n_runs)
    pool = ThreadPoolExecutor(max_workers=jobs) if jobs > 1 else None
    try:
        for first in range(0, n_graphs, group):
            built = {g: _graph(graphs[g]) for g in range(first, min(first + group, n_graphs))}
            tasks = [(g, r, run) for g in built for r in range(len(sources)) for run in runs]

            def solve(task: tuple[int, int, np.ndarray], built: dict = built) -> None:
                g, r, run = task
                _source_flows(*built[g], sources[r], run, out[g, r])

            if pool is None or len(tasks) == 1:
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
# Which residuals are positive is also kept as bit sets (64 nodes per uint64 word), so that a
# search jumps over saturated edges and dead or labelled nodes 64 at a time instead of testing
# them one by one (bit-set rows are numbered l n + node): ``res[l n + a]`` bit b: rf[l, a, b] > 0,
# ``res_t[l n + b]`` bit a: the same; ``flow[l n + b]`` bit a: rb[l, b, a] > 0, ``flow_t[l n + a]``
# bit b: the same. ``live[l]`` bit i: node
# (l, i) is labelled and not dead in the current phase (level >= 0).
# Line coverage cannot see compiled code; NUMBA_DISABLE_JIT=1 runs these functions as Python.
# The small helpers below are inlined by LLVM (forceinline), not by numba (inline="always"):
# numba's inlining binds each array argument to a new variable, with an atomic reference-count
# increment and decrement per call, which took ~30 % of the kernel's time.
# numba (and its compiler) load when a kernel is first called, not when attnflow is imported: the
# functions below are marked with `_kernel` and compiled together by `compile_kernels`.

_KERNELS: dict[str, bool] = {}  # name -> forceinline, of the functions numba compiles, in order
_COMPILE_LOCK = threading.Lock()
_compiled = False
trailing_zeros: Any = None  # numba's count-trailing-zeros intrinsic, bound by compile_kernels


def _kernel(forceinline: bool = False) -> Any:
    """Mark a function for numba (``njit(cache=True, nogil=True)``); until `compile_kernels` runs,
    the module-level name is a stand-in whose first call compiles every kernel and then runs."""

    def mark(function: Any) -> Any:
        _KERNELS[function.__name__] = forceinline

        def first_call(*args: Any) -> Any:
            compile_kernels()
            return globals()[function.__name__](*args)

        first_call.py_func = function  # type: ignore[attr-defined]
        return first_call

    return mark


def compile_kernels() -> None:
    """Replace the kernels' stand-ins by numba dispatchers and compile them, from numba's on-disk
    cache when it holds them (``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` beside this file, or
    the user's cache folder when that one is read-only); otherwise say first how long the one-time
    compilation takes. `make setup` calls this, so that the first ``--method flow`` does not wait."""
    global _compiled
    with _COMPILE_LOCK:
        if _compiled:
            return
        module = globals()
        from numba import config, njit
        from numba.cpython.unsafe.numbers import trailing_zeros

        for name, forceinline in _KERNELS.items():
            module[name] = njit(cache=True, nogil=True, forceinline=forceinline)(module[name].py_func)
        module["trailing_zeros"] = trailing_zeros  # an intrinsic the kernels call, bound when they compile
        _compiled = True
        if config.DISABLE_JIT or kernels_cached():
            return
        log.warning("compiling the flow kernel once (%s; later runs load it from the cache)", COMPILE_TIME)
        began = time.perf_counter()
        sinks = np.arange(2, dtype=np.int64)
        _source_flows(*_graph(np.full((1, 2, 2), 0.5)), np.int64(0), sinks, np.zeros(2, np.int64))
        log.info("compiled the flow kernel in %.0f s", time.perf_counter() - began)


def kernels_cached() -> bool:
    """Whether numba's cache holds the compiled kernels (for this source, Python and machine).
    Call it after `compile_kernels` has made the dispatchers; False when numba cannot tell."""
    try:
        return all(bool(globals()[name]._cache._cache_file._load_index()) for name in ("_build_graph", "_source_flows"))
    except (AttributeError, OSError):  # NUMBA_DISABLE_JIT, or another numba version
        return False


_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


@_kernel(forceinline=True)
def _set(bits, row, i):  # pragma: no cover
    bits[row, i >> 6] |= _ONE << np.uint64(i & 63)


@_kernel(forceinline=True)
def _clear(bits, row, i):  # pragma: no cover
    bits[row, i >> 6] &= ~(_ONE << np.uint64(i & 63))


@_kernel(forceinline=True)
def _alive(bits, row, i):  # pragma: no cover
    """Whether bit i of ``bits[row]`` is set (with ``live``: node (row, i) alive in this phase)."""
    return (bits[row, i >> 6] >> np.uint64(i & 63)) & _ONE != 0


@_kernel(forceinline=True)
def _next(x, x_row, y, y_row, y_inverted, start, n):  # pragma: no cover
    """First index >= start whose bit is set in ``x[x_row] & y[y_row]`` (``& ~y[y_row]`` when
    y_inverted), else n."""
    if start >= n:
        return n
    w = start >> 6
    flip = _ALL if y_inverted else np.uint64(0)
    word = x[x_row, w] & (y[y_row, w] ^ flip) & (_ALL << np.uint64(start & 63))
    while word == 0:
        w += 1
        if w >= x.shape[1]:
            return n
        word = x[x_row, w] & (y[y_row, w] ^ flip)
    return (w << 6) + int(trailing_zeros(word))


@_kernel(forceinline=True)
def _add(values, by_row, by_col, layer, x, y, d):  # pragma: no cover
    """values[layer, x, y] += d, keeping bit y of by_row[layer n + x] and bit x of by_col[layer n + y] = (value > 0)."""
    before = values[layer, x, y]
    after = before + d
    values[layer, x, y] = after
    n = values.shape[1]
    if before > 0 and after == 0:
        _clear(by_row, layer * n + x, y)
        _clear(by_col, layer * n + y, x)
    elif before == 0 and after > 0:
        _set(by_row, layer * n + x, y)
        _set(by_col, layer * n + y, x)


@_kernel(forceinline=True)
def _shift(rf, rb, res, res_t, flow, flow_t, layer, a, b, d):  # pragma: no cover
    """Send d more units (d < 0: cancel -d) along (layer+1, a) -> (layer, b), keeping the bit sets in step."""
    _add(rf, res, res_t, layer, a, b, -d)
    _add(rb, flow, flow_t, layer, b, a, d)


@_kernel()
def _build_graph(layers, n_heavy):  # pragma: no cover
    """One pass over ``layers [layer, q, k]`` for `_graph`."""
    n_layers, n = layers.shape[0], layers.shape[2]
    words = (n + 63) // 64
    cap = np.empty((n_layers, n, n), np.int64)
    nonzero = np.zeros((n_layers * n, words), np.uint64)
    nonzero_t = np.zeros((n_layers * n, words), np.uint64)
    heavy = np.full((n_layers, n, n_heavy), -1, np.int64)
    for layer in range(n_layers):
        for q in range(n):
            top = heavy[layer, q]
            for k in range(n):
                c = np.int64(np.rint(layers[layer, q, k] * SCALE))
                cap[layer, q, k] = c
                if c <= 0:
                    continue
                _set(nonzero, layer * n + q, k)
                _set(nonzero_t, layer * n + k, q)
                place = n_heavy  # insertion into the row's top list (earlier keys win ties)
                while place > 0 and (top[place - 1] < 0 or cap[layer, q, top[place - 1]] < c):
                    place -= 1
                if place < n_heavy:
                    top[place + 1 :] = top[place:-1].copy()
                    top[place] = k
    return cap, nonzero, nonzero_t, heavy


@_kernel()
def _distances(state, live, by_level, slots, used, source, sink, level, queue, steps, layer_of):  # pragma: no cover
    """BFS from the sink over reversed residual edges: ``level`` = distance to the sink.

    Stops once the source is labelled (nodes farther away cannot be on a shortest path).
    Returns False when the source cannot reach the sink. ``live`` ends up marking the labelled nodes;
    ``steps[0]`` counts SEARCH_COST per node taken from the queue.

    The labelled nodes are also sorted by distance into the bit sets ``by_level``: every edge goes
    one layer up or down, so a node's distance and layer have the same parity, and node (l, i) at
    distance d is bit i of row l * slots + (d − l) / 2. The DFS of `_blocking_flow` then finds the
    nodes one step nearer to the sink as one row: a node's children (a layer down) in its own row
    index, its parents (a layer up) in the one before. ``used[0]``: the rows per layer in use,
    cleared at the next search.
    """
    rf, _, _, res_t, _, flow_t = state  # searches read the column bit sets
    n_layers = rf.shape[0]
    n = rf.shape[1]
    s = n_layers * n + source
    level[:] = -1
    live[:] = 0
    for layer in range(n_layers + 1):
        for row in range(layer * slots, layer * slots + used[0]):
            for w in range(by_level.shape[1]):
                by_level[row, w] = 0
    used[0] = 1
    level[sink] = 0
    _set(live, 0, sink)
    _set(by_level, 0, sink)
    queue[0] = sink
    head = 0
    tail = 1
    while head < tail:
        v = queue[head]
        head += 1
        steps[0] += SEARCH_COST
        vl = layer_of[v]
        vi = v - vl * n
        lv = level[v] + 1
        up = (lv - vl - 1) >> 1  # rows of by_level for distance lv, a layer up and a layer down
        down = (lv - vl + 1) >> 1
        used[0] = max(used[0], down + 1)
        if vl == n_layers - 1:  # only the source feeds this layer
            if rf[vl, source, vi] > 0:
                level[s] = lv  # BFS order: every node nearer to the sink is labelled already
                return True
        else:  # (vl+1, a) -> (vl, vi) with room left, (vl+1, a) not labelled yet
            a = _next(res_t, vl * n + vi, live, vl + 1, True, 0, n)
            while a < n:
                w = (vl + 1) * n + a
                level[w] = lv
                _set(live, vl + 1, a)
                _set(by_level, (vl + 1) * slots + up, a)
                queue[tail] = w
                tail += 1
                a = _next(res_t, vl * n + vi, live, vl + 1, True, a + 1, n)
        if vl >= 2:  # (vl-1, c) -> (vl, vi): cancels flow on (vl, vi) -> (vl-1, c)
            c = _next(flow_t, (vl - 1) * n + vi, live, vl - 1, True, 0, n)
            while c < n:
                w = (vl - 1) * n + c
                level[w] = lv
                _set(live, vl - 1, c)
                _set(by_level, (vl - 1) * slots + down, c)
                queue[tail] = w
                tail += 1
                c = _next(flow_t, (vl - 1) * n + vi, live, vl - 1, True, c + 1, n)
    return False


@_kernel()
def _blocking_flow(state, heavy, by_level, slots, start, sink, level, limit, work, fresh):  # pragma: no cover
    """Push up to ``limit`` units from node ``start`` along edges that go one step nearer to the sink (``level``).

    The searched phases' DFS (the first phase has `_forward_flow`), with current arcs, that splits
    a node's flow over its edges (multi-push); the edges of a node are tried in key order, found
    through the bit sets: ``by_level`` (see `_distances`) holds the live nodes of each layer by
    distance, so the search ANDs a node's residual edges with the nodes one step nearer to the
    sink and skips saturated edges, dead nodes and nodes at other distances 64 at a time.

    ``work`` holds the per-node current arc (reset when ``fresh``; kept across calls within one
    phase), the DFS stack (node, edge, budget, pushed), a step counter (``steps[0]``: one per
    visit of a node) and each node's layer.
    Returns the flow pushed. Exhausted nodes get level -1 and leave ``by_level`` (dead for the
    rest of the phase).
    """
    rf, rb, res, res_t, flow, flow_t = state  # the DFS reads the row bit sets
    n_layers = rf.shape[0]
    n = rf.shape[1]
    n_heavy = heavy.shape[2]
    cur, st_node, st_kind, st_blk, st_a, st_b, budget, got, steps, layer_of = work
    if fresh:
        cur[:] = 0
    depth = 0
    st_node[0] = start
    budget[0] = limit
    got[0] = 0
    visits = 0
    while True:
        visits += 1
        u = st_node[depth]
        if u == sink:
            d = budget[depth]
        else:
            ul = layer_of[u]
            ui = u - ul * n
            lu = level[u]
            here = (lu - ul) >> 1  # u's row of by_level: its children one step nearer are in the same one
            k = cur[u]
            v = -1
            r = 0
            # Edge positions: [0, n_fwd) forward ones (down a layer; from layer 1 only the one
            # into the sink), then [n_fwd, n_fwd + n) reverse ones (back up a layer, along flow),
            # by key.
            n_fwd = 1 if ul == 1 else n_heavy + n
            n_edges = n_fwd + n if 1 <= ul <= n_layers - 2 and here > 0 else n_fwd
            while k < n_edges:
                if ul == 1 and k == 0:
                    if rf[0, ui, sink] > 0 and lu == 1:
                        v = sink
                        st_kind[depth] = 0
                        st_blk[depth] = 0
                        st_a[depth] = ui
                        st_b[depth] = sink
                        r = rf[0, ui, sink]
                        break
                    k = 1
                elif k < n_fwd:
                    if k < n_heavy:  # the largest capacities first
                        b = heavy[ul - 1, ui, k]
                        if b < 0:
                            k = n_heavy
                            continue
                    else:  # then every edge by key (the heavy ones again: at most one more test each)
                        b = _next(res, (ul - 1) * n + ui, by_level, (ul - 1) * slots + here, False, k - n_heavy, n)
                        if b >= n:
                            k = n_fwd
                            continue
                        k = n_heavy + b
                    w = (ul - 1) * n + b
                    if level[w] == lu - 1 and rf[ul - 1, ui, b] > 0:
                        if lu == 2:  # a child at distance 1 (layer 1) can only go into the sink: push there at once
                            d = min(budget[depth] - got[depth], rf[1, ui, b], rf[0, b, sink])
                            _shift(rf, rb, res, res_t, flow, flow_t, 0, b, sink, d)
                            _shift(rf, rb, res, res_t, flow, flow_t, 1, ui, b, d)
                            got[depth] += d
                            if rf[0, b, sink] == 0:
                                level[w] = -1
                                _clear(by_level, slots, b)  # layer 1, distance 1
                            if got[depth] == budget[depth]:
                                break  # placed all it was asked for (the edge may have room left)
                            k += 1  # the edge or the child's edge into the sink is full
                            continue
                        v = w
                        st_kind[depth] = 0
                        st_blk[depth] = ul - 1
                        st_a[depth] = ui
                        st_b[depth] = b
                        r = rf[ul - 1, ui, b]
                        break
                    k += 1
                else:
                    a = _next(flow, ul * n + ui, by_level, (ul + 1) * slots + here - 1, False, k - n_fwd, n)
                    if a >= n:
                        k = n_edges
                        continue
                    k = n_fwd + a
                    w = (ul + 1) * n + a
                    if level[w] == lu - 1:
                        v = w
                        st_kind[depth] = 1
                        st_blk[depth] = ul
                        st_a[depth] = a
                        st_b[depth] = ui
                        r = rb[ul, ui, a]
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
            if got[depth] < budget[depth]:  # no admissible edge left: dead for this phase
                level[u] = -1
                _clear(by_level, ul * slots + here, ui)
            d = got[depth]
        # Hand d units back up the stack until a node still has budget left to place.
        while True:
            if depth == 0:
                steps[0] += visits
                return d
            asked = budget[depth]
            depth -= 1
            blk = st_blk[depth]
            a = st_a[depth]
            b = st_b[depth]
            left = 0
            if d > 0:
                if st_kind[depth] == 0:
                    _shift(rf, rb, res, res_t, flow, flow_t, blk, a, b, d)
                    left = rf[blk, a, b]
                else:
                    _shift(rf, rb, res, res_t, flow, flow_t, blk, a, b, -d)
                    left = rb[blk, b, a]
                got[depth] += d
            if left == 0 or d < asked:
                cur[st_node[depth]] += 1  # edge saturated or child blocked: next edge
            if got[depth] < budget[depth]:
                break
            d = got[depth]


@_kernel(forceinline=True)
def _forward_flow(state, heavy, live, top, start, sink, limit, work, fresh):  # pragma: no cover
    """Push up to ``limit`` units from node (top, start), top >= 2, to the sink along forward residual edges.

    The search-free phase of Dinic's algorithm: every edge goes down one layer, so the distances
    to the sink are the layers, a DFS step from layer l always goes to layer l − 1 and the stack
    depth gives the layer (only node indices are kept; ``level`` is not read). Otherwise the DFS
    of `_blocking_flow`: multi-push, current arcs (positions: the ``N_HEAVY`` largest capacities,
    then every edge by key), dead nodes leave ``live``, and a node of layer 2 pushes into the
    sink through its children at once. ``work`` and ``fresh`` as there. Returns the flow pushed.

    No early return before the DFS: numba then keeps reference-count updates of the array
    arguments on every call (it is called once per node with excess when a flow moves to the
    next sink), which made the whole kernel 1.3x slower.
    """
    rf, rb, res, res_t, flow, flow_t = state
    n = rf.shape[1]
    n_heavy = heavy.shape[2]
    cur = work[0]
    st_node = work[1]
    budget = work[6]
    got = work[7]
    steps = work[8]
    if fresh:
        cur[:] = 0
    n_positions = n_heavy + n
    depth = 0
    st_node[0] = start
    budget[0] = limit
    got[0] = 0
    visits = 0
    while True:
        visits += 1
        layer = top - depth
        ui = st_node[depth]
        blk = layer - 1
        node = layer * n + ui
        want = budget[depth] - got[depth]
        k = cur[node]
        child = -1
        while k < n_positions:
            if k < n_heavy:  # the largest capacities first
                b = heavy[blk, ui, k]
                if b < 0:
                    k = n_heavy
                    continue
                if rf[blk, ui, b] == 0 or not _alive(live, blk, b):
                    k += 1
                    continue
            else:  # then every edge by key (the heavy ones again: at most one more test each)
                b = _next(res, blk * n + ui, live, blk, False, k - n_heavy, n)
                if b >= n:
                    k = n_positions
                    break
                k = n_heavy + b
            if layer == 2:  # a child of layer 1 can only go into the sink: push there at once
                d = min(want, rf[1, ui, b], rf[0, b, sink])
                _shift(rf, rb, res, res_t, flow, flow_t, 0, b, sink, d)
                _shift(rf, rb, res, res_t, flow, flow_t, 1, ui, b, d)
                got[depth] += d
                want -= d
                if rf[0, b, sink] == 0:
                    _clear(live, 1, b)
                if want == 0:
                    break  # placed all it was asked for (the edge may have room left)
                k += 1  # the edge or the child's edge into the sink is full
                continue
            child = b
            break
        cur[node] = k
        if child >= 0:  # descend, asking for what this node still has to place
            depth += 1
            st_node[depth] = child
            budget[depth] = min(want, rf[blk, ui, child])
            got[depth] = 0
            continue
        if want > 0:  # no usable edge left: dead for this phase
            _clear(live, layer, ui)
        d = got[depth]
        # Hand d units back up the stack until a node still has budget left to place.
        while True:
            if depth == 0:
                steps[0] += visits
                return d
            asked = budget[depth]
            b = st_node[depth]
            depth -= 1
            layer = top - depth
            a = st_node[depth]
            if d > 0:
                _shift(rf, rb, res, res_t, flow, flow_t, layer - 1, a, b, d)
                got[depth] += d
            if d < asked or rf[layer - 1, a, b] == 0:
                cur[layer * n + a] += 1  # child blocked or edge saturated: next edge
            if got[depth] < budget[depth]:
                break
            d = got[depth]


@_kernel()
def _move_sink(cap, state, heavy, live, all_live, work, source, old_sink, new_sink, surplus, limit):  # pragma: no cover
    """Turn the max flow into ``old_sink`` into a valid flow into ``new_sink`` (at most ``limit``); returns its value.

    Edge (1, a) -> sink keeps min(its flow, new capacity); the rest becomes excess at (1, a).
    Then, layer by layer from the bottom, each node pushes its excess on to the new sink along
    forward edges (a forward-only DFS from that node), and what it cannot place is cancelled one
    layer up along edges that carry flow; at the top, off the source's edges. The flow of the
    upper layers, which does not depend much on the sink, is kept.
    """
    rf, rb, res, res_t, flow, flow_t = state
    n_layers = cap.shape[0]
    n = cap.shape[1]
    value = 0
    for a in range(n):
        f = rb[0, old_sink, a]
        _shift(rf, rb, res, res_t, flow, flow_t, 0, a, old_sink, -f)
        keep = min(f, cap[0, a, new_sink])
        _shift(rf, rb, res, res_t, flow, flow_t, 0, a, new_sink, keep)
        value += keep
        surplus[a] = f - keep  # surplus[a]: excess of node (layer, a) on the layer being handled
    live[:] = all_live
    fresh = True
    for layer in range(1, n_layers):
        if layer >= 2:  # (1, a) has no other way to the sink
            for b in range(n):
                s = surplus[b]
                if s > 0 and value < limit and _alive(live, layer, b):
                    pushed = _forward_flow(state, heavy, live, layer, b, new_sink, min(s, limit - value), work, fresh)
                    fresh = False
                    value += pushed
                    surplus[b] = s - pushed
        for b in range(n):
            s = surplus[b]
            if s == 0:
                continue
            surplus[b] = 0
            if layer == n_layers - 1:  # only the source feeds the top layer
                _shift(rf, rb, res, res_t, flow, flow_t, layer, source, b, -s)
                continue
            a = _next(flow, layer * n + b, flow, layer * n + b, False, 0, n)
            while s > 0:  # (layer, b) has at least s units coming in: the loop ends before a reaches n
                take = min(s, rb[layer, b, a])
                _shift(rf, rb, res, res_t, flow, flow_t, layer, a, b, -take)
                surplus[n + a] += take
                s -= take
                a = _next(flow, layer * n + b, flow, layer * n + b, False, a + 1, n)
        for a in range(n):  # the next layer's excess becomes the current one
            surplus[a] = surplus[n + a]
            surplus[n + a] = 0
    for a in range(n):
        surplus[a] = 0  # excess of the source layer (L == 1) is simply dropped
    return value


@_kernel()
def _clear_flow(state, nonzero, nonzero_t):  # pragma: no cover
    """Back to zero flow: the edges that carry some (found through the flow bit sets) get their
    capacity back, and the bit sets are those of the empty flow (``nonzero``, ``nonzero_t`` and
    zeros), copied a word at a time instead of kept in step edge by edge."""
    rf, rb, res, res_t, flow, flow_t = state
    n = rb.shape[1]
    for row in range(flow.shape[0]):  # row = layer n + b: the edges (layer+1, a) -> (layer, b) with flow
        layer = row // n
        b = row - layer * n
        for w in range(flow.shape[1]):
            word = flow[row, w]
            while word != 0:
                a = (w << 6) + int(trailing_zeros(word))
                rf[layer, a, b] += rb[layer, b, a]
                rb[layer, b, a] = 0
                word &= word - _ONE
            flow[row, w] = 0
            flow_t[row, w] = 0
            res[row, w] = nonzero[row, w]
            res_t[row, w] = nonzero_t[row, w]


@_kernel()
def _source_side_cut(cap, level, source, into_inputs, limit):  # pragma: no cover
    """Remember the min cut found by a failed search, to bound the flows to later sinks.

    S = the nodes that cannot reach the sink (``level < 0``). Returns the capacity of the edges
    from S to the other nodes of layers 2 … L−1, which does not depend on the sink, and writes to
    ``into_inputs[a]`` the capacity from S into (1, a). For another sink j, each (1, a) can join
    S (cutting its edge into j) or not (cutting the edges from S into it), whichever is smaller:
    the cut's bound for j is the returned base + Σₐ min(cap[0, a, j], into_inputs[a]). Returns -1
    (nothing remembered) when S holds more than half the nodes of layers 2 … L−1 (such cuts rarely
    fit another sink) or when the base exceeds ``limit`` (the source's capacity, already a bound;
    stopping there also keeps the sums far from int64 overflow).
    """
    n_layers = cap.shape[0]
    n = cap.shape[1]
    if n_layers == 1:
        return -1
    in_s = 0
    for u in range(2 * n, n_layers * n):
        if level[u] < 0:
            in_s += 1
    if 2 * in_s > (n_layers - 2) * n:
        return -1
    into_inputs[:] = 0
    total = 0
    for layer in range(2, n_layers + 1):
        for a in range(n):
            if (layer == n_layers and a != source) or (layer < n_layers and level[layer * n + a] >= 0):
                continue
            if layer == 2:
                for b in range(n):
                    into_inputs[b] = min(into_inputs[b] + cap[1, a, b], _NO_LIMIT)
            else:
                for b in range(n):
                    if level[(layer - 1) * n + b] >= 0:
                        total += cap[layer - 1, a, b]
                if total > limit:  # each node adds at most its row sum, ~2^50
                    return -1
    return total


@_kernel()
def _source_flows(cap, nonzero, nonzero_t, heavy, source, sinks, out):  # pragma: no cover
    """Max flow from (L, source) to each (0, sink) in ``sinks``, written to ``out[sink]``.

    ``cap [layer, q, k]`` are the integer capacities; ``nonzero``/``nonzero_t`` their bit sets
    (see ``_graph``).
    """
    n_layers = cap.shape[0]
    n = cap.shape[1]
    n_nodes = (n_layers + 1) * n
    words = nonzero.shape[1]
    state = (
        cap.copy(),  # rf
        np.zeros_like(cap),  # rb
        nonzero.copy(),  # res
        nonzero_t.copy(),  # res_t
        np.zeros_like(nonzero),  # flow
        np.zeros_like(nonzero),  # flow_t
    )
    live = np.zeros((n_layers + 1, words), np.uint64)
    all_live = np.zeros((n_layers + 1, words), np.uint64)
    for i in range(n):
        for layer in range(n_layers + 1):
            _set(all_live, layer, i)
    level = np.empty(n_nodes, np.int64)
    queue = np.empty(n_nodes, np.int64)
    slots = n_nodes // 2 + 1  # (distance - layer) / 2 of a node is below this
    by_level = np.zeros(((n_layers + 1) * slots, words), np.uint64)  # see _distances
    used = np.zeros(1, np.int64)
    surplus = np.zeros(2 * n, np.int64)
    steps = np.zeros(1, np.int64)  # search and DFS steps so far, the cost of a sink's max-flow
    stack = n_nodes + 1  # a DFS path visits each distance to the sink at most once
    layer_of = np.arange(n_nodes) // n  # layer of each node id (cheaper than a division per step)
    work = (
        np.zeros(n_nodes, np.int64),  # current arc per node
        np.empty(stack, np.int64),  # DFS stack: node
        np.empty(stack, np.int64),  # edge kind (0 forward, 1 reverse), block, tail row, head column
        np.empty(stack, np.int64),
        np.empty(stack, np.int64),
        np.empty(stack, np.int64),
        np.empty(stack, np.int64),  # budget
        np.empty(stack, np.int64),  # pushed so far
        steps,
        layer_of,
    )
    out_capacity = 0
    for b in range(n):
        out_capacity += cap[n_layers - 1, source, b]
    flow = 0
    previous = -1
    # Warm or cold start (module docstring): the kind chosen, the running mean of its cost (steps
    # per sink), and while a switch is on trial the cost of the kind given up (-1 otherwise).
    warm_chosen = True
    chosen_cost = 0.0
    given_up_cost = -1.0
    since_switch = 0
    # Min cuts of earlier sinks, reused as upper bounds (see _source_side_cut), a ring of them.
    cut_base = np.full(N_CUTS, -1, np.int64)
    cut_into = np.zeros((N_CUTS, n), np.int64)
    n_cuts = 0
    interval = EXPLORE
    next_retry = EXPLORE
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
                for a in range(n):  # (1, a) in S or not, whichever cuts less
                    cut += min(cap[0, a, sink], cut_into[c, a])
                    if cut > bound:  # no larger sums: no int64 overflow for any n
                        break
                bound = min(bound, cut)
        retry = index == 2 or (index > 2 and index >= next_retry)  # the kind not chosen, this once
        warm = index >= 1 and warm_chosen != retry
        began = steps[0]
        if warm:
            flow = _move_sink(cap, state, heavy, live, all_live, work, source, previous, sink, surplus, bound)
        elif previous >= 0:
            _clear_flow(state, nonzero, nonzero_t)
            flow = 0
        previous = sink
        if flow < bound:  # first phase on forward edges only: distances are the layers, no search
            if n_layers == 1:  # one edge from the source into the sink
                rf, rb, res, res_t, carried, carried_t = state
                d = min(bound - flow, rf[0, source, sink])
                _shift(rf, rb, res, res_t, carried, carried_t, 0, source, sink, d)
                flow += d
            else:
                live[:] = all_live
                flow += _forward_flow(state, heavy, live, n_layers, source, sink, bound - flow, work, True)
        while flow < bound:
            if not _distances(state, live, by_level, slots, used, source, sink, level, queue, steps, layer_of):
                slot = n_cuts % N_CUTS
                cut_base[slot] = _source_side_cut(cap, level, source, cut_into[slot], out_capacity)
                n_cuts += cut_base[slot] >= 0
                break  # no augmenting path: the flow is maximum
            pushed = _blocking_flow(
                state, heavy, by_level, slots, n_layers * n + source, sink, level, bound - flow, work, True
            )
            if pushed == 0:  # a search that reached the source leaves a path to push along: a bug, not a loop
                raise RuntimeError("attention flow: a searched phase pushed no flow (internal error)")
            flow += pushed
        out[sink] = flow
        if index > 0:
            spent = float(steps[0] - began)
            if not retry:
                chosen_cost = spent if index == 1 else (1 - COST_DECAY) * chosen_cost + COST_DECAY * spent
                since_switch += 1
                if given_up_cost >= 0 and since_switch >= 2 and chosen_cost > given_up_cost:
                    warm_chosen = not warm_chosen  # the last switch did not pay: back
                    chosen_cost, given_up_cost = given_up_cost, -1.0
            elif spent < chosen_cost:  # the other kind did better than the chosen one lately: switch
                given_up_cost, chosen_cost = chosen_cost, spent
                warm_chosen = warm
                since_switch = 0
                interval = EXPLORE
                next_retry = index + interval
            else:  # it lost again: the chosen kind stays, and is retried half as often
                given_up_cost = -1.0
                interval = EXPLORE if index == 2 else 2 * interval
                next_retry = index + interval
