"""From an `AuditStats` to the numbers of ``results.json`` (definitions: docs/audit.md).

- words per predicted class, by their relevance *for* that class: the positive part of each
  text's signed relevance (``max(relevance, 0)``; the relevance itself for non-negative methods):
  examples, occurrences, total and mean per example holding the word with a 95 % confidence
  interval over those examples (on the log scale: it stays above 0; none for one example), share
  of the class's relevance, and the mean signed relevance beside it; ranked by the mean among
  words in at least ``min_count`` examples;
- contrast: per class, relevance for the class per example of the class minus relevance for
  their class per example of the other classes (positive parts, as above: the words that
  separate the classes);
- errors: accuracy, confusion, the most confident errors, and the words whose relevance for the
  prediction per example is higher in errors than in correct predictions (positive parts);
- terms: each term's mean |relevance| against the `MATCHED` words of nearest frequency (the chance
  baseline), its percentile among them, its share of all relevance against the baseline share;
- swaps: flipped-prediction rate (Wilson interval) and mean Δp (normal interval), and the texts
  left unswapped because a swap word has several partners.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from attnflow.dataset_audit.stats import (
    EXAMPLES,
    MAGNITUDE,
    OCCURRENCES,
    POSITIVE,
    POSITIVE_SQUARES,
    RELEVANCE,
    SQUARES,
    AuditStats,
    merge_words,
)
from attnflow.statistics import Z95

MATCHED = 50  # words of nearest frequency that form a term's chance baseline
FLAG_PERCENTILE = 95.0  # a term above this percentile of its matched words is flagged
TOP_WORDS = 20


def mean_interval(
    total: float, squares: float, n: float, non_negative: bool = False
) -> tuple[float, float | None, float | None]:
    """``(mean, low, high)``: the mean of n values from their sum and sum of squares, with a 95 %
    interval from its standard error se (the sample standard deviation over √n). Values that can
    be negative: the normal interval, mean ± 1.96 se. ``non_negative`` values (relevance for a
    class, magnitudes): the interval of log(mean) by the delta method, mean · exp(±1.96 se / mean),
    which stays above 0 where the normal one would reach below (a mean near 0 with a wide spread);
    all values 0: [0, 0]. ``n < 2``: no interval (``low`` and ``high`` None)."""
    mean = total / n
    if n < 2:
        return mean, None, None
    variance = max(squares - n * mean * mean, 0.0) / (n - 1)
    se = math.sqrt(variance / n)
    if non_negative:
        if mean <= 0.0:
            return mean, 0.0, 0.0
        factor = math.exp(Z95 * se / mean)
        return mean, mean / factor, mean * factor
    return mean, mean - Z95 * se, mean + Z95 * se


def wilson_interval(successes: float, n: float) -> tuple[float, float, float]:
    """``(rate, low, high)``: the Wilson 95 % interval of a proportion."""
    if n == 0:
        return math.nan, math.nan, math.nan
    rate = successes / n
    centre = (rate + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(rate * (1 - rate) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return rate, max(0.0, centre - half), min(1.0, centre + half)


def word_row(word: str, sums: Sequence[float], group_examples: int) -> dict[str, Any]:
    """One word's row of a table: its mean relevance for the class (positive part) with a confidence
    interval, counts, total and share, and its mean signed relevance."""
    mean, low, high = mean_interval(sums[POSITIVE], sums[POSITIVE_SQUARES], sums[EXAMPLES], non_negative=True)
    return {
        "word": word,
        "examples": int(sums[EXAMPLES]),
        "occurrences": int(sums[OCCURRENCES]),
        "total": sums[POSITIVE],
        "mean": mean,
        "ci": [low, high],
        "share": sums[POSITIVE] / group_examples if group_examples else 0.0,
        "signed_mean": sums[RELEVANCE] / sums[EXAMPLES],
    }


def ranked_words(table: dict[str, list[float]], group_examples: int, min_count: int, top: int) -> list[dict]:
    """Words in at least ``min_count`` examples, by mean relevance for the class (ties: by word)."""
    rows = [word_row(w, s, group_examples) for w, s in table.items() if s[EXAMPLES] >= min_count]
    return sorted(rows, key=lambda row: (-row["mean"], row["word"]))[:top]


def pooled(tables: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Word sums added over groups."""
    total: dict[str, list[float]] = {}
    for table in tables:
        merge_words(total, table)
    return total


def contrast(
    inside: dict[str, list[float]],
    outside: dict[str, list[float]],
    n_inside: int,
    n_outside: int,
    min_count: int,
    top: int,
) -> list[dict[str, Any]]:
    """Words by relevance per example inside a group minus per example outside it, each the
    positive part (the relevance for the class each example's map explains; both groups' examples
    must be > 0); words in at least ``min_count`` examples of the two groups together."""
    if not n_inside or not n_outside:
        return []
    rows: list[dict[str, Any]] = []
    for word in set(inside) | set(outside):
        a, b = inside.get(word), outside.get(word)
        in_examples, out_examples = (0 if sums is None else sums[EXAMPLES] for sums in (a, b))
        if in_examples + out_examples < min_count:
            continue
        per_inside = 0.0 if a is None else a[POSITIVE] / n_inside
        per_outside = 0.0 if b is None else b[POSITIVE] / n_outside
        rows.append(
            {
                "word": word,
                "contrast": per_inside - per_outside,
                "inside_per_example": per_inside,
                "outside_per_example": per_outside,
                "inside_examples": int(in_examples),
                "outside_examples": int(out_examples),
            }
        )
    return sorted(rows, key=lambda row: (-row["contrast"], row["word"]))[:top]


