"""Rule sets as rule objects per module kind: the tempered softmax reaches every family's attention
softmax however it is spelled (counted, and compared with a run where the rule is off), a rule set is
validated when it is written. (Composed rules on one module — attnlrp's gated activation: Identity,
then Scale ½ — are checked against the rules written out in test_lrp.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnflow.methods.model.lrp import (
    RULES,
    BackwardRules,
    ConstantNorm,
    Scale,
    TemperedSoftmax,
    backward_rules,
    lrp_relevance,
)

from tiny_models import TEXT_FAMILIES

TEXT = "the movie was great but the acting was bad"
# Every tiny text family whose row provides what the GIM rules require (the encoder-decoders' rows do not).
GIM_FAMILIES = [family for family in TEXT_FAMILIES if family not in ("t5", "bart")]


def _forward(model, rules):
    """One forward pass of ``TEXT`` under ``rules``: (y, the recording)."""
    encoded = model.tokenizer(TEXT, return_tensors="pt")
    with backward_rules(model, rules) as recording, torch.enable_grad():
        output = model.model(**encoded)
    hidden = output.logits if hasattr(output, "logits") else output.last_hidden_state
    return hidden.sum(), recording


@pytest.mark.parametrize("family", GIM_FAMILIES)
def test_the_tempered_softmax_runs_in_every_attention_layer(tiny_loaded, family):
    model = tiny_loaded(family)
    assert RULES["gim"].rule("softmax") == TemperedSoftmax(2.0)
    y, recording = _forward(model, RULES["gim"])
    assert recording.tempered_softmax == model.n_layers  # one softmax call per attention module, each tempered
    assert torch.isfinite(y)
    _, plain = _forward(model, RULES["attnlrp"])  # no softmax rule: nothing tempered
    assert plain.tempered_softmax == 0


@pytest.mark.parametrize("spelling", ["torch.softmax", "Tensor.softmax"])
def test_a_softmax_spelled_otherwise_still_gets_the_rule(tiny_classifier_path, monkeypatch, spelling):
    """BERT's eager attention calls ``nn.functional.softmax``; rewritten to call ``torch.softmax`` or
    ``Tensor.softmax`` the rule must still apply: the relevance is the same, and differs from the
    relevance with the softmax rule off (on sharp attention, where the temperature matters)."""
    from transformers.models.bert import modeling_bert

    import attnflow

    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    with torch.no_grad():  # sharp attention, where the softmax's temperature matters
        for layer in model.model.bert.encoder.layer:
            layer.attention.self.query.weight.mul_(150.0)
    trace = model.trace(TEXT, needs=("attentions", "target"))[0]
    tempered = BackwardRules(
        "tempered", "a tempered softmax", {"norm": ConstantNorm(), "softmax": TemperedSoftmax(3.0)}
    )
    plain = BackwardRules("plain", "the plain softmax", {"norm": ConstantNorm()})
    (expected,) = lrp_relevance(model, [trace], tempered)
    (without,) = lrp_relevance(model, [trace], plain)
    original = modeling_bert.nn.functional.softmax

    class Functional:  # nn.functional as the rewritten attention sees it: softmax spelled another way
        def __getattr__(self, name):
            if name == "softmax":
                if spelling == "torch.softmax":
                    return lambda x, dim=None, **kwargs: torch.softmax(x, dim, **kwargs)
                return lambda x, dim=None, **kwargs: x.softmax(dim, **kwargs)
            return getattr(torch.nn.functional, name)

    class NN:
        functional = Functional()

        def __getattr__(self, name):
            return getattr(torch.nn, name)

    monkeypatch.setattr(modeling_bert, "nn", NN())
    assert modeling_bert.nn.functional.softmax is not original
    (found,) = lrp_relevance(model, [trace], tempered)
    np.testing.assert_allclose(found.scores, expected.scores, rtol=1e-5, atol=1e-8)
    assert not np.allclose(found.scores, without.scores, rtol=1e-3)


def test_a_rule_set_is_checked_when_written():
    with pytest.raises(ValueError, match="unknown module kind 'attention'"):
        BackwardRules("bad", "a kind that does not exist", {"attention": Scale(0.5)})
    with pytest.raises(ValueError, match="TemperedSoftmax does not apply to 'norm' modules"):
        BackwardRules("bad", "a rule on the wrong kind", {"norm": TemperedSoftmax(2.0)})
    with pytest.raises(ValueError, match="baseline must be"):
        BackwardRules("bad", "an unknown baseline", baseline="mean")  # type: ignore[arg-type]
    quiet = BackwardRules("quiet", "rules that change nothing", {"value": Scale(1.0), "softmax": TemperedSoftmax(1.0)})
    assert quiet.rule("value") is None and quiet.rule("softmax") is None and quiet.requires == ("text_target",)
    assert RULES["attnlrp"].requires == ("text_target", "query_key", "norms", "attention_mixing")
