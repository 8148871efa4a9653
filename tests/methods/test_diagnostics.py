"""Row diagnostics against hand computations and an explicit per-row loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnflow.methods.diagnostics import is_causal, layer_diagnostics, max_row_entropy, row_entropy

# Layer 0 is lower-triangular by hand; layer 1 is uniform.
HAND = np.array(
    [
        [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]],
        np.full((3, 3), 1 / 3),
    ]
)  # [layer, query, key]
SPECIAL = np.array([True, False, False])
LOG2, LOG3 = math.log(2), math.log(3)


def test_hand_computed_layers():
    d = layer_diagnostics(HAND, SPECIAL)
    # layer 0: row entropies 0, log 2, -(2 * 0.25 log 0.25 + 0.5 log 0.5) = 1.5 log 2
    assert d.entropy[0] == pytest.approx((0 + LOG2 + 1.5 * LOG2) / 3)
    assert d.max_entropy[0] == pytest.approx(LOG3)
    assert d.normalized_entropy[0] == pytest.approx((0 + LOG2 + 1.5 * LOG2) / 3 / LOG3)
    assert d.special_share[0] == pytest.approx((1 + 0.5 + 0.25) / 3)
    assert d.top_token[0] == 0 and d.top_share[0] == pytest.approx(1.75 / 3)
    assert not d.diffuse[0] and d.collapsed[0]
    # layer 1: uniform rows: entropy = log 3, the maximum; every column holds 1/3
    assert d.entropy[1] == pytest.approx(LOG3)
    assert d.normalized_entropy[1] == pytest.approx(1.0)
    assert d.special_share[1] == pytest.approx(1 / 3)
    assert d.top_share[1] == pytest.approx(1 / 3)
    assert d.diffuse[1] and not d.collapsed[1]


def test_causal_rows_use_their_own_maximum():
    d = layer_diagnostics(HAND[:1], SPECIAL, causal=True)
    # row 0 reaches one key (max entropy 0: left out of the ratio); rows 1, 2: log 2 and log 3
    assert d.normalized_entropy[0] == pytest.approx((LOG2 / LOG2 + 1.5 * LOG2 / LOG3) / 2)
    assert d.max_entropy[0] == pytest.approx((0 + LOG2 + LOG3) / 3)
    assert is_causal(HAND[0]) and not is_causal(HAND[1])


def test_rows_are_normalised_and_zero_rows_left_out():
    scaled = HAND * np.array([2.0, 5.0, 0.5])[:, None]  # each row scaled: same distributions
    np.testing.assert_allclose(layer_diagnostics(scaled, SPECIAL).entropy, layer_diagnostics(HAND, SPECIAL).entropy)
    with_zero_row = HAND[0].copy()
    with_zero_row[1] = 0.0
    d = layer_diagnostics(with_zero_row, SPECIAL)
    assert d.entropy == pytest.approx((0 + 1.5 * LOG2) / 2)  # rows 0 and 2 only
    assert d.special_share == pytest.approx((1 + 0.25) / 2)


def test_thresholds_move_the_flags():
    assert not layer_diagnostics(HAND[1], collapse=0.34).collapsed
    assert layer_diagnostics(HAND[1], collapse=0.33).collapsed
    assert layer_diagnostics(HAND[0], diffusion=0.5).diffuse
    with pytest.raises(ValueError, match="thresholds"):
        layer_diagnostics(HAND, diffusion=0.0)


def test_matches_an_explicit_loop_on_random_stacks():
    rng = np.random.default_rng(3)
    matrices = rng.dirichlet(np.ones(7) * 0.4, size=(4, 3, 7))  # [layer, head, query, key]
    special = np.array([1, 0, 0, 0, 0, 0, 1], dtype=bool)
    d = layer_diagnostics(matrices, special)
    assert d.entropy.shape == (4, 3)
    for layer in range(4):
        for head in range(3):
            rows = matrices[layer, head]
            entropies = [-sum(p * math.log(p) for p in row if p > 0) for row in rows]
            assert d.entropy[layer, head] == pytest.approx(sum(entropies) / 7)
            assert d.normalized_entropy[layer, head] == pytest.approx(sum(entropies) / 7 / math.log(7))
            assert d.special_share[layer, head] == pytest.approx(sum(row[0] + row[6] for row in rows) / 7)
            columns = [sum(rows[i][j] for i in range(7)) / 7 for j in range(7)]
            assert d.top_token[layer, head] == int(np.argmax(columns))
            assert d.top_share[layer, head] == pytest.approx(max(columns))


def test_row_entropy_and_maximum():
    np.testing.assert_allclose(row_entropy(HAND[0]), [0, LOG2, 1.5 * LOG2])
    np.testing.assert_allclose(max_row_entropy(3), [LOG3] * 3)
    np.testing.assert_allclose(max_row_entropy(3, causal=True), [0, LOG2, LOG3])


def test_rejects_what_is_not_a_distribution():
    with pytest.raises(ValueError, match="non-negative"):
        layer_diagnostics(-HAND)
    with pytest.raises(ValueError, match="square"):
        layer_diagnostics(np.ones((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        layer_diagnostics(np.full((2, 2), np.nan))
