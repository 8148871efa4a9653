"""The backward rules (`cp_lrp`, `attnlrp`, `gim`) on the Qwen2, Gemma 3, GPT-2 and GPT-NeoX families,
against the rules written out as in tests/methods/test_lrp.py (the family's attention, norms and MLP
replaced, in the test only, by explicit forward passes): Qwen2's q/k/v biases and grouped-query
attention; Gemma 3's x·(1 + w) norms (four per layer, plus q/k norms), its embedding scaled by
√d_model (the gim baseline is the pad token's *scaled* embedding) and its local layers; GPT-2's
fused q | k | v (its built-in row) and position embeddings; GPT-NeoX's per-head fused q, k, v
(through a row the test registers). Exact conservation of cp_lrp on fused ReLU decoders."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest
import torch
from test_lrp import RULES, TEXTS, activation, attention_softmax, layer_norm, product, sharpen

import attnflow
from attnflow.methods.model.lrp import RULES as RULES_TABLE
from attnflow.methods.model.lrp import backward_rules, lrp_relevance
from attnflow.model import AttentionModel
from attnflow.rows.tiny import randomise_constants
from attnflow.targets import Target
from fused_rows import NEOX_ROW, registered, save_fused_model


def _written_out(model_type: str, rule: str) -> tuple[object, list[tuple[object, str, object]]]:
    """The family's modelling module and, per class, the forward written out under ``rule``."""
    if model_type == "gemma3_text":
        from transformers.models.gemma3 import modeling_gemma3 as module

        def rms_norm(self, x):  # Gemma: x / rms(x) · (1 + w)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps).detach() * (1.0 + self.weight)

        return module, [(module.Gemma3RMSNorm, "forward", rms_norm), (module.Gemma3MLP, "forward", gated(rule))]
    if model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as module

        def rms_norm(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).detach()

        return module, [(module.Qwen2RMSNorm, "forward", rms_norm), (module.Qwen2MLP, "forward", gated(rule))]
    norm = (torch.nn.LayerNorm, "forward", lambda self, x: layer_norm(x, self))
    if model_type == "gpt2":  # fused q|k|v (the model's own split runs), Conv1D MLP
        from transformers.models.gpt2 import modeling_gpt2 as module

        def mlp(self, x):
            return self.c_proj(activation(self.c_fc(x), self.act, rule))

        return module, [norm, (module.GPT2MLP, "forward", mlp)]
    from transformers.models.gpt_neox import modeling_gpt_neox as module  # per-head fused q, k, v

    def neox_mlp(self, x):
        return self.dense_4h_to_h(activation(self.dense_h_to_4h(x), self.act, rule))

    return module, [norm, (module.GPTNeoXMLP, "forward", neox_mlp)]


def gated(rule: str):
    def mlp(self, x):
        gate = activation(self.gate_proj(x), self.act_fn, rule)
        return self.down_proj(product(gate, self.up_proj(x), rule, matmul=False))

    return mlp


def family_oracle(model: AttentionModel, trace, rule: str, monkeypatch) -> np.ndarray:
    """``[token]`` relevance with the family's attention, norms and MLP written out under ``rule``
    (the model splits its own fused projections; GPT-2 adds its position embeddings to ``e``)."""
    module, replaced = _written_out(model.config.model_type, rule)

    def attention(module_, query, key, value, attention_mask, *_args, scaling=None, **_kwargs):
        groups = getattr(module_, "num_key_value_groups", 1)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = product(query, key.transpose(2, 3), rule) * (module_.scaling if scaling is None else scaling)
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = attention_softmax(scores, rule)
        return product(weights, value, rule).transpose(1, 2).contiguous(), weights

    monkeypatch.setattr(module, "eager_attention_forward", attention)
    for owner, name, forward in replaced:
        monkeypatch.setattr(owner, name, forward)
    ids = torch.as_tensor(trace.token_ids)[None]
    embed = model.hf_model.get_input_embeddings()
    e = embed(ids).detach().requires_grad_(True)  # what the model adds up: Gemma's scaled embedding
    y, _, _ = Target().objective(model)(
        torch.ones_like(ids), inputs_embeds=e, index=torch.as_tensor([trace.target.index])
    )
    (gradient,) = torch.autograd.grad(y.sum(), e)
    monkeypatch.undo()
    if rule == "gim":  # positions cancel in e − b
        attributed = e - embed(torch.full_like(ids, model.tokenizer.pad_token_id))
    elif model.config.model_type == "gpt2":  # the first block reads e + the position embeddings
        attributed = e + model.hf_model.transformer.wpe.weight[: ids.shape[1]]
    else:
        attributed = e
    return (attributed.detach()[0] * gradient[0]).sum(-1).double().numpy()


