"""Per-input faithfulness (`attnflow explain`'s badges) against the benchmark on the same input and
against forward passes of the perturbed inputs written out here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import attnflow
from attnflow.evaluate.benchmark import BenchmarkOptions, evaluate_method, prepare_examples
from attnflow.evaluate.per_input import BINS, input_faithfulness
from attnflow.evaluate.scorer import ClassifierScorer
from attnflow.explanation import explain

TEXT = "this story is not very good and the acting is great"
METHODS = ("grad_x_input", "rollout", "leave_one_out")


def _p(model, ids, index):
    """p(class index | ids), one plain forward pass."""
    with torch.no_grad():
        logits = model.model(input_ids=torch.tensor([list(ids)])).logits[0]
    return float(torch.softmax(logits.double(), dim=-1)[index])


@pytest.fixture(scope="module")
def classifier(tiny_classifier_path):
    """The tiny random classifier with its head scaled up, so that removing tokens moves p visibly."""
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    with torch.no_grad():
        model.model.classifier.weight.mul_(1000.0)
    return model


def test_per_input_faithfulness_equals_the_benchmark_on_that_input(classifier):
    key_model = classifier
    trace = key_model.trace_for(list(METHODS), [TEXT])[0]
    explanations = [explain(trace, method=m, model=key_model) for m in METHODS]
    records = input_faithfulness(key_model, trace, [e.scores for e in explanations])

    scorer = ClassifierScorer(key_model)
    examples = prepare_examples(key_model, scorer, [TEXT], [1])
    options = BenchmarkOptions(bins=BINS, sanity_samples=0)
    for method, record in zip(METHODS, records, strict=True):  # equal up to float32 noise: other padding
        benchmark = evaluate_method(key_model, scorer, examples, method, options)
        np.testing.assert_allclose(record["comprehensiveness"], benchmark.comprehensiveness[0], atol=1e-5)
        np.testing.assert_allclose(record["sufficiency"], benchmark.sufficiency[0], atol=1e-5)
        assert record["aopc_comprehensiveness"] == pytest.approx(np.mean(benchmark.comprehensiveness[0]), abs=1e-5)

    # by hand: the top ceil(k m) content tokens removed (comprehensiveness) or kept alone (sufficiency)
    ids, special, target = list(trace.token_ids), trace.special_mask, trace.target.index
    content = [j for j in range(len(ids)) if not special[j]]
    p_full = _p(key_model, ids, target)
    assert records[0]["probability"] == pytest.approx(trace.target.probability, abs=1e-5)
    for explanation, record in zip(explanations, records, strict=True):
        ranked = sorted(content, key=lambda j: (-explanation.scores[j], j))
        for k, comprehensive, sufficient in zip(BINS, record["comprehensiveness"], record["sufficiency"], strict=True):
            top = set(ranked[: math.ceil(k * len(content))])
            without = [t for j, t in enumerate(ids) if j not in top]
            only = [t for j, t in enumerate(ids) if special[j] or j in top]
            assert comprehensive == pytest.approx(p_full - _p(key_model, without, target), abs=1e-5)
            assert sufficient == pytest.approx(p_full - _p(key_model, only, target), abs=1e-5)
    # the random expectation: the mean over the seeded permutations 0..4 of the content tokens
    drops = []
    for seed in range(5):
        order = np.random.default_rng(seed).permutation(content)
        top = set(order[: math.ceil(0.5 * len(content))].tolist())
        drops.append(p_full - _p(key_model, [t for j, t in enumerate(ids) if j not in top], target))
    assert records[0]["random"]["comprehensiveness"][2] == pytest.approx(np.mean(drops), abs=1e-5)
    assert records[0]["random"] == records[2]["random"]


def test_next_token_faithfulness_reads_the_probability_of_that_token(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    trace = model.trace_for(["gradient"], ["the cat sat on the mat and the dog"])[0]
    explanation = explain(trace, method="gradient")
    record = input_faithfulness(model, trace, [explanation.scores])[0]
    assert record["probability"] == pytest.approx(trace.target.probability, rel=1e-5)  # the Objective's p

    def p_next(ids):
        with torch.no_grad():
            logits = model.model(input_ids=torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits.double(), dim=-1)[trace.target.index])

    ids, special = list(trace.token_ids), trace.special_mask
    content = [j for j in range(len(ids)) if not special[j]]
    top = set(sorted(content, key=lambda j: (-explanation.scores[j], j))[: math.ceil(0.5 * len(content))])
    without = [t for j, t in enumerate(ids) if j not in top]
    assert record["comprehensiveness"][2] == pytest.approx(p_next(ids) - p_next(without), abs=1e-5)


def test_explore_gives_each_view_its_per_input_faithfulness(classifier):
    """`attnflow.explore` (Python, not only the CLI) puts each view's badge on the page: the per-input
    faithfulness of the view's saliency row, as `input_faithfulness` scores it on that input."""
    exploration = attnflow.explore(classifier, TEXT, methods=["rollout", "grad_x_input"])
    trace = classifier.trace([TEXT], needs=("target",))[0]
    expected = input_faithfulness(classifier, trace, [view.saliency(exploration.row) for view in exploration.methods])
    for view, record in zip(exploration.methods, expected, strict=True):
        assert view.faithfulness is not None
        np.testing.assert_allclose(view.faithfulness["comprehensiveness"], record["comprehensiveness"], atol=1e-6)
    assert all(view.faithfulness is None for view in attnflow.explore(classifier, TEXT, faithfulness=False).methods)
    assert exploration.opens_on == "grad_x_input" and "auto's choice, grad_x_input" in exploration.opened_why


