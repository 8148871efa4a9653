"""`attnflow audit --data A --versus-data B`: one classifier over two domains. A planted domain
difference is found at the top (numbers checked against each text's map computed here and a
two-sample interval from numpy), the rollout maps and heads are compared, bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from planted import PLANTED, planted_texts
from scipy.stats import norm
from test_cli_audit import one_error_line
from test_cli_audit import run_cli as cli

import attnflow
from attnflow.dataset_audit.versus import VersusStep
from attnflow.dataset_audit.words import word_relevance
from attnflow.datasets import LabelledTexts
from attnflow.errors import InputError

from conftest import write_task

Z = norm.ppf(0.975)  # the two-sided 95 % normal quantile


def domain(folder, seed: int, great: bool) -> tuple:
    """``(csv path, texts)``: 150 planted texts; ``great`` False: the planted word removed from every text."""
    texts, labels, _ = planted_texts(150, seed=seed)
    if not great:
        texts = [" ".join(word for word in text.split() if word != PLANTED) or "the" for text in texts]
        labels = [int(label and ("she" in text.split())) for label, text in zip(labels, texts, strict=True)]
    return write_task(folder / f"domain-{seed}.csv", texts, labels), texts


def shares(model, texts: list[str], method: str, word: str) -> np.ndarray:
    """``[text]`` the word's share of each text's absolute relevance (0 where absent), one map a text."""
    found = []
    for text in texts:
        explanation = model.explain(text, method)
        words = word_relevance(text, explanation.offsets, explanation.special_mask, explanation.scores)
        found.append(abs(words[word][1]) if word in words else 0.0)
    return np.array(found)


def welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    change = a.mean() - b.mean()
    half = Z * np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return change, change - half, change + half


def test_a_planted_domain_difference_is_at_the_top(planted_model, tmp_path):
    without, texts_a = domain(tmp_path, seed=5, great=False)
    with_great, texts_b = domain(tmp_path, seed=6, great=True)
    out = tmp_path / "out"
    model = attnflow.load(str(planted_model), device="cpu")
    results = attnflow.audit(model, out, task=str(without), versus_data=str(with_great), device="cpu", quiet=True)
    changes = results["changes"]
    assert not changes["paired"] and changes["texts"] == [150, 150]
    assert results["run"]["sides"] == [str(without), str(with_great)]
    # the word the classifier keys on is in the second domain only: the largest change, a fall
    top = changes["words"][0]
    assert top["word"] == PLANTED and top["texts_per_side"][0] == 0 and top["texts_per_side"][1] > 20
    a, b = shares(model, texts_a, "attnlrp", PLANTED), shares(model, texts_b, "attnlrp", PLANTED)
    change, low, high = welch(a, b)
    assert top["model_per_text"] == 0.0 and top["versus_per_text"] == pytest.approx(b.mean(), rel=1e-5)
    assert (top["change"], *top["ci"]) == pytest.approx((change, low, high), rel=1e-5)
    assert high < 0
    # the rollout maps: each word's share of the map per domain, the same oracle
    rollout = next(row for row in changes["maps"]["rollout"] if row["word"] == PLANTED)
    a, b = shares(model, texts_a, "rollout", PLANTED), shares(model, texts_b, "rollout", PLANTED)
    assert (rollout["change"], *rollout["ci"]) == pytest.approx(welch(a, b), rel=1e-5)
    # heads: the same model on two domains, each side's means from its own texts
    assert changes["heads"]["layers"] == model.n_layers and len(changes["heads"]["entropy"]["moved"]) > 0
    # each domain's accuracy against a plain prediction
    encoded = model.tokenizer(texts_b, padding=True, return_tensors="pt")
    with torch.no_grad():
        predicted = model.hf_model(**encoded).logits.argmax(-1).numpy()
    labels = [int(row[1]) for row in (line.split(",") for line in with_great.read_text().splitlines()[1:])]
    assert changes["predictions"]["versus_accuracy"] == pytest.approx(np.mean(predicted == np.array(labels)))
    # the lead says so first
    said = f'{model.name} on {without} relies less on "{PLANTED}" than on {with_great}'
    assert any(entry["sentence"].startswith(said) for entry in changes["lead"][:2])
    page = (out / "report.html").read_text()
    assert "relies less on &quot;great&quot;" in page[page.index('<ol class="lead">') :]


def test_bad_domains_are_one_line_and_write_nothing(planted_model, planted_task, tmp_path, capsys):
    path, *_ = planted_task
    out = tmp_path / "out"
    base = ("--model", str(planted_model), "--data", str(path), "--out", str(out))
    assert cli(*base, "--versus-data", "no-such-data") == 2
    assert "--versus-data no-such-data: no such data; give rotten-tomatoes" in one_error_line(capsys)
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n", encoding="utf-8")
    assert cli(*base, "--versus-data", str(empty)) == 2
    assert f"--versus-data {empty}" in one_error_line(capsys)
    assert cli(*base, "--versus-data", str(path), "--versus", str(planted_model)) == 2
    assert "--versus (a second model over the same texts) or --versus-data" in one_error_line(capsys)
    words = tmp_path / "punctuation.csv"
    words.write_text("text,label\n!!!,0\n...,1\n", encoding="utf-8")
    assert cli(*base, "--versus-data", str(words)) == 2
    assert "no text of" in one_error_line(capsys)
    assert not out.exists() or not any(out.iterdir())


def test_a_domain_keeps_the_texts_of_the_classifiers_classes():
    data = LabelledTexts("d", ("a", "b", "c", "d"), np.array([0, 1, 2, 1]), ("Negative", "neutral", "positive"))
    kept = data.for_classes(["negative", "positive"])
    assert kept.texts == ("a", "c") and kept.labels.tolist() == [0, 1] and kept.label_names == ("negative", "positive")
    with pytest.raises(InputError, match="d has no class joy"):
        data.for_classes(["negative", "joy"])


def test_a_domain_resumes_to_the_numbers_of_a_whole_run(planted_model, tmp_path):
    """Two domains cut into batches of 8 with a checkpoint each: a run stopped after the first
    domain's batches and resumed gives the whole run's numbers."""
    first, _ = domain(tmp_path, seed=7, great=False)
    second, _ = domain(tmp_path, seed=8, great=True)
    options = dict(task=str(first), versus_data=str(second), samples=20, batch_size=8, device="cpu", quiet=True)
    whole = attnflow.audit(str(planted_model), tmp_path / "whole", **options)
    stopped = tmp_path / "stopped"
    calls = {"n": 0}
    run = VersusStep.run

    def stop_at_the_fifth(self, context, stats, batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return run(self, context, stats, batch)

    VersusStep.run = stop_at_the_fifth
    try:
        with pytest.raises(KeyboardInterrupt):
            attnflow.audit(str(planted_model), stopped, checkpoint_every=1, **options)
    finally:
        VersusStep.run = run
    saved = json.loads((stopped / "checkpoint.json").read_text())
    assert saved["done"] == 20 + 8  # the first domain's 20 texts (8, 8, 4), then one batch of the second
    resumed = attnflow.audit(str(planted_model), stopped, resume=True, **options)
    assert resumed["changes"]["texts"] == [20, 20]
    whole.pop("run"), resumed.pop("run")
    assert json.dumps(whole, sort_keys=True) == json.dumps(resumed, sort_keys=True)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_runtime")
def test_two_domains_on_ray_give_the_local_numbers(planted_model, tmp_path):
    from test_ray_audit import same

    first, _ = domain(tmp_path, seed=9, great=False)
    second, _ = domain(tmp_path, seed=10, great=True)
    options = dict(task=str(first), versus_data=str(second), samples=24, batch_size=8, device="cpu", quiet=True)
    local = attnflow.audit(str(planted_model), tmp_path / "local", **options)
    distributed = attnflow.audit(str(planted_model), tmp_path / "ray", engine="ray", workers=2, **options)
    local.pop("run"), distributed.pop("run")
    assert same(distributed, local)
