"""Heads that are A·V times a per-position factor before the output projection (`Values.head_factor`):
a sigmoid gate computed from the block input (MiniCPM5-MoE's ``q_gate_proj``, AFMoE's ``gate_proj``) or
a sink's rescaling of the weights after they are returned (Granite-SWA). Inference finds the values,
the conformance suite proves the factor by changing one token's values, and the value-aware methods
carry each head through it. The oracle is the model's own gate, read from its projection and put
through a sigmoid by hand, and loops over the definition (a norm between A·V and the output
projection, whose factor depends on the values, is `Values.head_norm`: tests/rows/test_head_norm.py).
Routes carry each head through D per query; the backward rules hold D constant (gradient × input
with the gate detached by hand, and CP-LRP's exact conservation), and a mixture of experts' routing
weights the same way (conservation on Mixtral, OLMoE, Qwen2-MoE with linear experts)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import InputError
from attnflow.rows import check_adapter
from attnflow.rows.adapters import find_layers
from inferred_tiny import assert_parts_add_up, tiny_inferred

TEXT = "the movie was great but the acting"


_tiny = tiny_inferred


@pytest.fixture(scope="module")
def gated():
    """A tiny MiniCPM5-MoE: per head, q_gate_proj's output holds the query and then the gate's logits."""
    return _tiny("minicpm5_moe")


@pytest.mark.parametrize("model_type", ["minicpm5_moe", "afmoe", "granite_swa"])
def test_the_values_are_found_with_a_factor_and_proven(model_type):
    model = _tiny(model_type)
    row = model.adapter
    assert row.values.head_factor and row.values.value.endswith(r"self_attn\.v_proj$") and not row.unverified
    report = check_adapter(row, model.hf_model, strict=False)
    assert report.outcome("head_factor") == "pass" and report.outcome("head_slices") == "n/a"
    assert {"values", "query_key", "streams"} <= row.provides
    plain = dataclasses.replace(row, values=dataclasses.replace(row.values, head_factor=False))
    assert check_adapter(plain, model.hf_model, strict=False).outcome("head_slices") == "fail"  # A·V alone is not it


def _own_parts(model, text):
    """Per layer: the weights ``[head, q, k]``, the values ``[token, kv_head, d_head]`` and the gate
    sigmoid(q_gate_proj's second half per head) ``[token, head, d_head]``, as the attention computes them."""
    from attnflow.rows.hook_points import HookPoint, hooks

    recorded: dict[str, torch.Tensor] = {}
    watched = [
        (HookPoint(module), lambda tensor, name=name: recorded.__setitem__(name, tensor.clone()))
        for name, module in model.hf_model.named_modules()
        if name.endswith(("self_attn.q_gate_proj", "self_attn.v_proj"))
    ]
    ids = torch.tensor(model.trace(text)[0].token_ids)[None]
    with hooks(watched), torch.no_grad():
        out = model.hf_model(input_ids=ids, output_attentions=True)
    d = model.d_head
    layers = []
    for layer, weights in enumerate(out.attentions):
        prefix = f"model.layers.{layer}.self_attn"
        query_gate = recorded[f"{prefix}.q_gate_proj"][0].view(-1, model.n_heads, 2 * d)
        gate = torch.sigmoid(query_gate.chunk(2, dim=-1)[1]).double()  # [token, head, d_head]
        values = recorded[f"{prefix}.v_proj"][0].view(ids.shape[1], -1, d).double()  # [token, kv_head, d_head]
        layers.append((weights[0].double(), values, gate))
    return layers


def test_norm_equals_explicit_loops_through_the_models_own_gate(gated):
    projections = [module for _, module in find_layers(gated.hf_model, gated.adapter.stack.output_projection)]
    d, n_heads = gated.d_head, gated.n_heads
    expected = []
    for layer, (attention, values, gate) in enumerate(_own_parts(gated, TEXT)):
        weight = projections[layer].weight.detach().double()  # [d_model, head * d_head]
        group = n_heads // values.shape[1]
        n = values.shape[0]
        matrix = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                vector = sum(
                    attention[h, i, j] * (weight[:, h * d : (h + 1) * d] @ (values[j, h // group] * gate[i, h]))
                    for h in range(n_heads)
                )
                matrix[i, j] = float(vector.norm())
        expected.append(matrix / matrix.sum(axis=1, keepdims=True))
    from attnflow.methods.relevance import norm

    trace = gated.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    np.testing.assert_allclose(norm(trace, layerwise=True), np.stack(expected), atol=1e-5)  # [layer, query, key]
    np.testing.assert_allclose(gated.explain(TEXT, method="norm").scores, expected[-1][-1], atol=1e-5)


def test_the_parts_add_up_to_the_attention_output(gated):
    """Σ_j (what token j adds) + b_O is what the output projection returns, in every layer."""
    assert_parts_add_up(gated, gated.trace(TEXT, needs=("attentions", "values", "output_weights"))[0])


def test_routes_carry_each_head_through_the_factor_per_query(gated):
    """Routes' (head, source) part at query i is A_h[i, j] (D_i^h ⊙ v_h(j)) W_O^h: equal to explicit
    loops through the model's own gate, and the parts plus the output bias rebuild the output
    projection's output to 1e-5 in every layer; the proximities of those per-query parts, from the
    compiled kernel, equal max(‖w‖ − ‖w − part‖, 0) computed directly."""
    from attnflow.flow_routes import contributions as parts
    from attnflow.flow_routes.forward import layer_view, read_weights, record

    ids = torch.tensor(gated.trace(TEXT)[0].token_ids)[None]
    recording, weights = record(gated, ids), read_weights(gated)
    d, n_heads = gated.d_head, gated.n_heads
    for index, (_, values, gate) in enumerate(_own_parts(gated, TEXT)):
        layer = layer_view(recording, weights, index)
        vectors = parts.head_vectors(layer.values, layer.output_weights, layer.factors)
        assert isinstance(vectors, parts.QueryVectors)
        every = vectors.rows(slice(None))  # [query, key, head, d_model]
        weight = gated.hf_model.model.layers[index].self_attn.o_proj.weight.detach().double()
        group = n_heads // values.shape[1]
        for i, j, h in [(3, 1, 0), (8, 8, 3), (5, 0, 2)]:
            expected = weight[:, h * d : (h + 1) * d] @ (values[j, h // group] * gate[i, h])
            np.testing.assert_allclose(every[i, j, h], expected, rtol=1e-5, atol=1e-6)
        summed = torch.einsum("hij,ijhd->id", layer.attention, every) + layer.output_bias
        np.testing.assert_allclose(summed, layer.attention_output, atol=1e-5)
        raw = parts.head_outputs(layer.attention, layer.values, layer.output_weights, layer.factors)
        np.testing.assert_allclose(raw.sum(1) + layer.output_bias, layer.attention_output, atol=1e-5)
        block = parts.linearise_attention(layer.inputs, layer.attention_output, layer.output_bias, None, False)
        for p in parts.NORMS:
            found = parts.head_proximities(layer.mid, block, vectors, layer.attention, p)  # [query, head, key]
            part = layer.attention.permute(1, 2, 0)[..., None] * every  # [query, key, head, d_model]
            direct = parts.proximity(layer.mid[:, None, None], part, p).permute(0, 2, 1)
            np.testing.assert_allclose(found, direct, rtol=1e-9, atol=1e-12)


def test_routes_run_on_factored_rows():
    for model_type in ("afmoe", "granite_swa"):
        routes = attnflow.routes(_tiny(model_type), TEXT)
        assert np.isfinite(routes.graph.heads).all() and routes.graph.heads.sum() > 0


def _logit_relevance(model, rules, hooked=()):
    """``(Σ_j R_j, Σ_b b · ∂̃y/∂b, y, R [token])`` of the last position's logit 7 under ``rules``,
    with ``hooked`` forward hooks ``(module, hook)`` on during the pass."""
    from attnflow.methods.model.lrp import backward_rules

    ids = torch.tensor(model.trace(TEXT)[0].token_ids)[None]
    handles = [module.register_forward_hook(hook) for module, hook in hooked]
    try:
        with backward_rules(model, rules) as recording, torch.enable_grad():
            y = model.hf_model(input_ids=ids).logits[0, -1, 7]
    finally:
        for handle in handles:
            handle.remove()
    outputs = [output for _, output in recording.biased_outputs]
    gradients = torch.autograd.grad(y, [recording.embedding_sum, *outputs], allow_unused=True)
    scores = (recording.embedding_sum * gradients[0]).sum(-1)[0].detach().double().numpy()
    biases = sum(
        float((b * g).sum()) for (b, _), g in zip(recording.biased_outputs, gradients[1:], strict=True) if g is not None
    )
    return float(scores.sum()), biases, float(y.detach()), scores


def test_the_gate_held_constant_is_gradient_times_input_with_the_gate_detached_by_hand():
    """The ``head_factor`` rule alone is gradient × input at the embedding sum with D constant; the
    oracle detaches AFMoE's own ``gate_proj`` output in a forward hook (so sigmoid(gate) is constant)
    and takes the plain gradient × input."""
    from attnflow.methods.model.lrp import BackwardRules, Scale

    model = _tiny("afmoe")
    gates = [module for name, module in model.hf_model.named_modules() if name.endswith("self_attn.gate_proj")]
    assert len(gates) == model.n_layers
    *_, found = _logit_relevance(model, BackwardRules("gate held", "", {"head_factor": Scale(0.0)}))
    detach = [(gate, lambda _m, _i, output: output.detach()) for gate in gates]
    *_, expected = _logit_relevance(model, BackwardRules("plain", ""), detach)
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-7 * np.abs(expected).max())
    *_, plain = _logit_relevance(model, BackwardRules("plain", ""))
    assert not np.allclose(plain, expected, rtol=1e-3)  # the gate's gradient does matter here


@pytest.mark.parametrize("model_type", ["minicpm5_moe", "afmoe", "granite_swa"])
def test_cp_lrp_conserves_through_the_factor(model_type):
    """With every MLP's output zeroed (a forward hook), the logit is embeddings → norms → gated
    attention: cp_lrp holds 1/σ, A and D constant, so Σ_j R_j + Σ_b b · ∂̃y/∂b = y exactly; without
    the ``head_factor`` rule D's gradient breaks it."""
    from attnflow.methods.model.lrp import RULES, BackwardRules

    model = _tiny(model_type)
    mlps = [module for name, module in model.hf_model.named_modules() if re.search(r"layers\.\d+\.mlp$", name)]
    assert len(mlps) == model.n_layers
    zero = [(mlp, lambda _m, _i, output: torch.zeros_like(output)) for mlp in mlps]
    tokens, biases, y, _ = _logit_relevance(model, RULES["cp_lrp"], zero)
    assert tokens + biases == pytest.approx(y, rel=1e-4, abs=1e-6)
    rules = dict(RULES["cp_lrp"].rules)
    del rules["head_factor"]
    tokens, biases, y, _ = _logit_relevance(model, BackwardRules("cp_lrp without", "", rules), zero)
    assert abs(tokens + biases - y) > 1e-3 * abs(y)  # 100 times the tolerance above


@pytest.mark.parametrize("method", ["attnlrp", "gim", "cp_lrp"])
def test_the_backward_rules_run_through_the_factor(gated, method):
    """The rule sets run on a factored row (the query_key rule at the scores, `Values.scores`), each
    sigmoid inside the attention modules held constant once per layer."""
    from attnflow.methods.model.lrp import RULES, backward_rules

    explanation = gated.explain(TEXT, method=method)
    assert explanation.scores.shape == (gated.trace(TEXT)[0].n_tokens,) and np.isfinite(explanation.scores).all()
    assert gated.adapter.values.scores and "query_key" in gated.adapter.provides
    ids = torch.tensor(gated.trace(TEXT)[0].token_ids)[None]
    with backward_rules(gated, RULES[method]) as recording, torch.enable_grad():
        gated.hf_model(input_ids=ids)
    assert recording.head_factors == gated.n_layers


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_factor_of_ones_gives_the_gram_matrices_numbers(tiny_loaded, family):
    """The per-query path (`attention_parts`, the norm after the output projection, the residual
    vector) with D = 1 gives what the Gram-matrix path gives on a family without a factor
    (Gemma 3: a sandwich norm after the output projection; Llama: none)."""
    from attnflow.methods.relevance import norm_matrices

    model = tiny_loaded(family)
    trace = model.trace(TEXT, needs=("attentions", "values", "output_weights", "layer_inputs"))[0]
    assert trace.head_factors is None and (trace.output_norms is not None) == (family == "gemma3")
    expected = [norm_matrices(trace), norm_matrices(trace, residual_vector=True)]
    ones = dataclasses.replace(trace, head_factors=np.ones_like(trace.values))
    found = [norm_matrices(ones), norm_matrices(ones, residual_vector=True)]
    for got, want in zip(found, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    halves = dataclasses.replace(trace, head_factors=np.full_like(trace.values, 0.5))
    assert not np.allclose(norm_matrices(halves, residual_vector=True), expected[1])  # the factor is read


@pytest.mark.parametrize("model_type", ["hy_v4", "axk2"])
def test_latent_values_times_a_gate_are_found_and_their_parts_add_up(model_type):
    """Multi-head latent attention whose heads are then gated (HY-V4, with a sink, and AXK2): the
    values are kv_b_proj's value columns with a per-position factor, and Σ_j (what token j adds)
    + b_O is what the model's own output projection returns."""
    model = _tiny(model_type)
    row = model.adapter
    (fused,) = row.fused
    assert fused.module.endswith(r"kv_b_proj$") and "value" in fused.parts and row.values.head_factor
    assert "values" in row.provides and not any(failure.startswith("head_factor") for failure in row.unverified)
    trace = model.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    assert_parts_add_up(model, trace)


def test_layers_with_different_key_value_head_counts_give_every_head_its_values():
    """MiMo-V2-Flash: local layers have other key/value head counts than global ones, and V is
    scaled by a constant (a factor); each layer's values are shared out to the query heads on
    their own, and Σ_j (what token j adds) + b_O is the model's own output projection's output."""
    model = _tiny("mimo_v2_flash")
    widths = {module.out_features for _, module in find_layers(model.hf_model, model.adapter.values.value)}
    assert len(widths) > 1 and "values" in model.adapter.provides  # the tiny model has both kinds of layer
    trace = model.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    assert_parts_add_up(model, trace)


class _Ones(torch.nn.Module):
    """An expert activation replaced by ones: act(gate) · up = up, so each expert is linear in x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x)


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe", "qwen2_moe"])
def test_cp_lrp_conserves_through_the_router_held_constant(model_type):
    """The MoE router's weights (and Qwen2-MoE's shared-expert gate) are gates held constant, the
    choice fixed (``router``). With the experts made linear (their activation replaced by ones),
    cp_lrp's logit is linear in the embedding sum and the biases: Σ_j R_j + Σ_b b · ∂̃y/∂b = y to
    1e-4; with the router's gradient left on it misses by more than 1e-2."""
    from attnflow.methods.model.lrp import RULES, BackwardRules

    model = _tiny(model_type)
    activations = [module for module in model.hf_model.modules() if hasattr(module, "act_fn")]
    assert activations and model.adapter.experts is not None
    for module in activations:
        module.act_fn = _Ones()
    tokens, biases, y, _ = _logit_relevance(model, RULES["cp_lrp"])
    assert tokens + biases == pytest.approx(y, rel=1e-4, abs=1e-6)
    rules = dict(RULES["cp_lrp"].rules)
    del rules["router"]
    tokens, biases, y, _ = _logit_relevance(model, BackwardRules("cp_lrp without", "", rules))
    assert abs(tokens + biases - y) > 1e-2 * abs(y)


def test_a_softplus_gate_is_held_and_a_factor_made_otherwise_is_refused_in_one_line():
    """Laguna's gate is softplus(g_proj(x)): held constant once per layer, as a sigmoid is. MiMo-V2-
    Flash's factor is made by neither: the rules say so in one line rather than leave it on the
    gradient's path, and routes refuse its layers of two value widths in one line."""
    from attnflow.errors import CaptureError
    from attnflow.methods.model.lrp import RULES, backward_rules

    laguna = _tiny("laguna")
    ids = torch.tensor(laguna.trace(TEXT)[0].token_ids)[None]
    with backward_rules(laguna, RULES["attnlrp"]) as recording, torch.enable_grad():
        laguna.hf_model(input_ids=ids)
    assert recording.head_factors == laguna.n_layers
    mimo = _tiny("mimo_v2_flash")
    with pytest.raises(CaptureError, match=r"^the mimo_v2_flash row's head factor .* not a sigmoid or softplus"):
        mimo.explain(TEXT, method="attnlrp")
    with pytest.raises(CaptureError, match=r"value projections differ in width \(32, 64\)"):
        attnflow.routes(mimo, TEXT)
