"""`attnflow.rows.experts`: `find_experts` infers a mixture of experts' row from its module and one
traced call, for every MoE family of transformers 5.25 tried here; each expert's output computed
from the fused parameters matches the model's own experts module run on that expert alone."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as T

from attnflow.rows.experts import contributions, find_experts, slots
from attnflow.rows.hook_points import output_tensor
from attnflow.rows.tiny import randomise_constants

from tiny_models import MOE_FAMILIES, moe_row

BLOCK = r"layers\.(\d+)\.(mlp|block_sparse_moe)$"
SMALL = dict(
    vocab_size=160,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=24,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
# Families with no tiny model saved here, built in the test: what find_experts must read in each.
OTHER_FAMILIES = {
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=16, head_dim=8),
    "granitemoe": lambda: T.GraniteMoeConfig(**SMALL, num_local_experts=4),
    "deepseek_v3": lambda: T.DeepseekV3Config(
        **SMALL,
        n_routed_experts=4,
        moe_intermediate_size=16,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    ),
    "gpt_oss": lambda: T.GptOssConfig(**SMALL, num_local_experts=4, head_dim=8, layer_types=["full_attention"]),
}


def hidden(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(seed))


def first_block(model: torch.nn.Module) -> torch.nn.Module:
    return next(
        module for name, module in model.named_modules() if re.search(r"layers\.0\.(mlp|block_sparse_moe)$", name)
    )


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_find_experts_gives_the_hand_row(tiny_moe, family):
    row = moe_row(family).experts
    assert find_experts(row.block, first_block(tiny_moe(family).hf_model), hidden()) == row


def built(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(OTHER_FAMILIES[family](), attn_implementation="eager").eval()
    randomise_constants(model)
    return model


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_find_experts_reads_other_families(family):
    block = first_block(built(family))
    row = find_experts(BLOCK, block, hidden())
    assert row is not None
    x = hidden(seed=2)  # another input than the traced one
    with torch.no_grad():
        assert torch.allclose(contributions(row, block, x).sum(dim=2), output_tensor(block(x)), atol=1e-6)
    expected = {  # what the source of each family says
        "qwen3_moe": dict(router="gate", transposed=False, bias=False, shared=None),
        "granitemoe": dict(router="router", transposed=False, bias=False, shared=None),
        "deepseek_v3": dict(router="gate", transposed=False, bias=False, shared="shared_experts", shared_gate=None),
        "gpt_oss": dict(router="router", transposed=True, bias=True, shared=None),
    }[family]
    assert {name: getattr(row, name) for name in expected} == expected


def test_a_plain_mlp_is_not_a_mixture(tiny_loaded):
    assert find_experts(BLOCK, first_block(tiny_loaded("llama").hf_model), hidden()) is None


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_expert_is_the_models_own_experts_module_run_on_it_alone(tiny_moe, family):
    """Oracle: the experts module's own forward, given one slot of the routing and the weight 1."""
    block = first_block(tiny_moe(family).hf_model)
    row = moe_row(family).experts
    x = hidden().reshape(-1, 32)
    with torch.no_grad():
        found = slots(row, block, x)
        for slot in range(found.indices.shape[1]):
            alone = block.experts(x, found.indices[:, slot : slot + 1], torch.ones_like(found.weights[:, :1]))
            torch.testing.assert_close(found.outputs[:, slot], alone, rtol=1e-5, atol=1e-6)
