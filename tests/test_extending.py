"""docs/extending.md runs as written, and each extension point works from its one declaration:
a toy method, a toy family (one adapter row: every method whose requirements it meets runs, the
others refuse naming what is missing) and a toy rule row (a working rule-based method, checked
against an independent gradient × input)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from attnflow.capture import unregister_adapter
from attnflow.methods.registry import available_methods, get_method, unregister

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
TEXT = "the movie was great but the acting"
ADDED_METHODS = ("last_layer", "attnlrp_tempered", "plain_rules")


@pytest.fixture(scope="module")
def extended():
    """The namespace after running every Python block of docs/extending.md in order."""
    namespace: dict = {}
    try:
        for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
            exec(compile(block, str(DOC), "exec"), namespace)
        yield namespace
    finally:
        for name in ADDED_METHODS:
            unregister(name)
        unregister_adapter("gemma")


def test_the_toy_method_runs_through_the_front_door(extended):
    model = extended["model"]
    explanation = model.explain(TEXT, method="last_layer", row="last")
    attentions = model.trace(TEXT)[0].attentions  # [layer, head, query, key]
    np.testing.assert_allclose(explanation.scores, attentions[-1].mean(axis=0)[-1], rtol=1e-6)
    assert "last_layer" in available_methods() and get_method("last_layer").requires == frozenset()


def test_the_toy_family_runs_every_method_it_provides_for_and_refuses_the_others(extended):
    model = extended["model"]
    assert model.adapter.family == "gemma" and type(model.model).__name__ == "GemmaForCausalLM"
    supported, refused = [], []
    for name in available_methods():
        spec = get_method(name)
        if spec.supports(model.adapter):
            scores = model.explain(TEXT, method=name).scores
            assert scores.shape[-1] == len(model.trace(TEXT)[0].tokens) and np.all(np.isfinite(scores)), name
            supported.append(name)
        else:
            missing = sorted(spec.requires - model.adapter.provides)
            with pytest.raises(
                ValueError, match=rf"{name}' does not support the gemma family: it requires {missing[0]}"
            ):
                model.explain(TEXT, method=name)
            refused.append(name)
    assert {"attnlrp", "gim", "cp_lrp", "rollout", "flow", "norm", "grad_x_input", "leave_one_out"} <= set(supported)
    assert {"alti", "value_zeroing"} <= set(refused)  # post-LN only: Gemma normalises before each block


def test_a_rule_row_is_a_working_method(extended):
    from attnflow.methods.model import BackwardRules, register_rules

    model = extended["model"]
    tempered = extended["tempered"]
    assert tempered.signed and "conservation" in tempered.extras
    assert not np.allclose(tempered.scores, model.explain(TEXT, method="attnlrp").scores)
    # A row that changes nothing is plain gradient x input at the word embeddings: grad_x_input's numbers.
    register_rules(BackwardRules("plain_rules", "no rule at all", norms_constant=False))
    plain = model.explain(TEXT, method="plain_rules").scores
    expected = model.explain(TEXT, method="grad_x_input", signed=True).scores
    np.testing.assert_allclose(plain, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