def sharp(model: AttentionModel, factor: float) -> AttentionModel:
    """Sharper attention: the query projection × ``factor`` (its columns of a fused projection, sliced
    by hand); Gemma's q norm would undo a larger q projection, so its scaling grows."""
    model_type, hf_model = model.config.model_type, model.hf_model
    if model_type in ("qwen2",):
        return sharpen(model, factor)
    with torch.no_grad():
        for layer in range(model.n_layers):
            if model_type == "gemma3_text":
                hf_model.model.layers[layer].self_attn.scaling *= factor
            elif model_type == "gpt2":  # Conv1D [in, out]: q | k | v
                fused = hf_model.transformer.h[layer].attn.c_attn
                fused.weight[:, : model.d_model] *= factor
                fused.bias[: model.d_model] *= factor
            else:  # GPT-NeoX [out, in]: per head q, k, v
                fused = hf_model.gpt_neox.layers[layer].attention.query_key_value
                fused.weight.view(model.n_heads, 3, model.d_head, -1)[:, 0] *= factor
                fused.bias.view(model.n_heads, 3, model.d_head)[:, 0] *= factor
    return model


def randomised(model: AttentionModel) -> AttentionModel:
    """Every 1-D parameter moved by 0.3·randn (GPT-2 starts its biases at 0: no bias would absorb relevance)."""
    torch.manual_seed(1)
    randomise_constants(model.hf_model)
    return model


@contextmanager
def loaded(family: str, tiny_model_path, tmp_path) -> Iterator[AttentionModel]:
    """The family's tiny model: GPT-NeoX through the row a test registers (no built-in row)."""
    if family != "gpt_neox":
        model = attnflow.load(str(tiny_model_path(family)), device="cpu")
        yield randomised(model) if family == "gpt2" else model
        return
    with registered(NEOX_ROW):
        yield attnflow.load(str(save_fused_model(family, tmp_path / family)), device="cpu")


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "gpt2", "gpt_neox"])
def test_relevance_equals_the_rules_written_out(tiny_model_path, tmp_path, family, monkeypatch):
    with loaded(family, tiny_model_path, tmp_path) as model:
        sharp(model, 30.0)
        assert model.trace(TEXTS[1])[0].attentions.max(axis=-1).mean() > 0.3  # sharp enough to tell rules apart
        trace = model.trace(TEXTS[1], needs=("attentions", "target"))[0]
        results = {}
        for rule in RULES:
            (relevance,) = lrp_relevance(model, [trace], rule)
            expected = family_oracle(model, trace, rule, monkeypatch)
            np.testing.assert_allclose(relevance.scores, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
            assert relevance.target_value == pytest.approx(trace.target.value, rel=1e-5)
            front_door = model.explain(TEXTS[1], method=rule)  # the same relevance through model.explain
            np.testing.assert_allclose(front_door.scores, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
            results[rule] = relevance
    assert not np.allclose(results["attnlrp"].scores, results["gim"].scores)  # the rows differ on this family
    # q, k and v biases (Qwen2's; GPT-2's and GPT-NeoX's fused ones) absorb relevance
    if family != "gemma3":
        assert all(abs(relevance.bias_share) > 0 for relevance in results.values())


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_cp_lrp_on_a_fused_relu_decoder_conserves_exactly(tiny_model_path, tmp_path, family):
    """With ReLU activations, cp_lrp's rules make the logit exactly linear in the embedding sum and the
    biases: Σ_j R_j + Σ_b b · ∂̃y/∂b = y, the fused projection's query and key columns stopped."""
    with loaded(family, tiny_model_path, tmp_path) as model:
        for mlp in (module for module in model.hf_model.modules() if hasattr(module, "act")):
            mlp.act = torch.nn.ReLU()  # GPT-2's and GPT-NeoX's MLPs call self.act
        ids = torch.as_tensor(model.trace(TEXTS[0])[0].token_ids)[None]
        with backward_rules(model, RULES_TABLE["cp_lrp"]) as recording, torch.enable_grad():
            y = model.hf_model(input_ids=ids).logits[0, -1, 7]
        outputs = [output for _, output in recording.biased_outputs]
        gradients = torch.autograd.grad(y, [recording.embedding_sum, *outputs], allow_unused=True)
    tokens = float((recording.embedding_sum * gradients[0]).sum().detach())
    biases = sum(
        float((b * g).sum().detach())
        for (b, _), g in zip(recording.biased_outputs, gradients[1:], strict=True)
        if g is not None
    )
    value = float(y.detach())
    assert abs(biases) > 1e-3 * abs(value)  # the fused biases do absorb relevance
    assert tokens + biases == pytest.approx(value, rel=1e-4, abs=1e-5)
