"""Sites of a block whose attention site is a norm after the output projection while inference finds
no value vectors: AFMoE gates the heads by sigmoid(gate_proj(x)) before ``o_proj`` (so A·V alone is
not the projection's input) and norms the projection's output (``post_attention_layernorm``) before
the residual addition. The projection's output is not the attention site there, so the residual sum
alone proves the sites (before, the row lost them and patching was refused). The oracle is the
model's own forward: block output = block input + attention site + MLP site read with plain hooks,
and restoring the clean attention site of the last layer at the last position in the corrupted run,
by hand, gives the metric `attnflow.patch` reports for that site."""

from __future__ import annotations

import pytest
import torch

import attnflow
from attnflow.causal import patch
from attnflow.rows.adapters import find_layers
from attnflow.rows.hook_points import HookPoint, hooks
from attnflow.rows.tiny import build_tiny

CLEAN, CORRUPT = "the cat sat on the mat", "the dog sat on the mat"  # equal token lengths


@pytest.fixture(scope="module")
def afmoe(tmp_path_factory):
    return attnflow.load(str(build_tiny("afmoe", tmp_path_factory.mktemp("afmoe"))), device="cpu")


def _outputs(model, ids: torch.Tensor, patterns: dict[str, str]) -> dict[str, list[torch.Tensor]]:
    """Each pattern's modules' outputs (``"in"``: the block's first input) in one plain forward."""
    seen: dict[str, list[torch.Tensor]] = {what: [] for what in patterns}
    hooked = []
    for what, pattern in patterns.items():
        side = "input" if what == "in" else "output"
        for _, module in find_layers(model.hf_model, pattern):
            hooked.append((HookPoint(module, side), lambda tensor, what=what: seen[what].append(tensor.clone())))
    with hooks(hooked), torch.no_grad():
        model.hf_model(input_ids=ids)
    return seen


def test_the_sites_after_an_unproven_projection_are_kept_and_patch_like_the_model(afmoe):
    row = afmoe.adapter
    assert row.inferred and row.values is None  # the gated heads: no value vectors proven
    assert "sites" in row.provides and row.streams is not None and not row.unverified
    assert not row.stack.output_projection.startswith(row.sites.attention[:-1])  # the site is not o_proj's
    ids = afmoe.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    seen = _outputs(
        afmoe,
        ids,
        {"in": row.sites.block, "out": row.sites.block, "attn": row.sites.attention, "mlp": row.sites.mlp},
    )
    for before, after, attention, mlp in zip(seen["in"], seen["out"], seen["attn"], seen["mlp"], strict=True):
        torch.testing.assert_close(after, before + attention + mlp, rtol=1e-5, atol=1e-5)

    result = patch(afmoe, CLEAN, CORRUPT, sites="residual,attn", methods="exact", progress=False)
    last, layer = len(result.tokens) - 1, afmoe.n_layers - 1
    assert result.effects["exact"]["residual"][afmoe.n_layers, last] == pytest.approx(1.0, abs=1e-5)

    corrupt = afmoe.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    clean_site = seen["attn"][layer]  # [1, token, d_model]
    with torch.no_grad():
        clean_logits = afmoe.hf_model(input_ids=ids).logits[0, -1]
        target = int(clean_logits.argmax())
        corrupt_logits = afmoe.hf_model(input_ids=corrupt).logits[0, -1]
        module = find_layers(afmoe.hf_model, row.sites.attention)[layer][1]

        def restore(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.clone()
            tensor[:, last] = clean_site[:, last]
            return tensor

        with hooks([(HookPoint(module, "output"), restore)]):
            patched_logits = afmoe.hf_model(input_ids=corrupt).logits[0, -1]
    m_clean, m_corrupt, m_patched = (
        float(torch.log_softmax(logits, dim=-1)[target]) for logits in (clean_logits, corrupt_logits, patched_logits)
    )
    assert result.clean_metric == pytest.approx(m_clean, abs=1e-5)
    assert result.corrupt_metric == pytest.approx(m_corrupt, abs=1e-5)
    expected = (m_patched - m_corrupt) / (m_clean - m_corrupt)
    assert result.effects["exact"]["attn"][layer, last] == pytest.approx(expected, abs=1e-4)
