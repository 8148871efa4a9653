"""The ``experts`` site kind: one expert's part of a mixture of experts' output per (layer, expert,
position). Patching it equals a hand-written hook that replaces that part in the MoE block's
output directly; its own value changes nothing (the conformance suite's ``own_value``)."""

from __future__ import annotations

import pytest
import torch

from attnflow.causal import patch
from attnflow.causal.patching import Metric, Patches, PatchRunner, site_value, stacked
from attnflow.causal.sites import Site
from attnflow.errors import InputError
from attnflow.rows import check_adapter

from tiny_models import MOE_FAMILIES

CLEAN, CORRUPT = "the cat sat on the mat", "the dog ran on the mat"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_rows_pass_the_conformance_suite(tiny_moe, family):
    model = tiny_moe(family)
    assert {"own_value", "residual_sum"} <= check_adapter(model.adapter, model).passed


def expert_part(block: torch.nn.Module, x: torch.Tensor, expert: int, shared: bool) -> torch.Tensor:
    """``[T, d]`` expert ``expert``'s part of ``block``'s output on ``x [T, d]``, from the model's own
    router and experts module (the shared expert and its gate when ``shared``)."""
    with torch.no_grad():
        if shared:
            return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        _, weights, indices = block.gate(x)
        chosen = indices == expert  # [T, k]
        slot = chosen.int().argmax(dim=1, keepdim=True)  # [T, 1]
        alone = block.experts(x, indices.gather(1, slot), torch.ones_like(weights[:, :1]))
        return alone * (weights * chosen).sum(dim=1, keepdim=True)


def by_hand(model, ids: torch.Tensor, layer: int, expert: int, new: torch.Tensor, position: int | None) -> torch.Tensor:
    """log p(target) at the last position with the part replaced by a hook of our own."""
    block = model.hf_model.model.layers[layer].mlp
    shared = expert == block.experts.num_experts

    def replace(_module, args, output):
        old = expert_part(block, args[0][0], expert, shared)
        changed = (
            new - old
            if position is None
            else torch.zeros_like(old).index_copy(0, torch.tensor([position]), (new - old[position])[None])
        )
        return output + changed[None]

    handle = block.register_forward_hook(replace)
    try:
        with torch.no_grad():
            logits = model.hf_model(input_ids=ids).logits
    finally:
        handle.remove()
    return torch.log_softmax(logits[0, -1], dim=-1)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_patching_an_expert_equals_replacing_its_part_by_hand(tiny_moe, family):
    model = tiny_moe(family)
    tokenise = lambda text: model.tokenizer(text, return_tensors="pt")["input_ids"]  # noqa: E731
    clean, corrupt = tokenise(CLEAN), tokenise(CORRUPT)
    target = int(clean[0, -1])
    runner = PatchRunner(model, Metric("next_token", target))
    _, recorded = runner.forward(clean, 1, record=True)
    source = stacked(recorded)
    assert source["experts"].shape == (1, 2, clean.shape[1], runner.modules.n_experts, 32)
    clean_inputs = []
    hook = model.hf_model.model.layers[1].mlp.register_forward_hook(lambda _m, a, _o: clean_inputs.append(a[0][0]))
    try:
        with torch.no_grad():
            model.hf_model(input_ids=clean)
    finally:
        hook.remove()
    block = model.hf_model.model.layers[1].mlp
    for expert in range(runner.modules.n_experts):
        shared = expert == block.experts.num_experts
        for position in (None, 2):
            site = Site("experts", 1, expert, position)
            value = site_value(source, 0, site, model.n_heads)
            new = expert_part(block, clean_inputs[0], expert, shared)
            torch.testing.assert_close(value, new if position is None else new[position], rtol=1e-5, atol=1e-6)
            patches = Patches()
            patches.add(0, site, value)
            with torch.no_grad():
                metric, _ = runner.forward(corrupt, 1, patches=patches)
            expected = by_hand(model, corrupt, 1, expert, new if position is None else new[position], position)
            assert float(metric[0]) == pytest.approx(float(expected[target]), abs=1e-5)


@pytest.mark.filterwarnings("ignore::attnflow.errors.PatchingWarning")  # a tiny random model prefers no target
def test_an_experts_sweep_and_a_row_without_experts(tiny_moe, tiny_loaded):
    result = patch(tiny_moe("qwen2_moe"), CLEAN, CORRUPT, sites="experts", progress=False)
    effects = result.effects["exact"]["experts"]
    assert effects.shape == (2, 5) and torch.isfinite(torch.as_tensor(effects)).all()  # 4 experts + the shared one
    with pytest.raises(InputError) as error:
        patch(tiny_loaded("llama"), CLEAN, CORRUPT, sites="experts", progress=False)
    assert "no experts sites" in str(error.value) and "\n" not in str(error.value)