def test_the_explorer_opens_on_autos_choice(classifier):
    """With badges, the page opens on the one-pass target method most comprehensive on this input
    (as --method auto chooses); without them, on rollout."""
    from attnflow.evaluate.per_input import auto_methods

    exploration = attnflow.explore(classifier, TEXT, methods=["rollout", "grad_x_input", "grad_rollout", "attnlrp"])
    candidates = [view for view in exploration.methods if view.name in auto_methods(classifier.adapter, "class")]
    assert {view.name for view in candidates} == {"grad_x_input", "grad_rollout", "attnlrp"}
    best = max(candidates, key=lambda view: view.faithfulness["aopc_comprehensiveness"])
    assert exploration.opens_on == best.name and exploration.opened_why.startswith(
        f"opens on auto's choice, {best.name}"
    )
    from attnflow.viz.explorer import explorer_payload

    meta, _ = explorer_payload(exploration)
    assert meta["opens_on"] == best.name and meta["opened_why"] == exploration.opened_why
    plain = attnflow.explore(classifier, TEXT, methods=["grad_x_input", "rollout"], faithfulness=False)
    assert plain.opens_on == "rollout" and plain.opened_why == ""


def test_the_png_carries_the_badge(classifier):
    """The figure of `explanation.png` states the map's faithfulness on this input, as the page does."""
    from attnflow.evaluate.per_input import add_faithfulness
    from attnflow.viz.page import faithfulness_badge

    trace = classifier.trace_for(["grad_x_input"], [TEXT])[0]
    explanation = explain(trace, method="grad_x_input", model=classifier)
    assert "faithfulness" not in explanation.plot().get_suptitle()
    add_faithfulness(classifier, trace, [explanation])
    title = explanation.plot().get_suptitle()
    assert f"faithfulness on this input: {faithfulness_badge(explanation.faithfulness)}" in title
    assert f"comprehensiveness {explanation.faithfulness['aopc_comprehensiveness']:.2f}, NAOPC" in title


def test_the_random_baseline_is_kept_per_input_and_the_records_do_not_change(classifier, monkeypatch):
    from attnflow.evaluate import per_input

    trace = classifier.trace_for(["grad_x_input", "rollout"], ["the cat sat on the mat and the dog ran"])[0]
    scores = [explain(trace, method=name, model=classifier).scores for name in ("grad_x_input", "rollout")]
    scored: list[int] = []
    score_all = per_input.perturbation_probabilities
    monkeypatch.setattr(
        per_input,
        "perturbation_probabilities",
        lambda scorer, examples, *rest: scored.append(len(examples)) or score_all(scorer, examples, *rest),
    )
    searched: list[int] = []
    search_bounds = per_input.search_bounds
    monkeypatch.setattr(
        per_input, "search_bounds", lambda *args, **kw: searched.append(1) or search_bounds(*args, **kw)
    )
    first = input_faithfulness(classifier, trace, scores)
    again = input_faithfulness(classifier, trace, scores[::-1])  # the methods' rankings alone this time
    assert scored == [2 + per_input.RANDOM_RANKINGS, 2] and searched == [1]  # the bounds are kept too
    for record, repeated in zip(first, again[::-1], strict=True):
        assert repeated["random"] == record["random"] and repeated["bounds"] == record["bounds"]
        # AOPC's float noise of other batches (< 1e-6), divided by the bounds' span
        assert repeated["naopc_comprehensiveness"] == pytest.approx(record["naopc_comprehensiveness"], abs=1e-4)
        np.testing.assert_allclose(repeated["comprehensiveness"], record["comprehensiveness"], atol=1e-6)
        assert repeated["probability"] == pytest.approx(record["probability"], abs=1e-6)
    input_faithfulness(classifier, trace, scores, seed=1)  # another baseline: its random rankings are scored
    assert scored[-1] == 2 + per_input.RANDOM_RANKINGS


