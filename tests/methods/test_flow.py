"""Attention flow against an independent oracle: networkx max-flow on the layered graph (docs/methods.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnflow.methods import attention_flow, get_method
from attnflow.methods.registry import call_method, method_options


def softmax_attentions(rng, n_layers, n_heads, n, *, sharpness=3.0, causal=False, sparse=False):
    """Random softmax weights ``[layer, head, query, key]``; optionally causal or with exact zeros."""
    logits = rng.normal(size=(n_layers, n_heads, n, n)) * sharpness
    if causal:
        logits = logits + np.triu(np.full((n, n), -np.inf), 1)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    if sparse:  # zero-capacity edges: drop small weights, renormalise
        weights = np.where(weights < 0.12, 0.0, weights)
        weights /= weights.sum(axis=-1, keepdims=True)
    return weights


def structured_attentions(rng, n_layers, n_heads, n):
    """Sharp, local attention with a sink token: min cuts inside the graph, not only at its ends."""
    logits = rng.normal(size=(n_layers, n_heads, n, n)) * 4.0
    logits[..., 0] += 4.0
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    logits -= distance * rng.uniform(0, 2, size=(n_layers, n_heads, 1, 1))
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def capacities(attentions, head_fusion="mean", residual="half"):
    """Ã per layer, written out from docs/methods.md (independently of attnflow.methods.transforms)."""
    if isinstance(head_fusion, str):
        fused = {"mean": np.mean, "max": np.max, "min": np.min}[head_fusion](attentions, axis=-3)
        fused = fused / fused.sum(axis=-1, keepdims=True)  # max/min are renormalised; mean unchanged
    else:
        weights = np.asarray(head_fusion, dtype=float) / np.sum(head_fusion)
        fused = np.einsum("lhqk,h->lqk", attentions, weights)
    eye = np.eye(attentions.shape[-1])
    if residual == "half":
        return 0.5 * (fused + eye)
    if residual == "renorm":
        return (fused + eye) / (fused + eye).sum(axis=-1, keepdims=True)
    if residual == "none":
        return fused
    return residual * fused + (1 - residual) * eye


def networkx_flows(layers, rows=None, cols=None):
    """Raw flow matrix from networkx: one maximum_flow_value per (output, input) pair."""
    n_layers, n, _ = layers.shape
    graph = nx.DiGraph()
    for l in range(n_layers):
        for i, j in zip(*np.nonzero(layers[l])):
            graph.add_edge((l + 1, i), (l, j), capacity=float(layers[l, i, j]))
    rows = range(n) if rows is None else rows
    cols = range(n) if cols is None else cols
    return np.array(
        [
            [nx.maximum_flow_value(graph, (n_layers, i), (0, j)) if graph.has_node((0, j)) else 0.0 for j in cols]
            for i in rows
        ]
    )


ORACLE_CASES = [
    # (head_fusion, residual, n_layers, n, attention kind)
    ("mean", "half", 3, 8, "dense"),
    ("mean", "half", 4, 12, "dense"),
    ("max", "renorm", 3, 7, "dense"),
    ("min", 0.3, 2, 6, "dense"),
    ([0.2, 0.5, 0.3], "none", 3, 8, "sparse"),
    ("mean", "none", 4, 9, "causal"),
    ("mean", 0.8, 4, 10, "structured"),
    ("max", "half", 3, 12, "structured"),
    ("mean", "none", 4, 12, "structured"),
]


@pytest.mark.parametrize("head_fusion, residual, n_layers, n, kind", ORACLE_CASES)
def test_matches_networkx_raw_and_normalized(head_fusion, residual, n_layers, n, kind):
    rng = np.random.default_rng(n * 31 + n_layers)
    if kind == "structured":
        attentions = structured_attentions(rng, n_layers, 3, n)
    else:
        attentions = softmax_attentions(rng, n_layers, 3, n, causal=kind == "causal", sparse=kind == "sparse")
    expected = networkx_flows(capacities(attentions, head_fusion, residual))

    raw = attention_flow(attentions, head_fusion=head_fusion, residual=residual, normalize=False)
    normalized = attention_flow(attentions, head_fusion=head_fusion, residual=residual)

    assert raw.shape == normalized.shape == (n, n) and raw.dtype == np.float64
    np.testing.assert_allclose(raw, expected, rtol=0, atol=1e-9)
    np.testing.assert_allclose(normalized, expected / expected.sum(axis=-1, keepdims=True), rtol=0, atol=1e-9)


def test_matches_networkx_on_a_larger_graph_with_inner_cuts():
    # n = 40 exercises everything the kernel does across a run of sinks: warm starts, cancelling
    # flow, BFS phases and cold restarts (most pairs here are not at the trivial bound).
    rng = np.random.default_rng(7)
    attentions = structured_attentions(rng, 6, 2, 40)
    layers = capacities(attentions, "mean", 0.7)
    raw = attention_flow(attentions, residual=0.7, rows=[0, 21], normalize=False)
    cols = np.arange(0, 40, 3)  # the kernel solves every sink in turn; networkx checks every third
    expected = networkx_flows(layers, rows=[0, 21], cols=cols)
    np.testing.assert_allclose(raw[:, cols], expected, rtol=0, atol=1e-9)
    assert_inner_cuts(expected, layers, cols)


def sharp_local_attentions(rng, n_layers, n_heads, n):
    """The benchmark's adversarial input: sharp (logits sigma 4), local (-0.5 per position of
    distance), with a sink token 0 (+4): most flows stop at cuts inside the graph."""
    logits = rng.normal(size=(n_layers, n_heads, n, n)) * 4.0
    logits[..., 0] += 4.0
    logits -= 0.5 * np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def assert_inner_cuts(expected, layers, cols, share=0.2):
    """The oracle case is not trivial: many flows stay below min(1, column sum)."""
    trivial_bound = np.minimum(1.0, layers[0].sum(axis=0))[cols]
    assert np.mean(np.abs(expected - trivial_bound) > 1e-6) > share


def test_matches_networkx_on_the_sharp_local_input():
    rng = np.random.default_rng(12)
    attentions = sharp_local_attentions(rng, 6, 1, 24)  # one sharp head: most flows stop inside
    layers = capacities(attentions)
    raw = attention_flow(attentions, rows=[0, 23], normalize=False)
    expected = networkx_flows(layers, rows=[0, 23])
    np.testing.assert_allclose(raw, expected, rtol=0, atol=1e-9)
    assert_inner_cuts(expected, layers, np.arange(24))


@pytest.mark.parametrize("n_layers, n, rows", [(3, 70, [0, 37]), (2, 131, [130])])
def test_matches_networkx_beyond_one_word_of_nodes(n_layers, n, rows):
    # The kernel keeps residuals and live nodes as 64-bit words: n > 64 and n > 128 cross words.
    rng = np.random.default_rng(n)
    attentions = structured_attentions(rng, n_layers, 2, n)
    layers = capacities(attentions, "mean", 0.6)
    raw = attention_flow(attentions, residual=0.6, rows=rows, normalize=False)
    cols = np.array([0, rows[0], 63, 64, n - 1])  # the kernel solves every sink; networkx checks these
    expected = networkx_flows(layers, rows=rows, cols=cols)
    np.testing.assert_allclose(raw[:, cols], expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("residual, kind", [("half", "dense"), (0.6, "structured"), ("renorm", "sharp_local")])
def test_per_head_flow_matches_networkx_on_each_heads_own_graph(residual, kind):
    rng = np.random.default_rng(13)
    n_layers, n_heads, n = 4, 3, 9
    attentions = {
        "dense": lambda: softmax_attentions(rng, n_layers, n_heads, n),
        "structured": lambda: structured_attentions(rng, n_layers, n_heads, n),
        "sharp_local": lambda: sharp_local_attentions(rng, n_layers, n_heads, n),
    }[kind]()
    raw = attention_flow(attentions, head_fusion="none", residual=residual, normalize=False)
    normalized = attention_flow(attentions, head_fusion="none", residual=residual)
    assert raw.shape == normalized.shape == (n_heads, n, n)
    for head in range(n_heads):
        # head h alone, through every layer: the "mean" of one head is that head
        expected = networkx_flows(capacities(attentions[:, [head]], "mean", residual))
        np.testing.assert_allclose(raw[head], expected, rtol=0, atol=1e-9)
        np.testing.assert_allclose(normalized[head], expected / expected.sum(-1, keepdims=True), rtol=0, atol=1e-9)
    # heads really differ: a per-head graph is not the fused one
    assert np.abs(raw - attention_flow(attentions, residual=residual, normalize=False)).max() > 1e-3


def test_per_head_flow_batched_rows_layer_and_threads():
    rng = np.random.default_rng(14)
    batch = np.stack([structured_attentions(rng, 3, 4, 11) for _ in range(2)])  # [batch, layer, head, q, k]
    one_thread = attention_flow(batch, head_fusion="none", rows=[0, -1], layer=2)
    assert one_thread.shape == (2, 4, 2, 11)  # [batch, head, rows, key]
    for b in range(2):
        for head in range(4):
            np.testing.assert_array_equal(
                one_thread[b, head], attention_flow(batch[b][:, [head]], rows=[0, 10], layer=2)
            )
    for n_jobs in (2, -1):  # threads over (graph, row, run of sinks): the same flows
        np.testing.assert_array_equal(
            attention_flow(batch, head_fusion="none", rows=[0, -1], layer=2, n_jobs=n_jobs), one_thread
        )
    single = attention_flow(torch.from_numpy(batch[0]), head_fusion="none", rows=[0], n_jobs=2)
    assert isinstance(single, torch.Tensor) and single.shape == (4, 1, 11)


def test_real_minilm_attention_cls_row_and_per_head_match_networkx(minilm):
    trace = minilm.trace("Attention flow follows information through every layer of the model.")[0]
    attentions = np.asarray(trace.attentions, dtype=np.float64)  # [layer, head, query, key], float32 capture
    attentions /= attentions.sum(axis=-1, keepdims=True)
    n = attentions.shape[-1]
    cls = attention_flow(attentions, rows=[0], normalize=False)
    np.testing.assert_allclose(cls, networkx_flows(capacities(attentions), rows=[0]), rtol=0, atol=1e-9)
    per_head = attention_flow(attentions, head_fusion="none", rows=[0], normalize=False, n_jobs=2)
    assert per_head.shape == (attentions.shape[1], 1, n)
    for head in (0, 7):
        expected = networkx_flows(capacities(attentions[:, [head]]), rows=[0])
        np.testing.assert_allclose(per_head[head], expected, rtol=0, atol=1e-9)


def test_raw_flow_is_between_zero_and_the_trivial_bounds():
    attentions = structured_attentions(np.random.default_rng(3), 4, 2, 16)
    layers = capacities(attentions)
    raw = attention_flow(attentions, normalize=False)
    assert raw.min() >= 0.0
    assert raw.max() <= 1.0 + 1e-12  # a source sends at most its row sum, 1
    assert np.all(raw <= layers[0].sum(axis=0)[None, :] + 1e-12)  # a sink takes at most its column sum


def test_rows_select_rows_of_the_full_matrix():
    attentions = softmax_attentions(np.random.default_rng(4), 3, 2, 9)
    for normalize in (False, True):
        full = attention_flow(attentions, normalize=normalize)
        np.testing.assert_array_equal(attention_flow(attentions, rows=[0], normalize=normalize), full[[0]])
        np.testing.assert_array_equal(attention_flow(attentions, rows=0, normalize=normalize), full[[0]])
        picked = attention_flow(attentions, rows=[3, -1, 3], normalize=normalize)
        np.testing.assert_array_equal(picked, full[[3, 8, 3]])
    assert attention_flow(attentions, rows=[]).shape == (0, 9)


def test_layer_option_matches_networkx_on_the_truncated_graph():
    attentions = structured_attentions(np.random.default_rng(5), 4, 2, 8)
    layers = capacities(attentions)
    for layer in range(1, 5):
        raw = attention_flow(attentions, layer=layer, normalize=False)
        np.testing.assert_allclose(raw, networkx_flows(layers[:layer]), rtol=0, atol=1e-9)
    np.testing.assert_array_equal(attention_flow(attentions, layer=4), attention_flow(attentions))
    # layer=1: the flow through one layer is its edge capacity.
    np.testing.assert_allclose(attention_flow(attentions, layer=1, normalize=False), layers[0], rtol=0, atol=1e-14)


def test_batched_input_equals_each_sample_and_threads_change_nothing():
    rng = np.random.default_rng(6)
    batch = np.stack([softmax_attentions(rng, 3, 2, 10) for _ in range(3)])  # [batch, layer, head, q, k]
    one_thread = attention_flow(batch, rows=[0, 4])
    assert one_thread.shape == (3, 2, 10)
    for b in range(3):
        np.testing.assert_array_equal(one_thread[b], attention_flow(batch[b], rows=[0, 4]))
    for n_jobs in (2, -1):
        np.testing.assert_array_equal(attention_flow(batch, rows=[0, 4], n_jobs=n_jobs), one_thread)
        # a single row is split into runs of sinks across threads: same flows
        np.testing.assert_array_equal(attention_flow(batch[0], rows=[4], n_jobs=n_jobs), one_thread[0, [1]])


def test_torch_input_returns_a_tensor_like_it():
    attentions = softmax_attentions(np.random.default_rng(8), 3, 2, 7)
    expected = attention_flow(attentions)
    result = attention_flow(torch.from_numpy(attentions))
    assert isinstance(result, torch.Tensor) and result.dtype == torch.float64
    np.testing.assert_array_equal(result.numpy(), expected)
    single = attention_flow(torch.from_numpy(attentions).float(), rows=[0])
    assert single.dtype == torch.float32 and single.shape == (1, 7)
    np.testing.assert_allclose(single.numpy(), expected[[0]], atol=1e-6)


def test_one_token_and_one_layer():
    assert attention_flow(np.ones((3, 2, 1, 1)), normalize=False).tolist() == [[1.0]]
    assert attention_flow(np.ones((3, 2, 1, 1))).tolist() == [[1.0]]
    attentions = softmax_attentions(np.random.default_rng(9), 1, 2, 5)
    layers = capacities(attentions)
    np.testing.assert_allclose(attention_flow(attentions, normalize=False), layers[0], rtol=0, atol=1e-14)
    np.testing.assert_allclose(attention_flow(attentions), layers[0], rtol=0, atol=1e-14)  # rows sum to 1


def test_an_all_zero_fused_row_gives_zero_flows_not_nan():
    attentions = np.zeros((2, 2, 3, 3))  # [layer, head, q, k]: the two heads never share a key
    attentions[:, 0] = np.eye(3)[[0, 0, 1]]
    attentions[:, 1] = np.eye(3)[[1, 2, 2]]
    assert attention_flow(attentions, head_fusion="min", residual="none").tolist() == [[0.0] * 3] * 3
    np.testing.assert_array_equal(attention_flow(attentions, head_fusion="min"), np.eye(3))


def test_registered_flow_takes_head_weights_and_a_layer():
    spec = get_method("flow")
    attentions = softmax_attentions(np.random.default_rng(10), 2, 3, 6)
    chosen = method_options(spec, {"weights": [1.0, 2.0, 1.0], "layer": 1, "residual": None})
    registered = call_method(spec, SimpleNamespace(attentions=attentions), **chosen)
    expected = networkx_flows(capacities(attentions, [0.25, 0.5, 0.25], "half")[:1])  # layer 1: first layer only
    np.testing.assert_allclose(registered, expected / expected.sum(axis=-1, keepdims=True), rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="either head weights or a head fusion"):
        attention_flow(attentions, head_fusion="max", weights=[1.0, 1.0, 1.0])


def _attentions():
    return softmax_attentions(np.random.default_rng(11), 2, 2, 5)


BAD_INPUTS = [
    (lambda a: np.where(a == a.max(), np.nan, a), {}, "NaN"),
    (lambda a: a - 0.05, {"residual": "renorm"}, "negative"),
    (lambda a: a * 1.5, {}, "sum to 1"),
    (lambda a: a[0, 0], {}, r"\[layer, head, query, key\]"),
    (lambda a: a[..., :4], {}, "square"),
    (lambda a: a, {"rows": [5]}, "rows must lie"),
    (lambda a: a, {"rows": [-6]}, "rows must lie"),
    (lambda a: a, {"rows": [0.5]}, "rows must be an int"),
    (lambda a: a, {"rows": [[0, 1]]}, "rows must be an int"),
    (lambda a: a, {"layer": 0}, "layer must be an integer in \\[1, 2\\]"),
    (lambda a: a, {"layer": 3}, "layer must be"),
    (lambda a: a, {"layer": True}, "layer must be"),
    (lambda a: a, {"layer": 1.0}, "layer must be"),
    (lambda a: a, {"head_fusion": "sum"}, "unknown head_fusion"),
    (lambda a: a, {"head_fusion": [1.0, 2.0, 3.0]}, "head weights"),
    (lambda a: a, {"residual": 1.5}, "alpha"),
    (lambda a: a, {"residual": "full"}, "unknown residual"),
    (lambda a: a, {"n_jobs": 0}, "n_jobs"),
    (lambda a: a, {"normalize": "yes"}, "normalize"),
]


@pytest.mark.parametrize("corrupt, options, message", BAD_INPUTS)
def test_bad_input_raises_a_clear_value_error(corrupt, options, message):
    with pytest.raises(ValueError, match=message):
        attention_flow(corrupt(_attentions()), **options)


@settings(max_examples=40, deadline=None)
@given(
    n_layers=st.integers(1, 4),
    n_heads=st.integers(1, 3),
    n=st.integers(1, 7),
    seed=st.integers(0, 2**32 - 1),
    residual=st.sampled_from(["half", "renorm", "none", 0.25]),
    kind=st.sampled_from(["dense", "causal", "sparse", "structured"]),
)
def test_flow_invariants(n_layers, n_heads, n, seed, residual, kind):
    rng = np.random.default_rng(seed)
    if kind == "structured":
        attentions = structured_attentions(rng, n_layers, n_heads, n)
    else:
        attentions = softmax_attentions(rng, n_layers, n_heads, n, causal=kind == "causal", sparse=kind == "sparse")
    raw = attention_flow(attentions, residual=residual, normalize=False)
    normalized = attention_flow(attentions, residual=residual)
    assert raw.min() >= 0.0 and raw.max() <= 1.0 + 1e-12
    np.testing.assert_allclose(normalized.sum(axis=-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(normalized, raw / raw.sum(axis=-1, keepdims=True), atol=1e-15)


@pytest.mark.parametrize("n", [3, 70])
def test_graph_capacities_bits_and_heaviest_edges_match_numpy(n):
    from attnflow.methods.flow_kernels import N_HEAVY, SCALE_BITS, _graph

    rng = np.random.default_rng(n)
    layers = softmax_attentions(rng, 2, 1, n, sparse=True)[:, 0]  # exact zeros and equal rows' maxima
    cap, nonzero, nonzero_t, heavy = _graph(layers)
    want = np.rint(layers * 2.0**SCALE_BITS).astype(np.int64)
    np.testing.assert_array_equal(cap, want)

    def bits(words):  # [layer n + row, word] uint64 -> [layer, row, n] 0/1
        rows = words.reshape(2, n, -1)
        return np.array([[[(int(w[k >> 6]) >> (k & 63)) & 1 for k in range(n)] for w in row] for row in rows])

    np.testing.assert_array_equal(bits(nonzero), want > 0)
    np.testing.assert_array_equal(bits(nonzero_t), (want > 0).transpose(0, 2, 1))
    top = min(N_HEAVY, n)
    picked = np.where(heavy >= 0, np.take_along_axis(want, np.maximum(heavy, 0), axis=-1), 0)
    np.testing.assert_array_equal(picked, -np.sort(-want, axis=-1)[..., :top])  # the largest, in order
    n_positive = (want > 0).sum(axis=-1, keepdims=True)
    np.testing.assert_array_equal(heavy < 0, np.arange(top) >= n_positive)  # -1 only past the non-zero ones


@pytest.mark.parametrize("n_layers", [2, 3, 5])
def test_a_remembered_cut_bounds_every_sink_and_is_exact_for_its_own(n_layers):
    """The min cut kept from one sink's last search (its source side above layer 1, each node of
    layer 1 on whichever side cuts less for the next sink) bounds every other sink's max flow and
    equals its own sink's; checked against networkx on the integer capacities the kernel uses."""
    from attnflow.methods.flow_kernels import _graph, _source_side_cut

    layers = capacities(structured_attentions(np.random.default_rng(3), n_layers, 2, 10))
    cap = _graph(layers)[0]  # [layer, q, k] int64, the kernel's exact capacities
    n = layers.shape[-1]
    graph = nx.DiGraph()
    for l in range(n_layers):
        for i, j in zip(*np.nonzero(cap[l])):
            graph.add_edge((l + 1, int(i)), (l, int(j)), capacity=int(cap[l, i, j]))
    kept = 0
    for source in (0, 4):
        flows = [nx.maximum_flow_value(graph, (n_layers, source), (0, j)) for j in range(n)]
        limit = int(cap[n_layers - 1, source].sum())
        for sink in range(n):
            value, (side, _) = nx.minimum_cut(graph, (n_layers, source), (0, sink))
            assert value == flows[sink]
            level = np.zeros((n_layers + 1) * n, np.int64)
            for l, i in side:
                level[l * n + i] = -1
            into = np.zeros(n, np.int64)
            base = _source_side_cut(cap, level, source, into, limit)
            if base < 0:
                continue  # not kept (a large source side)
            kept += 1
            bounds = [base + int(np.minimum(cap[0, :, j], into).sum()) for j in range(n)]
            assert bounds[sink] == flows[sink]
            assert all(bound >= flow for bound, flow in zip(bounds, flows))
    assert kept >= n  # most cuts are kept


# ----- the one-time compilation of the kernel says so ------------------------------------------

FIRST_FLOW = (
    "import logging, numpy as np; logging.basicConfig(format='%(message)s'); "
    "from attnflow.methods.flow import attention_flow; attention_flow(np.full((1, 1, 2, 2), 0.5))"
)


def test_a_cold_cache_announces_the_compilation_before_it_starts(tmp_path):
    """numba compiles the kernel once per machine (about a minute): a line says so first. The test
    stops the process at that line instead of waiting for the compilation."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # an empty cache
    process = subprocess.Popen([sys.executable, "-c", FIRST_FLOW], stderr=subprocess.PIPE, text=True, env=env)
    try:
        first_line = process.stderr.readline() if process.stderr is not None else ""
    finally:
        process.kill()
        process.wait()
    assert first_line.startswith("compiling the flow kernel once (about a minute;"), first_line


def test_a_warm_cache_says_nothing():
    attention_flow(np.full((1, 1, 2, 2), 0.5))  # compiled (and cached) in this process if it was not yet
    result = subprocess.run([sys.executable, "-c", FIRST_FLOW], capture_output=True, text=True, timeout=300, check=True)
    assert result.stderr == ""
