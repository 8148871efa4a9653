"""The metrics against hand computations and explicit definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import spearmanr

from attnflow.evaluate.benchmark import BenchmarkOptions, Example, perturbation_probabilities
from attnflow.evaluate.deletion import only_top, perturb, without_top
from attnflow.evaluate.metrics import aopc, content_ranking, deletion_auc, rank_agreement, top_count
from attnflow.statistics import mean_se

CLS, SEP, MASK = 101, 102, 103
A, B, C = 7, 8, 9


class LookupScorer:
    """p(class 1) = 0.1 + 0.5 [a present] + 0.1 [b present] + 0.2 [c present]; records its calls."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, ...]]] = []

    def probabilities(self, sequences):
        p = np.array([0.1 + 0.5 * (A in s) + 0.1 * (B in s) + 0.2 * (C in s) for s in sequences])
        return np.stack([1 - p, p], axis=1)

    def chosen(self, sequences, classes, bases=None):  # noqa: ARG002 - no model, nothing cached
        self.calls.append([(tuple(s), c) for s, c in zip(sequences, classes)])
        return self.probabilities(sequences)[np.arange(len(classes)), classes]


def toy_example() -> Example:
    return Example("a b c", 1, (CLS, A, B, C, SEP), np.array([True, False, False, False, True]), target=1, p_full=0.9)


def test_aopc_equals_hand_computation_on_three_tokens():
    # scores rank a > c > b; m = 3 content tokens, so the bins 1/5/10/20/50 % keep ceil(k*3) = 1,1,1,1,2.
    example = toy_example()
    ranking = content_ranking(np.array([9.0, 3.0, 1.0, 2.0, 9.0]), example.special_mask)
    assert ranking.tolist() == [1, 3, 2]  # special tokens (score 9) never ranked
    without, only, curve = perturbation_probabilities(
        LookupScorer(), [example], [ranking], BenchmarkOptions(curve_points=4), MASK
    )
    # comprehensiveness: without a -> 0.4 (drop 0.5, four bins), without a and c -> 0.2 (drop 0.7)
    drops, comprehensiveness = aopc([0.9], without)
    assert drops[0] == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.7])
    assert comprehensiveness[0] == pytest.approx((4 * 0.5 + 0.7) / 5)
    # sufficiency: only a -> 0.6 (drop 0.3), only a and c -> 0.8 (drop 0.1)
    assert aopc([0.9], only)[1][0] == pytest.approx((4 * 0.3 + 0.1) / 5)
    # deletion curve at 0, 1/3, 2/3, 1 of the content: remove nothing, a, a+c, all
    assert curve[0] == pytest.approx([0.9, 0.4, 0.2, 0.1])
    assert deletion_auc(curve)[0] == pytest.approx((0.9 + 0.4) / 6 + (0.4 + 0.2) / 6 + (0.2 + 0.1) / 6)


def test_identical_variants_are_scored_once_in_one_call():
    scorer = LookupScorer()
    example = toy_example()
    perturbation_probabilities(scorer, [example, example], [np.array([1, 3, 2])] * 2, BenchmarkOptions(), MASK)
    assert len(scorer.calls) == 1  # one call; the real scorer computes each distinct (ids, class) once


def test_deletion_rebuilds_ids_and_keeps_special_tokens():
    ids = (CLS, A, B, C, SEP)
    assert perturb(ids, np.array([1, 3]), "remove", MASK) == (CLS, B, SEP)
    assert perturb(ids, np.array([1, 3]), "mask", MASK) == (CLS, MASK, B, MASK, SEP)
    ranking = np.array([2, 1, 3])
    assert without_top(ids, ranking, 3, "remove", MASK) == (CLS, SEP)
    assert only_top(ids, ranking, 1, "remove", MASK) == (CLS, B, SEP)
    assert only_top(ids, ranking, 0, "mask", MASK) == (CLS, MASK, MASK, MASK, SEP)
    with pytest.raises(ValueError, match="unknown replacement"):
        perturb(ids, ranking, "blank", MASK)


def test_deletion_on_real_tokenizer_removes_the_word(tiny_model_path):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_path("bert"))
    ids = tokenizer("the movie was great")["input_ids"]
    special = np.array(tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True), dtype=bool)
    scores = np.zeros(len(ids))
    scores[ids.index(tokenizer.convert_tokens_to_ids("great"))] = 1.0
    ranking = content_ranking(scores, special)
    shorter = without_top(ids, ranking, 1, "remove", tokenizer.mask_token_id)
    assert tokenizer.convert_ids_to_tokens(list(shorter)) == ["[CLS]", "the", "movie", "was", "[SEP]"]
    # everything removed still leaves the special tokens
    assert without_top(ids, ranking, len(ranking), "remove", None) == (ids[0], ids[-1])


def test_top_count_is_a_ceiling_robust_to_float_noise():
    assert [top_count(k, 30) for k in (0.01, 0.05, 0.1, 0.2, 0.5)] == [1, 2, 3, 6, 15]
    assert [top_count(k, 3) for k in (0.01, 0.5, 1.0)] == [1, 2, 3]
    assert top_count(0.0, 7) == 0


def test_ranking_rejects_nan_and_keeps_text_order_on_ties():
    special = np.array([True, False, False, False, True])
    assert content_ranking(np.zeros(5), special).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="NaN"):
        content_ranking(np.array([0, np.nan, 1, 2, 0]), special)


def test_rank_agreement_matches_scipy_and_handles_constant_maps():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.integers(0, 4, 9).astype(float), rng.normal(size=9)  # ties in a
        if np.ptp(a) > 0:
            assert rank_agreement(a, b) == pytest.approx(spearmanr(a, b).statistic)
    assert rank_agreement(np.ones(4), np.ones(4)) == 1.0
    assert rank_agreement(np.ones(4), np.arange(4.0)) == 0.0


def test_mean_se_is_the_standard_error_of_the_mean():
    values = np.array([1.0, 2.0, 4.0, np.nan])
    mean, se = mean_se(values)
    assert mean == pytest.approx(7 / 3)
    assert se == pytest.approx(np.std([1, 2, 4], ddof=1) / math.sqrt(3))
    means, ses = mean_se(np.array([[1.0, 0.0], [3.0, 0.0]]))
    assert means.tolist() == [2.0, 0.0] and ses.tolist() == pytest.approx([1.0, 0.0])
