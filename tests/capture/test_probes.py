"""The embedded classifiers' heads: shipped in the package (checksummed), never trained on load,
and reproduced by `attnflow models install ALIAS --retrain`."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import attnflow
from attnflow.capture import probes
from attnflow.capture.probes import PROBES
from attnflow.cli import main
from attnflow.errors import ModelLoadError

ROOT = Path(__file__).resolve().parents[2]
HEADS = ROOT / "src" / "attnflow" / "capture" / "heads"


def stored(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as arrays:
        return {name: arrays[name] for name in arrays.files}


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATTNFLOW_CACHE", str(cache))
    return cache


def test_the_shipped_heads_are_checksummed_package_data():
    assert {"minilm-sentiment", "minilm-topics"} <= set(probes.SHIPPED_HEADS) <= set(PROBES)
    assert sorted(path.name for path in HEADS.iterdir()) == sorted(f"{alias}.npz" for alias in probes.SHIPPED_HEADS)
    package_data = re.search(
        r"\[tool\.setuptools\.package-data\]\nattnflow = \[(.*)\]", (ROOT / "pyproject.toml").read_text()
    )
    assert '"capture/heads/*.npz"' in package_data.group(1)
    for alias, digest in probes.SHIPPED_HEADS.items():
        spec, path = PROBES[alias], HEADS / f"{alias}.npz"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
        arrays = stored(path)
        meta = json.loads(str(arrays["meta"]))
        n_classes = len(arrays["labels"])
        assert (meta["alias"], meta["encoder"], meta["task"]) == (alias, spec.encoder, spec.task)
        assert arrays["weight"].shape == (n_classes, 768 if spec.encoder == "mpnet" else 384)
        assert arrays["bias"].shape == (n_classes,) and np.isfinite(arrays["weight"]).all()
        assert meta["heldout_accuracy"] > meta["majority_accuracy"] + 0.15


def test_an_empty_cache_loads_the_shipped_head_without_training(empty_cache, monkeypatch):
    def no_training(*_args, **_kwargs):
        raise AssertionError("loading a classifier must not train its head")

    monkeypatch.setattr(probes, "train_probe", no_training)
    monkeypatch.setattr(probes, "mean_pooled_features", no_training)
    classifier = attnflow.load("minilm-sentiment", device="cpu")
    assert classifier.probe["source"] == str(HEADS / "minilm-sentiment.npz")
    assert not empty_cache.exists()
    # the prediction is the shipped head applied to minilm's own mean-pooled output, recomputed here
    head = stored(HEADS / "minilm-sentiment.npz")
    encoder = attnflow.load("minilm", device="cpu")
    text = "A dull, tedious mess of a film."
    encoded = encoder.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        pooled = encoder.model(**encoded).last_hidden_state[0].mean(0).numpy()  # one text: no padding
    logits = head["weight"] @ pooled + head["bias"]
    target = classifier.trace(text, needs=("target",))[0].target
    assert target.label == head["labels"][logits.argmax()] == "negative"
    assert target.value == pytest.approx(float(logits.max()), abs=1e-4)


@pytest.mark.usefixtures("empty_cache")
def test_a_damaged_or_missing_shipped_head_is_refused_in_one_line(tmp_path, monkeypatch):
    heads = tmp_path / "heads"
    heads.mkdir()
    monkeypatch.setattr(probes, "SHIPPED_HEADS_DIR", heads)
    with pytest.raises(ModelLoadError, match=r"minilm-topics head .* is missing .*reinstall attnflow") as missing:
        probes.read_head("minilm-topics")
    damaged = bytearray((HEADS / "minilm-topics.npz").read_bytes())
    damaged[-100] ^= 1
    (heads / "minilm-topics.npz").write_bytes(bytes(damaged))
    with pytest.raises(ModelLoadError, match=r"minilm-topics head .* is damaged \(sha256 [0-9a-f]{64}, expected"):
        probes.read_head("minilm-topics")
    assert "\n" not in str(missing.value)


def test_a_retrained_head_in_the_cache_replaces_the_shipped_one(empty_cache, capsys):
    shipped = probes.read_head("minilm-sentiment")
    retrained = probes.Head(shipped.weight * 2, shipped.bias - 1, {**shipped.meta, "heldout_accuracy": 0.5})
    probes.write_head(retrained, empty_cache / "probes" / "minilm-sentiment.npz")
    head = probes.read_head("minilm-sentiment")
    np.testing.assert_array_equal(head.weight, shipped.weight * 2)
    np.testing.assert_array_equal(head.bias, shipped.bias - 1)
    assert head.meta["heldout_accuracy"] == 0.5 and head.meta["labels"] == ["negative", "positive"]
    assert main(["models", "list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line[:1].strip()}
    assert "held-out accuracy 0.500" in listed["minilm-sentiment"] and "retrained" in listed["minilm-sentiment"]
    assert "retrained" not in listed["minilm-topics"] and "installed" in listed["minilm-topics"]
    (empty_cache / "probes" / "minilm-sentiment.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError, match=r"head .* is damaged .*--retrain"):
        probes.read_head("minilm-sentiment")


def test_a_classifier_without_a_shipped_head_asks_for_retrain(empty_cache, monkeypatch, capsys):
    monkeypatch.delitem(probes.SHIPPED_HEADS, "minilm-topics")
    with pytest.raises(ModelLoadError, match=r"^minilm-topics has no trained head .* install minilm-topics --retrain"):
        attnflow.load("minilm-topics", device="cpu")
    assert main(["models", "list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    row = listing.index(next(line for line in listing if line.startswith("minilm-topics ")))
    assert "not installed" in listing[row] and "models install minilm-topics --retrain" in listing[row + 1]
    assert not empty_cache.exists()


def test_retrain_is_only_for_classifiers(capsys):
    assert main(["models", "install", "minilm", "--retrain"]) == 2
    assert "--retrain trains a classifier's head" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("alias", list(probes.SHIPPED_HEADS))
def test_retrain_reproduces_the_shipped_head(alias, empty_cache, monkeypatch, capsys):
    mpnet = Path.home() / ".cache" / "attnflow" / "all-mpnet-base-v2"
    if PROBES[alias].encoder == "mpnet" and mpnet.exists():  # reuse the unpacked encoder, not the head
        shutil.copytree(mpnet, empty_cache / "all-mpnet-base-v2")
    seen = []  # the features the retrain fits on ([text, d_model])
    pooled = probes.mean_pooled_features

    def recorded(*args, **kwargs):
        seen.append(pooled(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(probes, "mean_pooled_features", recorded)
    assert main(["models", "install", alias, "--retrain"]) == 0
    retrained_path = empty_cache / "probes" / f"{alias}.npz"
    assert f"retrained head in {retrained_path}\n{alias}: the shipped head has" in capsys.readouterr().out
    retrained, shipped = stored(retrained_path), stored(HEADS / f"{alias}.npz")
    retrained_meta, shipped_meta = json.loads(str(retrained["meta"])), json.loads(str(shipped["meta"]))
    assert retrained_meta["n_test"] == shipped_meta["n_test"]
    # the same held-out predictions up to one example (float noise of another thread count)
    assert abs(retrained_meta["heldout_accuracy"] - shipped_meta["heldout_accuracy"]) <= 1 / shipped_meta["n_test"]
    features = np.asarray(seen[0], dtype=np.float64)  # [text, d_model]

    def logits(head: dict[str, np.ndarray]) -> np.ndarray:  # [text, class]
        return features @ head["weight"].T.astype(np.float64) + head["bias"]

    np.testing.assert_allclose(logits(retrained), logits(shipped), atol=1e-3 * np.abs(logits(shipped)).max())
    # The fit determines the standardised weights (raw weight × feature std). A feature that is
    # constant up to float noise (std ~1e-8: minilm has such dimensions) gets a large raw weight
    # fitted to that noise, which no prediction feels; compared standardised, it is ~0 on both sides.
    spread = features.std(axis=0)  # [d_model]
    standardised = {name: head["weight"] * spread for name, head in (("retrained", retrained), ("shipped", shipped))}
    scale = np.abs(standardised["shipped"]).max()
    np.testing.assert_allclose(standardised["retrained"], standardised["shipped"], atol=1e-3 * scale)
    np.testing.assert_array_equal(retrained["labels"], shipped["labels"])
