"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash, ...): the values are, per
head, the second part of ``kv_b_proj``'s output (``[batch, 1, token, heads * (qk_nope + v)]``),
after the key's position-free half of another width. Inference finds them as a per-head `Fused`
with unequal widths, the conformance suite proves it, and the value-aware methods and routes read
them. The oracle is the model's own split (`torch.split` of each head's slice, as its attention
does) and loops over the definitions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import attnflow
from attnflow.rows import check_adapter
from attnflow.rows.adapters import Fused, find_layers
from attnflow.rows.infer import verified_row
from attnflow.rows.tiny import model_class, randomise_constants, tiny_config, tiny_tokenizer

TEXT = "the movie was great but the acting"


@pytest.fixture(scope="module")
def latent():
    """A tiny DeepSeek-V3 whose key halves and values differ in width (8 and 16 per head)."""
    config = tiny_config("deepseek_v3")
    config.qk_nope_head_dim, config.v_head_dim = 8, 16
    config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    torch.manual_seed(0)
    model = model_class("deepseek_v3", "causal-lm")._from_config(config, attn_implementation="eager")
    randomise_constants(model)
    model.eval()
    return attnflow.AttentionModel(model, tiny_tokenizer(), name="tiny latent", adapter=verified_row(model, "decoder"))


def test_the_values_are_found_as_a_per_head_part_of_their_own_width(latent):
    row, config = latent.adapter, latent.config
    assert not row.unverified and {"values", "streams", "sites"} <= row.provides
    (fused,) = row.fused
    assert fused.module.endswith(r"self_attn\.kv_b_proj$") and fused.layout == "per_head"
    assert fused.parts == ("other", "value") and fused.widths == (config.qk_nope_head_dim, config.v_head_dim)
    nope, width = config.qk_nope_head_dim, config.v_head_dim
    per_head = nope + width
    expected = [h * per_head + nope + k for h in range(latent.n_heads) for k in range(width)]
    assert row.part_columns("value", latent.n_heads * per_head, config).tolist() == expected


def test_values_of_the_wrong_order_fail_head_slices(latent):
    row = latent.adapter
    swapped = Fused(row.fused[0].module, ("value", "other"), "per_head", tuple(reversed(row.fused[0].widths)))
    report = check_adapter(dataclasses.replace(row, fused=(swapped,)), latent.hf_model, strict=False)
    assert report.outcome("head_slices") == "fail"


