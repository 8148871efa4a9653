"""Route extraction and importance on hand-made graphs: numbers worked out by hand, and every
importance equal to a brute-force sum over the paths of kept edges from the top node."""

from __future__ import annotations

import numpy as np
import pytest

from attnflow.flow_routes.graph import Direct, Graph, check_threshold, compose, kept_edges, reach, route_nodes


def hand_made() -> Graph:
    """2 layers, 2 heads, 3 tokens; every whole's shares sum to 1."""
    heads = np.zeros((2, 2, 3, 3))
    heads[0, 0, 0] = [0.4, 0, 0]
    heads[0, 0, 1], heads[0, 1, 1] = [0.1, 0.03, 0], [0.17, 0, 0]
    heads[0, 0, 2], heads[0, 1, 2] = [0.05, 0.1, 0.2], [0.1, 0.02, 0.13]
    heads[1, 0, 2], heads[1, 1, 2] = [0.2, 0.03, 0], [0, 0.02, 0.25]
    heads[1, 0, 0], heads[1, 0, 1] = [0.5, 0, 0], [0.3, 0.3, 0]
    attention_residual = np.array([[0.6, 0.7, 0.4], [0.5, 0.4, 0.5]])
    ffn = np.array([[0.5, 0.01, 0.2], [0.9, 0.9, 0.3]])
    zeros = np.zeros((2, 3))
    graph = Graph(heads, attention_residual, zeros, ffn, 1 - ffn, zeros)
    np.testing.assert_allclose(graph.attention_residual + graph.heads.sum(axis=(1, 3)), 1.0)
    return graph


def test_the_hand_made_route_and_its_importances():
    graph = hand_made()
    found = compose(graph, 2, 0.04)
    # layer 1: both feed-forward edges kept (0.3, 0.7): mid(1, 2) = 1; attention edges into it: the
    # residual 0.5 and the sources 0 (0.2), 1 (0.05: the heads' 0.03 + 0.02, kept as one edge), 2 (0.25)
    np.testing.assert_allclose(found.inputs[2], [0, 0, 1])
    np.testing.assert_allclose(found.mids[1], [0, 0, 1.0])
    np.testing.assert_allclose(found.inputs[1], [0.2, 0.05, 0.75])
    # layer 0: mid = in(1) × kept feed-forward weights (position 1 loses its ffn edge 0.01)
    np.testing.assert_allclose(found.mids[0], [0.2, 0.05 * 0.99, 0.75])
    np.testing.assert_allclose(found.ffn[0], [0.1, 0.0, 0.15])
    mid = found.mids[0]
    expected = [
        mid[0] * 0.6 + mid[0] * 0.4 + mid[1] * 0.27 + mid[2] * 0.15,
        mid[1] * 0.7 + mid[2] * 0.12,  # 1 -> 1 (0.03) is below τ
        mid[2] * 0.4 + mid[2] * 0.33,
    ]
    np.testing.assert_allclose(found.inputs[0], expected)
    np.testing.assert_allclose(found.heads[1], [0.23, 0.27])
    np.testing.assert_allclose(
        found.heads[0], [mid[0] * 0.4 + mid[1] * 0.1 + mid[2] * 0.35, mid[1] * 0.17 + mid[2] * 0.25]
    )
    edges = kept_edges(graph, found, 2, 0.04)
    assert len(edges) == 6 + 5 + 8
    assert {(e.kind, e.layer, e.source[2], e.target[2]) for e in edges if e.kind == "attention"} == {
        ("attention", 1, 0, 2), ("attention", 1, 1, 2), ("attention", 1, 2, 2),
        ("attention", 0, 0, 0), ("attention", 0, 0, 1), ("attention", 0, 0, 2), ("attention", 0, 1, 2),
        ("attention", 0, 2, 2),
    }  # fmt: skip
    assert edges[0].importance == max(edge.importance for edge in edges)
    nodes = dict(route_nodes(found))
    assert nodes[("in", 2, 2)] == 1.0 and ("in", 2, 0) not in nodes and ("mid", 1, 0) not in nodes
    assert len(nodes) == 1 + 1 + 3 + 3 + 3


