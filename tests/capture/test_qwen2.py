"""Qwen2 (Llama's layout with biases on q, k and v; grouped-query attention): captured attentions
and next-token scores equal the model's own eager forward, loaded here by transformers alone; the
value vectors (bias included, each key-value head shared by its query heads) rebuild the attention
block's real output; the embedded qwen2.5-0.5b (slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

import attnflow
from attnflow.rows.adapters import find_layers

TEXT = "the movie was terrible, but the acting was great."
PROMPT = "The capital of France is"


def test_capture_and_next_token_equal_the_models_own_forward(tiny_model_path):
    path = tiny_model_path("qwen2")
    model = attnflow.load(str(path), device="cpu")
    assert model.config.model_type == "qwen2" and model.kind == "decoder"
    trace = model.trace(TEXT, needs=("attentions", "values", "output_weights", "target"))[0]
    reference = T.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    block_outputs: list[torch.Tensor] = []
    projections = find_layers(reference, r"layers\.(\d+)\.self_attn\.o_proj$")
    handles = [module.register_forward_hook(lambda _m, _i, out: block_outputs.append(out)) for _, module in projections]
    try:
        with torch.no_grad():
            out = reference(input_ids=torch.tensor(trace.token_ids)[None], output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    np.testing.assert_allclose(trace.attentions, torch.stack(out.attentions, 1)[0].numpy(), atol=1e-6)
    log_probabilities = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
    assert trace.target.index == int(log_probabilities.argmax())
    assert trace.target.value == pytest.approx(float(log_probabilities.max()), rel=1e-5)

    kv_heads = reference.config.num_key_value_heads
    assert kv_heads < model.n_heads and all(layer.self_attn.v_proj.bias is not None for layer in reference.model.layers)
    for layer, block_output in enumerate(block_outputs):
        values = trace.captured("values")[layer]  # [token, head, d_head]
        # query head h reads key-value head h // (heads per kv head): heads of one group share values
        group = model.n_heads // kv_heads
        for h in range(model.n_heads):
            np.testing.assert_array_equal(values[:, h], values[:, (h // group) * group])
        # f_h(x_j) = v_j^h W_O^h [token, head, d_model]; the block's output is Σ_h Σ_j A[h,i,j] f_h(x_j) + b_O
        contributions = np.einsum("jhd,hde->jhe", values, trace.output_weights[layer])
        bias = trace.captured("output_bias")[layer]
        rebuilt = np.einsum("hij,jhe->ie", trace.attentions[layer], contributions) + bias
        np.testing.assert_allclose(rebuilt, block_output[0].numpy(), atol=1e-5)


def test_value_aware_methods_run(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("qwen2")), device="cpu")
    assert {"values", "query_key", "gated_mlp"} <= model.adapter.provides
    explanation = model.explain(TEXT, method="norm_rollout")
    np.testing.assert_allclose(explanation.matrix.sum(-1), 1.0, atol=1e-6)


@pytest.mark.slow
def test_qwen25_05b_equals_its_own_forward():
    model = attnflow.load("qwen2.5-0.5b", device="cpu")
    assert (model.n_layers, model.n_heads, model.config.num_key_value_heads, model.d_model) == (24, 14, 2, 896)
    trace = model.trace(PROMPT, needs=("attentions", "target"))[0]
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor(trace.token_ids)[None], output_attentions=True)
    np.testing.assert_allclose(trace.attentions, torch.stack(out.attentions, 1)[0].numpy(), atol=1e-6)
    log_probabilities = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
    # float32 logits over a vocabulary of 150k-260k tokens: the log-probabilities agree to ~3e-5
    assert trace.target.value == pytest.approx(float(log_probabilities.max()), abs=2e-4)
    assert model.tokenizer.decode([trace.target.index]).strip() == "Paris"
