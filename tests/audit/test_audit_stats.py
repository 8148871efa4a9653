"""The accumulator merges like one pass; the analysis' numbers against explicit recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnflow.dataset_audit import analysis
from attnflow.dataset_audit.stats import KEPT, KEPT_AMBIGUOUS, AuditStats, ExampleResult


def random_results(n: int, seed: int) -> list[ExampleResult]:
    rng = np.random.default_rng(seed)
    vocabulary = [f"w{k}" for k in range(12)]
    results = []
    for index in range(n):
        chosen = rng.choice(vocabulary, size=rng.integers(1, 5), replace=False)
        words = {str(word): (int(rng.integers(1, 3)), float(rng.uniform(-0.5, 1.0))) for word in chosen}  # signed
        predicted, label = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        swapped = None
        if rng.random() < 0.4:
            after = int(rng.integers(0, 3))
            swapped = {"text": "x", "predicted_before": predicted, "predicted_after": after, "delta_p": rng.normal()}
        ambiguous = ("her",) if swapped is None and rng.random() < 0.2 else ()
        results.append(
            ExampleResult(
                index, f"text {index}", predicted, float(rng.random()), label, words, [], [], [], [], swapped, ambiguous
            )
        )
    return results


def test_merged_halves_equal_one_pass_and_keep_the_same_examples():
    results = random_results(200, seed=0)
    whole, first, second = AuditStats(3), AuditStats(3), AuditStats(3)
    for result in results:
        whole.update(result)
    for result in results[120:]:  # the second half first: the kept examples must not depend on order
        second.update(result)
    for result in results[:120]:
        first.update(result)
    merged = AuditStats.from_state_dict(second.state_dict()).merge(first)
    a, b = whole.state_dict(), merged.state_dict()
    assert a["examples"] == b["examples"] and a["confusion"] == b["confusion"]
    for group in range(3):
        assert a["words"][group].keys() == b["words"][group].keys()
        for word, sums in a["words"][group].items():
            np.testing.assert_allclose(sums, b["words"][group][word], rtol=1e-12)
    assert [e["index"] for e in whole.kept_errors()] == [e["index"] for e in merged.kept_errors()]
    assert len(whole.kept_errors()) == KEPT
    # Oracle: the KEPT most confident misclassified examples, by an explicit sort.
    wrong = sorted((r for r in results if r.label != r.predicted), key=lambda r: (-r.probability, r.index))
    assert [e["index"] for e in whole.kept_errors()] == [r.index for r in wrong[:KEPT]]
    swapped = [r for r in results if r.swapped is not None]
    flips = [r for r in swapped if r.swapped["predicted_after"] != r.swapped["predicted_before"]]
    assert whole.swaps[:2] == [len(swapped), len(flips)]
    assert whole.swaps[2] == pytest.approx(sum(r.swapped["delta_p"] for r in swapped))
    unswapped = [r.index for r in results if r.ambiguous]
    assert whole.unswapped == merged.unswapped == len(unswapped) and merged.ambiguous == {"her": len(unswapped)}
    assert [e["index"] for e in merged.kept_ambiguous()] == unswapped[:KEPT_AMBIGUOUS]


def test_word_means_and_intervals_match_numpy():
    """Words rank by their relevance for the class: the mean of the positive parts of the signed
    per-text relevance, recomputed here from the examples."""
    results = random_results(300, seed=1)
    stats = AuditStats(3)
    for result in results:
        stats.update(result)
    ranked = analysis.ranked_words(stats.words[0], stats.examples[0], min_count=1, top=50)
    assert len(ranked) == 12
    for row in ranked:
        signed = np.array([r.words[row["word"]][1] for r in results if r.predicted == 0 and row["word"] in r.words])
        values = np.maximum(signed, 0.0)
        assert (signed < 0).any()  # the positive part matters in this case
        assert row["examples"] == values.size
        assert row["mean"] == pytest.approx(values.mean()) and row["signed_mean"] == pytest.approx(signed.mean())
        factor = math.exp(1.959964 * values.std(ddof=1) / math.sqrt(values.size) / values.mean())  # log scale
        assert row["ci"] == pytest.approx([values.mean() / factor, values.mean() * factor])
        assert row["share"] == pytest.approx(values.sum() / stats.examples[0])
    assert [row["mean"] for row in ranked] == sorted((row["mean"] for row in ranked), reverse=True)


def test_wilson_interval_of_a_known_case():
    rate, low, high = analysis.wilson_interval(5, 10)
    assert (rate, round(low, 4), round(high, 4)) == (0.5, 0.2366, 0.7634)


def test_contrast_per_example_by_hand():
    """Positive parts per text inside minus outside; texts without the word count 0."""
    inside, outside = AuditStats(1), AuditStats(1)
    for index, (good, plot) in enumerate([(0.5, None), (0.75, -0.5), (-0.25, None), (None, 0.25), (None, None)]):
        words = {w: (1, v) for w, v in (("good", good), ("plot", plot)) if v is not None}
        inside.update(ExampleResult(index, "t", 0, 0.9, None, words, [], [], [], []))
    for index in range(10):
        words = {"good": (1, -0.5)} if index < 4 else {"plot": (1, 0.2)} if index < 8 else {}
        outside.update(ExampleResult(index, "t", 0, 0.9, None, words, [], [], [], []))
    rows = analysis.contrast(inside.words[0], outside.words[0], n_inside=5, n_outside=10, min_count=1, top=5)
    assert [row["word"] for row in rows] == ["good", "plot"]
    assert rows[0]["contrast"] == pytest.approx((0.5 + 0.75 + 0) / 5 - 0 / 10)
    assert rows[1]["contrast"] == pytest.approx((0 + 0.25) / 5 - 4 * 0.2 / 10)
    assert (rows[0]["inside_examples"], rows[0]["outside_examples"]) == (3, 4)


def test_a_term_is_flagged_only_above_its_matched_words():
    rng = np.random.default_rng(3)
    # [examples, occurrences, relevance, relevance², |relevance|, relevance⁺, (relevance⁺)²]
    words = {f"w{k}": [20.0, 20.0, 20 * m, 20 * m * m, 20 * m] for k, m in enumerate(rng.uniform(0.05, 0.15, 80))}
    words["loud"] = [20.0, 20.0, 20 * 0.5, 20 * 0.25, 20 * 0.5]  # far above every other word
    words["plain"] = [20.0, 20.0, 20 * 0.1, 20 * 0.01, 20 * 0.1]  # like the others
    words["rare"] = [2.0, 2.0, 1.0, 0.5, 1.0]  # high, but in fewer texts than min_count
    for sums in words.values():
        sums += sums[2:4]  # non-negative relevance: the positive part is the relevance
    result = analysis.term_audit(words, ["loud", "plain", "rare", "absent"], min_count=5)
    rows = {row["term"]: row for row in result["terms"]}
    assert result["flagged"] == ["loud"] and result["missing"] == ["absent"]
    assert rows["loud"]["percentile"] == 100.0 and rows["loud"]["matched_words"] == analysis.MATCHED
    assert 10.0 < rows["plain"]["percentile"] < 90.0
    total = sum(sums[4] for sums in words.values())
    assert rows["loud"]["share"] == pytest.approx(10.0 / total)


def test_the_term_baseline_does_not_depend_on_the_order_words_came_in():
    """80 words in 20 texts each tie on frequency: which 50 form the baseline must not depend on the
    order of the word table (Ray's merge, a resumed run bring words in another order)."""
    rng = np.random.default_rng(5)
    words = {f"w{k:02d}": [20.0, 20.0, 20 * m, 20 * m * m, 20 * m] for k, m in enumerate(rng.uniform(0.05, 0.5, 80))}
    words["term"] = [20.0, 20.0, 2.0, 0.2, 2.0]
    for sums in words.values():
        sums += sums[2:4]
    forward = analysis.term_audit(words, ["term"], min_count=5)
    backward = analysis.term_audit(dict(reversed(words.items())), ["term"], min_count=5)
    for key in ("baseline_median", "baseline_p95", "percentile", "matched_words"):
        assert forward["terms"][0][key] == backward["terms"][0][key]
    assert forward["ratio"] == pytest.approx(backward["ratio"], rel=1e-12)  # the total: another order of sums


def test_the_term_audit_counts_reliance_against_the_prediction_too():
    """A signed method: a term at +0.4 in half its texts and -0.4 in the others (it decides the
    prediction both ways) averages 0 signed, but the model relies on it: flagged by |relevance|."""
    stats = AuditStats(n_classes=2)
    rng = np.random.default_rng(0)
    for index in range(40):
        words = {f"w{k}": (1, float(rng.uniform(0.05, 0.15))) for k in range(60)}
        words["pivot"] = (1, 0.4 if index % 2 else -0.4)
        stats.update(ExampleResult(index, "t", index % 2, 0.9, None, words, [], [], [], []))
    merged = analysis.pooled(stats.words)
    assert merged["pivot"][2] == pytest.approx(0.0) and merged["pivot"][4] == pytest.approx(16.0)
    result = analysis.term_audit(merged, ["pivot", "w0"], min_count=5)
    rows = {row["term"]: row for row in result["terms"]}
    assert result["flagged"] == ["pivot"]
    assert rows["pivot"]["mean"] == pytest.approx(0.4) and rows["pivot"]["percentile"] == 100.0
    total = sum(sums[4] for sums in merged.values())
    assert rows["pivot"]["share"] == pytest.approx(16.0 / total)


def test_a_non_negative_mean_gets_an_interval_above_zero_and_one_text_none():
    """Mostly zeros and one large value: mean ± 1.96 se would go below 0; the interval of the log of
    the mean (delta method) stays inside the support. One text: no interval at all."""
    values = np.array([0.0, 0.0, 0.0, 0.0, 1.0])
    mean, low, high = analysis.mean_interval(values.sum(), (values**2).sum(), values.size, non_negative=True)
    se = values.std(ddof=1) / math.sqrt(values.size)
    assert mean - 1.959964 * se < 0 < low  # the normal interval would leave the support
    assert (low, high) == pytest.approx((mean * math.exp(-1.959964 * se / mean), mean * math.exp(1.959964 * se / mean)))
    assert analysis.mean_interval(0.0, 0.0, 4, non_negative=True) == (0.0, 0.0, 0.0)  # all zero: nothing uncertain
    assert analysis.mean_interval(0.3, 0.09, 1, non_negative=True) == (0.3, None, None)
    signed = np.array([-0.5, 0.1, 0.2])  # a signed mean (Δp of the swaps) keeps the normal interval
    _, low, high = analysis.mean_interval(signed.sum(), (signed**2).sum(), signed.size)
    half = 1.959964 * signed.std(ddof=1) / math.sqrt(signed.size)
    assert (low, high) == pytest.approx((signed.mean() - half, signed.mean() + half))


def test_words_and_terms_in_one_text_say_they_have_no_interval():
    from attnflow.dataset_audit.report import build_report

    stats = AuditStats(2)
    stats.update(ExampleResult(0, "a rare film", 1, 0.9, 1, {"rare": (1, 0.4), "film": (1, 0.2)}, [], [], [], []))
    results = analysis.analyse(stats, ["neg", "pos"], min_count=1, terms=["rare"])
    (term,) = results["terms"]["terms"]
    assert term["ci"] == [None, None]
    run = {"model": "m", "method": "attnlrp", "data": "d.csv", "split": "all", "labels": ["neg", "pos"]}
    run.update(samples=1, min_count=1, engine="local", elapsed_s=1.0, swap=[])
    page = build_report({"run": run, **results})
    assert "n = 1: no interval" in page and "n/a" not in page