def term_audit(all_words: dict[str, list[float]], terms: Sequence[str], min_count: int) -> dict[str, Any]:
    """Each term against the `MATCHED` non-term words of nearest example count (log scale), by the
    magnitude of their relevance (|relevance|: for signed methods, reliance against the
    prediction counts as reliance; for non-negative ones it is the relevance)."""
    # by word: words of equal frequency tie, and the nearest ones must not depend on the order in
    # which the texts (Ray's workers, a resumed run) brought them in
    candidates = sorted((w, s) for w, s in all_words.items() if w not in terms and s[EXAMPLES] >= 1)
    counts = np.array([s[EXAMPLES] for _, s in candidates], dtype=np.float64)
    means = np.array([s[MAGNITUDE] / s[EXAMPLES] for _, s in candidates], dtype=np.float64)
    total = sum(s[MAGNITUDE] for s in all_words.values())
    rows: list[dict[str, Any]] = []
    missing = []
    for term in terms:
        sums = all_words.get(term)
        if sums is None:
            missing.append(term)
            continue
        nearest = np.argsort(np.abs(np.log(counts) - math.log(sums[EXAMPLES])), kind="stable")[:MATCHED]
        baseline = means[nearest]
        mean, low, high = mean_interval(sums[MAGNITUDE], sums[SQUARES], sums[EXAMPLES], non_negative=True)
        percentile = float(100.0 * np.mean(baseline < mean)) if baseline.size else math.nan
        expected = float(np.median(baseline)) * sums[EXAMPLES] if baseline.size else math.nan
        rows.append(
            {
                "term": term,
                "examples": int(sums[EXAMPLES]),
                "mean": mean,
                "ci": [low, high],
                "baseline_median": float(np.median(baseline)) if baseline.size else math.nan,
                "baseline_p95": float(np.percentile(baseline, FLAG_PERCENTILE)) if baseline.size else math.nan,
                "matched_words": int(baseline.size),
                "percentile": percentile,
                "share": sums[MAGNITUDE] / total if total else 0.0,
                "baseline_share": expected / total if total else math.nan,
                "flagged": bool(sums[EXAMPLES] >= min_count and percentile >= FLAG_PERCENTILE),
            }
        )
    share = sum(row["share"] for row in rows)
    baseline_share = sum(row["baseline_share"] for row in rows)
    return {
        "terms": rows,
        "missing": missing,
        "share": share,
        "baseline_share": baseline_share,
        "ratio": share / baseline_share if baseline_share else math.nan,
        "flagged": [row["term"] for row in rows if row["flagged"]],
    }


def swap_summary(stats: AuditStats) -> dict[str, Any]:
    """The counterfactual swaps: the rate of flipped predictions and the mean change of p, with intervals."""
    texts, flips, total, squares = stats.swaps
    rate, low, high = wilson_interval(flips, texts)
    mean, mean_low, mean_high = mean_interval(total, squares, texts) if texts else (math.nan,) * 3
    return {
        "texts": int(texts),
        "flips": int(flips),
        "flip_rate": rate,
        "flip_rate_ci": [low, high],
        "mean_delta_p": mean,
        "mean_delta_p_ci": [mean_low, mean_high],
        "flipping_examples": stats.kept_changes(),
        "unswapped": stats.unswapped,
        "ambiguous": dict(sorted(stats.ambiguous.items())),
        "unswapped_examples": stats.kept_ambiguous(),
    }


def analyse(
    stats: AuditStats,
    label_names: Sequence[str],
    min_count: int,
    terms: Sequence[str] = (),
    swaps: bool = False,
    labelled: bool = True,
    top: int = TOP_WORDS,
) -> dict[str, Any]:
    """The result sections of ``results.json`` (see the module doc)."""
    all_words = pooled(stats.words)
    classes = []
    for index, name in enumerate(label_names):
        others = pooled([table for k, table in enumerate(stats.words) if k != index])
        n_others = stats.n_samples - stats.examples[index]
        classes.append(
            {
                "class": name,
                "examples": stats.examples[index],
                "top_words": ranked_words(stats.words[index], stats.examples[index], min_count, top),
                "contrast": contrast(stats.words[index], others, stats.examples[index], n_others, min_count, top),
            }
        )
    results: dict[str, Any] = {"classes": classes, "vocabulary": len(all_words), "noted_texts": stats.noted}
    if labelled:
        correct, wrong = stats.outcome_examples
        results["errors"] = {
            "accuracy": correct / (correct + wrong) if correct + wrong else math.nan,
            "correct": correct,
            "errors": wrong,
            "confusion": stats.confusion,
            "error_words": contrast(stats.outcome_words[1], stats.outcome_words[0], wrong, correct, min_count, top),
            "most_confident": stats.kept_errors(),
        }
    if terms:
        results["terms"] = term_audit(all_words, terms, min_count)
    if swaps:
        results["swaps"] = swap_summary(stats)
    return results