def test_the_budget_chooses_the_tightest_search_that_fits():
    """(content tokens m, tokens n): a beam of width 1 while its perturbed inputs hold at most
    10,000 tokens in all (about 4 Σ (m − s + 1) · n over the sizes s up to m/2), then the bin-level
    search (about 4 m · n), then the single-token orders ((m + 12) · n), then none."""
    budget = per_input_budget(bounds_tokens=10_000, scored=256)
    chosen = [budget.bounds_search(m, m + 2) for m in (5, 16, 30, 60, 120)]
    assert chosen == ["beam", "beam", "levels", "singles", "none"]  # m ≤ 8: exact under every search
    assert budget.skipped(256) is None and "257 content tokens" in budget.skipped(257)


@pytest.mark.parametrize(
    "bounds_tokens, search", [(10_000, "beam"), (2_000, "levels"), (1_000, "singles"), (100, "none")]
)
def test_a_smaller_budget_gets_cheaper_bounds_and_says_when_there_are_none(classifier, bounds_tokens, search):
    """The same ranking's AOPC whatever the budget (11 content tokens); its NAOPC from the search
    the budget allows, or None with a note once not even the cheapest fits."""
    trace = classifier.trace_for(["grad_x_input"], [TEXT])[0]
    scores = [explain(trace, method="grad_x_input", model=classifier).scores]
    reference = input_faithfulness(classifier, trace, scores)[0]
    budget = per_input_budget(bounds_tokens=bounds_tokens, scored=256)
    (record,) = input_faithfulness(classifier, trace, scores, budget=budget)
    assert record["bounds"]["search"] == search
    assert record["aopc_comprehensiveness"] == pytest.approx(reference["aopc_comprehensiveness"], abs=1e-6)
    if search == "none":
        assert record["naopc_comprehensiveness"] is None and record["naopc_sufficiency"] is None
        assert "NAOPC not computed: the bounds of 11 content tokens" in record["bounds"]["note"]
        assert "NAOPC not computed" in faithfulness_badge_title(record)
    else:
        assert 0.0 <= record["naopc_comprehensiveness"] <= 1.0


def test_over_the_scored_budget_there_is_no_faithfulness_and_auto_says_why(classifier, monkeypatch):
    from attnflow.evaluate import per_input

    monkeypatch.setattr(per_input, "BUDGET", per_input_budget(scored=4))
    monkeypatch.setattr(
        per_input, "perturbation_probabilities", lambda *a, **k: pytest.fail("no perturbed input is scored")
    )
    plan = per_input.plan_methods(classifier, ["auto"], {})
    trace = classifier.trace_for(list(plan.per_method), [TEXT])[0]
    (chosen,) = per_input.explain_planned(classifier, trace, plan)
    assert chosen.faithfulness is None and chosen.method == plan.candidates[0]
    assert "faithfulness not computed: 11 content tokens, over the per-input budget of 4" in chosen.notes
    assert chosen.chosen_by.startswith(f"--method auto chose {chosen.method} without a per-input test")


def test_faithfulness_can_be_turned_off(classifier, monkeypatch):
    from attnflow.evaluate import per_input

    monkeypatch.setattr(
        per_input, "perturbation_probabilities", lambda *a, **k: pytest.fail("no perturbed input is scored")
    )
    plan = per_input.plan_methods(classifier, ["auto", "rollout"], {})
    trace = classifier.trace_for(list(plan.per_method), [TEXT])[0]
    chosen, rollout = per_input.explain_planned(classifier, trace, plan, faithfulness=False)
    assert chosen.faithfulness is None and rollout.faithfulness is None
    assert "faithfulness turned off" in chosen.chosen_by


def per_input_budget(**limits):
    from attnflow.evaluate.per_input import FaithfulnessBudget

    return FaithfulnessBudget(**limits)


