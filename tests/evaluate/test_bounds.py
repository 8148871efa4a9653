"""AOPC bounds and NAOPC against brute force over every deletion order."""

from __future__ import annotations

from itertools import permutations

import numpy as np
import pytest

from attnflow.evaluate.benchmark import BenchmarkOptions, Example, perturbation_probabilities
from attnflow.evaluate.bounds import (
    aopc_bounds,
    beam_chain_bounds,
    chain_bounds,
    exact_chain_bounds,
    level_chain_bounds,
    normalised_aopc,
)
from attnflow.evaluate.metrics import BINS, aopc, top_count


def interacting_value(n_items: int, seed: int):
    """A drop that is not additive over tokens (pairs interact), so greedy orders are not optimal."""
    rng = np.random.default_rng(seed)
    single, pair = rng.normal(size=n_items), rng.normal(size=(n_items, n_items))

    def value(sets):
        out = []
        for chosen in sets:
            items = sorted(chosen)
            out.append(sum(single[i] for i in items) + sum(pair[i, j] for i in items for j in items if i < j))
        return np.array(out)

    return value


def brute_force(value, n_items, counts):
    """min and max over all n! orders of the mean over bins of value(top c_k)."""
    totals = [np.mean([value([frozenset(order[:c])])[0] for c in counts]) for order in permutations(range(n_items))]
    return min(totals), max(totals)


@pytest.mark.parametrize(
    "n_items, bins, seed", [(4, BINS, 0), (6, BINS, 1), (6, (0.1, 0.2, 0.5), 2), (5, (0.4, 1.0), 3)]
)
def test_exact_bounds_equal_brute_force_over_every_order(n_items, bins, seed):
    value = interacting_value(n_items, seed)
    counts = [top_count(k, n_items) for k in bins]
    assert exact_chain_bounds(value, n_items, counts) == pytest.approx(brute_force(value, n_items, counts))


@pytest.mark.parametrize("seed", range(4))
def test_beam_bounds_lie_inside_the_exact_ones_and_reach_them_with_a_wide_beam(seed):
    n_items = 7
    value = interacting_value(n_items, seed)
    counts = [top_count(k, n_items) for k in BINS]
    low, high = exact_chain_bounds(value, n_items, counts)
    for width in (1, 2, 4):
        beam_low, beam_high = beam_chain_bounds(value, n_items, counts, width)
        assert low - 1e-12 <= beam_low <= beam_high <= high + 1e-12
    # a beam that keeps every prefix is an exhaustive search
    assert beam_chain_bounds(value, n_items, counts, beam_width=10_000) == pytest.approx((low, high))
    assert chain_bounds(value, n_items, counts, exact_limit=6)[2] == "beam"
    assert chain_bounds(value, n_items, counts, exact_limit=7)[2] == "exact"
    low_none, high_none, search = chain_bounds(value, n_items, counts, exact_limit=6, beam_width=0)
    assert search == "none" and np.isnan(low_none) and np.isnan(high_none)  # no search: NAOPC undefined


@pytest.mark.parametrize("seed", range(4))
def test_level_bounds_lie_inside_the_exact_ones_and_are_exact_for_an_additive_drop(seed):
    n_items = 8
    counts = [top_count(k, n_items) for k in (0.1, 0.3, 0.5, 1.0)]  # bins that add 1, 2, 1, 4 items
    value = interacting_value(n_items, seed)
    low, high = exact_chain_bounds(value, n_items, counts)
    level_low, level_high = level_chain_bounds(value, n_items, counts)
    assert low - 1e-12 <= level_low <= level_high <= high + 1e-12
    weights = np.random.default_rng(seed).normal(size=n_items)  # additive: best-first is optimal
    additive = lambda sets: np.array([weights[sorted(chosen)].sum() for chosen in sets])  # noqa: E731
    assert level_chain_bounds(additive, n_items, counts) == pytest.approx(exact_chain_bounds(additive, n_items, counts))


