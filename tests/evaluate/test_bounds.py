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
    search_bounds,
    search_cost,
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
    low_none, high_none, search = chain_bounds(value, n_items, counts, exact_limit=6, search="exact")
    assert search == "none" and np.isnan(low_none) and np.isnan(high_none)  # no search: NAOPC undefined
    assert chain_bounds(value, n_items, counts, search="none")[2] == "none"  # not even the exact search


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

    def chosen(self, sequences, classes, bases=None):  # noqa: ARG002 - no model, nothing cached
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


@pytest.mark.parametrize("seed", range(3))
def test_single_token_bounds_lie_inside_the_exact_ones_and_cost_m_plus_the_bins(seed):
    """Each token removed alone once, then the two orders' top sets: inner bounds, m + a few sets,
    and exact when the drop is additive over tokens (each token's own drop is then its share)."""
    n_items, asked = 8, []
    counts = [top_count(k, n_items) for k in (0.1, 0.3, 0.5, 1.0)]
    value = interacting_value(n_items, seed)

    def counted(sets):
        asked.extend(sets)
        return value(sets)

    low, high = exact_chain_bounds(value, n_items, counts)
    single_low, single_high, search = chain_bounds(counted, n_items, counts, exact_limit=2, search="singles")
    assert search == "singles" and low - 1e-12 <= single_low <= single_high <= high + 1e-12
    assert len(set(asked)) <= n_items + 2 * len(set(counts))
    weights = np.random.default_rng(seed).normal(size=n_items)
    additive = lambda sets: np.array([weights[sorted(chosen)].sum() for chosen in sets])  # noqa: E731
    assert chain_bounds(additive, n_items, counts, exact_limit=2, search="singles")[:2] == pytest.approx(
        exact_chain_bounds(additive, n_items, counts)
    )


class CountingScorer(InteractingScorer):
    """`InteractingScorer` that counts its calls."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.calls = 0

    def chosen(self, sequences, classes, bases=None):  # noqa: ARG002 - no model, nothing cached
        self.calls += 1
        return super().chosen(sequences, classes)


@pytest.mark.parametrize("search", ["levels", "beam", "singles"])
def test_many_inputs_search_together_one_call_per_step_with_the_same_bounds(search):
    """`search_bounds` advances every input's four searches (two metrics, two bounds) in lockstep:
    the bounds of each input alone, in as many scorer calls as the longest search has steps."""
    contents = [(1, 2, 3, 4, 5, 6), (2, 3, 4, 5, 6), (1, 3, 5, 6, 2, 4, 1)]
    scorer = CountingScorer(seed=3)
    examples = []
    for tokens in contents:
        ids = (CLS, *tokens, SEP)
        special = np.array([True] + [False] * len(tokens) + [True])
        examples.append(Example("x", 1, ids, special, target=1, p_full=float(scorer.chosen([ids], [1])[0])))
    alone, calls_alone = [], []
    for example in examples:
        scorer.calls = 0
        alone.append(search_bounds(scorer, [example], BINS, "remove", MASK, search, exact_limit=3, beam_width=2)[0])
        calls_alone.append(scorer.calls)
    scorer.calls = 0
    together = search_bounds(scorer, examples, BINS, "remove", MASK, search, exact_limit=3, beam_width=2)
    assert scorer.calls == max(calls_alone) < sum(calls_alone)
    for one, joint in zip(alone, together, strict=True):
        assert joint.search == one.search == search
        assert joint.comprehensiveness == pytest.approx(one.comprehensiveness)
        assert joint.sufficiency == pytest.approx(one.sufficiency)


def test_search_costs_order_the_searches_and_count_the_exact_sets():
    counts = [top_count(k, 40) for k in BINS]
    costs = [search_cost(40, counts, search) for search in ("singles", "levels", "beam")]
    assert costs == sorted(costs) and costs[0] == 40 + 4 * len(set(counts))
    assert search_cost(40, counts, "none") == search_cost(40, counts, "exact") == 0
    small = [top_count(k, 6) for k in BINS]  # sizes 1, 1, 1, 2, 3
    assert search_cost(6, small, "levels") == 2 * (6 + 15 + 20)  # exact: every set of sizes 1, 2, 3, per metric