def faithfulness_badge_title(record) -> str:
    """The badge's hover text as the HTML page writes it."""
    from types import SimpleNamespace

    from attnflow.viz.html import _badge

    return _badge(SimpleNamespace(faithfulness=record))


REVIEW = (
    "It is rare for a sequel to understand what made the first film work, and rarer still for it to improve "
    "on it, but this one does both: the jokes are sharper, the villain is finally given a reason to exist, "
    "the action scenes are staged so that you can follow them, and the ending earns its tears."
)


def test_a_long_review_costs_a_bounded_number_of_perturbed_inputs(minilm_sentiment, monkeypatch):
    """The real classifier on a ~70-token review: auto's candidates, the random rankings and the
    cheap bounds score about m + a few inputs per ranking (the greedy search before the budget
    scored ~1.5 m², minutes per request). A budget that affords the single-token orders at this
    length (10,000 tokens; the default's 3,000 stops them at 48 content tokens: no bounds here)."""
    from attnflow.evaluate import per_input

    assert per_input.BUDGET.bounds_search(70, 72) == "none"
    monkeypatch.setattr(per_input, "BUDGET", per_input.FaithfulnessBudget(bounds_tokens=10_000))
    scored: list[int] = []
    logits = ClassifierScorer._logits
    monkeypatch.setattr(
        ClassifierScorer, "_logits", lambda self, batch: scored.append(len(batch.rows)) or logits(self, batch)
    )
    plan = per_input.plan_methods(minilm_sentiment, ["auto"], {})
    trace = minilm_sentiment.trace_for(list(plan.per_method), [REVIEW])[0]
    (chosen,) = per_input.explain_planned(minilm_sentiment, trace, plan)
    m = int((~np.asarray(trace.special_mask)).sum())
    rankings = len(plan.candidates) + per_input.RANDOM_RANKINGS
    assert 48 < m <= 80 and chosen.faithfulness["bounds"]["search"] == "singles"
    assert sum(scored) <= (m + 4 * len(BINS) + 1) + rankings * (2 * len(BINS) + 1)
    assert 0.0 <= chosen.faithfulness["naopc_comprehensiveness"] <= 1.0


@pytest.mark.parametrize("best, warned", [(0.902, "no better than"), (0.93, "barely above"), (1.5, None)])
def test_auto_warns_when_its_choice_is_not_clearly_better_than_random(best, warned):
    """qwen2.5-0.5b on ' Paris' vs ' Rome': auto chose a map at 0.902 where random rankings reach
    0.905; the choice must say that no candidate is a map to trust there."""
    from types import SimpleNamespace

    from attnflow.errors import ExplanationWarning
    from attnflow.evaluate.per_input import choose_most_comprehensive

    def candidate(method, value):
        record = {"aopc_comprehensiveness": value, "random": {"aopc_comprehensiveness": 0.905}, "bins": [0.1]}
        return SimpleNamespace(method=method, faithfulness={**record, "target": "Paris"}, notes=[], chosen_by=None)

    candidates = [candidate("gim", best - 0.05), candidate("attnlrp", best)]
    if warned is None:
        chosen = choose_most_comprehensive(candidates)
        assert chosen.notes == []
    else:
        with pytest.warns(ExplanationWarning, match=warned):
            chosen = choose_most_comprehensive(candidates)
        assert chosen.method == "attnlrp" and f"is {warned} random rankings on this input" in chosen.notes[0]


def _measured(choice: float, draws: list[float], bounds: list[float], probability: float) -> dict:
    """A faithfulness record of numbers measured on smollm2 (auto's choice, each random ranking's
    AOPC comprehensiveness, the input's exact bounds)."""
    return {
        "target": "x",
        "quantity": "p(x)",
        "probability": probability,
        "bins": [0.1, 0.2, 0.5],
        "aopc_comprehensiveness": choice,
        "random": {"aopc_comprehensiveness": float(np.mean(draws)), "draws": draws, "rankings": len(draws)},
        "bounds": {"comprehensiveness": bounds, "sufficiency": [0.0, 1.0], "search": "exact"},
    }


