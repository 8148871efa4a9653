"""Targets, the embedded classifier, the `model.explain` front door and the method scope, on real
models (minilm-sentiment, minilm, smollm2 in the slow set) and tiny ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnflow
from attnflow.capture.probes import PROBES, probe_metadata
from attnflow.datasets import rotten_tomatoes, wiki_topics
from attnflow.errors import InputError

SENTENCE = "The movie was terrible, but the acting was great."
SCRIPT = Path(sys.executable).with_name("attnflow")
RELEVANCE_METHODS = (
    "grad_rollout",
    "norm",
    "norm_rollout",
    "alti",
    "value_zeroing",
    "gradient",
    "grad_x_input",
    "integrated_gradients",
    "leave_one_out",
    "random",
)


def test_the_tasks_split_stratified_and_reproducibly():
    data = rotten_tomatoes()
    assert (len(data), data.label_names) == (12_808, ("negative", "positive"))
    assert int(data.labels.sum()) == 7_403  # fresh snippets
    train, test = data.split()
    assert len(np.intersect1d(train, test)) == 0 and len(train) + len(test) == len(data)
    for label in (0, 1):  # each class keeps its share in the held-out part
        assert abs(np.mean(data.labels[test] == label) - np.mean(data.labels == label)) < 1e-3
    np.testing.assert_array_equal(test, data.split()[1])
    topics = wiki_topics()
    assert len(topics.label_names) == 12 and len(topics) == 10_033
    assert max(len(text) for text in topics.texts) <= 300


def test_minilm_sentiment_is_a_real_classifier(minilm_sentiment):
    meta = probe_metadata("minilm-sentiment")
    assert meta["labels"] == ["negative", "positive"]
    assert meta["heldout_accuracy"] > meta["majority_accuracy"] + 0.1  # ~0.78 vs 0.58
    assert (meta["n_train"], meta["n_test"]) == (10_246, 2_562)
    traces = minilm_sentiment.trace(
        ["A dull, tedious mess of a film.", "A moving, beautifully acted masterpiece."], needs=("target",)
    )
    assert [t.target.label for t in traces] == ["negative", "positive"]
    # the target value is the logit of the predicted class, recomputed here through the module
    encoded = minilm_sentiment.tokenizer("A dull, tedious mess of a film.", return_tensors="pt")
    with torch.no_grad():
        logits = minilm_sentiment.model(**encoded).logits[0]
    assert traces[0].target.value == pytest.approx(float(logits[0]), abs=1e-4)
    assert traces[0].target.probability == pytest.approx(float(torch.softmax(logits, 0)[0]), abs=1e-5)


@pytest.mark.parametrize("method", RELEVANCE_METHODS)
def test_every_method_explains_the_real_classifier(minilm_sentiment, method):
    explanation = minilm_sentiment.explain(SENTENCE, method=method)
    n = explanation.n_tokens
    assert explanation.scores.shape == (n,) and np.all(np.isfinite(explanation.scores))
    assert explanation.prediction["label"] == "negative"
    spec = attnflow.get_method(method)
    assert (explanation.target is not None) == spec.uses_target
    assert (explanation.matrix is None) == spec.scores_only
    data = json.loads(explanation.to_json())
    if spec.uses_target:
        assert data["target"]["kind"] == "class" and data["target"]["label"] == "negative"
    if method != "random":  # a method that tells the truth ranks a sentiment word first
        assert explanation.top(1)[0][1] in ("terrible", "acting", "great", "movie")


def test_value_aware_norm_picks_the_sentiment_words_where_rollout_does_not(minilm_sentiment):
    norm = [token for _, token, _ in minilm_sentiment.explain(SENTENCE, method="norm").top(3)]
    rollout = [token for _, token, _ in minilm_sentiment.explain(SENTENCE, method="rollout").top(3)]
    assert "terrible" in norm and "acting" in norm
    assert "terrible" not in rollout


def test_a_class_by_name_or_index_and_bad_targets(minilm_sentiment):
    by_name = minilm_sentiment.explain(SENTENCE, method="gradient", target="positive")
    by_index = minilm_sentiment.explain(SENTENCE, method="gradient", target=1)
    assert by_name.target["label"] == by_index.target["label"] == "positive"
    np.testing.assert_allclose(by_name.scores, by_index.scores)
    # a two-class logistic head has w_negative = -w_positive: gradient norms agree, signed effects flip
    predicted = minilm_sentiment.explain(SENTENCE, method="leave_one_out")
    other = minilm_sentiment.explain(SENTENCE, method="leave_one_out", target="positive")
    assert predicted.target["label"] == "negative"
    np.testing.assert_allclose(predicted.scores, -other.scores, atol=1e-4)
    with pytest.raises(InputError, match="unknown class 'neutral'.*negative, positive"):
        minilm_sentiment.explain(SENTENCE, method="gradient", target="neutral")
    with pytest.raises(InputError, match="out of range"):
        minilm_sentiment.explain(SENTENCE, method="gradient", target=2)
    with pytest.raises(InputError, match="does not depend on a target"):
        minilm_sentiment.explain(SENTENCE, method="rollout", target="positive")


def test_a_sentence_encoder_explains_similarity_to_a_target_text(minilm):
    with pytest.raises(InputError, match="target text"):
        minilm.explain("A cat sat on the mat.", method="gradient")
    explanation = minilm.explain("A cat sat on the mat.", method="leave_one_out", target_text="a kitten")
    assert explanation.target["kind"] == "similarity" and explanation.target["label"] == "a kitten"
    encoded = minilm.tokenizer(["A cat sat on the mat.", "a kitten"], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = minilm.model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    cosine = float(torch.nn.functional.cosine_similarity(pooled[0], pooled[1], dim=0))
    assert explanation.target["value"] == pytest.approx(cosine, abs=1e-4)
    assert explanation.top(1)[0][1] == "cat"


def test_a_causal_lm_explains_the_next_token(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    explanation = model.explain("the cat sat on the", method="gradient")
    target = explanation.target
    assert target["kind"] == "next_token"
    ids = model.tokenizer("the cat sat on the", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        log_probs = torch.log_softmax(model.model(input_ids=ids).logits[0, -1], dim=-1)
    assert target["index"] == int(log_probs.argmax())
    assert target["value"] == pytest.approx(float(log_probs.max()), abs=1e-5)
    chosen = model.explain("the cat sat on the", method="leave_one_out", target="mat")
    assert chosen.target["index"] == model.tokenizer.convert_tokens_to_ids("mat")
    with pytest.raises(InputError, match="2 tokens"):
        model.explain("the cat sat on the", method="gradient", target="cat dog")


@pytest.mark.parametrize(
    "method", ["grad_rollout", "norm", "norm_rollout", "gradient", "grad_x_input", "leave_one_out"]
)
def test_llama_family_methods_run(tiny_model_path, method):
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    explanation = model.explain("the cat sat on the mat", method=method)
    assert np.all(np.isfinite(explanation.scores))


@pytest.mark.parametrize(("family", "method"), [("llama", "alti"), ("llama", "value_zeroing"), ("gpt2", "alti")])
def test_unsupported_combinations_name_the_family_and_what_works(tiny_model_path, family, method):
    model = attnflow.load(str(tiny_model_path(family)), device="cpu")
    with pytest.raises(
        ValueError, match=rf"'{method}' does not support the {family} family.*methods for {family}: .*grad_rollout"
    ):
        model.explain("the cat sat on the mat", method=method)


def test_needs_capture_exactly_what_is_asked(minilm_sentiment):
    plain = minilm_sentiment.trace(SENTENCE, needs=("attentions",))[0]
    assert (
        plain.target is None and plain.attention_grads is None and plain.values is None and plain.head_outputs is None
    )
    full = minilm_sentiment.trace(SENTENCE, needs=("attention_grads", "values"))[0]
    assert full.target.label == "negative" and full.embedding_grads is None
    assert full.attention_grads.shape == full.attentions.shape
    assert full.layer_names == minilm_sentiment.layer_names
    np.testing.assert_allclose(plain.attentions, full.attentions, atol=1e-6)  # the same forward pass
    with pytest.raises(ValueError, match="unknown needs"):
        minilm_sentiment.trace(SENTENCE, needs=("gradients",))


def test_batched_relevance_equals_one_by_one(minilm_sentiment):
    texts = [SENTENCE, "Fine.", "An overlong, joyless slog that never finds its footing."]
    batched = minilm_sentiment.explain(texts, method="alti", batch_size=3)
    for text, explanation in zip(texts, batched):
        single = minilm_sentiment.explain(text, method="alti")
        np.testing.assert_allclose(explanation.matrix, single.matrix, atol=1e-4)
    grads = minilm_sentiment.explain(texts, method="grad_x_input", batch_size=3)
    for text, explanation in zip(texts, grads):
        np.testing.assert_allclose(
            explanation.scores, minilm_sentiment.explain(text, method="grad_x_input").scores, rtol=1e-3, atol=1e-5
        )


def test_cli_explains_the_classifier_by_default(tmp_path, capsys):
    from attnflow.cli import main

    out = tmp_path / "both"
    assert main(["explain", SENTENCE, "--method", "rollout,alti,grad_rollout", "--out", str(out), "--save-trace"]) == 0
    assert "prediction: negative (p = 0." in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"rollout", "alti", "grad_rollout", "comparison.html", "trace.npz"}
    data = json.loads((out / "grad_rollout" / "explanation.json").read_text())
    assert data["model"] == "minilm-sentiment" and data["target"]["label"] == "negative"
    assert "target" not in json.loads((out / "rollout" / "explanation.json").read_text())
    with np.load(out / "trace.npz") as arrays:
        assert (
            arrays["attention_grads"].shape == arrays["attentions"].shape
            and arrays["attention_grads"].dtype == np.float32
        )
    page = (out / "comparison.html").read_text()
    assert "prediction: negative" in page and page.index("rollout") < page.index("alti")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--method", "rollout", "--target", "positive"], ["does not depend on a target"]),
        (["--method", "gradient", "--target", "neutral"], ["unknown class 'neutral'"]),
        (["--method", "alti", "--model", "TINY_LLAMA"], ["alti", "llama"]),
        (["--method", "gradient", "--target", "5"], ["class index 5 out of range", "negative, positive"]),
        (["--method", "gradient", "--model", "TINY_BERT", "--target-text", "a dog"], ["no sentence-embedding pooling"]),
        (["--method", "gradient", "--model", "TINY_LLAMA", "--target-token", "zzqx"], ["give exactly one token"]),
        (["--method", "grad_rollout", "--model", "TINY_BERT"], ["without a classifier head", "--target-text"]),
        (["--method", "norm,alti", "--discard-ratio", "0.5"], ["none of the methods", "--discard-ratio"]),
        (["--method", "nope"], ["unknown method 'nope'"]),
    ],
)
def test_cli_bad_method_or_target_is_one_line(tmp_path, tiny_model_path, capsys, args, words):
    """In-process (`attnflow.cli.main`): a traceback would fail the test as an exception; the
    installed script's own one-line errors are tested in tests/cli/test_explain.py."""
    from attnflow.cli import main

    tiny = {"TINY_LLAMA": "llama", "TINY_BERT": "bert"}
    args = [str(tiny_model_path(tiny[arg])) if arg in tiny else arg for arg in args]
    try:
        code = main(["explain", SENTENCE, "--out", str(tmp_path / "x"), "-q", "--device", "cpu", *args])
    except SystemExit as stopped:  # argparse's own errors
        code = stopped.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    if lines[0].startswith("usage:"):  # argparse's own form: the usage, then one error line
        lines = lines[-1:]
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0]


