"""The bounds of AOPC on one input, and normalised AOPC (NAOPC; Edin et al., ACL 2025).

AOPC depends on the model and the input as much as on the explanation: on one input every ranking
may drop p by 0.4, on another none more than 0.05. NAOPC puts each input's AOPC between the worst
and the best any ranking of that input reaches: ``(AOPC − lower) / (upper − lower)``, so 0 is the
worst possible ranking and 1 the best (for sufficiency, where lower is better, 0 is the best).

AOPC over bins k (counts ``c_k = ceil(k·m)`` of the m content tokens) depends on a ranking only
through the nested sets of its top ``c_k`` tokens, so the bounds are optimal chains of nested sets
``S_1 ⊆ S_2 ⊆ …`` with ``|S_i| = c_i`` (every chain is the top sets of some ranking):

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
  (or worst) of them fill the next bin's count. Inner bounds as well (each result is a ranking).

The functions take a ``value(sets) -> [set]`` callable, so they are tested on hand-made scorers;
`aopc_bounds` wires it to a model's perturbed inputs (comprehensiveness: the set is removed;
sufficiency: only the set is kept).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from itertools import combinations, pairwise
from typing import Any, Callable, Sequence

import numpy as np

from attnflow.evaluate.deletion import perturb
from attnflow.evaluate.metrics import top_count
from attnflow.evaluate.scorer import target_values

EXACT_LIMIT = 8  # content tokens up to which the bounds are exact (2^8 sets at most)
BEAM_WIDTH = 4  # prefixes kept per step of the beam search
SEARCHES = ("exact", "beam", "levels", "none")  # none: beyond the exact limit with beam width 0
LONG_INPUT_SEARCHES = ("beam", "levels")  # what a caller may ask for beyond the exact limit

SetValue = Callable[[list[frozenset[int]]], np.ndarray]  # sets of items -> [set] drop of p


@dataclass(frozen=True)
class AopcBounds:
    """The lowest and highest AOPC any ranking of one input reaches, per metric.

    Attributes:
        comprehensiveness: ``(lower, upper)`` AOPC comprehensiveness.
        sufficiency: ``(lower, upper)`` AOPC sufficiency.
        search: ``"exact"``, ``"beam"``, ``"levels"`` or ``"none"`` (see the module docstring).
    """

    comprehensiveness: tuple[float, float]
    sufficiency: tuple[float, float]
    search: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AopcBounds":
        """The inverse of `to_dict`."""
        low_c, high_c = data["comprehensiveness"]
        low_s, high_s = data["sufficiency"]
        return cls((float(low_c), float(high_c)), (float(low_s), float(high_s)), str(data["search"]))


def exact_chain_bounds(value: SetValue, n_items: int, counts: Sequence[int]) -> tuple[float, float]:
    """``(lowest, highest)`` mean over the bins of ``value(top c_k items)`` over all orders of
    ``n_items`` items, by dynamic programming over nested sets (``counts`` nondecreasing)."""
    levels = sorted(Counter(counts).items())  # (set size, bins with that size)
    sets = {size: [frozenset(chosen) for chosen in combinations(range(n_items), size)] for size, _ in levels}
    every = [chosen for size, _ in levels for chosen in sets[size]]
    values = dict(zip(every, np.asarray(value(every), dtype=np.float64).tolist(), strict=True))
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


def beam_chain_bounds(
    value: SetValue, n_items: int, counts: Sequence[int], beam_width: int = BEAM_WIDTH
) -> tuple[float, float]:
    """``(low, high)``: the AOPC of the worst and the best order a beam search finds (see the
    module docstring); ``low`` ≥ the exact lowest and ``high`` ≤ the exact highest."""
    if beam_width < 1:
        raise ValueError(f"the beam width must be at least 1, got {beam_width}")
    bins_at = Counter(counts)
    found = []
    for sign in (-1.0, 1.0):  # -1: the lowest AOPC, +1: the highest
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
            drops = np.asarray(value(grown), dtype=np.float64)
            bins = bins_at.get(size, 0)
            reached = [children[child] + bins * float(drop) for child, drop in zip(grown, drops, strict=True)]
            priority = [
                total if bins else children[child] + float(drop)
                for child, total, drop in zip(grown, reached, drops, strict=True)
            ]
            keep = np.argsort([-sign * p for p in priority], kind="stable")[:beam_width]
            beam = [(grown[i], reached[i]) for i in keep]
        found.append(sign * max(sign * total for _, total in beam) / len(counts))
    return found[0], found[1]


def level_chain_bounds(value: SetValue, n_items: int, counts: Sequence[int]) -> tuple[float, float]:
    """``(low, high)``: the AOPC of the worst and the best order grown a bin at a time (see the
    module docstring); inner bounds, as the beam's. Forward passes per bound: the remaining items
    at each distinct bin size, plus one per bin that adds more than one item."""
    levels = sorted(Counter(counts).items())  # (set size, bins with that size), sizes increasing
    found = []
    for sign in (-1.0, 1.0):  # -1: the lowest AOPC, +1: the highest
        chosen: list[int] = []
        total = 0.0
        for size, bins in levels:
            rest = [item for item in range(n_items) if item not in chosen]
            alone = np.asarray(value([frozenset(chosen) | {item} for item in rest]), dtype=np.float64)
            best = np.argsort(-sign * alone, kind="stable")[: size - len(chosen)]
            chosen += [rest[i] for i in best]
            drop = alone[best[0]] if len(best) == 1 else float(value([frozenset(chosen)])[0])
            total += bins * drop
        found.append(total / len(counts))
    return found[0], found[1]


def chain_bounds(
    value: SetValue,
    n_items: int,
    counts: Sequence[int],
    exact_limit: int = EXACT_LIMIT,
    beam_width: int = BEAM_WIDTH,
    search: str = "beam",
) -> tuple[float, float, str]:
    """``(lower, upper, search)``: exact up to ``exact_limit`` items, ``search`` (``"beam"`` or
    ``"levels"``) beyond; with ``beam_width`` 0 no search beyond (NaN bounds: NAOPC undefined for
    that input)."""
    if search not in LONG_INPUT_SEARCHES:
        raise ValueError(f"unknown bounds search {search!r}; choose one of {', '.join(LONG_INPUT_SEARCHES)}")
    if n_items <= exact_limit:
        return (*exact_chain_bounds(value, n_items, counts), "exact")
    if beam_width == 0:
        return float("nan"), float("nan"), "none"
    if search == "levels":
        return (*level_chain_bounds(value, n_items, counts), "levels")
    return (*beam_chain_bounds(value, n_items, counts, beam_width), "beam")


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
    """The AOPC bounds of one benchmark `Example` (its target, and its contrast when it has
    one), scored through ``scorer`` as the benchmark scores a method's perturbations; ``search``
    beyond ``exact_limit`` content tokens: ``"beam"`` or ``"levels"`` (`chain_bounds`)."""
    content = np.flatnonzero(~np.asarray(example.special_mask, dtype=bool))
    m = len(content)
    counts = [top_count(k, m) for k in bins]

    def drops(keep: bool) -> SetValue:
        def value(sets: list[frozenset[int]]) -> np.ndarray:
            removed = [sorted(set(range(m)) - chosen) if keep else sorted(chosen) for chosen in sets]
            variants = [perturb(example.ids, content[np.asarray(r, dtype=np.int64)], replace, mask_id) for r in removed]
            return example.p_full - target_values(scorer, [(variant, example) for variant in variants])

        return value

    low_c, high_c, found = chain_bounds(drops(False), m, counts, exact_limit, beam_width, search)
    low_s, high_s, _ = chain_bounds(drops(True), m, counts, exact_limit, beam_width, search)
    return AopcBounds((low_c, high_c), (low_s, high_s), found)


def normalised_aopc(aopc: np.ndarray | float, lower: np.ndarray | float, upper: np.ndarray | float) -> np.ndarray:
    """``(aopc − lower) / (upper − lower)`` elementwise, the span first widened to include ``aopc``
    (its ranking is a real one: with searched bounds it may beat them, and the exact bounds hold
    it anyway), so NAOPC lies in [0, 1]; NaN where the span is 0 (every ranking of that input gives
    the same AOPC: nothing to tell apart)."""
    aopc, lower, upper = (np.asarray(a, dtype=np.float64) for a in (aopc, lower, upper))
    lower, upper = np.minimum(lower, aopc), np.maximum(upper, aopc)
    span = upper - lower
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(span > 1e-12, (aopc - lower) / np.where(span > 1e-12, span, 1.0), np.nan)
