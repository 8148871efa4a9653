"""The backward-rule methods (`cp_lrp`, `attnlrp`, `gim`) against independent oracles: explicit
forward passes that apply each rule where it is defined (detached σ in every norm, a detached
attention matrix, each factor of a product given half its gradient, activations f(x) = x · (f(x)/x)
with the ratio detached, a softmax whose backward is T times that of softmax(x / T), the pad
token's embedding as baseline), written here from the models' weights; exact conservation where the
rules conserve by construction; hooks that never outlive a call; batches equal single inputs; a rule
row written in a test becomes a working method."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import transformers as T

import attnflow
from attnflow.capture.probes import _make_classifier
from attnflow.errors import InputError
from attnflow.methods.model.lrp import lrp_relevance
from attnflow.model import AttentionModel
from attnflow.rows.tiny import tiny_tokenizer
from attnflow.targets import Target
from fused_rows import registered
from lrp_oracle import activation, attention_softmax, product, write_out_llama_rules

from tiny_models import tiny_config

TEXTS = ["the movie was terrible, but the acting was great.", "a good film", "the cat sat on the mat and ran"]
RULES = ("cp_lrp", "attnlrp", "gim")


def attributed(e: torch.Tensor, word_embeddings: torch.Tensor, ids: torch.Tensor, pad: int, rule: str) -> torch.Tensor:
    """What the gradient multiplies ``[token, d_model]``: the embedding sum, or for gim the sum minus
    the same sum with the pad token's word embedding at every position."""
    return (word_embeddings[ids] - word_embeddings[pad]).detach() if rule == "gim" else e.detach()


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps).detach() * norm.weight + norm.bias


def bert_oracle(classifier: torch.nn.Module, ids: torch.Tensor, target: int, rule: str) -> np.ndarray:
    """``[token]`` relevance of a BertForSequenceClassification written out from its weights."""
    bert, n = classifier.bert, len(ids)
    embeddings = bert.embeddings
    e = (
        embeddings.word_embeddings.weight[ids]
        + embeddings.position_embeddings.weight[:n]
        + embeddings.token_type_embeddings.weight[0]
    ).detach()
    e.requires_grad_(True)
    h = layer_norm(e, embeddings.LayerNorm)
    for layer in bert.encoder.layer:
        attention = layer.attention.self
        heads, width = attention.num_attention_heads, attention.attention_head_size

        def split(x: torch.Tensor, heads: int = heads, width: int = width) -> torch.Tensor:
            return x.reshape(n, heads, width).transpose(0, 1)  # [head, token, d_head]

        q, k, v = split(attention.query(h)), split(attention.key(h)), split(attention.value(h))
        weights = attention_softmax(product(q, k.transpose(1, 2), rule) / math.sqrt(width), rule)
        context = product(weights, v, rule).transpose(0, 1).reshape(n, heads * width)
        h = layer_norm(layer.attention.output.dense(context) + h, layer.attention.output.LayerNorm)
        inner = activation(layer.intermediate.dense(h), torch.nn.functional.gelu, rule)
        h = layer_norm(layer.output.dense(inner) + h, layer.output.LayerNorm)
    pooled = activation(bert.pooler.dense(h[0]), torch.tanh, rule)
    y = classifier.classifier(pooled)[target]
    (gradient,) = torch.autograd.grad(y, e)
    pad = classifier.config.pad_token_id
    return (attributed(e, embeddings.word_embeddings.weight, ids, pad, rule) * gradient).sum(-1).double().numpy()


def sharpen(model: AttentionModel, factor: float) -> AttentionModel:
    """The query projections × ``factor``, so that attention is far from uniform: a random tiny
    model's near-uniform softmax has the same backward at every temperature."""
    with torch.no_grad():
        for name, parameter in model.model.named_parameters():
            if name.endswith(("query.weight", "q_proj.weight")):
                parameter.mul_(factor)
    return model