def path_sums(graph: Graph, position: int, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Importance as Σ over every path of kept edges from the top of the product of its weights."""
    n_layers, n_tokens = graph.n_layers, graph.n_tokens
    inputs, mids = np.zeros((n_layers + 1, n_tokens)), np.zeros((n_layers, n_tokens))

    def down_from_input(layer: int, i: int, carried: float) -> None:
        inputs[layer, i] += carried
        if layer == 0:
            return
        if graph.parallel:  # the edges into ("in", layer, i) leave the stream entering layer - 1
            if graph.ffn[layer - 1, i] > threshold:
                down_from_input(layer - 1, i, carried * graph.ffn[layer - 1, i])
            down_through_attention(layer - 1, i, carried)
            return
        for weight in (graph.ffn[layer - 1, i], graph.ffn_residual[layer - 1, i]):
            if weight > threshold:
                down_from_mid(layer - 1, i, carried * weight)

    def down_from_mid(layer: int, i: int, carried: float) -> None:
        mids[layer, i] += carried
        down_through_attention(layer, i, carried)

    def down_through_attention(layer: int, i: int, carried: float) -> None:
        if graph.attention_residual[layer, i] > threshold:
            down_from_input(layer, i, carried * graph.attention_residual[layer, i])
        for j in range(n_tokens):
            if graph.attention[layer, i, j] > threshold:
                down_from_input(layer, j, carried * graph.attention[layer, i, j])

    down_from_input(n_layers, position, 1.0)
    return inputs, mids


def random_graph(rng: np.random.Generator, n_layers: int, n_heads: int, n_tokens: int, parallel: bool = False) -> Graph:
    """A causal graph with random shares (each whole's sum to 1; parallel: one whole per layer and
    position, the feed-forward share among its parts)."""
    heads = rng.random((n_layers, n_heads, n_tokens, n_tokens)) * np.tril(np.ones((n_tokens, n_tokens)))
    residual, ffn = rng.random((n_layers, n_tokens)), rng.random((n_layers, n_tokens))
    zeros = np.zeros((n_layers, n_tokens))
    if parallel:
        total = residual + heads.sum(axis=(1, 3)) + ffn
        heads, residual, ffn = heads / total[:, None, :, None], residual / total, ffn / total
        return Graph(heads, residual, zeros, ffn, zeros, zeros, parallel=True)
    total = residual + heads.sum(axis=(1, 3))
    heads, residual = heads / total[:, None, :, None], residual / total
    return Graph(heads, residual, zeros, ffn, 1 - ffn, zeros)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 0.04, 0.1])
def test_importance_is_the_sum_over_paths(threshold, parallel):
    n_tokens = 4
    graph = random_graph(np.random.default_rng(0), n_layers=3, n_heads=2, n_tokens=n_tokens, parallel=parallel)
    for position in range(n_tokens):
        found = compose(graph, position, threshold)
        inputs, mids = path_sums(graph, position, threshold)
        np.testing.assert_allclose(found.inputs, inputs, atol=1e-12)
        np.testing.assert_allclose(found.mids, mids, atol=1e-12)
        assert {node for node, _ in route_nodes(found)} == {
            *(("in", layer, i) for layer, i in np.argwhere(inputs > 0)),
            *(("mid", layer, i) for layer, i in np.argwhere(mids > 0)),
        }
        assert not parallel or not mids.any()  # a parallel block has no stream between its updates
        for edge in kept_edges(graph, found, position, threshold):  # every edge joins two nodes of the route
            for stream, layer, i in (edge.source, edge.target):
                assert (inputs if stream == "in" else mids)[layer, i] > 0, edge


def test_contrastive_mode_weights_the_top_stream_by_direct_effects():
    graph = hand_made()
    head_effects = np.zeros((2, 2, 3))
    head_effects[1, 0, 0], head_effects[1, 1, 0] = 2.0, 1.0  # both heads raise the difference from source 0
    head_effects[0, 1, 1] = -0.5  # lowers it, from source 1
    ffn_effects = np.array([0.01, 1.49])
    total = 3.0 + 0.5 + 0.01 + 1.49  # D: every direct edge's |effect| (no biases, embedding 0)
    direct = Direct(
        attention=np.abs(head_effects.sum(axis=1)) / total,
        heads=np.abs(head_effects) / total,
        ffn=np.abs(ffn_effects) / total,
        head_effects=head_effects,
        ffn_effects=ffn_effects,
        embedding_effect=0.0,
        bias_effect=0.0,
    )
    assert direct.total == pytest.approx(2.0 + 1.0 - 0.5 + 0.01 + 1.49)
    found = compose(graph, 2, 0.04, direct)
    np.testing.assert_allclose(found.inputs[:, 2], 1.0)  # the top position's stream carries every direct effect
    np.testing.assert_allclose(found.mids[:, 2], 1.0)
    np.testing.assert_allclose(found.ffn[:, 2], [0.0, 1.49 / total])  # 0.01 / 5 is below τ
    np.testing.assert_allclose(found.inputs[1, :2], [3.0 / total, 0.0])  # the direct edges chosen by effect
    # layer 0: position 0 as usual from mid(0, 0) = 0.6 (0.6 × 0.6 + 0.6 × 0.4); position 1 only by
    # its direct edge into the top stream (1 × 0.5 / D: the plain weight 0.12 of that edge is replaced)
    np.testing.assert_allclose(found.inputs[0, :2], [0.6, 0.5 / total])
    np.testing.assert_allclose(found.heads[1], [2.0 / total, 1.0 / total])


def test_threshold_outside_zero_one_is_refused():
    for bad in (-0.1, 1.0, 1.5, "0.1", True, float("nan")):
        with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\)"):
            check_threshold(bad)
    assert check_threshold(0) == 0.0


def test_top_weights_compose_linearly():
    graph = random_graph(np.random.default_rng(3), n_layers=3, n_heads=2, n_tokens=4)
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    for threshold in (0.0, 0.1):
        pooled = compose(graph, weights, threshold)
        by_position = [compose(graph, i, threshold) for i in range(4)]
        for name in ("inputs", "mids", "heads", "ffn"):
            expected = sum(w * getattr(single, name) for w, single in zip(weights, by_position, strict=True))
            np.testing.assert_allclose(getattr(pooled, name), expected, atol=1e-12)
    with pytest.raises(ValueError, match="one per position"):
        compose(graph, np.ones(3), 0.0)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("contrastive", [False, True])
def test_reach_gives_the_route_at_every_higher_threshold(contrastive, parallel):
    rng = np.random.default_rng(5)
    n_layers, n_heads, n_tokens, position = 3, 2, 5, 4
    graph = random_graph(rng, n_layers, n_heads, n_tokens, parallel)
    direct = None
    if contrastive:
        shares = rng.random((n_layers, n_heads, n_tokens)) * 0.2
        direct = Direct(shares.sum(axis=1), shares, rng.random(n_layers) * 0.2, shares, np.ones(n_layers), 0.0, 0.0)
    low = 0.02
    lowest = compose(graph, position, low, direct)
    edges, reached = kept_edges(graph, lowest, position, low, direct), reach(graph, position, direct)

    def key(edge):
        return edge.kind, edge.source, edge.target

    for higher in (0.02, 0.05, 0.1, 0.2, 0.3):
        composition = compose(graph, position, higher, direct)
        assert {key(edge) for edge in kept_edges(graph, composition, position, higher, direct)} == {
            key(edge) for edge in edges if edge.reach > higher
        }
        np.testing.assert_array_equal(composition.inputs > 0, reached.inputs > higher)
        np.testing.assert_array_equal(composition.mids > 0, reached.mids > higher)
