"""`context_similarity` against an explicit loop over layers and heads (docs/methods.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnflow import Trace, context_similarity

N_LAYERS, N_TOKENS, N_HEADS, D_HEAD, D_MODEL = 2, 6, 3, 4, 12


def head_outputs(seed: int = 0, batch: int | None = None) -> np.ndarray:
    shape = (N_LAYERS, N_TOKENS, N_HEADS, D_HEAD)  # [layer, token, head, d_head]
    return np.random.default_rng(seed).normal(size=shape if batch is None else (batch, *shape))


def output_weights(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(N_LAYERS, N_HEADS, D_HEAD, D_MODEL))


def loop_similarity(z: np.ndarray, w_o: np.ndarray | None = None) -> np.ndarray:
    """Oracle: one matrix at a time, ``z`` ``[layer, token, head, d_head]`` -> ``[layer, head, n, n]``."""
    n_layers, n, n_heads, _ = z.shape
    out = np.zeros((n_layers, n_heads, n, n))
    for layer in range(n_layers):
        for head in range(n_heads):
            vectors = z[layer, :, head, :]  # [token, d_head]
            if w_o is not None:
                vectors = vectors @ w_o[layer, head]  # the head's slice of the output projection
            for i in range(n):
                for j in range(n):
                    out[layer, head, i, j] = 0.0 if i == j else float(vectors[i] @ vectors[j])
    return out


def test_head_space_equals_loop():
    z = head_outputs()
    similarity = context_similarity(z)
    assert similarity.shape == (N_LAYERS, N_HEADS, N_TOKENS, N_TOKENS)
    np.testing.assert_allclose(similarity, loop_similarity(z), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(similarity, np.swapaxes(similarity, -1, -2))
    assert np.all(np.diagonal(similarity, axis1=-2, axis2=-1) == 0)


def test_projected_space_equals_each_heads_slice_of_w_o():
    z, w_o = head_outputs(), output_weights()
    similarity = context_similarity(z, space="projected", output_weights=w_o)
    np.testing.assert_allclose(similarity, loop_similarity(z, w_o), rtol=1e-10, atol=1e-10)
    # The projected space differs from the head space unless W_O is orthonormal.
    assert not np.allclose(similarity, context_similarity(z))


def test_batched_equals_each_sample():
    z = head_outputs(batch=3)
    similarity = context_similarity(z)
    assert similarity.shape == (3, N_LAYERS, N_HEADS, N_TOKENS, N_TOKENS)
    for b in range(3):
        np.testing.assert_allclose(similarity[b], loop_similarity(z[b]), rtol=1e-12, atol=1e-12)
    w_o = output_weights()
    projected = context_similarity(z, space="projected", output_weights=w_o)
    np.testing.assert_allclose(projected[1], loop_similarity(z[1], w_o), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_in_torch_out(dtype):
    z = head_outputs(batch=2)
    similarity = context_similarity(torch.as_tensor(z, dtype=dtype))
    assert isinstance(similarity, torch.Tensor) and similarity.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 1e-4
    np.testing.assert_allclose(similarity.numpy(), context_similarity(z), rtol=tolerance, atol=tolerance)
    projected = context_similarity(
        torch.as_tensor(z, dtype=dtype), space="projected", output_weights=torch.as_tensor(output_weights())
    )
    assert projected.dtype == dtype
    np.testing.assert_allclose(
        projected.numpy(),
        context_similarity(z, space="projected", output_weights=output_weights()),
        rtol=tolerance * 10,
        atol=tolerance * 10,
    )


def test_trace_input_uses_its_head_outputs_and_output_weights():
    z, w_o = head_outputs().astype(np.float32), output_weights().astype(np.float32)
    attentions = np.full((N_LAYERS, N_HEADS, N_TOKENS, N_TOKENS), 1.0 / N_TOKENS, dtype=np.float32)
    trace = Trace(
        tokens=[f"t{i}" for i in range(N_TOKENS)],
        token_ids=np.arange(N_TOKENS),
        offsets=np.zeros((N_TOKENS, 2), dtype=np.int64),
        special_mask=np.zeros(N_TOKENS, dtype=bool),
        attentions=attentions,
        head_outputs=z,
        output_weights=w_o,
    )
    np.testing.assert_allclose(context_similarity(trace), loop_similarity(z.astype(np.float64)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        context_similarity(trace, space="projected"),
        loop_similarity(z.astype(np.float64), w_o.astype(np.float64)),
        rtol=1e-5,
        atol=1e-5,
    )
    trace.head_outputs = None
    with pytest.raises(ValueError, match="no head_outputs"):
        context_similarity(trace)


def test_errors():
    z = head_outputs()
    with pytest.raises(ValueError, match="space"):
        context_similarity(z, space="cosine")
    with pytest.raises(ValueError, match="output_weights"):
        context_similarity(z, space="projected")
    with pytest.raises(ValueError, match="output_weights must be"):
        context_similarity(z, space="projected", output_weights=np.zeros((N_LAYERS, N_HEADS + 1, D_HEAD, D_MODEL)))
    with pytest.raises(ValueError, match="head_outputs must be"):
        context_similarity(z[0])


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**16), st.permutations(range(N_TOKENS)))
def test_permuting_tokens_permutes_the_matrix(seed, order):
    z = head_outputs(seed)
    order = np.array(order)
    permuted = context_similarity(z[:, order])
    np.testing.assert_allclose(permuted, context_similarity(z)[..., order[:, None], order[None, :]], atol=1e-12)
