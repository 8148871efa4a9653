"""`shap` against Shapley values enumerated here over every order of the content tokens, with one
plain forward pass per coalition (no code of attnflow's scorer or of the method)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import ExplanationWarning
from attnflow.explanation import explain

TEXT = "the movie was terrible but great"  # 6 content tokens: 720 orders, 64 coalitions


@pytest.fixture(scope="module")
def tiny_bert(tiny_classifier_path):
    """The tiny classifier with its head scaled up: its random head moves the logit by ~1e-5 per
    token, too little to tell right from wrong values against float32 noise; scaled, by ~1e-2."""
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    with torch.no_grad():
        model.model.classifier.weight.mul_(1000.0)
    return model


def _logit(model, ids, index):
    with torch.no_grad():
        return float(model.model(input_ids=torch.tensor([ids])).logits[0, index])


def _coalition_value(model, trace, present, replace):
    """y with the content tokens outside ``present`` removed from the ids or put as [MASK]."""
    mask_id = model.tokenizer.mask_token_id
    ids = []
    for j, token in enumerate(int(i) for i in trace.token_ids):
        if trace.special_mask[j] or j in present:
            ids.append(token)
        elif replace == "mask":
            ids.append(mask_id)
    return _logit(model, ids, trace.target.index)


def _shapley_by_orders(model, trace, replace):
    """φ_j = mean over all m! orders of y(tokens before j and j) − y(tokens before j)."""
    content = [int(j) for j in np.flatnonzero(~trace.special_mask)]
    cache = {}

    def value(coalition):
        key = frozenset(coalition)
        if key not in cache:
            cache[key] = _coalition_value(model, trace, key, replace)
        return cache[key]

    phi = dict.fromkeys(content, 0.0)
    for order in itertools.permutations(content):
        for k, j in enumerate(order):
            phi[j] += value(order[: k + 1]) - value(order[:k])
    return np.array([phi.get(j, 0.0) / math.factorial(len(content)) for j in range(trace.n_tokens)])


@pytest.mark.parametrize("replace", ["remove", "mask"])
def test_shap_equals_shapley_values_enumerated_over_all_orders(tiny_bert, replace):
    trace = tiny_bert.trace(TEXT, needs=("target",))[0]
    assert (~trace.special_mask).sum() == 6
    scores = explain(trace, method="shap", model=tiny_bert, replace=replace, batch_size=5).scores
    np.testing.assert_allclose(scores, _shapley_by_orders(tiny_bert, trace, replace), atol=1e-5)
    assert np.all(scores[trace.special_mask] == 0)


def test_sampled_shap_is_efficient_and_a_budget_below_one_order_is_raised(tiny_bert):
    trace = tiny_bert.trace(TEXT, needs=("target",))[0]
    everything = _logit(tiny_bert, list(trace.token_ids), trace.target.index)
    nothing = _coalition_value(tiny_bert, trace, set(), "remove")
    sampled = explain(trace, method="shap", model=tiny_bert, max_evals=30, seed=1)  # 5 orders, not the 64 coalitions
    assert sampled.scores.sum() == pytest.approx(everything - nothing, abs=1e-5)
    exact = _shapley_by_orders(tiny_bert, trace, "remove")
    assert not np.allclose(sampled.scores, exact, atol=1e-5)  # sampled, not enumerated
    with pytest.warns(ExplanationWarning, match="max_evals 3 is below the 7 coalitions"):
        raised = explain(trace, method="shap", model=tiny_bert, max_evals=3)
    assert raised.scores.sum() == pytest.approx(everything - nothing, abs=1e-5)
    assert "raised to 7" in raised.notes[0]