def test_models_list_shows_the_classifiers_accuracy():
    result = subprocess.run([str(SCRIPT), "models", "list"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    line = next(line for line in result.stdout.splitlines() if line.startswith("minilm-sentiment"))
    accuracy = probe_metadata("minilm-sentiment")["heldout_accuracy"]
    assert f"held-out accuracy {accuracy:.3f}" in line
    assert set(PROBES) <= {line.split()[0] for line in result.stdout.splitlines() if line and not line.startswith(" ")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", ["grad_rollout", "gradient", "grad_x_input", "norm", "norm_rollout", "leave_one_out"]
)
def test_smollm2_methods(smollm2, method):
    explanation = smollm2.explain("The capital of France is", method=method)
    assert explanation.target is None or explanation.target["kind"] == "next_token"
    assert np.all(np.isfinite(explanation.scores))
    with pytest.raises(ValueError, match="does not support the llama family"):
        smollm2.explain("The capital of France is", method="alti")


def test_next_token_y_reads_only_the_last_positions_and_equals_the_full_logits(tiny_model_path):
    """A batch of two lengths (right padding): y from the logits of the last real positions alone
    (``logits_to_keep``) equals log_softmax of the whole [batch, token, vocab] logits read there."""
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    objective = attnflow.targets.Target().objective(model)
    ids = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        choices = objective.choices(mask, input_ids=ids)
        full = torch.log_softmax(model.hf_model(input_ids=ids, attention_mask=mask).logits, dim=-1)
    assert objective.keeps_logits
    torch.testing.assert_close(choices, full[torch.arange(2), torch.tensor([3, 2])])
