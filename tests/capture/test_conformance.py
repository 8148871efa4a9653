"""The conformance suite of adapter rows (`attnflow.rows.check_adapter`): every row of the table
passes on its tiny model, running the checks its row provides for; deliberately broken rows (a
wrong head-slice pattern, a norm of the wrong place or form, an MLP site that is not the MLP) fail
with one line naming the failed check; a fused q/k/v row declared in the wrong layout fails head_slices."""

from __future__ import annotations

import dataclasses

import pytest

import attnflow.rows
from attnflow.rows import ADAPTERS, AdapterCheckError, check_adapter

from fused_rows import NEOX_ROW, PHI3_ROW, tiny_fused_model, with_layout
from tiny_models import TEXT_FAMILIES, VARIANT_FAMILIES, VISION_FAMILIES

EVERY_CHECK = {
    "attention_weights", "head_slices", "attention_output", "residual_sum", "ffn_input", "own_value", "knockout"
}  # fmt: skip


@pytest.mark.parametrize("family", TEXT_FAMILIES + VISION_FAMILIES)
def test_every_row_passes_on_its_tiny_model(tiny_loaded, family):
    model = tiny_loaded(family)
    ran = check_adapter(model.adapter, model).passed
    assert {"attention_weights", "norm_form"} <= ran
    assert ("head_slices" in ran) == ("values" in model.adapter.provides or model.adapter.values is not None)
    assert ("own_value" in ran) == ("knockout" in ran) == ("sites" in model.adapter.provides)
    if family in ("llama", "qwen2"):
        assert ran >= EVERY_CHECK  # pre-norm with values and sites: the whole suite
    if family in ("bert", "distilbert", "mpnet"):
        assert "post_norm" in ran and "residual_sum" not in ran


@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_the_variant_rows_pass_on_their_tiny_models(variant_loaded, family):
    """Parallel blocks (Phi, GPT-J), post-norms (OLMo-2), sandwich norms (Gemma 2), attention sinks
    (GPT-OSS): every check; the attention site of a post- or sandwich-norm row is its norm's
    output, not the projection's."""
    model = variant_loaded(family)
    ran = check_adapter(model.adapter, model).passed
    assert ran | {"attention_output"} >= EVERY_CHECK | {"norm_form"}
    assert ("attention_output" in ran) == (model.adapter.values.output_norm is None)


def test_attention_sinks_are_declared_in_the_stack(variant_loaded):
    """GPT-OSS's rows of weights sum to less than 1 (the sink takes the rest): a stack without
    ``sinks`` fails attention_weights, one with it passes and its knockout too."""
    model = variant_loaded("gpt_oss")
    sums = model.trace("the cat sat on the mat")[0].attentions.sum(axis=-1)  # [layer, head, query]
    assert sums.max() < 1 - 1e-3
    message = failure(broken(model, stack={"sinks": False}), model)
    assert "fails attention_weights: stack layer 0 row sums" in message


def test_a_row_declaring_the_wrong_topology_fails_ffn_input(variant_loaded, tiny_loaded):
    phi = variant_loaded("phi")  # parallel: its feed-forward block reads the block input
    message = failure(broken(phi, streams={"parallel": False}), phi)
    assert "fails ffn_input: layer 0" in message and "declares a sequential block" in message
    llama = tiny_loaded("llama")  # sequential: its feed-forward block reads input + attention
    message = failure(broken(llama, streams={"parallel": True}), llama)
    assert "fails ffn_input: layer 0" in message and "declares a parallel block" in message


def test_every_row_of_the_table_has_a_tiny_model_here():
    families = {row.family for row in ADAPTERS}
    covered = {attnflow.rows.adapter_for(_model_type(f), "").family for f in TEXT_FAMILIES + VISION_FAMILIES}
    assert families == covered


def _model_type(family: str) -> str:
    from tiny_models import tiny_config

    return tiny_config(family).model_type


def broken(model, **changes) -> attnflow.rows.Adapter:
    """The model's row with some of its parts replaced (``values``, ``sites``, ``stack``, ``streams``: dicts of fields)."""
    row = model.adapter
    replaced = {name: dataclasses.replace(getattr(row, name), **fields) for name, fields in changes.items()}
    return dataclasses.replace(row, family=f"broken-{row.family}", **replaced)


def failure(row, model) -> str:
    with pytest.raises(AdapterCheckError) as error:
        check_adapter(row, model)
    message = str(error.value)
    assert "\n" not in message and row.family in message
    return message


