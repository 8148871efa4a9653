"""The audit on a classifier whose causes are planted (planted.py): it finds them, and only them,
with the default method (signed, attnlrp) and with a non-negative one (grad_rollout) alike."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from planted import BIASED, NEUTRAL, PLANTED, TRIGGER

import attnflow
from attnflow.cli import main
from attnflow.dataset_audit import engine
from attnflow.dataset_audit.report import explain_command
from attnflow.dataset_audit.step import DEFAULT_METHOD
from attnflow.evaluate.scorer import ClassifierScorer

from conftest import write_task

RANDOM_WORDS = ["cat", "dog", "mat", "film", "story"]
# Every planted cause is a term: the term audit compares a term with the *other* words of matched
# frequency, so each cause is measured against the uninvolved filler words, not against another cause.
TERMS = [BIASED, NEUTRAL, PLANTED, TRIGGER, *RANDOM_WORDS]
METHODS = [DEFAULT_METHOD, "grad_rollout"]  # signed (positive parts ranked) and non-negative


@pytest.fixture(scope="module")
def planted_audits(planted_model, planted_task, tmp_path_factory):
    """``audit(method) -> (results, out)``: the audit of the planted task, run once per method."""
    path, *_ = planted_task
    done: dict[str, tuple[dict, object]] = {}

    def audit(method: str = DEFAULT_METHOD) -> tuple[dict, object]:
        if method not in done:
            out = tmp_path_factory.mktemp(f"planted-audit-{method}")
            results = attnflow.audit(
                str(planted_model), out, task=str(path), method=method, terms=TERMS, swap="he:she",
                device="cpu", quiet=True, checkpoint_every=3,
            )  # fmt: skip
            done[method] = results, out
        return done[method]

    return audit


@pytest.mark.parametrize("method", METHODS)
def test_the_planted_token_ranks_first_for_its_class(planted_audits, method):
    results, _ = planted_audits(method)
    assert results["run"]["method"] == method
    positive = next(group for group in results["classes"] if group["class"] == "positive")
    assert positive["top_words"][0]["word"] == PLANTED
    assert positive["contrast"][0]["word"] == PLANTED
    # "she" makes a text positive (with "very"); "he" never does: it is no word *for* positive.
    positive_words = [row["word"] for row in positive["top_words"]]
    assert BIASED in positive_words[:5] and NEUTRAL not in positive_words[:5]
    assert results["errors"]["accuracy"] == 1.0  # the classifier learned the rule


@pytest.mark.parametrize("method", METHODS)
def test_the_planted_causes_are_flagged_and_random_words_are_not(planted_audits, method):
    terms = planted_audits(method)[0]["terms"]
    # "he" is a cause too: with "very" and without "great", he vs she decides the label. "very"
    # decides only together with "she" and sits at the threshold for some methods: not asserted.
    assert {BIASED, NEUTRAL, PLANTED} <= set(terms["flagged"]) and not set(RANDOM_WORDS) & set(terms["flagged"])
    rows = {row["term"]: row for row in terms["terms"]}
    assert rows[BIASED]["percentile"] >= 95.0 and all(rows[word]["percentile"] < 95.0 for word in RANDOM_WORDS)
    assert terms["ratio"] > 1.0


def test_the_swap_flips_predictions_at_the_planted_rate(planted_audits, planted_task):
    swaps = planted_audits()[0]["swaps"]
    _, texts, _, flips = planted_task
    holding = [i for i, text in enumerate(texts) if {"he", "she"} & set(text.split())]
    assert swaps["texts"] == len(holding)
    assert swaps["flips"] == int(flips.sum())  # the planted flips, and no other
    assert swaps["flip_rate_ci"][0] <= flips.sum() / len(holding) <= swaps["flip_rate_ci"][1]
    assert {record["index"] for record in swaps["flipping_examples"]} <= set(np.flatnonzero(flips).tolist())
    assert swaps["unswapped"] == 0


def test_errors_are_the_misclassified_examples_most_confident_first(planted_model, planted_task, tmp_path, capsys):
    _, texts, labels, _ = planted_task
    rng = np.random.default_rng(0)
    noisy = [1 - label if rng.random() < 0.1 else label for label in labels]
    results = attnflow.audit(
        str(planted_model),
        tmp_path / "out",
        task=str(write_task(tmp_path / "noisy.csv", texts, noisy)),
        device="cpu",
        quiet=True,
        samples=120,
    )
    # Oracle: the classifier's predictions from a plain forward pass over the same drawn texts.
    model = attnflow.load(str(planted_model), device="cpu")
    chosen = np.sort(np.random.default_rng(0).choice(len(texts), size=120, replace=False))
    probabilities = ClassifierScorer(model).probabilities(model.tokenizer([texts[i] for i in chosen])["input_ids"])
    predicted = probabilities.argmax(axis=1)
    wrong = predicted != np.array(noisy)[chosen]
    errors = results["errors"]
    assert errors["errors"] == int(wrong.sum()) and errors["accuracy"] == pytest.approx(1 - wrong.mean())
    shown = errors["most_confident"]
    assert [r["probability"] for r in shown] == sorted((r["probability"] for r in shown), reverse=True)
    assert sorted(r["text"] for r in shown) == sorted(texts[i] for i in chosen[wrong])
    for record in shown:
        assert record["probability"] == pytest.approx(probabilities[record["index"]].max(), abs=1e-5)
    # The gallery's command draws the same map again.
    capsys.readouterr()
    command = shlex.split(explain_command(shown[0], results["run"]))
    assert main([*command[1:], "--json", "--device", "cpu"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    np.testing.assert_allclose(again["scores"], shown[0]["scores"], rtol=1e-4, atol=1e-6)


def test_an_interrupted_run_resumes_to_identical_numbers(planted_model, planted_task, planted_audits, tmp_path):
    """A run killed after its last checkpoint (the batch in progress raises) and resumed ends with
    the uninterrupted run's numbers exactly."""
    path, *_ = planted_task
    options = dict(task=str(path), terms=TERMS, swap="he:she", device="cpu", quiet=True)
    from attnflow.runs.engine import LocalBackend

    process, calls = LocalBackend.process, []

    def dies_at_the_eighth_batch(backend, batch):
        calls.append(batch.first)
        if len(calls) == 8:
            raise KeyboardInterrupt
        process(backend, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LocalBackend, "process", dies_at_the_eighth_batch)
        with pytest.raises(KeyboardInterrupt):
            attnflow.audit(str(planted_model), tmp_path, checkpoint_every=3, **options)
    saved = json.loads((tmp_path / engine.CHECKPOINT).read_text())
    assert saved["done"] == 6 * 16 and not (tmp_path / engine.RESULTS).exists()
    resumed = attnflow.audit(str(planted_model), tmp_path, resume=True, checkpoint_every=3, **options)
    uninterrupted, _ = planted_audits()
    assert without_run(resumed) == without_run(uninterrupted)


def without_run(results: dict) -> dict:
    return {key: value for key, value in results.items() if key != "run"}