# Four short factual prompts written for this test, smollm2 (exact bounds, 6 to 9 content tokens):
# "The chemical symbol for gold is" -> " Au": every ranking drops p by 0.952-0.958;
# "The largest planet in our solar system is" -> " Jupiter": one random ranking of five reaches the best;
# "The author of Pride and Prejudice is Jane" -> " Austen": attnlrp at the best, random rankings far below;
# "Mount Everest lies on the border of Nepal and" -> " the": leave-one-out's ranking (0.297) planted as the
# choice, within the random rankings' spread (0.255 ± 0.05).
GOLD = _measured(0.958, [0.9525, 0.9584, 0.9525, 0.9566, 0.9577], [0.9525, 0.9584], 0.958)
JUPITER = _measured(0.102, [0.0518, 0.0934, 0.0869, 0.0889, 0.1023], [0.0416, 0.1029], 0.103)
AUSTEN = _measured(0.950, [0.3494, 0.3080, 0.3034, 0.3080, 0.3034], [0.1184, 0.9499], 0.950)
EVEREST_LOO = _measured(0.297, [0.1872, 0.3010, 0.2713, 0.3010, 0.2156], [0.0761, 0.3341], 0.334)


@pytest.mark.parametrize(
    ("record", "level", "warned"),
    [
        (GOLD, "indistinct", "deletion cannot tell rankings apart on this input"),
        (JUPITER, "indistinct", "deletion cannot tell rankings apart on this input"),
        (AUSTEN, "clear", None),
        (EVEREST_LOO, "weak", "is no better than random rankings on this input"),
        ({**AUSTEN, "aopc_comprehensiveness": 0.55}, "marginal", "is barely above random rankings on this input"),
    ],
)
def test_autos_warning_says_what_its_badge_can_show(record, level, warned):
    """Short prompts whose badge shows NAOPC 0.99-1.00: where every ranking (random ones included)
    drops p alike, auto says deletion cannot tell rankings apart (not that its choice is barely above
    random); a choice clearly above random rankings' spread and half-way to the best ranking is not
    warned about; one within their spread, or short of half-way, still is."""
    from types import SimpleNamespace

    from attnflow.errors import ExplanationWarning
    from attnflow.evaluate.per_input import choose_most_comprehensive
    from attnflow.explanation import faithfulness_level

    assert faithfulness_level(record) == level
    chosen = SimpleNamespace(method="attnlrp", faithfulness=record, notes=[], chosen_by=None)
    if warned is None:
        choose_most_comprehensive([chosen])
        assert chosen.notes == []
        return
    with pytest.warns(ExplanationWarning, match=warned):
        choose_most_comprehensive([chosen])
    assert len(chosen.notes) == 1 and warned in chosen.notes[0]
    if level == "indistinct":
        assert "neither confirmed nor refuted" in chosen.notes[0] and "barely" not in chosen.notes[0]


# Written for this test (the "tune" set; "held-out" was not used to set the rule: benchmarks/bench_auto_warning.py)
SHORT_FACTS = json.loads((Path(__file__).parent / "short_facts.json").read_text(encoding="utf-8"))["tune"]


@pytest.mark.slow
def test_auto_on_short_factual_prompts_never_contradicts_its_badge(smollm2):
    """Eight short factual prompts written for this test (none from the docs), smollm2, auto: no
    warning that its choice is barely above (or no better than) random rankings where the badge
    beside it shows NAOPC ≥ 0.9; where deletion cannot tell rankings apart the note says so. A
    planted ranking, the reverse of auto's choice on the last prompt, is no better than random and
    still warned about."""
    import dataclasses
    import warnings

    from attnflow.errors import ExplanationWarning
    from attnflow.evaluate.per_input import choose_most_comprehensive, explain_planned, plan_methods
    from attnflow.explanation import faithfulness_level

    plan = plan_methods(smollm2, ["auto"], {})
    for text in SHORT_FACTS:
        trace = smollm2.trace_for(list(plan.per_method), text)[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (chosen,) = explain_planned(smollm2, trace, plan)
        messages = [str(w.message) for w in caught if "random rankings on this input (" in str(w.message)]
        level = faithfulness_level(chosen.faithfulness)
        assert chosen.faithfulness["naopc_comprehensiveness"] >= 0.9, text
        assert messages == [] and level in ("clear", "indistinct"), (text, level, messages)
        assert any("cannot tell rankings apart" in note for note in chosen.notes) == (level == "indistinct")
    reversed_scores = -chosen.scores  # the last prompt's: its most relevant token ranked last
    (record,) = input_faithfulness(smollm2, trace, [reversed_scores])
    planted = dataclasses.replace(chosen, faithfulness=record, notes=[], method="reversed")
    with pytest.warns(ExplanationWarning, match="reversed, is no better than random rankings on this input"):
        choose_most_comprehensive([planted])