def test_a_wrong_head_slice_pattern_fails_head_slices(tiny_loaded):
    model = tiny_loaded("llama")
    row = broken(model, stack={"output_projection": r"layers\.(\d+)\.self_attn\.q_proj$"})  # hidden states, not heads
    assert "fails head_slices: layer 0" in failure(row, model)
    row = broken(model, values={"value": r"layers\.(\d+)\.self_attn\.k_proj$"})  # keys taken for values
    assert "fails head_slices" in failure(row, model)


def test_a_norm_of_the_wrong_place_or_form_fails(tiny_loaded):
    bert = tiny_loaded("bert")
    after_mlp = broken(bert, values={"norm": r"layer\.(\d+)\.output\.LayerNorm$"})  # the norm after the MLP
    assert "fails post_norm: layer 0: the norm's input" in failure(after_mlp, bert)
    llama = tiny_loaded("llama")
    not_a_norm = dataclasses.replace(llama.adapter, family="broken-llama", embedding_norm=r"layers\.0\.mlp\.act_fn$")
    assert "fails norm_form" in failure(not_a_norm, llama) and "act_fn" in failure(not_a_norm, llama)


def test_an_mlp_site_that_is_not_the_mlp_output_fails_residual_sum(tiny_loaded):
    model = tiny_loaded("gpt2")
    row = broken(model, sites={"mlp": r"\bh\.(\d+)\.mlp\.c_fc$"})
    assert "fails residual_sum: layer 0" in failure(row, model)


def test_a_user_row_is_checked_before_it_is_registered(tiny_loaded):
    model = tiny_loaded("qwen2")  # the documented way: build the row, check it on the model, then register it
    row = dataclasses.replace(model.adapter, family="my-qwen2")
    assert check_adapter(row, model.model).passed >= EVERY_CHECK  # the Hugging Face module itself works too
    assert model.model.training is False


def test_a_row_declaring_the_wrong_norm_form_fails_norm_form(tiny_loaded):
    gemma = tiny_loaded("gemma3")  # its RMS norms multiply by 1 + w (w randomised in the tiny model)
    plain_weight = dataclasses.replace(
        gemma.adapter, family="broken-gemma3", norms=dataclasses.replace(gemma.adapter.norms, rms_offset=0.0)
    )
    message = failure(plain_weight, gemma)
    assert "fails norm_form" in message and "RMS norm scaled by 0 + w" in message
    bert = tiny_loaded("bert")
    rms = dataclasses.replace(
        bert.adapter, family="broken-bert", norms=dataclasses.replace(bert.adapter.norms, form="rms")
    )
    assert "is not an RMS norm" in failure(rms, bert)


def test_a_norms_pattern_that_misses_a_norm_fails_norm_form(tiny_loaded):
    llama = tiny_loaded("llama")
    only_inputs = dataclasses.replace(
        llama.adapter,
        family="broken-llama",
        norms=dataclasses.replace(llama.adapter.norms, modules=r"input_layernorm$"),
    )
    message = failure(only_inputs, llama)
    assert "fails norm_form" in message and "post_attention_layernorm" in message and "not matched" in message


@pytest.mark.parametrize(
    ("model_type", "row", "wrong", "said"),
    [
        ("gpt_neox", NEOX_ROW, "side_by_side", "V the value columns of a side_by_side fused projection"),
        ("phi3", PHI3_ROW, "per_group", "V the value columns of a per_group fused projection"),
        ("phi3", PHI3_ROW, "per_head", "do not hold {'query': 4, 'key': 2, 'value': 2} heads laid out per_head"),
    ],
)
def test_a_fused_row_passes_in_its_layout_and_fails_head_slices_in_another(model_type, row, wrong, said):
    """GPT-NeoX's query_key_value is laid out per head, Phi-3's qkv_proj side by side with 2 kv heads
    of 4: each row passes the whole suite; declared in another layout it reads other columns as
    the values (or columns that cannot hold its heads) and fails head_slices, saying so."""
    model = tiny_fused_model(model_type)
    assert check_adapter(row, model).passed >= (EVERY_CHECK - {"ffn_input"}) | {"norm_form"}  # no streams in these rows
    message = failure(with_layout(row, wrong), model)
    assert "fails head_slices: layer 0" in message and said in message


def test_a_gated_mlp_whose_product_no_module_reads_fails_gated_product(tiny_loaded):
    model = tiny_loaded("llama")
    assert "gated_product" in check_adapter(model.adapter, model).passed
    row = broken(model, gated_mlp={"up": "gate_proj"})  # act(gate(x)) · gate(x): nothing reads it
    assert "fails gated_product: layer 0: no module of the gated MLP reads" in failure(row, model)
