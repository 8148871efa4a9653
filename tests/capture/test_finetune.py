"""Fine-tuned classifiers (`attnflow.capture.finetune`): the build is reproducible to the checksum,
its weights are checked at load, and an unbuilt one is refused with the command that builds it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attnflow.capture import finetune
from attnflow.capture.finetune import FINETUNED, Recipe, build_into, load_finetuned_classifier
from attnflow.capture.probes import _make_classifier
from attnflow.datasets import LabelledTexts
from attnflow.errors import ModelLoadError
from attnflow.rows.tiny import tiny_tokenizer

RECIPE = Recipe(epochs=30, train_samples=None, batch_size=8, learning_rate=3e-3, threads=1)


def tiny_task() -> LabelledTexts:
    """48 texts: label 1 when "good" is in them, 0 when "bad" is."""
    rng = np.random.default_rng(7)
    filler = "the movie was a film plot story and it this very".split()
    texts, labels = [], []
    for i in range(48):
        words = list(rng.choice(filler, size=int(rng.integers(3, 9))))
        words.insert(int(rng.integers(0, len(words))), "good" if i % 2 else "bad")
        texts.append(" ".join(words))
        labels.append(i % 2)
    return LabelledTexts("tiny", tuple(texts), np.asarray(labels, dtype=np.int64), ("negative", "positive"))


def tiny_classifier(seed: int = 0) -> torch.nn.Module:
    import transformers

    from tiny_models import tiny_config

    torch.manual_seed(seed)
    encoder = transformers.BertModel(tiny_config("bert"), add_pooling_layer=False)
    return _make_classifier()(encoder, torch.nn.Linear(32, 2), ["negative", "positive"])


def build(folder: Path, recipe: Recipe = RECIPE) -> dict:
    return build_into(folder, tiny_classifier(), tiny_tokenizer(), tiny_task(), recipe, {"alias": "tiny"}, False)


def test_a_build_is_reproducible_to_the_checksum(tmp_path):
    first, second = build(tmp_path / "a"), build(tmp_path / "b")
    assert first["sha256"] == second["sha256"]
    assert (tmp_path / "a" / finetune.WEIGHTS).read_bytes() == (tmp_path / "b" / finetune.WEIGHTS).read_bytes()
    # another seed gives other weights (the test can fail), and the training moved the encoder
    other = build(tmp_path / "c", Recipe(**{**RECIPE.__dict__, "seed": 1}))
    assert other["sha256"] != first["sha256"]
    from safetensors.torch import load_file

    trained, start = load_file(str(tmp_path / "a" / finetune.WEIGHTS)), tiny_classifier().state_dict()
    moved = [name for name in start if not torch.equal(trained[name], start[name])]
    assert any(name.startswith("encoder.encoder.layer.0.attention") for name in moved)
    assert "head.weight" in moved
    assert "encoder.embeddings.word_embeddings.weight" not in moved  # the recipe keeps the word table


def test_the_build_record_says_what_was_trained_and_how_well(tmp_path):
    record = build(tmp_path / "a")
    stored = json.loads((tmp_path / "a" / finetune.RECORD).read_text())
    assert stored == record
    train, test = tiny_task().split()
    assert (record["n_train"], record["n_test"]) == (len(train), len(test)) == (38, 10)
    assert record["recipe"]["seed"] == 0 and record["labels"] == ["negative", "positive"]
    # held-out accuracy recomputed from the saved weights by hand
    classifier = tiny_classifier()
    from safetensors.torch import load_file

    classifier.load_state_dict(load_file(str(tmp_path / "a" / finetune.WEIGHTS)))
    classifier.eval()
    data, tokenizer, right = tiny_task(), tiny_tokenizer(), 0
    with torch.no_grad():
        for i in test:
            encoded = tokenizer(data.texts[i], return_tensors="pt")
            right += int(classifier(**encoded).logits.argmax(-1).item() == data.labels[i])
    assert record["heldout_accuracy"] == pytest.approx(right / len(test))
    assert record["heldout_accuracy"] == 1.0  # the planted word is learnt


def test_the_batches_cover_every_example_once_in_runs_of_similar_length():
    lengths = list(np.random.default_rng(0).integers(3, 60, size=100))
    found = finetune.batches(lengths, 8, np.random.default_rng(0), pool=4)
    assert sorted(np.concatenate(found).tolist()) == list(range(100))
    assert all(len(batch) <= 8 for batch in found)
    spread = np.mean([np.ptp([lengths[i] for i in batch]) for batch in found])
    assert spread < 20  # random batches of 8 would spread over about 45 tokens
    again = finetune.batches(lengths, 8, np.random.default_rng(0), pool=4)
    assert all(np.array_equal(a, b) for a, b in zip(found, again, strict=True))


class _Encoder:
    """What `load_finetuned_classifier` reads of a `CaptureModel`: the HF module and its width."""

    def __init__(self) -> None:
        self.hf_model = tiny_classifier().encoder
        self.d_model = 32


def test_a_build_is_checked_at_load_and_an_unbuilt_one_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    alias = next(iter(FINETUNED))
    assert not finetune.is_built(alias)
    with pytest.raises(ModelLoadError, match=f"attnflow models install {alias}"):
        load_finetuned_classifier(alias, _Encoder())
    build(finetune.finetuned_dir(alias))
    classifier, record = load_finetuned_classifier(alias, _Encoder())
    weights = finetune.finetuned_dir(alias) / finetune.WEIGHTS
    assert record["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert classifier.config.id2label == {0: "negative", 1: "positive"}
    weights = finetune.finetuned_dir(alias) / finetune.WEIGHTS
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 1
    weights.write_bytes(bytes(damaged))
    with pytest.raises(ModelLoadError, match=r"damaged.*--force"):
        load_finetuned_classifier(alias, _Encoder())


def test_models_install_and_list_report_a_build(tmp_path, monkeypatch, capsys):
    from attnflow.cli import main

    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    alias = next(iter(FINETUNED))
    assert main(["models", "list", "--json"]) == 0
    row = next(row for row in json.loads(capsys.readouterr().out) if row["alias"] == alias)
    assert row["state"] == "not prepared" and f"attnflow models install {alias}" in row["preparation"]
    record = build(finetune.finetuned_dir(alias))
    assert main(["models", "install", alias]) == 0  # built: nothing is trained again
    out = capsys.readouterr().out
    assert f"held-out accuracy {record['heldout_accuracy']:.3f}" in out and record["sha256"] in out
    assert main(["models", "list", "--json"]) == 0
    row = next(row for row in json.loads(capsys.readouterr().out) if row["alias"] == alias)
    assert row["state"] == "installed" and row["heldout_accuracy"] == record["heldout_accuracy"]
