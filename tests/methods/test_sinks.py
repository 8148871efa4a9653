"""Attention sinks (GPT-OSS): rows over the real tokens sum to 1 − s; the methods that read rows
summing to 1 count the sink's share s on the diagonal (docs/methods.md, "Attention sinks"). The
oracle is the model's own weights (transformers' forward with ``output_attentions``), with the
share put on the diagonal and the rollout product written out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnflow.errors import ExplanationWarning, InputError
from attnflow.methods.transforms import validate_attentions

TEXT = "the cat sat on the mat"


def test_rollout_counts_each_rows_sink_share_on_its_diagonal(variant_loaded):
    model = variant_loaded("gpt_oss")
    with pytest.warns(ExplanationWarning, match="sinks"):
        explanation = model.explain(TEXT, method="rollout")
    ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        own = model.hf_model(input_ids=ids, output_attentions=True).attentions  # L × [1, head, q, k]
    expected = np.eye(ids.shape[1])
    shares = []
    for weights in own:
        fused = weights[0].double().mean(dim=0).numpy()  # [q, k] the heads' mean
        share = 1.0 - fused.sum(axis=-1)  # [q] the sink's share of each row
        shares.append(share)
        moved = fused + np.diag(share)
        expected = 0.5 * (moved + np.eye(len(share))) @ expected
    assert max(float(share.max()) for share in shares) > 0.05  # the sinks hold a real share
    np.testing.assert_allclose(explanation.matrix, expected, atol=1e-5)
    np.testing.assert_allclose(explanation.matrix.sum(axis=-1), 1.0, atol=1e-5)
    assert any("sinks" in note and "diagonal" in note for note in explanation.notes)


def test_a_row_summing_below_one_is_reported_with_its_own_sum():
    weights = np.full((1, 1, 2, 2), 0.2)  # rows sum to 0.4
    with pytest.raises(InputError, match=r"sums to 0\.4 off by 0\.6"):
        validate_attentions(weights)