def _own_values(model, text):
    """Per layer ``[token, head, v]``: kv_b_proj's output split per head as the attention splits it."""
    config, recorded = model.config, {}
    layers = find_layers(model.hf_model, r"layers\.(\d+)\.self_attn\.kv_b_proj$")
    handles = [
        module.register_forward_hook(lambda _m, _i, out, name=name: recorded.__setitem__(name, out.detach()))
        for name, module in layers
    ]
    try:
        with torch.no_grad():
            out = model.hf_model(input_ids=torch.tensor(model.trace(text)[0].token_ids)[None], output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    values = []
    for name, _ in layers:
        per_head = recorded[name][0, 0].view(-1, model.n_heads, config.qk_nope_head_dim + config.v_head_dim)
        values.append(torch.split(per_head, [config.qk_nope_head_dim, config.v_head_dim], dim=-1)[1].double())
    return values, [weights[0].double() for weights in out.attentions]


def test_norm_equals_explicit_loops_and_routes_add_up(latent):
    values, attentions = _own_values(latent, TEXT)
    projections = [module for _, module in find_layers(latent.hf_model, latent.adapter.stack.output_projection)]
    d = latent.d_head
    expected = []
    for layer, (value, attention) in enumerate(zip(values, attentions, strict=True)):
        weight = projections[layer].weight.detach().double()  # [d_model, head * d_head]
        n = value.shape[0]
        matrix = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                vector = sum(
                    attention[h, i, j] * (weight[:, h * d : (h + 1) * d] @ value[j, h]) for h in range(latent.n_heads)
                )
                matrix[i, j] = float(vector.norm())
        expected.append(matrix / matrix.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(latent.explain(TEXT, method="norm").scores, expected[-1][-1], atol=1e-5)
    routes = attnflow.routes(latent, TEXT)  # routes check that the parts add up to every stream
    assert routes.edges and routes.graph.n_layers == latent.n_layers


def _scaled_at(module, factor, columns=None):
    """A forward hook: the module's output as it is, its gradient × ``factor`` (on ``columns`` of its
    last axis, all of them when None; 0: the gradient stops), written out with ``detach``."""

    def hook(_module, _inputs, output):
        scaled = output * factor + output.detach() * (1 - factor)
        if columns is None:
            return scaled
        chosen = torch.zeros(output.shape[-1], dtype=torch.bool)
        chosen[columns] = True
        return torch.where(chosen, scaled, output)

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("name", ["attnlrp", "gim", "cp_lrp"])
def test_the_query_key_rule_at_the_scores_equals_it_written_at_the_latent_projections(latent, name):
    """Multi-head latent attention has no query or key projection: Q is q_b_proj's output, K is
    kv_b_proj's key columns beside kv_a_proj_with_mqa's rotary columns. The rule set's query/key
    rule (× ¼ in attnlrp and gim, a stop in cp_lrp), which the row applies at the softmax's input,
    gives the relevance of the same factor written by hand at those three places, the rule set's
    other rules unchanged."""
    from attnflow.methods.model.lrp import RULES, BackwardRules, lrp_relevance

    row, config = latent.adapter, latent.config
    assert row.values.scores and row.projection("query") is None and "query_key" in row.provides
    rules = RULES[name]
    factor = rules.rules["query_key"].factor
    others = {kind: rule for kind, rule in rules.rules.items() if kind != "query_key"}
    by_hand = BackwardRules(f"{name}-by-hand", "the query/key factor written by hand", others, rules.baseline)
    trace = latent.trace(TEXT, needs=("attentions", "target"))[0]
    (expected_off,) = lrp_relevance(latent, [trace], by_hand)  # the factor nowhere
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    key_columns = [h * (nope + config.v_head_dim) + k for h in range(latent.n_heads) for k in range(nope)]
    handles = []
    for layer in latent.hf_model.model.layers:
        attention = layer.self_attn
        query = attention.q_b_proj if getattr(attention, "q_b_proj", None) is not None else attention.q_proj
        latent_width = attention.kv_a_proj_with_mqa.out_features - rope
        handles += [
            _scaled_at(query, factor),
            _scaled_at(attention.kv_b_proj, factor, key_columns),
            _scaled_at(attention.kv_a_proj_with_mqa, factor, list(range(latent_width, latent_width + rope))),
        ]
    try:
        (expected,) = lrp_relevance(latent, [trace], by_hand)
    finally:
        for handle in handles:
            handle.remove()
    (found,) = lrp_relevance(latent, [trace], rules)
    np.testing.assert_allclose(found.scores, expected.scores, rtol=1e-5, atol=1e-7)
    assert not np.allclose(found.scores, expected_off.scores, rtol=1e-3)  # the factor matters on this model


def test_an_attention_without_a_softmax_call_gets_no_rules_at_the_scores(latent, monkeypatch):
    """The ``scores`` check: where the weights come from no softmax called inside the attention module
    (here written out as exp / sum), it fails, and the inferred row leaves the scores out: the
    backward rules are refused in one line naming the check."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    def softmax(x, dim=-1, dtype=None, **_kwargs):
        x = x.to(dtype) if dtype is not None else x
        exp = (x - x.amax(dim=dim, keepdim=True)).exp()
        return exp / exp.sum(dim=dim, keepdim=True)

    class Functional:
        def __getattr__(self, name):
            return softmax if name == "softmax" else getattr(torch.nn.functional, name)

    class NN:
        functional = Functional()

        def __getattr__(self, name):
            return getattr(torch.nn, name)

    assert check_adapter(latent.adapter, latent.hf_model, strict=False).outcome("scores") == "pass"
    monkeypatch.setattr(modeling_deepseek_v3, "nn", NN())
    report = check_adapter(latent.adapter, latent.hf_model, strict=False)
    assert report.outcome("scores") == "fail" and report.outcome("head_slices") == "pass"
    row = verified_row(latent.hf_model, "decoder")
    assert not row.values.scores and "query_key" not in row.provides and "values" in row.provides
    assert any(failure.startswith("scores: layer 0") for failure in row.unverified)
