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
