"""`attnflow audit --versus`: a planted change is found at the top of the diff, the changed
predictions are the ones a plain forward pass finds, bad input is one line, a resumed run and Ray
give the numbers of a whole local run."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from planted import planted_texts, train_planted_classifier
from test_cli_audit import one_error_line
from test_cli_audit import run_cli as cli

import attnflow
from attnflow.capture.probes import _make_classifier, fit_logistic_regression, mean_pooled_features
from run_helpers import kill_at_first_checkpoint

from conftest import write_task

BEFORE, AFTER = "great", "ending"  # the word each head keys on


@pytest.fixture(scope="module")
def head_pair(tiny_model_path):
    """Two classifiers on one tiny random BERT encoder with mean pooling: the same logistic-regression
    head (the shipped probes' fit) trained to key on "great" (before) and on "ending" (after)."""
    encoder = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    texts, _, _ = planted_texts(600, seed=1)
    features = mean_pooled_features(encoder, texts, progress=False)

    def keyed_on(word: str) -> attnflow.AttentionModel:
        weight, bias = fit_logistic_regression(features, np.array([int(word in t.split()) for t in texts]), 2)
        head = torch.nn.Linear(weight.shape[1], 2)
        with torch.no_grad():
            head.weight.copy_(torch.from_numpy(weight))
            head.bias.copy_(torch.from_numpy(bias))
        module = _make_classifier()(copy.deepcopy(encoder.hf_model), head, ["negative", "positive"])
        return attnflow.AttentionModel(module, encoder.tokenizer, name=f"keyed-on-{word}", adapter=encoder.adapter,
                                       device="cpu")  # fmt: skip

    return keyed_on(BEFORE), keyed_on(AFTER)


@pytest.fixture(scope="module")
def after_task(tmp_path_factory):
    """200 planted texts labelled by the word the retrained head keys on."""
    texts, _, _ = planted_texts(200, seed=2)
    labels = [int(AFTER in text.split()) for text in texts]
    return write_task(tmp_path_factory.mktemp("after") / "task.csv", texts, labels), texts, labels


def test_a_planted_change_is_at_the_top_of_the_diff(head_pair, after_task, tmp_path):
    before, after = head_pair
    path, texts, labels = after_task
    results = attnflow.audit(
        after, tmp_path / "out", versus=before, task=str(path), terms=[AFTER], device="cpu", quiet=True
    )
    changes = results["changes"]
    # the two words of largest change: the one the new head keys on rose, the old one fell
    assert {row["word"] for row in changes["words"][:2]} == {AFTER, BEFORE}
    rose = max(changes["words"], key=lambda row: row["change"])
    fell = min(changes["words"], key=lambda row: row["change"])
    assert rose["word"] == AFTER and rose["ci"][0] > 0
    assert fell["word"] == BEFORE and fell["ci"][1] < 0
    # the retrained head's word gains share of relevance: the term share moved up, its interval above 0
    assert changes["terms"]["change"]["ci"][0] > 0
    # the encoder is shared: not one attention statistic moved (an exact oracle)
    for name in ("entropy", "special", "previous"):
        assert all(row["change"] == 0.0 for row in changes["heads"][name]["moved"])
        assert any(row["model"] > 0 for row in changes["heads"][name]["moved"])
    # ... nor the rollout maps, raw or value-aware: every word's share of them is the same in both
    for method in ("rollout", "norm_rollout"):
        assert changes["maps"][method] and all(row["change"] == 0.0 for row in changes["maps"][method])
        assert any(row["model_per_text"] > 0 for row in changes["maps"][method])
    # the changed predictions are those of a plain forward pass of each classifier
    predicted = []
    for model in (after, before):
        encoded = model.tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            predicted.append(model.hf_model(**encoded).logits.argmax(-1).numpy())
    truth = np.array(labels)
    fixed = int(((predicted[0] == truth) & (predicted[1] != truth)).sum())
    new = int(((predicted[0] != truth) & (predicted[1] == truth)).sum())
    flips = changes["predictions"]
    assert (flips["fixed"], flips["new_errors"], flips["changed"]) == (
        fixed,
        new,
        int((predicted[0] != predicted[1]).sum()),
    )
    assert fixed > 0
    shown = flips["examples"][0]
    assert shown["outcome"] in ("fixed", "new_errors")
    assert shown["model"]["predicted"] != shown["versus"]["predicted"] and shown["model"]["tokens"]
    # each model's own audit is there too, and the page leads with the largest change in words
    assert results["model"]["errors"]["accuracy"] == pytest.approx((predicted[0] == truth).mean())
    page = (tmp_path / "out" / "report.html").read_text()
    lead = page[page.index('<ol class="lead">') : page.index("</ol>")]
    assert f"relies more on &quot;{AFTER}&quot;" in lead and f"relies less on &quot;{BEFORE}&quot;" in lead


@pytest.fixture(scope="module")
def three_classes(tmp_path_factory):
    """A tiny BERT classifier of three classes (random weights)."""
    import transformers as T

    from attnflow.rows.tiny import tiny_tokenizer

    from tiny_models import tiny_config

    torch.manual_seed(0)
    config = tiny_config("bert")
    config.num_labels = 3
    config.id2label, config.label2id = {0: "a", 1: "b", 2: "c"}, {"a": 0, "b": 1, "c": 2}
    folder = tmp_path_factory.mktemp("three") / "model"
    T.BertForSequenceClassification(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_bad_pairs_are_one_line_and_write_nothing(planted_model, planted_task, three_classes, tmp_path, capsys):
    path, *_ = planted_task
    out = tmp_path / "out"
    assert (
        cli("--model", str(planted_model), "--versus", str(three_classes), "--task", str(path), "--out", str(out)) == 2
    )
    assert "have different label sets (negative, positive against a, b, c)" in one_error_line(capsys)
    assert (
        cli("--model", str(planted_model), "--versus", str(tmp_path / "nope"), "--task", str(path), "--out", str(out))
        == 2
    )
    assert "--versus " + str(tmp_path / "nope") in one_error_line(capsys)
    words = tmp_path / "punctuation.txt"
    words.write_text("!!!\n...\n?\n", encoding="utf-8")
    assert (
        cli("--model", str(planted_model), "--versus", str(planted_model), "--file", str(words), "--out", str(out)) == 2
    )
    assert "no text of" in one_error_line(capsys)
    assert not out.exists() or not any(out.iterdir())


@pytest.fixture(scope="module")
def early_model(tmp_path_factory):
    """The planted classifier after 40 training steps (the same labels, another model)."""
    return train_planted_classifier(tmp_path_factory.mktemp("early") / "model", steps=40)


@pytest.mark.slow  # two interpreters; the audit's own kill/resume runs in test_cli_audit.py
def test_kill_and_resume_give_the_numbers_of_a_whole_run(planted_model, early_model, planted_task, tmp_path):
    path, *_ = planted_task
    arguments = [
        "--model", str(planted_model), "--versus", str(early_model), "--task", str(path), "--samples", "120",
        "--terms", "great,she", "--batch-size", "4", "--checkpoint-every", "2",
    ]  # fmt: skip
    assert cli(*arguments, "--out", str(tmp_path / "whole")) == 0
    killed = tmp_path / "killed"
    saved = kill_at_first_checkpoint(["audit", *arguments, "--device", "cpu", "--quiet"], killed)
    assert not saved["complete"] and 0 < saved["done"] < 120
    assert cli(*arguments, "--out", str(killed), "--resume") == 0
    first, second = (json.loads((folder / "results.json").read_text()) for folder in (tmp_path / "whole", killed))
    first.pop("run"), second.pop("run")
    assert first == second
    assert first["changes"]["predictions"]["changed"] > 0


@pytest.mark.slow
@pytest.mark.usefixtures("ray_runtime")
def test_ray_matches_the_local_engine(planted_model, early_model, planted_task, tmp_path):
    from test_ray_audit import same

    path, *_ = planted_task
    options = dict(task=str(path), samples=40, terms="great,she", device="cpu", quiet=True, batch_size=8)
    local = attnflow.audit(str(planted_model), tmp_path / "local", versus=str(early_model), **options)
    distributed = attnflow.audit(
        str(planted_model), tmp_path / "ray", versus=str(early_model), engine="ray", workers=2, **options
    )
    local.pop("run"), distributed.pop("run")
    assert same(distributed, local)


def test_a_versus_checkpoint_of_the_earlier_sums_is_refused(planted_model, planted_task, tmp_path, capsys):
    """A --versus checkpoint written before the sums per side (format 4, a one-model audit's) is
    refused in one line, not read with the wrong layout."""
    path, *_ = planted_task
    arguments = ["--model", str(planted_model), "--versus", str(planted_model), "--task", str(path), "--samples", "8"]
    assert cli(*arguments, "--out", str(tmp_path)) == 0
    saved = json.loads((tmp_path / "checkpoint.json").read_text())
    saved["format"], saved["complete"] = 4, False
    (tmp_path / "checkpoint.json").write_text(json.dumps(saved), encoding="utf-8")
    capsys.readouterr()
    assert cli(*arguments, "--out", str(tmp_path), "--resume") == 2
    assert "checkpoint format 4 is not 5" in one_error_line(capsys)
