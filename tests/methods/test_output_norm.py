"""Value-aware methods through a norm after the output projection (Gemma 2/3's sandwich norm,
OLMo-2's post-norm), against an oracle that knows nothing of the norm's form: the model's own
tensors recorded by plain hooks (the value projection's output, the output projection's weight, the
attention weights, the norm's real input y_i and output out_i), and token j's part through head h
computed in loops as A[h,i,j] v_j^h W_O^h ⊙ out_i / y_i (an RMS norm with its statistic fixed
multiplies by g / rms(y_i) = out_i / y_i). The parts are checked to add up to the norm's real
output before they serve as the oracle of `norm_matrices`, `norm` and ``norm_rollout``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnflow
from attnflow.methods.relevance import norm_matrices
from attnflow.rows.adapters import find_layers

TEXT = "the movie was terrible, but the acting was great."
VALUE_NEEDS = ("values", "output_weights", "layer_inputs")


def _recorded(model, text):
    """Per layer: the value projection's output ``[token, width]``, the output norm's input and
    output and the block's input ``[token, d_model]``, and the attention weights ``[head, q, k]``."""
    row = model.adapter
    points = {
        "values": row.values.value,
        "norm_in": row.values.output_norm,
        "norm_out": row.values.output_norm,
        "block_in": row.values.block,
    }
    seen: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for what, pattern in points.items():
        for layer, (_, module) in enumerate(find_layers(model.model, pattern)):

            def hook(_module, args, output, what=what, layer=layer):
                tensor = args[0] if what in ("norm_in", "block_in") else output
                seen[(what, layer)] = (tensor[0] if isinstance(tensor, tuple) else tensor)[0].detach().double()

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            ids = torch.tensor(model.trace(text)[0].token_ids)[None]
            out = model.model(input_ids=ids, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    attentions = [weights[0].double() for weights in out.attentions]
    return seen, attentions


def _oracle(model, text, residual_vector=False):
    """``[layer, query, key]`` ‖c_ij (+ δ_ij x_i)‖ from explicit loops, c_ij summing to the norm's output."""
    seen, attentions = _recorded(model, text)
    projections = [module for _, module in find_layers(model.model, model.adapter.stack.output_projection)]
    n_heads, d_head = model.n_heads, model.d_head
    result = []
    for layer, attention in enumerate(attentions):
        weight = projections[layer].weight.detach().double()  # [d_model, head * d_head]
        values = seen[("values", layer)]  # [token, kv_heads * d_head]
        group = n_heads // (values.shape[1] // d_head)
        y, out, inputs = seen[("norm_in", layer)], seen[("norm_out", layer)], seen[("block_in", layer)]
        n = y.shape[0]
        multiplier = out / y  # [token, d_model]: g / rms(y_i)
        matrix = np.zeros((n, n))
        for i in range(n):
            total = torch.zeros_like(out[i])
            for j in range(n):
                part = torch.zeros_like(out[i])
                for h in range(n_heads):
                    kv = h // group
                    head_value = values[j, kv * d_head : (kv + 1) * d_head]
                    part += attention[h, i, j] * (weight[:, h * d_head : (h + 1) * d_head] @ head_value)
                contribution = part * multiplier[i]
                total += contribution
                if residual_vector and i == j:
                    contribution = contribution + inputs[i]
                matrix[i, j] = float(contribution.norm())
            torch.testing.assert_close(total, out[i], rtol=1e-4, atol=1e-4 * float(out[i].abs().max()))
        result.append(matrix)
    return np.stack(result)


@pytest.fixture(params=["gemma3", "gemma2", "olmo2"])
def output_norm_model(request, tiny_loaded, variant_loaded):
    """The tiny Gemma 3 (hand row), Gemma 2 and OLMo-2 (the tests' rows, tests/variant_rows.py)."""
    model = tiny_loaded("gemma3") if request.param == "gemma3" else variant_loaded(request.param)
    assert model.adapter.values.output_norm is not None
    return model


@pytest.mark.parametrize("residual_vector", [False, True])
def test_norms_through_the_output_norm_equal_explicit_loops(output_norm_model, residual_vector):
    model = output_norm_model
    assert "values" in model.adapter.provides
    trace = model.trace(TEXT, needs=VALUE_NEEDS)[0]
    assert trace.output_norms is not None and trace.output_norms["kind"] == "rms"
    expected = _oracle(model, TEXT, residual_vector)
    found = norm_matrices(trace, residual_vector=residual_vector)
    np.testing.assert_allclose(found, expected, rtol=1e-4, atol=1e-6 * expected.max())


def test_norm_and_norm_rollout_read_the_output_norm(output_norm_model):
    model = output_norm_model
    normalised = [m / m.sum(axis=1, keepdims=True) for m in _oracle(model, TEXT)]
    np.testing.assert_allclose(model.explain(TEXT, method="norm").scores, normalised[-1][-1], atol=1e-5)
    trace = model.trace(TEXT, needs=VALUE_NEEDS)[0]
    np.testing.assert_allclose(attnflow.norm(trace, layer=0), normalised[0], atol=1e-5)
    residual = [m / m.sum(axis=1, keepdims=True) for m in _oracle(model, TEXT, residual_vector=True)]
    np.testing.assert_allclose(attnflow.norm_rollout(trace, residual="norm"), residual[1] @ residual[0], atol=1e-5)


def test_an_output_norm_without_a_declared_form_refuses_the_values(tiny_loaded):
    """The norm's form comes from the row's `Norms`: without it, no value-aware method."""
    import dataclasses

    row = dataclasses.replace(tiny_loaded("gemma3").adapter, norms=None)
    assert "values" not in row.provides
    assert "values" in dataclasses.replace(row, values=dataclasses.replace(row.values, output_norm=None)).provides


@pytest.mark.slow
def test_gemma3_270m_norm_equals_explicit_loops():
    """Real weights: the embedded gemma3-270m (18 layers, 4 heads, 1 key/value head), three layers."""
    model = attnflow.load("gemma3-270m", device="cpu")
    text = "The capital of France is"
    trace = model.trace(text, needs=VALUE_NEEDS)[0]
    expected = _oracle(model, text)
    found = norm_matrices(trace)
    for layer in (0, model.n_layers // 2, model.n_layers - 1):
        np.testing.assert_allclose(found[layer], expected[layer], rtol=1e-3, atol=1e-5 * expected[layer].max())
