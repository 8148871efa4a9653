"""Rollout against an explicit-loop oracle (plain Python, no matrix products), plus invariants."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import attnflow
from attnflow.methods import encoder_decoder_rollout, raw_attention, rollout, saliency_row, to_patch_grid
from attnflow.methods.transforms import PruningCollapseWarning, prepare_layers


def random_attention(rng, layers=3, heads=2, n=4, batch=None):
    shape = (layers, heads, n, n) if batch is None else (batch, layers, heads, n, n)
    logits = rng.normal(size=shape) * 2
    weights = np.exp(logits)
    return weights / weights.sum(-1, keepdims=True)


# -- the oracle: loops over every index, written from docs/methods.md -------------------------------


def oracle_layer(attention, fusion, residual, threshold, top_k, discard_ratio, prune_on="attention"):
    """Ã for one layer ``[head][q][k]`` as nested lists.

    prune_on="attention": fuse, prune the fused rows, add the residual, renormalise the rows;
    prune_on="residual": fuse, add the residual, prune Ã's rows and renormalise them.
    """
    fused = oracle_fuse(attention, fusion)
    pruning = (threshold, top_k, discard_ratio)
    if all(option is None for option in pruning):
        return oracle_residual(fused, residual)
    if prune_on == "attention":
        return oracle_renormalise(oracle_residual(oracle_prune(fused, *pruning), residual))
    return oracle_renormalise(oracle_prune(oracle_residual(fused, residual), *pruning))


def oracle_fuse(attention, fusion):
    heads, n = len(attention), len(attention[0])
    fused = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            values = [attention[h][i][j] for h in range(heads)]
            if fusion == "mean":
                fused[i][j] = sum(values) / heads
            elif fusion == "max":
                fused[i][j] = max(values)
            elif fusion == "min":
                fused[i][j] = min(values)
            else:  # weights
                total = sum(fusion)
                fused[i][j] = sum(w / total * v for w, v in zip(fusion, values))
    if fusion in ("max", "min"):  # element-wise max/min rows are renormalised
        fused = oracle_renormalise(fused)
    return fused


def oracle_residual(fused, residual):
    n = len(fused)
    mixed = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            eye = 1.0 if i == j else 0.0
            if residual == "half":
                mixed[i][j] = 0.5 * (fused[i][j] + eye)
            elif residual == "renorm":
                mixed[i][j] = (fused[i][j] + eye) / (sum(fused[i]) + 1.0)
            elif residual == "none":
                mixed[i][j] = fused[i][j]
            else:
                mixed[i][j] = residual * fused[i][j] + (1 - residual) * eye
    return mixed


def oracle_prune(matrix, threshold, top_k, discard_ratio):
    """Zero the pruned entries of every row (no renormalisation); each row keeps its maximum."""
    n = len(matrix)
    pruned = []
    for row in matrix:
        order = sorted(range(n), key=lambda j: (-row[j], j))
        rank = {j: r for r, j in enumerate(order)}
        top = max(row)
        kept = []
        for j in range(n):
            keep = True
            if threshold is not None and row[j] < threshold:
                keep = False
            if top_k is not None and rank[j] >= top_k:
                keep = False
            if discard_ratio is not None and rank[j] >= n - math.floor(discard_ratio * n):
                keep = False
            kept.append(row[j] if keep or row[j] == top else 0.0)
        pruned.append(kept)
    return pruned


def oracle_renormalise(matrix):
    return [[value / sum(row) for value in row] for row in matrix]


def oracle_rollout(attentions, fusion="mean", residual="half", start_layer=0, **pruning):
    """Returns the list of R⁽ˡ⁾ for l = start_layer … L-1."""
    n = len(attentions[0][0])
    joint = [[1.0 if i == j else 0.0 for j in range(n)] for i in range(n)]
    history = []
    for layer in attentions[start_layer:]:
        a = oracle_layer(layer, fusion, residual, **pruning)
        joint = [[sum(a[i][k] * joint[k][j] for k in range(n)) for j in range(n)] for i in range(n)]
        history.append(joint)
    return np.array(history)


FUSIONS = ["mean", "max", "min", (0.2, 0.8)]
RESIDUALS = ["half", "renorm", 0.3, "none"]
PRUNINGS = [{}, {"threshold": 0.2}, {"top_k": 2}, {"discard_ratio": 0.5}, {"threshold": 0.1, "top_k": 3}]


PRUNE_PLACES = ["attention", "residual"]


@pytest.mark.parametrize(
    "fusion,residual,start_layer,pruning,prune_on",
    list(itertools.product(FUSIONS, RESIDUALS, [0, 1], PRUNINGS, PRUNE_PLACES)),
)
def test_rollout_matches_explicit_loops(fusion, residual, start_layer, pruning, prune_on):
    attentions = random_attention(np.random.default_rng(7), layers=3, heads=2, n=5)
    kwargs = dict(residual=residual, start_layer=start_layer, prune_on=prune_on, **pruning)
    if isinstance(fusion, tuple):
        kwargs["weights"] = list(fusion)
    else:
        kwargs["head_fusion"] = fusion
    expected = oracle_rollout(
        attentions.tolist(),
        fusion,
        residual,
        start_layer,
        threshold=pruning.get("threshold"),
        top_k=pruning.get("top_k"),
        discard_ratio=pruning.get("discard_ratio"),
        prune_on=prune_on,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PruningCollapseWarning)  # collapse is tested on its own below
        np.testing.assert_allclose(rollout(attentions, **kwargs), expected[-1], atol=1e-12)
        np.testing.assert_allclose(rollout(attentions, layerwise=True, **kwargs), expected, atol=1e-12)


def test_the_two_pruning_places_differ():
    """Pruning the fused attention and pruning Ã give different layers (so the oracle tells them apart)."""
    attentions = random_attention(np.random.default_rng(9), layers=2, heads=2, n=5)
    on_attention = rollout(attentions, discard_ratio=0.5, prune_on="attention")
    on_residual = rollout(attentions, discard_ratio=0.5, prune_on="residual")
    assert np.abs(on_attention - on_residual).max() > 1e-3


def test_layerwise_is_the_cumulative_product():
    attentions = random_attention(np.random.default_rng(1), layers=4, n=6)
    layers = rollout(attentions, layerwise=True)
    fused = 0.5 * (attentions.mean(1) + np.eye(6))
    np.testing.assert_allclose(layers[0], fused[0])
    for layer in range(1, 4):
        np.testing.assert_allclose(layers[layer], fused[layer] @ layers[layer - 1], atol=1e-14)


def test_head_specific_rollout():
    attentions = random_attention(np.random.default_rng(2), layers=3, heads=3, n=4)
    per_head = rollout(attentions, head_fusion="none")
    assert per_head.shape == (3, 4, 4)
    for head in range(3):
        single = attentions[:, head : head + 1]  # one head: every fusion is that head
        np.testing.assert_allclose(per_head[head], rollout(single), atol=1e-14)
    np.testing.assert_allclose(rollout(attentions, head_fusion="none", aggregate_heads=True), per_head.mean(0))


def test_identity_attention_gives_identity():
    eye = np.broadcast_to(np.eye(5), (4, 3, 5, 5))
    for residual in ["half", "renorm", "none", 0.7]:
        np.testing.assert_allclose(rollout(eye, residual=residual), np.eye(5))


def test_batched_equals_per_sample_and_pruning_is_per_row_and_sample():
    rng = np.random.default_rng(3)
    batch = random_attention(rng, layers=3, n=6, batch=4)
    batch[2] = random_attention(rng, layers=3, n=6) ** 3  # a differently-shaped sample
    batch[2] /= batch[2].sum(-1, keepdims=True)
    for options in [{}, {"discard_ratio": 0.5}, {"top_k": 2}, {"threshold": 0.15}]:
        together = rollout(batch, **options)
        for index in range(4):
            np.testing.assert_allclose(together[index], rollout(batch[index], **options), atol=1e-14)
    # discard_ratio 0.5 on 6 keys keeps exactly 3 entries in every row of every layer of every
    # sample (pruning the attention: the residual then adds the diagonal back when it was dropped)
    for prune_on in PRUNE_PLACES:
        kept = (prepare_layers(batch, discard_ratio=0.5, residual="none", prune_on=prune_on) > 0).sum(-1)
        assert (kept == 3).all()
    pruned_attention = prepare_layers(batch, discard_ratio=0.5, residual="none") > 0
    with_residual = prepare_layers(batch, discard_ratio=0.5) > 0  # prune_on="attention", ½(A + I)
    np.testing.assert_array_equal(with_residual, pruned_attention | np.eye(6, dtype=bool))


@pytest.mark.parametrize("prune_on", PRUNE_PLACES)
def test_pruning_keeps_the_row_maximum(prune_on):
    attentions = random_attention(np.random.default_rng(4), n=5)
    fused = attentions.mean(1)  # [layer, q, k]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PruningCollapseWarning)
        layers = prepare_layers(attentions, residual="none", threshold=0.99, prune_on=prune_on)
    # threshold 0.99 drops everything but each row's maximum, which is kept (and becomes 1)
    kept = layers > 0
    np.testing.assert_array_equal(kept, fused == fused.max(-1, keepdims=True))
    np.testing.assert_allclose(layers[kept], 1.0)


def test_pruning_that_leaves_only_the_diagonal_warns():
    """A diagonal-heavy attention: ½(A + I) pruned to its largest entry is the identity."""
    n = 6
    rng = np.random.default_rng(11)
    attentions = random_attention(rng, layers=3, heads=2, n=n)
    attentions[1] = 0.3 * np.eye(n) + 0.7 * attentions[1]  # layer 1 still has off-diagonal maxima
    with pytest.warns(PruningCollapseWarning, match=r"layer\(s\) 0, 1, 2 of 3") as caught:
        collapsed = rollout(attentions, head_fusion="max", discard_ratio=0.9, prune_on="residual")
    assert "prune_on='attention'" in str(caught[0].message)
    np.testing.assert_allclose(collapsed, np.eye(n))  # the surprise the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error", PruningCollapseWarning)
        kept = rollout(attentions, head_fusion="max", discard_ratio=0.9, prune_on="attention")
    assert np.abs(kept - np.eye(n)).max() > 0.05
    # Attention whose largest entry is the diagonal in layer 2 only: the warning names layer 2.
    attentions[2] = 0.6 * np.eye(n) + 0.4 * attentions[2]
    with pytest.warns(PruningCollapseWarning, match=r"layer\(s\) 2 of 3"):
        rollout(attentions, top_k=1, prune_on="attention")
    # batched: a layer collapsed in any sample is named; heads kept apart: only if every head collapsed
    with pytest.warns(PruningCollapseWarning, match=r"layer\(s\) 2 of 3"):
        rollout(np.stack([random_attention(rng, layers=3, heads=2, n=n), attentions]), top_k=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PruningCollapseWarning)
        rollout(attentions, top_k=2)  # two entries per row: nothing collapses
        rollout(attentions)  # no pruning, no warning


def test_torch_in_torch_out():
    attentions = random_attention(np.random.default_rng(5))
    result = rollout(torch.tensor(attentions, dtype=torch.float32))
    assert isinstance(result, torch.Tensor) and result.dtype == torch.float32
    np.testing.assert_allclose(result.numpy(), rollout(attentions), atol=1e-6)


@pytest.mark.filterwarnings("ignore::attnflow.methods.transforms.PruningCollapseWarning")
@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    layers=st.integers(1, 4),
    heads=st.integers(1, 3),
    n=st.integers(1, 7),
    fusion=st.sampled_from(["mean", "max", "min", "none"]),
    residual=st.sampled_from(["half", "renorm", "none", 0.0, 0.5, 1.0]),
    prune=st.sampled_from([{}, {"threshold": 0.3}, {"top_k": 1}, {"discard_ratio": 0.9}]),
)
def test_rows_stochastic_and_non_negative(data, layers, heads, n, fusion, residual, prune):
    raw = data.draw(arrays(np.float64, (layers, heads, n, n), elements=st.floats(0, 1e3)))
    raw = raw + 1e-9  # softmax weights are strictly positive
    attentions = raw / raw.sum(-1, keepdims=True)
    result = rollout(attentions, head_fusion=fusion, residual=residual, **prune)
    assert np.all(result >= 0)
    np.testing.assert_allclose(result.sum(-1), 1.0, atol=1e-9)


@pytest.mark.parametrize(
    "bad,kwargs,message",
    [
        (np.full((2, 2, 3, 3), np.nan), {}, "NaN"),
        (np.where(np.eye(3, dtype=bool), np.inf, 0.0) * np.ones((2, 2, 3, 3)), {}, "NaN or infinite"),
        (np.where(np.eye(3, dtype=bool), -np.inf, 0.5) * np.ones((2, 2, 3, 3)), {}, "NaN or infinite"),
        (np.full((2, 2, 3, 3), 1e308), {}, "sum to infinity"),
        (np.full((2, 2, 3, 3), 1e308), {"residual": "renorm"}, "sum to infinity"),
        (-np.ones((2, 2, 3, 3)) / 3, {}, "negative"),
        (np.ones((2, 2, 3, 3)), {}, "sum to 1"),
        (np.ones((2, 3, 3)) / 3, {}, r"\[layer, head, query, key\]"),
        (np.ones((2, 2, 3, 4)) / 4, {}, "square"),
        (np.ones((2, 2, 3, 3)) / 3, {"head_fusion": "median"}, "head_fusion"),
        (np.ones((2, 2, 3, 3)) / 3, {"residual": 1.5}, r"\[0, 1\]"),
        (np.ones((2, 2, 3, 3)) / 3, {"residual": "full"}, "residual"),
        (np.ones((2, 2, 3, 3)) / 3, {"start_layer": 2}, "start_layer"),
        (np.ones((2, 2, 3, 3)) / 3, {"top_k": 0}, "top_k"),
        (np.ones((2, 2, 3, 3)) / 3, {"discard_ratio": 1.0}, "discard_ratio"),
        (np.ones((2, 2, 3, 3)) / 3, {"discard_ratio": -0.1}, "discard_ratio"),
        (np.ones((2, 2, 3, 3)) / 3, {"threshold": 2}, r"threshold must lie in \[0, 1\)"),
        (np.ones((2, 2, 3, 3)) / 3, {"threshold": 1.0}, "threshold"),
        (np.ones((2, 2, 3, 3)) / 3, {"threshold": float("nan")}, "threshold"),
        (np.ones((2, 2, 3, 3)) / 3, {"prune_on": "fused"}, "prune_on"),
        (np.ones((2, 2, 3, 3)) / 3, {"weights": [1, 2, 3]}, "2 heads"),
    ],
)
def test_bad_input_is_a_clear_value_error(bad, kwargs, message):
    with pytest.raises(ValueError, match=message):
        rollout(bad, **kwargs)


def test_raw_attention_and_registry():
    attentions = random_attention(np.random.default_rng(6))
    np.testing.assert_allclose(raw_attention(attentions), attentions[-1].mean(0))
    max_fused = attentions[0].max(0)
    np.testing.assert_allclose(
        raw_attention(attentions, layer=0, head_fusion="max"), max_fused / max_fused.sum(-1, keepdims=True)
    )
    assert {"rollout", "raw"} <= set(attnflow.available_methods())
    assert attnflow.get_method("rollout").function is rollout
    with pytest.raises(ValueError, match="available"):
        attnflow.get_method("nope")


def test_saliency_rows_and_patch_grid():
    matrix = np.arange(16.0).reshape(4, 4)
    np.testing.assert_array_equal(saliency_row(matrix, "cls"), matrix[0])
    np.testing.assert_array_equal(saliency_row(matrix, "last"), matrix[3])
    np.testing.assert_array_equal(saliency_row(matrix, "mean"), matrix.mean(0))
    np.testing.assert_array_equal(saliency_row(matrix, 2), matrix[2])
    np.testing.assert_array_equal(saliency_row(matrix, "-1"), matrix[3])
    with pytest.raises(ValueError, match="out of range"):
        saliency_row(matrix, 4)
    scores = np.arange(1 + 6.0)  # CLS + a 2 x 3 grid
    np.testing.assert_array_equal(to_patch_grid(scores, (2, 3)), [[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="grid"):
        to_patch_grid(scores, (3, 3))


def test_decoder_rollout_stays_causal():
    attentions = np.tril(np.random.default_rng(8).random((3, 2, 5, 5))) + 1e-3 * np.eye(5)
    attentions /= attentions.sum(-1, keepdims=True)
    result = rollout(attentions)
    assert np.allclose(np.triu(result, 1), 0)
    np.testing.assert_allclose(saliency_row(result, "last").sum(), 1.0)


def test_encoder_decoder_rollout_by_hand():
    """2 layers, 1 head, encoder of 2 tokens, decoder of 2 tokens; residual none for easy sums."""
    enc = np.array([[[[0.5, 0.5], [0.0, 1.0]]], [[[1.0, 0.0], [0.5, 0.5]]]])  # [layer, head, 2, 2]
    dec = np.array([[[[1.0, 0.0], [0.5, 0.5]]], [[[1.0, 0.0], [0.0, 1.0]]]])
    cross = np.array([[[[1.0, 0.0], [0.0, 1.0]]], [[[0.5, 0.5], [1.0, 0.0]]]])
    # R_enc = E1 E0 = [[1,0],[.5,.5]] @ [[.5,.5],[0,1]] = [[.5,.5],[.25,.75]]
    # R_dec(0) = D0 = [[1,0],[.5,.5]];  R_dec(1) = D1 D0 = D0
    # Σ = D0 C0 R_enc + D0 C1 R_enc; D0 C0 = [[1,0],[.5,.5]]; D0 C1 = [[.5,.5],[.75,.25]]
    # sum = [[1.5,.5],[1.25,.75]] @ R_enc = [[.875,1.125],[.8125,1.1875]]; rows / 2
    result = encoder_decoder_rollout(enc, dec, cross, residual="none")
    np.testing.assert_allclose(result.encoder, [[0.5, 0.5], [0.25, 0.75]])
    np.testing.assert_allclose(result.decoder, [[1.0, 0.0], [0.5, 0.5]])
    np.testing.assert_allclose(result.decoder_to_encoder, [[0.4375, 0.5625], [0.40625, 0.59375]])
    with pytest.raises(ValueError, match="layers"):
        encoder_decoder_rollout(enc, dec, cross[:1])


def test_readme_pruning_example_on_minilm_is_not_the_identity(minilm):
    """``--head-fusion max --discard-ratio 0.9`` (the README's example) on the real minilm: pruning
    the fused attention keeps a real map; pruning Ã (the old behaviour) gives the identity and warns."""
    trace = minilm.trace("The movie was terrible.")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PruningCollapseWarning)
        kept = rollout(trace.attentions, head_fusion="max", discard_ratio=0.9)
    assert np.abs(kept - np.eye(trace.n_tokens)).max() > 0.5
    content = ~trace.special_mask
    scores = kept.mean(axis=0)
    assert trace.tokens[int(np.flatnonzero(content)[np.argmax(scores[content])])] == "terrible"
    with pytest.warns(PruningCollapseWarning, match=r"layer\(s\) 0, 1, 2, 3, 4, 5 of 6"):
        collapsed = rollout(trace.attentions, head_fusion="max", discard_ratio=0.9, prune_on="residual")
    np.testing.assert_allclose(collapsed, np.eye(trace.n_tokens))
