"""The backward rules written out as explicit forward passes (an oracle independent of the rule
engine): each rule where it is defined — detached σ in every norm, a detached attention matrix, each
factor of a product given half its gradient, activations f(x) = x · (f(x)/x) with the ratio detached,
a softmax whose backward is T times that of softmax(x / T). Used by tests/methods/test_lrp*.py and by
the RelP check in tests/causal/test_approximations.py."""

from __future__ import annotations

import torch

GIM_TEMPERATURE = 2.0


def product(a: torch.Tensor, b: torch.Tensor, rule: str, matmul: bool = True) -> torch.Tensor:
    """a·b; under attnlrp's and gim's uniform rule each factor receives half of the gradient."""
    multiply = torch.matmul if matmul else torch.mul
    if rule in ("attnlrp", "gim"):
        return 0.5 * multiply(a, b.detach()) + 0.5 * multiply(a.detach(), b)
    return multiply(a, b)


def activation(x: torch.Tensor, function, rule: str) -> torch.Tensor:
    """f(x); under attnlrp's identity rule the gradient is f(x)/x."""
    return x * (function(x) / x).detach() if rule == "attnlrp" else function(x)


def attention_softmax(scores: torch.Tensor, rule: str) -> torch.Tensor:
    """softmax(scores); cp_lrp: a constant; gim: the forward value with T times the gradient of
    softmax(scores / T) (the temperature-adjusted backward, written as a sum, not a hook)."""
    weights = torch.softmax(scores, dim=-1)
    if rule == "cp_lrp":
        return weights.detach()
    if rule == "gim":
        tempered = torch.softmax(scores / GIM_TEMPERATURE, dim=-1)
        return weights.detach() + GIM_TEMPERATURE * (tempered - tempered.detach())
    return weights


def write_out_llama_rules(monkeypatch, rule: str) -> None:
    """Replace, until ``monkeypatch.undo()``, Llama's attention, RMS norm and MLP by ``rule`` written out
    (the rest of the forward pass is the model's own code)."""
    from transformers.models.llama import modeling_llama as llama

    def attention(module, query, key, value, attention_mask, scaling, **_kwargs):
        key = llama.repeat_kv(key, module.num_key_value_groups)
        value = llama.repeat_kv(value, module.num_key_value_groups)
        scores = product(query, key.transpose(2, 3), rule) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = attention_softmax(scores, rule)
        return product(weights, value, rule).transpose(1, 2).contiguous(), weights

    def rms_norm(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).detach()

    def mlp(self, x):
        gate = activation(self.gate_proj(x), torch.nn.functional.silu, rule)  # gim: the plain SiLU
        return self.down_proj(product(gate, self.up_proj(x), rule, matmul=False))

    monkeypatch.setattr(llama, "eager_attention_forward", attention)
    monkeypatch.setattr(llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(llama.LlamaMLP, "forward", mlp)
