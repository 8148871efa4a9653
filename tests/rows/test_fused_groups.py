"""A fused q/k/v projection cut into a fixed number of groups, each holding its share of every
part's heads, in an order other than q, k, v (`Fused.groups`): CodeGen's ``qkv_proj``, viewed as 4
model-parallel shards of (query, value, key). Inference finds the layout, the order and the groups
from A·V; the oracle is CodeGen's own split of the projection, written out by hand."""

from __future__ import annotations

import pytest
import torch

from attnflow.rows import check_adapter
from attnflow.rows.adapters import Fused
from attnflow.rows.hook_points import HookPoint, hooks
from inferred_tiny import tiny_inferred

TEXT = "the movie was great but the acting"
SHARDS = 4  # CodeGen's mp_num, written in its attention


@pytest.fixture(scope="module")
def codegen():
    """A tiny CodeGen with 8 heads, so that its 4 shards are neither one head each nor one group."""
    return tiny_inferred("codegen", n_head=8)


def test_the_groups_and_the_order_are_found_and_proven(codegen):
    (fused,) = codegen.adapter.fused
    assert (fused.parts, fused.layout, fused.groups) == (("query", "value", "key"), "per_group", SHARDS)
    assert {"values", "query_key"} <= codegen.adapter.provides and not codegen.adapter.unverified
    assert check_adapter(codegen.adapter, codegen.hf_model, strict=False).outcome("head_slices") == "pass"


def test_the_value_columns_are_codegens_own_split(codegen):
    """What the trace reads as values is CodeGen's value: per shard, the middle third of its features."""
    seen: dict[str, torch.Tensor] = {}
    projection = codegen.hf_model.transformer.h[0].attn.qkv_proj
    trace = codegen.trace(TEXT, needs=("attentions", "values"))[0]
    ids = torch.tensor(trace.token_ids)[None]
    with hooks([(HookPoint(projection), lambda tensor: seen.__setitem__("qkv", tensor.clone()))]), torch.no_grad():
        codegen.hf_model(input_ids=ids)
    local = codegen.hf_model.config.n_embd // SHARDS
    shards = seen["qkv"][0].view(ids.shape[1], SHARDS, 3 * local)  # [token, shard, q | v | k]
    value = shards[..., local : 2 * local].reshape(ids.shape[1], codegen.n_heads, codegen.d_head)
    torch.testing.assert_close(torch.as_tensor(trace.values[0]).float(), value, rtol=1e-5, atol=1e-6)


def test_groups_need_the_per_group_layout():
    with pytest.raises(ValueError, match="per_group"):
        Fused("x", ("query", "key", "value"), "per_head", groups=4)
