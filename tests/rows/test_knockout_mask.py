"""Attention knockout where the model's attention mask is not the usual additive ``[batch, 1, query,
key]`` one: a padding mask broadcast over the queries (``[batch, 1, 1, key]``: GPT-1 applies its
causal mask from a buffer of its own), or a boolean mask whose True means "masked" (MPT's, filled
with the dtype's minimum by ``masked_fill``). The oracle is the softmax itself: blocking key 0 of the
last query zeroes that weight and divides the query's other weights by 1 − its old weight; every
other query is untouched."""

from __future__ import annotations

import pytest
import torch

import attnflow
from attnflow.errors import InputError
from attnflow.rows import check_adapter
from attnflow.rows.adapters import find_layers
from attnflow.rows.hook_points import HookPoint, hooks
from attnflow.rows.infer import verified_row
from attnflow.rows.site_kinds import SITE_KIND_ROWS, Write
from attnflow.rows.tiny import model_class, randomise_constants, tiny_config, tiny_tokenizer


@pytest.mark.parametrize("model_type", ["openai-gpt", "mpt"])
def test_knockout_blocks_one_edge_whatever_the_mask_form(model_type):
    torch.manual_seed(0)
    hf_model = model_class(model_type, "causal-lm")._from_config(tiny_config(model_type), attn_implementation="eager")
    randomise_constants(hf_model)
    hf_model.eval()
    row = verified_row(hf_model, "decoder")
    assert not row.unverified and {"sites", "streams"} <= row.provides
    assert check_adapter(row, hf_model, strict=False).outcome("knockout") == "pass"

    model = attnflow.AttentionModel(hf_model, tiny_tokenizer(), name=f"tiny {model_type}", adapter=row)
    ids = model.tokenizer("the movie was great but the acting", return_tensors="pt")["input_ids"]
    last = ids.shape[1] - 1
    kind = SITE_KIND_ROWS["knockout"]
    modules = [module for _, module in find_layers(hf_model, kind.pattern(row))]
    block = Write(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), None, last)
    seen: list[torch.Tensor] = []
    with torch.no_grad():
        before = hf_model(input_ids=ids, output_attentions=True).attentions[0][0]  # [head, query, key]
        knocked = [(kind.hook_points(modules)[0], lambda mask, first: kind.write(mask, [block], model.n_heads, first))]
        weights = [(HookPoint(modules[0], "output", index=row.stack.weights_index), seen.append)]
        with hooks(knocked + weights):
            hf_model(input_ids=ids, output_attentions=True)
    after = seen[0][0]
    assert torch.equal(after[:, last, 0], torch.zeros_like(after[:, last, 0]))
    expected = before[:, last, 1:] / (1 - before[:, last, :1])
    torch.testing.assert_close(after[:, last, 1:], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after[:, :last], before[:, :last])


@pytest.mark.parametrize("masked", [False, True], ids=["true-keeps", "true-masks"])
def test_a_boolean_mask_gets_the_blocked_value_of_its_own_convention(masked):
    """Hand-computed: a causal boolean mask ``[1, 1, 4, 4]`` in either convention (True kept, as
    torch's scaled_dot_product_attention reads it; True masked, as MPT's ``masked_fill``) has only
    the blocked edge (query 3, key 1) flipped to the convention's "masked" value; blocking the one
    key query 0 reads is refused."""
    kind = SITE_KIND_ROWS["knockout"]
    visible = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]  # [batch, 1, query, key]
    mask = ~visible if masked else visible
    hidden = torch.zeros(1, 4, 8)  # [batch, token, d_model]
    written = kind.write(mask, [Write(torch.tensor([0]), torch.tensor([1]), None, 3)], 2, hidden)
    expected = mask.clone()
    expected[0, 0, 3, 1] = masked
    assert written.dtype == torch.bool and torch.equal(written, expected)
    assert torch.equal(mask, ~visible if masked else visible)  # the model's own mask is untouched
    with pytest.raises(InputError, match="no key to read"):
        kind.write(mask, [Write(torch.tensor([0]), torch.tensor([0]), None, 0)], 2, hidden)
