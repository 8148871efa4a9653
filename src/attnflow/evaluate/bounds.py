"""The bounds of AOPC on one input, and normalised AOPC (NAOPC; Edin et al., ACL 2025).

AOPC depends on the model and the input as much as on the explanation: on one input every ranking
may drop p by 0.4, on another none more than 0.05. NAOPC puts each input's AOPC between the worst
and the best any ranking of that input reaches: ``(AOPC − lower) / (upper − lower)``, so 0 is the
worst possible ranking and 1 the best (for sufficiency, where lower is better, 0 is the best).

AOPC over bins k (counts ``c_k = ceil(k·m)`` of the m content tokens) depends on a ranking only
through the nested sets of its top ``c_k`` tokens, so the bounds are optimal chains of nested sets
``S_1 ⊆ S_2 ⊆ …`` with ``|S_i| = c_i`` (every chain is the top sets of some ranking). The searches,
cheapest last:

- **exact** (m ≤ `EXACT_LIMIT`): every set of every bin size is scored once, and a dynamic
  programme over the sizes finds the best and the worst chain — the same numbers as enumerating
  all m! deletion orders;
- **beam** (longer inputs): orders are grown one token at a time, keeping the `BEAM_WIDTH` best
  (or worst) prefixes; a prefix is ranked by the bin terms it has reached plus its current drop.
  Every beam result is the AOPC of a real ranking, so the beam's upper bound is at most the exact
  one and its lower bound at least the exact one. A ranking whose AOPC falls outside the found
  [lower, upper] is itself a better bound: `normalised_aopc` widens the span to include it (NAOPC
  1 or 0: "at least as good as the search found"), which keeps the bounds inner ones;
- **levels** (longer inputs, about half the forward passes of a beam of width 1): orders are grown
  one bin at a time: from the top set of a bin, every remaining token is tried alone and the best
  (or worst) of them fill the next bin's count. Inner bounds as well (each result is a ranking);
- **singles** (long inputs, m + a few forward passes): each token is removed alone once, and the
  tokens ordered by that drop (highest first, and lowest first) give the two rankings whose AOPC
  are the bounds of both metrics. Inner bounds, the loosest: this is the ranking leave-one-out
  makes when it explains the same probability, so leave-one-out meets the upper bound by
  construction (NAOPC comprehensiveness 1).

``none`` searches nothing (NaN bounds, NAOPC undefined); ``exact`` searches nothing beyond the
exact limit. Every search is a generator that yields the sets it wants scored and receives their
values, so the searches of both metrics, both bounds and many inputs advance in lockstep and each
step is one batched call (`search_bounds`). The pure ``*_chain_bounds`` functions take a
``value(sets) -> [set]`` callable and are tested on hand-made scorers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from itertools import combinations, pairwise
from typing import Any, Callable, Generator, Sequence

import numpy as np

from attnflow.evaluate.deletion import perturb
from attnflow.evaluate.metrics import top_count
from attnflow.evaluate.scorer import target_values

EXACT_LIMIT = 8  # content tokens up to which the bounds are exact (2^8 sets at most)
BEAM_WIDTH = 4  # prefixes kept per step of the beam search
BOUND_SEARCHES = ("none", "exact", "singles", "levels", "beam")  # what a caller may ask for

SetValue = Callable[[list[frozenset[int]]], np.ndarray]  # sets of items -> [set] drop of p
# A search yields requests (lists of items to score), receives their values [item] and returns its result.
Search = Generator[list[Any], np.ndarray, Any]
Probe = tuple[bool, frozenset[int]]  # (keep only the set: sufficiency; else remove it: comprehensiveness, set)


@dataclass(frozen=True)
class AopcBounds:
    """The lowest and highest AOPC any ranking of one input reaches, per metric.

    Attributes:
        comprehensiveness: ``(lower, upper)`` AOPC comprehensiveness (NaN: not searched).
        sufficiency: ``(lower, upper)`` AOPC sufficiency.
        search: ``"exact"``, ``"beam"``, ``"levels"``, ``"singles"`` or ``"none"`` (see the module
            docstring).
    """

    comprehensiveness: tuple[float, float]
    sufficiency: tuple[float, float]
    search: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (None for a bound not searched)."""
        return {
            name: [None if np.isnan(b) else b for b in value] if isinstance(value, tuple) else value
            for name, value in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AopcBounds":
        """The inverse of `to_dict`."""

        def pair(values: Sequence[float | None]) -> tuple[float, float]:
            low, high = (float("nan") if b is None else float(b) for b in values)
            return low, high

        return cls(pair(data["comprehensiveness"]), pair(data["sufficiency"]), str(data["search"]))


UNSEARCHED = AopcBounds((float("nan"), float("nan")), (float("nan"), float("nan")), "none")


# ----- the searches, as generators ------------------------------------------------------------


def _exact_steps(n_items: int, counts: Sequence[int]) -> Search:
    """``(lowest, highest)`` mean over the bins of ``value(top c_k items)`` over all orders, by
    dynamic programming over nested sets (``counts`` nondecreasing); one request of every set."""
    levels = sorted(Counter(counts).items())  # (set size, bins with that size)
    sets = {size: [frozenset(chosen) for chosen in combinations(range(n_items), size)] for size, _ in levels}
    every = [chosen for size, _ in levels for chosen in sets[size]]
    values = dict(zip(every, np.asarray((yield every), dtype=np.float64).tolist(), strict=True))
    first_size, first_bins = levels[0]
    lowest = {chosen: first_bins * values[chosen] for chosen in sets[first_size]}
    highest = dict(lowest)
    for (previous, _), (size, bins) in pairwise(levels):
        next_lowest, next_highest = {}, {}
        for chosen in sets[size]:
            inside = [frozenset(part) for part in combinations(sorted(chosen), previous)]
            next_lowest[chosen] = bins * values[chosen] + min(lowest[part] for part in inside)
            next_highest[chosen] = bins * values[chosen] + max(highest[part] for part in inside)
        lowest, highest = next_lowest, next_highest
    return min(lowest.values()) / len(counts), max(highest.values()) / len(counts)


def _beam_steps(n_items: int, counts: Sequence[int], beam_width: int, sign: float) -> Search:
    """The AOPC of the best (``sign`` +1) or worst (-1) order a beam search finds; one request per
    set size."""
    bins_at = Counter(counts)
    beam: list[tuple[frozenset[int], float]] = [(frozenset(), 0.0)]  # (top set, bin terms reached)
    for size in range(1, max(counts) + 1):
        children: dict[frozenset[int], float] = {}
        for chosen, banked in beam:
            for item in range(n_items):
                if item not in chosen:
                    child = chosen | {item}
                    if child not in children or sign * banked > sign * children[child]:
                        children[child] = banked
        grown = list(children)
        drops = np.asarray((yield grown), dtype=np.float64)
        bins = bins_at.get(size, 0)
        reached = [children[child] + bins * float(drop) for child, drop in zip(grown, drops, strict=True)]
        priority = [
            total if bins else children[child] + float(drop)
            for child, total, drop in zip(grown, reached, drops, strict=True)
        ]
        keep = np.argsort([-sign * p for p in priority], kind="stable")[:beam_width]
        beam = [(grown[i], reached[i]) for i in keep]
    return sign * max(sign * total for _, total in beam) / len(counts)


def _level_steps(n_items: int, counts: Sequence[int], sign: float) -> Search:
    """The AOPC of the best (+1) or worst (-1) order grown a bin at a time; per distinct bin size
    one request of the remaining items alone, and one of the grown set when it adds several."""
    chosen: list[int] = []
    total = 0.0
    for size, bins in sorted(Counter(counts).items()):
        rest = [item for item in range(n_items) if item not in chosen]
        alone = np.asarray((yield [frozenset(chosen) | {item} for item in rest]), dtype=np.float64)
        best = np.argsort(-sign * alone, kind="stable")[: size - len(chosen)]
        chosen += [rest[i] for i in best]
        drop = alone[best[0]] if len(best) == 1 else float((yield [frozenset(chosen)])[0])
        total += bins * drop
    return total / len(counts)


def _singles_steps(n_items: int, counts: Sequence[int]) -> Search:
    """Both metrics' ``(lower, upper)`` from the two orders of the tokens by their drop when
    removed alone (highest first, lowest first): requests of `Probe`s, one of the m single
    removals, one of the two orders' top sets for both metrics."""
    alone = np.asarray((yield [(False, frozenset({item})) for item in range(n_items)]), dtype=np.float64)
    orders = (np.argsort(alone, kind="stable"), np.argsort(-alone, kind="stable"))  # lowest, highest first
    probes = [(keep, frozenset(order[:c].tolist())) for keep in (False, True) for order in orders for c in counts]
    values = np.asarray((yield probes), dtype=np.float64).reshape(2, 2, len(counts)).mean(axis=2)  # [metric, order]
    return (tuple(sorted(values[0].tolist())), tuple(sorted(values[1].tolist())))


def _lockstep(*searches: Search) -> Search:
    """Searches advanced together: each step requests what all of them request (concatenated) and
    sends each its share of the values; returns their results, in order."""
    results: list[Any] = [None] * len(searches)
    requests: dict[int, list[Any]] = {}
    for index, search in enumerate(searches):
        try:
            requests[index] = next(search)
        except StopIteration as stop:
            results[index] = stop.value
    while requests:
        values = np.asarray((yield [item for request in requests.values() for item in request]), dtype=np.float64)
        start, following = 0, {}
        for index, request in requests.items():
            share, start = values[start : start + len(request)], start + len(request)
            try:
                following[index] = searches[index].send(share)
            except StopIteration as stop:
                results[index] = stop.value
        requests = following
    return tuple(results)


def _mapped(search: Search, wrap: Callable[[Any], Any]) -> Search:
    """``search`` with every requested item passed through ``wrap`` (values unchanged)."""
    try:
        request = next(search)
        while True:
            request = search.send((yield [wrap(item) for item in request]))
    except StopIteration as stop:
        return stop.value


def _both_bounds(one: Callable[[float], Search]) -> Search:
    """``(lower, upper)`` of a search run once per sign."""
    return (yield from _lockstep(one(-1.0), one(1.0)))


def bounds_steps(
    n_items: int,
    counts: Sequence[int],
    search: str,
    exact_limit: int = EXACT_LIMIT,
    beam_width: int = BEAM_WIDTH,
) -> Search:
    """The `AopcBounds` of an input with ``n_items`` content tokens, as a search of `Probe`
    requests: exact up to ``exact_limit`` items (unless ``search`` is ``"none"``), ``search``
    beyond (`BOUND_SEARCHES`; ``"exact"`` and ``"none"``: nothing, NaN bounds)."""
    if search not in BOUND_SEARCHES:
        raise ValueError(f"unknown bounds search {search!r}; choose one of {', '.join(BOUND_SEARCHES)}")
    if search == "none" or (n_items > exact_limit and search == "exact"):
        return UNSEARCHED
    if n_items <= exact_limit:
        search = "exact"
    if search == "singles":
        comprehensiveness, sufficiency = yield from _singles_steps(n_items, counts)
        return AopcBounds(comprehensiveness, sufficiency, search)

    def per_metric(keep: bool) -> Search:
        if search == "exact":
            steps = _exact_steps(n_items, counts)
        elif search == "levels":
            steps = _both_bounds(lambda sign: _level_steps(n_items, counts, sign))
        else:
            if beam_width < 1:
                raise ValueError(f"the beam width must be at least 1, got {beam_width}")
            steps = _both_bounds(lambda sign: _beam_steps(n_items, counts, beam_width, sign))
        return _mapped(steps, lambda chosen: (keep, chosen))

    comprehensiveness, sufficiency = yield from _lockstep(per_metric(False), per_metric(True))
    return AopcBounds(comprehensiveness, sufficiency, search)


def _run(search: Search, value: Callable[[list[Any]], np.ndarray]) -> Any:
    """Drive one search with ``value`` (requested items -> [item] values) to its result."""
    try:
        request = next(search)
        while True:
            request = search.send(np.asarray(value(request), dtype=np.float64))
    except StopIteration as stop:
        return stop.value


# ----- the pure functions (a value callable) ----------------------------------------------------


def exact_chain_bounds(value: SetValue, n_items: int, counts: Sequence[int]) -> tuple[float, float]:
    """``(lowest, highest)`` mean over the bins of ``value(top c_k items)`` over all orders of
    ``n_items`` items (``counts`` nondecreasing)."""
    return _run(_exact_steps(n_items, counts), value)


def beam_chain_bounds(
    value: SetValue, n_items: int, counts: Sequence[int], beam_width: int = BEAM_WIDTH
) -> tuple[float, float]:
    """``(low, high)``: the AOPC of the worst and the best order a beam search finds; ``low`` ≥
    the exact lowest and ``high`` ≤ the exact highest."""
    if beam_width < 1:
        raise ValueError(f"the beam width must be at least 1, got {beam_width}")
    return _run(_both_bounds(lambda sign: _beam_steps(n_items, counts, beam_width, sign)), value)


def level_chain_bounds(value: SetValue, n_items: int, counts: Sequence[int]) -> tuple[float, float]:
    """``(low, high)``: the AOPC of the worst and the best order grown a bin at a time; inner
    bounds, as the beam's."""
    return _run(_both_bounds(lambda sign: _level_steps(n_items, counts, sign)), value)


def chain_bounds(
    value: SetValue,
    n_items: int,
    counts: Sequence[int],
    exact_limit: int = EXACT_LIMIT,
    beam_width: int = BEAM_WIDTH,
    search: str = "beam",
) -> tuple[float, float, str]:
    """``(lower, upper, search used)`` of one metric whose drops are ``value(sets)``, as
    `bounds_steps` searches them (NaN bounds where nothing is searched)."""
    bounds = _run(
        bounds_steps(n_items, counts, search, exact_limit, beam_width),
        lambda probes: value([chosen for _, chosen in probes]),
    )
    return (*bounds.comprehensiveness, bounds.search)


# ----- an input's bounds, scored through a model ------------------------------------------------


def search_bounds(
    scorer: Any,
    examples: Sequence[Any],
    bins: Sequence[float],
    replace: str,
    mask_id: int | None,
    search: str,
    exact_limit: int = EXACT_LIMIT,
    beam_width: int = BEAM_WIDTH,
) -> list[AopcBounds]:
    """The `AopcBounds` of each benchmark `Example` (its target, and its contrast when it has one),
    the searches of every example advancing together: one batched ``scorer`` call per step
    (comprehensiveness removes a set, sufficiency keeps only it; drops are ``p_full`` minus the
    perturbed input's quantity, scored as the benchmark scores a method's perturbations)."""
    contents = [np.flatnonzero(~np.asarray(example.special_mask, dtype=bool)) for example in examples]

    def tagged(index: int) -> Search:
        m = len(contents[index])
        steps = bounds_steps(m, [top_count(k, m) for k in bins], search, exact_limit, beam_width)
        return _mapped(steps, lambda probe: (index, *probe))

    searches = [tagged(index) for index in range(len(examples))]

    def drops(probes: list[tuple[int, bool, frozenset[int]]]) -> np.ndarray:
        variants = []
        for index, keep, chosen in probes:
            content, example = contents[index], examples[index]
            removed = sorted(set(range(len(content))) - chosen) if keep else sorted(chosen)
            ids = perturb(example.ids, content[np.asarray(removed, dtype=np.int64)], replace, mask_id)
            variants.append((ids, example))
        p_full = np.array([examples[index].p_full for index, _, _ in probes], dtype=np.float64)
        return p_full - target_values(scorer, variants) if variants else np.zeros(0)

    return list(_run(_lockstep(*searches), drops))


def aopc_bounds(
    scorer: Any,
    example: Any,
    bins: Sequence[float],
    replace: str,
    mask_id: int | None,
    exact_limit: int = EXACT_LIMIT,
    beam_width: int = BEAM_WIDTH,
    search: str = "beam",
) -> AopcBounds:
    """The AOPC bounds of one benchmark `Example` (`search_bounds` of that one example)."""
    return search_bounds(scorer, [example], bins, replace, mask_id, search, exact_limit, beam_width)[0]


def search_cost(
    n_items: int, counts: Sequence[int], search: str, exact_limit: int = EXACT_LIMIT, beam_width: int = BEAM_WIDTH
) -> int:
    """About how many perturbed inputs the bounds of an input with ``n_items`` content tokens score
    (an upper estimate: the scorer scores a repeated input once)."""
    if search == "none" or (n_items > exact_limit and search == "exact"):
        return 0
    sizes = sorted(set(counts))
    if n_items <= exact_limit:
        from math import comb

        return 2 * sum(comb(n_items, size) for size in sizes)
    if search == "singles":
        return n_items + 4 * len(sizes)
    if search == "levels":
        per_sign = sum(n_items - previous for previous in [0, *sizes[:-1]]) + len(sizes)
        return 2 * (2 * per_sign - n_items)  # both metrics; the first level is shared by both signs
    return 4 * beam_width * sum(n_items - size + 1 for size in range(1, max(counts) + 1))


def normalised_aopc(aopc: np.ndarray | float, lower: np.ndarray | float, upper: np.ndarray | float) -> np.ndarray:
    """``(aopc − lower) / (upper − lower)`` elementwise, the span first widened to include ``aopc``
    (its ranking is a real one: with searched bounds it may beat them, and the exact bounds hold
    it anyway), so NAOPC lies in [0, 1]; NaN where the span is 0 (every ranking of that input gives
    the same AOPC: nothing to tell apart) or the bounds were not searched."""
    aopc, lower, upper = (np.asarray(a, dtype=np.float64) for a in (aopc, lower, upper))
    with np.errstate(invalid="ignore"):
        lower, upper = np.minimum(lower, aopc), np.maximum(upper, aopc)
        span = upper - lower
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(span > 1e-12, (aopc - lower) / np.where(span > 1e-12, span, 1.0), np.nan)
