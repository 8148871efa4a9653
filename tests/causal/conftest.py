"""Tiny models for the patching tests: Llama and GPT-2 language models and a BERT classifier."""

from __future__ import annotations

import pytest
import torch

import attnflow

CLEAN = "the cat sat on the mat"
CORRUPT = "the dog sat on the mat"


@pytest.fixture(scope="session")
def tiny_patch_models(tiny_model_path, tiny_classifier_path):
    """``{family: AttentionModel}`` for llama, gpt2 (causal LMs) and bert (a classifier)."""
    bert = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    # The random classifier barely responds to its input (its logits move by ~1e-6 between texts):
    # sharper attention scores and a larger head let a patch move its metric by ~1e-2.
    with torch.no_grad():
        bert.model.bert.pooler.dense.weight.mul_(30)
        bert.model.classifier.weight.mul_(30)
        for layer in bert.model.bert.encoder.layer:
            layer.attention.self.query.weight.mul_(8)
            layer.attention.self.key.weight.mul_(8)
    return {
        "llama": attnflow.load(str(tiny_model_path("llama")), device="cpu"),
        "gpt2": attnflow.load(str(tiny_model_path("gpt2")), device="cpu"),
        "bert": bert,
    }
