"""Values split into heads before a module that returns them ``[batch, token, kv_heads, d_head]``
(`Values.per_head`): Gemma 3n's weightless per-head RMS ``v_norm`` after ``v_proj``. Inference finds
them, the conformance suite proves A·V per head, and the value-aware methods read them. The oracle
is the model's own ``v_proj`` output, RMS-normalised per head by hand, and loops over the definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnflow.rows import check_adapter
from attnflow.rows.adapters import find_layers, token_rows
from inferred_tiny import norm_by_loops, recorded_outputs, tiny_inferred

TEXT = "the movie was great but the acting"


@pytest.fixture(scope="module")
def normed():
    """A tiny Gemma 3n text model: its values are v_norm(v_proj(x)) per head."""
    return tiny_inferred("gemma3n_text")


def test_the_per_head_values_are_found_and_proven(normed):
    row = normed.adapter
    assert row.values.per_head and row.values.value.endswith(r"self_attn\.v_norm$") and not row.values.head_factor
    assert row.values.query.endswith(r"q_proj$") and row.values.key.endswith(r"k_proj$")
    assert {"values", "query_key"} <= row.provides and not row.unverified
    report = check_adapter(row, normed.hf_model, strict=False)
    assert report.outcome("head_slices") == "pass" and report.outcome("head_factor") == "n/a"


def test_token_rows_flattens_split_heads_as_a_view():
    output = torch.zeros(1, 3, 2, 4)  # [batch, token, head, d_head]
    rows = token_rows(output, heads=True)
    rows[0, 1, 5] = 1.0
    assert rows.shape == (1, 3, 8) and output[0, 1, 1, 1] == 1.0
    assert token_rows(torch.zeros(1, 1, 3, 8)).shape == (1, 3, 8)  # latent attention's [batch, 1, token, width]


def _own_values(model, ids):
    """Per layer ``[token, kv_head, d_head]``: v_proj's output, divided per head by its RMS by hand."""
    recorded, out = recorded_outputs(model, ids, "self_attn.v_proj")
    eps = model.hf_model.config.rms_norm_eps
    layers = []
    for layer, weights in enumerate(out.attentions):
        raw = recorded[f"model.layers.{layer}.self_attn.v_proj"][0].double().view(ids.shape[1], -1, model.d_head)
        values = raw / torch.sqrt(raw.pow(2).mean(dim=-1, keepdim=True) + eps)
        layers.append((weights[0].double(), values))
    return layers


def test_norm_equals_explicit_loops_over_the_hand_normalised_values(normed):
    from attnflow.methods.relevance import norm

    trace = normed.trace(TEXT, needs=("attentions", "values", "output_weights"))[0]
    ids = torch.tensor(trace.token_ids)[None]
    projections = [module for _, module in find_layers(normed.hf_model, normed.adapter.stack.output_projection)]
    expected = [
        norm_by_loops(attention, values, projections[layer].weight.detach().double())
        for layer, (attention, values) in enumerate(_own_values(normed, ids))
    ]
    np.testing.assert_allclose(norm(trace, layerwise=True), np.stack(expected), atol=1e-5)  # [layer, query, key]
