"""The backward rules (`cp_lrp`, `attnlrp`, `gim`) on the Qwen2 and Gemma 3 families, against the
rules written out as in tests/methods/test_lrp.py (the family's attention, RMS norm and MLP replaced,
in the test only, by explicit forward passes): Qwen2's q/k/v biases and grouped-query attention;
Gemma 3's x·(1 + w) norms (four per layer, plus q/k norms), its embedding scaled by √d_model (the
gim baseline is the pad token's *scaled* embedding) and its local layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lrp import RULES, TEXTS, activation, attention_softmax, product, sharpen

import attnflow
from attnflow.methods.model.lrp import lrp_relevance
from attnflow.model import AttentionModel
from attnflow.targets import Target


def family_oracle(model: AttentionModel, trace, rule: str, monkeypatch) -> np.ndarray:
    """``[token]`` relevance with the family's attention, RMS norm and MLP written out under ``rule``."""
    family = model.config.model_type
    if family == "gemma3_text":
        from transformers.models.gemma3 import modeling_gemma3 as module

        norm_class, mlp_class = module.Gemma3RMSNorm, module.Gemma3MLP

        def rms_norm(self, x):  # Gemma: x / rms(x) · (1 + w)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps).detach() * (1.0 + self.weight)

    else:
        from transformers.models.qwen2 import modeling_qwen2 as module

        norm_class, mlp_class = module.Qwen2RMSNorm, module.Qwen2MLP

        def rms_norm(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).detach()

    def attention(module_, query, key, value, attention_mask, *_args, scaling=None, **_kwargs):
        key = module.repeat_kv(key, module_.num_key_value_groups)
        value = module.repeat_kv(value, module_.num_key_value_groups)
        scores = product(query, key.transpose(2, 3), rule) * (module_.scaling if scaling is None else scaling)
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = attention_softmax(scores, rule)
        return product(weights, value, rule).transpose(1, 2).contiguous(), weights

    def mlp(self, x):
        gate = activation(self.gate_proj(x), self.act_fn, rule)
        return self.down_proj(product(gate, self.up_proj(x), rule, matmul=False))

    monkeypatch.setattr(module, "eager_attention_forward", attention)
    monkeypatch.setattr(norm_class, "forward", rms_norm)
    monkeypatch.setattr(mlp_class, "forward", mlp)
    ids = torch.as_tensor(trace.token_ids)[None]
    embed = model.model.get_input_embeddings()
    e = embed(ids).detach().requires_grad_(True)  # what the model adds up: Gemma's scaled embedding
    y, _, _ = Target().objective(model)(
        torch.ones_like(ids), inputs_embeds=e, index=torch.as_tensor([trace.target.index])
    )
    (gradient,) = torch.autograd.grad(y.sum(), e)
    monkeypatch.undo()
    baseline = embed(torch.full_like(ids, model.tokenizer.pad_token_id)) if rule == "gim" else torch.zeros_like(e)
    return ((e - baseline).detach()[0] * gradient[0]).sum(-1).double().numpy()


def sharp(model: AttentionModel, factor: float) -> AttentionModel:
    """Sharper attention; Gemma's q norm would undo a larger q projection, so its scaling grows."""
    if model.config.model_type != "gemma3_text":
        return sharpen(model, factor)
    for layer in model.model.model.layers:
        layer.self_attn.scaling *= factor
    return model


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_relevance_equals_the_rules_written_out(tiny_model_path, family, monkeypatch):
    model = sharp(attnflow.load(str(tiny_model_path(family)), device="cpu"), 30.0)
    assert model.trace(TEXTS[1])[0].attentions.max(axis=-1).mean() > 0.3  # sharp enough to tell rules apart
    trace = model.trace(TEXTS[1], needs=("attentions", "target"))[0]
    results = {}
    for rule in RULES:
        (relevance,) = lrp_relevance(model, [trace], rule)
        expected = family_oracle(model, trace, rule, monkeypatch)
        np.testing.assert_allclose(relevance.scores, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
        assert relevance.target_value == pytest.approx(trace.target.value, rel=1e-5)
        results[rule] = relevance
    assert not np.allclose(results["attnlrp"].scores, results["gim"].scores)  # the rows differ on this family
    # Qwen2's q, k and v biases absorb relevance (q and k only where their gradient is not stopped)
    if family == "qwen2":
        assert all(abs(relevance.bias_share) > 0 for relevance in results.values())
