"""The layer stack of an inferred row found from the traced run (`attnflow.rows.infer`): the list of
blocks that hold the calls returning softmax weights, whatever the blocks' classes, the config's
layer count or the other lists of the model; what the trace cannot map (a block run twice, two
attention modules in one block) refused in one line naming the part and docs/extending.md."""

from __future__ import annotations

import pytest
import torch

from attnflow.rows.adapters import find_layers
from attnflow.rows.hook_points import HookPoint, hooks
from attnflow.rows.infer import InferenceError, verified_row
from attnflow.rows.tiny import build_tiny, model_class


def _tiny(model_type: str, folder, task: str = "causal-lm"):
    build_tiny(model_type, folder, task)
    return model_class(model_type, task).from_pretrained(folder, attn_implementation="eager").eval()


def _model_attentions(model) -> tuple[torch.Tensor, ...]:
    """The model's own ``[batch, head, query, key]`` weights per layer, from transformers' output."""
    ids = torch.randint(5, 150, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True).attentions


def _row_attentions(row, model) -> list[torch.Tensor]:
    """The weights the row's stack modules return on the same input (an oracle apart from inference)."""
    recorded: dict[str, torch.Tensor] = {}
    layers = find_layers(model, row.stack.attention)

    def keep(name: str):
        def hook(weights: torch.Tensor) -> None:
            recorded.setdefault(name, weights.detach().clone())

        return hook

    with hooks([(HookPoint(module, "output", index=row.stack.weights_index), keep(name)) for name, module in layers]):
        _model_attentions(model)
    return [recorded[name] for name, _ in layers]


@pytest.mark.parametrize(
    ("model_type", "stack"),
    [
        # a sliding-window block class, then a full-attention one: no two blocks of one class
        ("inkling2_text", r"^model\.layers\.(\d+)\.self_attn$"),
        # vision and audio towers beside the language model, the audio one last in the module order,
        # neither run on text
        ("phi4_multimodal", r"^model\.layers\.(\d+)\.self_attn$"),
    ],
)
def test_the_stack_is_the_list_whose_blocks_attend_in_the_traced_run(tmp_path, model_type, stack):
    model = _tiny(model_type, tmp_path)
    row = verified_row(model, "decoder")
    assert row.stack.attention == stack
    expected = _model_attentions(model)
    found = _row_attentions(row, model)
    assert len(found) == len(expected) == 2
    for layer, (ours, theirs) in enumerate(zip(found, expected, strict=True)):
        torch.testing.assert_close(ours, theirs, msg=f"layer {layer}")


def test_a_block_run_more_than_once_is_refused_naming_it(tmp_path):
    """ALBERT runs one shared layer group for every layer: a row maps one module per layer."""
    model = _tiny("albert", tmp_path, "sequence-classification")
    with pytest.raises(InferenceError, match=r"albert_layer_groups\.0 ran 2 times.*docs/extending\.md") as caught:
        verified_row(model, "encoder")
    assert "\n" not in str(caught.value)


def test_a_block_with_two_attention_modules_is_refused_naming_them(tmp_path):
    """LongCat-Flash: two attention sublayers per block (num_hidden_layers counts both)."""
    model = _tiny("longcat_flash", tmp_path)
    both = r"\(model\.layers\.0\.self_attn\.0, model\.layers\.0\.self_attn\.1\)"
    with pytest.raises(InferenceError, match=r"holds 2 attention modules " + both):
        verified_row(model, "decoder")


def test_sinks_in_later_layers_only_are_declared_for_the_stack(tmp_path):
    """MiMo-V2-Flash: full-attention layer 0 without sinks, sliding layer 1 with them; the stack
    declares sinks, and the first layer's rows summing to exactly 1 still pass the check."""
    model = _tiny("mimo_v2_flash", tmp_path)
    sums = [weights.sum(dim=-1) for weights in _model_attentions(model)]
    torch.testing.assert_close(sums[0], torch.ones_like(sums[0]))
    assert bool((sums[1] < 1 - 1e-3).any())  # the sink's share
    row = verified_row(model, "decoder")
    assert row.stack.sinks and not row.unverified


def test_a_stream_wider_than_the_attention_output_leaves_the_sites_out_instead_of_crashing(tmp_path):
    """DeepSeek-V4's blocks carry several residual streams ([batch, streams, token, d]): the block is
    neither a pre- nor a post-norm sum of its attention's output, so no sites, but rollout's parts."""
    model = _tiny("deepseek_v4", tmp_path)
    row = verified_row(model, "decoder")
    assert row.stack.attention == r"^model\.layers\.(\d+)\.self_attn$"
    assert row.sites is None and row.streams is None
    for ours, theirs in zip(_row_attentions(row, model), _model_attentions(model), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_a_head_count_that_differs_per_layer_is_refused_in_one_line(tmp_path):
    """Dots3-Note sets its heads per layer (transformers refuses the global read): the tiny build keeps
    the released per-layer overrides (64 heads) beside the shrunk global 4, so its layers differ."""
    import attnflow
    from attnflow.errors import CaptureError

    folder = build_tiny("dots3_note", tmp_path)
    with pytest.raises(CaptureError, match=r"sets num_attention_heads per layer and its layers differ \(\[4, 64\]\)"):
        attnflow.load(str(folder), device="cpu", progress=False)


def test_softmax_rows_of_another_head_count_are_named_in_the_refusal(tmp_path):
    """ConvBERT's self-attention returns num_attention_heads / head_ratio heads (2 of the config's 4)."""
    model = _tiny("convbert", tmp_path, "sequence-classification")
    nearest = r"the nearest: convbert\.encoder\.layer\.0\.attention\.self returned softmax rows \[2, 2, 7, 7\]"
    with pytest.raises(InferenceError, match=nearest + " as output 1"):
        verified_row(model, "encoder")


def test_layers_attending_over_keys_beside_the_input_are_refused_in_one_line(tmp_path):
    """DeepSeek-V4 adds compressed keys once the input outgrows its compression ratio: a later layer's
    weights then have more keys than the first's, which one [layer, head, query, key] map cannot hold."""
    import attnflow
    from attnflow.errors import CaptureError

    model = attnflow.load(str(build_tiny("deepseek_v4", tmp_path)), device="cpu", progress=False)
    with pytest.raises(CaptureError, match=r"layer 1's attention weights are \[1, \d+, 11, 13\], layer 0's") as caught:
        model.explain("the movie was terrible but the acting was great", method="rollout")
    assert "\n" not in str(caught.value)


def test_attention_modules_listed_without_blocks_are_refused_naming_them(tmp_path):
    """XLM keeps its attention modules, norms and feed-forward blocks in parallel lists, no block
    around a layer (the identity-based search used to take the last list, of norms, for the stack)."""
    model = _tiny("xlm", tmp_path, "sequence-classification")
    itself = r"transformer\.attentions\.0, .* is itself an element of transformer\.attentions"
    with pytest.raises(InferenceError, match=itself):
        verified_row(model, "encoder")