def test_level_bounds_score_fewer_sets_than_a_beam_of_width_1():
    n_items, asked = 26, []
    counts = [top_count(k, n_items) for k in BINS]
    value = interacting_value(n_items, 0)

    def counted(sets):
        asked.append(len(sets))
        return value(sets)

    level_chain_bounds(counted, n_items, counts)
    levels = sum(asked)
    asked.clear()
    beam_chain_bounds(counted, n_items, counts, 1)
    assert levels < 0.5 * sum(asked)
    assert chain_bounds(value, n_items, counts, search="levels")[2] == "levels"
    with pytest.raises(ValueError, match="unknown bounds search"):
        chain_bounds(value, n_items, counts, search="exhaustive")


def test_normalised_aopc_maps_the_bounds_to_0_and_1():
    result = normalised_aopc(
        np.array([0.2, 0.5, 0.35, 0.3]), np.array([0.2, 0.1, 0.3, 0.3]), np.array([0.6, 0.5, 0.4, 0.3])
    )
    np.testing.assert_allclose(result[:3], [0.0, 1.0, 0.5])
    assert np.isnan(result[3])  # every ranking equal: undefined
    # a ranking beyond searched (inner) bounds widens them: it is the best (worst) found
    beyond = normalised_aopc(np.array([0.7, 0.1, 0.3]), np.array([0.2, 0.2, 0.3]), np.array([0.6, 0.6, 0.3]))
    np.testing.assert_allclose(beyond[:2], [1.0, 0.0])
    assert np.isnan(beyond[2])


CLS, SEP, MASK = 101, 102, 103


class InteractingScorer:
    """p(class 1 | ids) from a non-additive function of which content tokens remain."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.weights = {token: w for token, w in zip(range(1, 7), rng.uniform(0, 1, size=6))}

    def chosen(self, sequences, classes):
        p = []
        for ids in sequences:
            present = [self.weights[t] for t in ids if t in self.weights]
            z = sum(present) - 0.8 * max(present, default=0.0) * min(present, default=0.0)
            p.append(1 / (1 + np.exp(-(z - 1.5))))
        p = np.array(p)
        return np.where(np.asarray(classes) == 1, p, 1 - p)


@pytest.mark.parametrize("replace", ["remove", "mask"])
def test_bounds_of_an_input_contain_every_ranking_and_are_reached(replace):
    """Every ranking's AOPC, as the benchmark measures it, lies between the bounds; some ranking
    reaches each bound (exact search)."""
    scorer = InteractingScorer(seed=5)
    ids = (CLS, 1, 2, 3, 4, 5, SEP)
    special = np.array([True, False, False, False, False, False, True])
    p_full = float(scorer.chosen([ids], [1])[0])
    example = Example("x", 1, ids, special, target=1, p_full=p_full)
    bounds = aopc_bounds(scorer, example, BINS, replace, MASK)
    assert bounds.search == "exact"
    rankings = [np.array(order) for order in permutations(range(1, 6))]
    without, only, _ = perturbation_probabilities(
        scorer, [example] * len(rankings), rankings, BenchmarkOptions(replace=replace, curve_points=2), MASK
    )
    comprehensiveness = aopc(np.full(len(rankings), p_full), without)[1]
    sufficiency = aopc(np.full(len(rankings), p_full), only)[1]
    assert bounds.comprehensiveness == pytest.approx((comprehensiveness.min(), comprehensiveness.max()))
    assert bounds.sufficiency == pytest.approx((sufficiency.min(), sufficiency.max()))
    beam = aopc_bounds(scorer, example, BINS, replace, MASK, exact_limit=2, beam_width=1)
    assert beam.search == "beam"
    assert bounds.comprehensiveness[0] - 1e-12 <= beam.comprehensiveness[0] <= beam.comprehensiveness[1]
    assert beam.comprehensiveness[1] <= bounds.comprehensiveness[1] + 1e-12
