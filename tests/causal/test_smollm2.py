"""The shipped factual pairs on the real smollm2: equal token lengths, one-token answers, the clean
text predicts its target (slow: 30 prompts); restoring the predicting residual restores the metric
exactly; a head sweep (slow)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
import torch

from attnflow.causal import patch
from attnflow.causal.api import resolve_metric
from attnflow.causal.dataset import read_pairs
from attnflow.causal.patching import Patches, PatchRunner, site_value, stacked
from attnflow.causal.sites import Site
from attnflow.targets import Target

PAIRS = read_pairs(Path(str(files("attnflow.causal") / "data" / "factual.jsonl")))


def test_the_factual_pairs_hold_on_smollm2(smollm2):
    tokenizer = smollm2.tokenizer
    assert len(PAIRS) >= 20
    for pair in PAIRS:
        assert len(tokenizer(pair["clean"])["input_ids"]) == len(tokenizer(pair["corrupt"])["input_ids"]), pair
        for answer in (pair["target"], pair["contrast"]):
            assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) == 1, answer

    pair = PAIRS[2]  # restoring the last layer's residual at the last position gives effect 1
    clean = tokenizer(pair["clean"], return_tensors="pt")["input_ids"]
    corrupt = tokenizer(pair["corrupt"], return_tensors="pt")["input_ids"]
    runner = PatchRunner(smollm2, resolve_metric(smollm2, clean, Target(pair["target"], contrast=pair["contrast"])))
    final = Site("residual", smollm2.n_layers, clean.shape[1] - 1)
    with torch.no_grad():
        clean_metric, recorded = runner.forward(clean, 1, record=True)
        corrupt_metric, _ = runner.forward(corrupt, 1)
        patches = Patches()
        patches.add(0, final, site_value(stacked(recorded), 0, final, smollm2.n_heads))
        restored, _ = runner.forward(corrupt, 1, patches=patches)
    assert clean_metric.item() > corrupt_metric.item() + 1  # the counterfactual flips the answer
    assert restored.item() == clean_metric.item()


def test_the_pairs_written_another_way_hold_on_smollm2(smollm2):
    """factual_other.jsonl (docs/causal.md): same token lengths, one-token answers, the clean text
    prefers the target and the corrupt one the contrast (logit(target) − logit(contrast) > 0 < 0)."""
    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / "factual_other.jsonl")))
    assert len(pairs) >= 10
    _check_pairs(smollm2, pairs)


@pytest.mark.slow
def test_the_fresh_pairs_hold_on_smollm2(smollm2):
    """factual_fresh.jsonl (docs/causal.md, written after the sampled check's design was fixed):
    the checks above, and each text's top prediction is its answer (the target, the contrast)."""
    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / "factual_fresh.jsonl")))
    assert len(pairs) == 9
    _check_pairs(smollm2, pairs)
    for pair in pairs:
        for text, answer in ((pair["clean"], pair["target"]), (pair["corrupt"], pair["contrast"])):
            ids = smollm2.tokenizer(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                top = int(smollm2.model(input_ids=ids).logits[0, -1].argmax())
            assert smollm2.tokenizer.decode([top]) == answer, (text, answer)


def _check_pairs(smollm2, pairs: list[dict]) -> None:
    """Same token lengths, one-token answers, clean prefers the target and corrupt the contrast."""
    tokenizer = smollm2.tokenizer
    for pair in pairs:
        target, contrast = (
            tokenizer(answer, add_special_tokens=False)["input_ids"] for answer in (pair["target"], pair["contrast"])
        )
        assert len(target) == len(contrast) == 1, pair
        differences = []
        for text in (pair["clean"], pair["corrupt"]):
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                logits = smollm2.model(input_ids=ids).logits[0, -1]
            differences.append(float(logits[target[0]] - logits[contrast[0]]))
            assert ids.shape[1] == len(tokenizer(pair["clean"])["input_ids"]), pair
        assert differences[0] > 0 > differences[1], (pair, differences)


@pytest.mark.slow
def test_smollm2_predicts_every_target(smollm2):
    tokenizer = smollm2.tokenizer
    encoded = tokenizer([pair["clean"] for pair in PAIRS], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = smollm2.model(**encoded).logits  # [pair, token, vocab], right padding
    last = encoded["attention_mask"].sum(dim=1) - 1
    predicted = logits[torch.arange(len(PAIRS)), last].argmax(dim=-1)
    assert [tokenizer.decode([int(token)]) for token in predicted] == [pair["target"] for pair in PAIRS]


@pytest.mark.slow
def test_head_sweep_on_smollm2(smollm2):
    pair = min(PAIRS, key=lambda pair: len(pair["clean"]))
    result = patch(
        smollm2, pair["clean"], pair["corrupt"], target=pair["target"], contrast=pair["contrast"],
        sites="heads", methods="exact,atp,relp", progress=False,
    )  # fmt: skip
    heads = result.effects["exact"]["heads"]
    assert heads.shape == (smollm2.n_layers, smollm2.n_heads)
    assert np.isfinite(heads).all() and np.abs(heads).max() > 0.05
    assert result.correlations["atp"]["heads"]["pearson"] > 0.5