@pytest.mark.parametrize("rule", RULES)
def test_bert_relevance_equals_the_rules_written_out(tiny_classifier_path, rule):
    model = sharpen(attnflow.load(str(tiny_classifier_path("bert")), device="cpu"), 150.0)
    assert model.trace(TEXTS[0])[0].attentions.max(axis=-1).mean() > 0.3  # sharp enough to tell temperatures apart
    traces = model.trace(TEXTS[:2], needs=("attentions", "target"))
    for trace, relevance in zip(traces, lrp_relevance(model, traces, rule), strict=True):
        expected = bert_oracle(model.model, torch.as_tensor(trace.token_ids), trace.target.index, rule)
        np.testing.assert_allclose(relevance.scores, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
        assert np.abs(expected).max() > 0


def llama_oracle(model: AttentionModel, trace, rule: str, monkeypatch) -> np.ndarray:
    """``[token]`` relevance of a tiny Llama whose attention, RMS norm and MLP are replaced, in
    this test only, by the rules written out (the rest is the model's own code)."""
    write_out_llama_rules(monkeypatch, rule)
    ids = torch.as_tensor(trace.token_ids)[None]
    e = model.model.get_input_embeddings()(ids).detach().requires_grad_(True)
    y, _, _ = Target().objective(model)(
        torch.ones_like(ids), inputs_embeds=e, index=torch.as_tensor([trace.target.index])
    )
    (gradient,) = torch.autograd.grad(y.sum(), e)
    monkeypatch.undo()
    word_embeddings = model.model.get_input_embeddings().weight
    pad = model.tokenizer.pad_token_id
    return (attributed(e[0], word_embeddings, ids[0], pad, rule) * gradient[0]).sum(-1).double().numpy()


@pytest.mark.parametrize("rule", RULES)
def test_llama_relevance_equals_the_rules_written_out(tiny_model_path, rule, monkeypatch):
    model = sharpen(attnflow.load(str(tiny_model_path("llama")), device="cpu"), 30.0)
    assert model.trace(TEXTS[0])[0].attentions.max(axis=-1).mean() > 0.3
    trace = model.trace(TEXTS[0], needs=("attentions", "target"))[0]
    (relevance,) = lrp_relevance(model, [trace], rule)
    expected = llama_oracle(model, trace, rule, monkeypatch)
    np.testing.assert_allclose(relevance.scores, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
    assert relevance.target_value == pytest.approx(trace.target.value, rel=1e-5)


def relu_classifier(family: str, zero_biases: bool) -> AttentionModel:
    """A tiny BERT-like encoder with ReLU activations, mean pooling and a linear head: a network
    that cp_lrp's rules make exactly linear in the embedding sum and the biases."""
    torch.manual_seed(1)
    config = tiny_config(family)
    if family == "distilbert":
        config.activation = "relu"
    else:
        config.hidden_act = "relu"
    encoder = T.AutoModel.from_config(config, attn_implementation="eager")
    head = torch.nn.Linear(config.hidden_size if family != "distilbert" else config.dim, 2)
    with torch.no_grad():
        for name, parameter in [*encoder.named_parameters(), ("head.bias", head.bias)]:
            if name.endswith("bias"):
                parameter.zero_() if zero_biases else parameter.normal_(0.0, 0.5)
    classifier = _make_classifier()(encoder, head, ["neg", "pos"])
    tokenizer = tiny_tokenizer()
    return AttentionModel(classifier, tokenizer, name=f"tiny relu {family}", device="cpu")


@pytest.mark.parametrize("family", ["bert", "electra", "roberta", "distilbert", "mpnet"])
def test_cp_lrp_conserves_exactly_with_relu_and_accounts_for_biases(family):
    for zero_biases in (True, False):
        model = relu_classifier(family, zero_biases)
        traces = model.trace(TEXTS, needs=("attentions", "target"))
        for trace, relevance in zip(traces, lrp_relevance(model, traces, "cp_lrp"), strict=True):
            total = relevance.scores.sum() + relevance.bias_relevance
            assert total == pytest.approx(trace.target.value, rel=1e-4, abs=1e-5)
            if zero_biases:
                assert relevance.bias_relevance == 0.0
                assert relevance.conservation == pytest.approx(1.0, rel=1e-4)
            else:
                assert abs(relevance.bias_share) > 1e-3  # the biases do absorb relevance


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_batch_equals_one_input_at_a_time(tiny_classifier_path, tiny_model_path, family):
    path = tiny_classifier_path(family) if family == "bert" else tiny_model_path(family)
    model = attnflow.load(str(path), device="cpu")
    traces = model.trace(TEXTS, needs=("attentions", "target"))
    assert len({trace.n_tokens for trace in traces}) == len(traces)  # padding is exercised
    for rule in RULES:
        batched = lrp_relevance(model, traces, rule)
        for trace, together in zip(traces, batched, strict=True):
            (alone,) = lrp_relevance(model, [trace], rule)
            np.testing.assert_allclose(together.scores, alone.scores, rtol=1e-4, atol=1e-7)
            assert together.bias_relevance == pytest.approx(alone.bias_relevance, rel=1e-4, abs=1e-7)


def test_the_front_door_runs_the_rules_once_for_a_batch(tiny_classifier_path, monkeypatch):
    """`model.explain(texts, rule)` (what evaluate and the audit call) uses the rules' batch form:
    one `lrp_relevance` call for all texts, each explanation equal to explaining its text alone."""
    from attnflow.methods.model import lrp

    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    calls = []
    original = lrp.lrp_relevance
    monkeypatch.setattr(
        lrp, "lrp_relevance", lambda m, traces, rule: calls.append(len(traces)) or original(m, traces, rule)
    )
    for rule in RULES:
        calls.clear()
        together = model.explain(TEXTS, method=rule, batch_size=len(TEXTS))
        assert calls == [len(TEXTS)]
        for text, explanation in zip(TEXTS, together, strict=True):
            alone = model.explain(text, method=rule)
            np.testing.assert_allclose(explanation.scores, alone.scores, rtol=1e-4, atol=1e-7)
            assert explanation.extras == pytest.approx(alone.extras, rel=1e-4, abs=1e-7)
            assert explanation.signed and explanation.target["index"] == alone.target["index"]
            assert explanation.target["value"] == pytest.approx(alone.target["value"], rel=1e-5)


def plain_gradients(model: AttentionModel, ids: torch.Tensor) -> list[torch.Tensor]:
    """d(logit 0)/d(every parameter) of the unaltered model."""
    model.model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, 0].backward()
    gradients = [parameter.grad.clone() for parameter in model.model.parameters()]
    model.model.zero_grad(set_to_none=True)
    return gradients


def test_the_model_is_unchanged_after_lrp_also_when_the_forward_pass_raises(tiny_classifier_path):
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    trace = model.trace(TEXTS[0], needs=("attentions", "target"))[0]
    ids = torch.as_tensor(trace.token_ids)[None]
    before = plain_gradients(model, ids)
    hook_counts = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.model.modules()]
    for rule in RULES:
        lrp_relevance(model, [trace], rule)
        assert all(parameter.grad is None for parameter in model.model.parameters())

    def fail(*_args):
        raise RuntimeError("boom")

    handle = model.model.bert.encoder.layer[1].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            lrp_relevance(model, [trace], "attnlrp")
    finally:
        handle.remove()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.model.modules()] == hook_counts
    for expected, actual in zip(before, plain_gradients(model, ids), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_lrp_explains_the_real_classifier_and_not_random_weights(minilm_sentiment, tmp_path):
    from scipy.stats import spearmanr

    from attnflow.evaluate.sanity import cascade

    sentence = "The movie was terrible, but the acting was great."
    *_, (_, randomised) = cascade(minilm_sentiment)  # the head and every block random
    for method in RULES:
        explanation = minilm_sentiment.explain(sentence, method=method)
        assert explanation.target["label"] == "negative"
        content = ~explanation.special_mask
        scores = explanation.scores[content]
        assert np.abs(scores).max() > 0.3 * abs(explanation.target["value"])  # not ≈ 0
        assert scores.std() > 0.2 * np.abs(scores).max()  # not constant
        by_token = dict(zip(explanation.tokens, explanation.scores, strict=True))
        assert by_token["terrible"] > 0 > by_token["great"]  # signed: for and against "negative"
        extras = explanation.extras
        assert extras["target_value"] == pytest.approx(explanation.target["value"], rel=1e-5)
        assert extras["conservation"] == pytest.approx(explanation.scores.sum() / extras["target_value"])
        assert extras["bias_share"] == pytest.approx(extras["bias_relevance"] / extras["target_value"])
        explanation.save(tmp_path / method)
        assert attnflow.Explanation.load(tmp_path / method).extras == pytest.approx(extras)
        random_map = randomised.explain(sentence, method=method, target=explanation.target["index"]).scores[content]
        assert abs(spearmanr(scores, random_map)[0]) < 0.5


def test_lrp_refuses_other_families_in_one_line(tiny_model_path):
    from PIL import Image

    vision = attnflow.load(str(tiny_model_path("dinov2")), device="cpu")
    with pytest.raises(
        ValueError, match=r"'attnlrp' does not support the dinov2 family: it requires query_key .*text_target"
    ):
        vision.trace_image_for(["attnlrp"], Image.new("RGB", (16, 16)))
    gpt2 = attnflow.load(str(tiny_model_path("gpt2")), device="cpu")
    unsplit = dataclasses.replace(gpt2.adapter, family="unsplit-gpt2", fused=())  # c_attn's parts not named
    with registered(unsplit):
        model = attnflow.load(str(tiny_model_path("gpt2")), device="cpu")
        with pytest.raises(
            ValueError, match=r"'cp_lrp' does not support the unsplit-gpt2 family: it requires query_key \(query and"
        ):
            model.explain("the cat sat", method="cp_lrp")
        with pytest.raises(
            InputError, match=r"cp_lrp does not support the unsplit-gpt2 family \(.*\): it requires query_key"
        ):
            lrp_relevance(model, model.trace("the cat sat", needs=("attentions", "target")), "cp_lrp")


@pytest.mark.slow
def test_lrp_on_smollm2_explains_the_next_token():
    smollm2 = attnflow.load("smollm2", device="cpu")
    prompts = ["The capital of France is", "One, two, three, four,"]
    traces = smollm2.trace(prompts, needs=("attentions", "target"))
    for rule in RULES:
        batched = lrp_relevance(smollm2, traces, rule)
        for trace, relevance in zip(traces, batched, strict=True):
            assert trace.target.kind == "next_token"
            assert np.all(np.isfinite(relevance.scores)) and np.abs(relevance.scores).max() > 0
            (alone,) = lrp_relevance(smollm2, [trace], rule)
            np.testing.assert_allclose(relevance.scores, alone.scores, rtol=1e-3, atol=1e-5)
        explanation = smollm2.explain(prompts[0], method=rule)
        assert explanation.target["kind"] == "next_token" and "conservation" in explanation.extras
