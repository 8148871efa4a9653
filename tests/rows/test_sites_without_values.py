"""Sites inference proves from the residual stream in blocks that are not input + attention(norm(x)) +
MLP(norm(…)) with the projection's output as the attention site.

A block whose attention site is a norm after the output projection and whose heads are not A·V
alone: AFMoE gates the heads by sigmoid(gate_proj(x)) before ``o_proj`` (its values are proven with
that per-position factor, `Values.head_factor`, tests/rows/test_head_factor.py) and norms the
projection's output (``post_attention_layernorm``) before the residual addition. The projection's
output is not the attention site there, so the residual sum proves the sites (before, the row lost
them and patching was refused).

Gated blocks (`Sites.gated`): the block output is a per-channel affine combination of its input and
the two sites, not their sum (Doge's learned residual scales, Ergo's residual gates, Beam's depth-
scaled residual addition, MiniCPM3's branch multiplier): the sites are kept, and the streams are
gated ones (`Streams.gated`, their constants fitted where routes run) where a module reads the
stream between the updates.

The oracle is the model's own forward: block output = block input + attention site + MLP site read
with plain hooks (gated: a least-squares fit per channel, c_0 + c_1 x + c_2 a + c_3 m, leaves
nothing, and without the MLP site it does not), and restoring the clean attention site of the last
layer at the last position in the corrupted run, by hand, gives the metric `attnflow.patch` reports for that site."""

from __future__ import annotations

import pytest
import torch

import attnflow
from attnflow.causal import patch
from attnflow.rows.adapters import find_layers
from attnflow.rows.hook_points import HookPoint, hooks
from attnflow.rows.tiny import build_tiny

CLEAN, CORRUPT = "the cat sat on the mat", "the dog sat on the mat"  # equal token lengths


# model type: whether its block is gated (GPT-NeoX-Japanese: its last attention block returns a bias
# the layer adds outside every module, so only the first block's plain sum holds)
CASES = {"afmoe": False, "doge": True, "ergo": True, "gpt_neox_japanese": True}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    model_type = request.param
    return attnflow.load(str(build_tiny(model_type, tmp_path_factory.mktemp(model_type))), device="cpu")


def _per_channel_fit(out: torch.Tensor, terms: list[torch.Tensor]) -> torch.Tensor:
    """The largest residual of out ≈ c_0 + Σ c_k ⊙ terms[k], fitted per channel by least squares."""
    width = out.shape[-1]
    columns = [torch.ones(out.numel() // width, width, dtype=torch.float64)]
    columns += [term.reshape(-1, width).double() for term in terms]
    design = torch.stack(columns, dim=-1).transpose(0, 1)  # [channel, row, 1 + terms]
    target = out.reshape(-1, width).double().transpose(0, 1).unsqueeze(-1)  # [channel, row, 1]
    fitted = design @ torch.linalg.lstsq(design, target).solution
    return (fitted - target).abs().max()


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


def test_the_proven_sites_are_kept_and_patch_like_the_model(tiny):
    afmoe, row = tiny, tiny.adapter  # afmoe: any of CASES
    gated = CASES[row.family]
    assert row.inferred and "sites" in row.provides
    assert len(row.unverified) == (row.family == "gpt_neox_japanese")  # its plain sum, recorded as failed
    assert row.sites.gated == gated
    # Gated streams where a module reads the stream between the updates (`Streams.gated`); none in
    # GPT-NeoX-Japanese, whose bias outside every module the per-channel constants do not hold.
    streams = {"afmoe": False, "doge": True, "ergo": True, "gpt_neox_japanese": None}[row.family]
    assert (None if row.streams is None else row.streams.gated) == streams
    if row.family == "afmoe":
        assert row.values.head_factor  # the gated heads: value vectors proven with a per-position factor
        assert not row.stack.output_projection.startswith(row.sites.attention[:-1])  # the site is not o_proj's
    ids = afmoe.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    seen = _outputs(
        afmoe,
        ids,
        {"in": row.sites.block, "out": row.sites.block, "attn": row.sites.attention, "mlp": row.sites.mlp},
    )
    plain = []
    for before, after, attention, mlp in zip(seen["in"], seen["out"], seen["attn"], seen["mlp"], strict=True):
        plain.append(bool(torch.allclose(after, before + attention + mlp, rtol=1e-5, atol=1e-5)))
        if gated:
            assert _per_channel_fit(after, [before, attention, mlp]) < 1e-5
            assert _per_channel_fit(after, [before, attention]) > 1e-3  # the MLP site carries the branch
    assert all(plain) != gated  # a gated block is not the plain sum in some layer

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


def test_affine_failure_on_hand_made_streams():
    """Hand-made [2, 7, 4] tensors: out = 1 + x + 2a − 3m per channel is an affine combination of all
    three; a site that is the whole output needs neither the input nor the other site; a square is
    not affine; too few rows determine nothing."""
    from attnflow.rows.tracing import affine_failure

    generator = torch.Generator().manual_seed(0)
    x, a, m = (torch.randn(2, 7, 4, generator=generator) for _ in range(3))
    scale = torch.tensor([1.0, 0.5, -2.0, 3.0])  # per channel
    assert affine_failure(1 + x + 2 * a * scale - 3 * m, (x, a, m), 1e-4) is None
    assert "not needed" in affine_failure(m, (x, a, m), 1e-4)
    assert "largest difference" in affine_failure(x + a * a + m, (x, a, m), 1e-4)
    assert "not determined" in affine_failure(x[:, :3] + a[:, :3], (x[:, :3], a[:, :3], m[:, :3]), 1e-4)
