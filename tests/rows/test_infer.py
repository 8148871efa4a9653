"""Rows inferred from the model itself (`attnflow.rows.infer`): the inferred row of every built-in
text family reads exactly the modules its hand row names; a model type no hand row covers loads
through inference and runs rollout, the backward rules and routes; a part whose check fails is left
out, and the refusal names the failed check."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from attnflow.rows.adapters import find_layers
from attnflow.rows.infer import InferenceError, infer_row, verified_row
from attnflow.rows.tiny import build_tiny

from tiny_models import VARIANT_FAMILIES

# The built-in text families with one stack (the encoder-decoder rows, T5 and BART, are not inferred).
INFERRED_FAMILIES = ("bert", "roberta", "electra", "distilbert", "mpnet", "gpt2", "llama", "qwen2", "gemma3")


# Fields that name an attribute below a part's module, not a pattern over the model's modules.
ATTRIBUTE_FIELDS = {"up", "activation", "router", "experts", "first", "down", "shared", "shared_gate"}


def _reads(model, pattern: str | None, every: bool = False) -> list[str]:
    """The module names a row pattern reads: one per layer, or every match (``every``, or no layer group)."""
    if pattern is None:
        return []
    if re.compile(pattern).groups and not every:
        return [name for name, _ in find_layers(model, pattern)]
    return [name for name, _ in model.named_modules() if name and re.search(pattern, name)]


def _what_a_row_reads(row, model) -> dict[str, object]:
    """Every part of ``row`` as the modules it reads on ``model`` (patterns differ, readings must not)."""
    reading: dict[str, object] = {
        "kind": row.kind,
        "heads": row.heads(model.config),
        "weights_in_out": row.weights_in_out,
        "weights_index": row.stack.weights_index,
        "embedding_norm": _reads(model, row.embedding_norm)[:1],
    }
    for part in ("stack", "values", "sites", "streams", "gated_mlp", "experts"):
        fields = getattr(row, part)
        if fields is None:
            reading[part] = None
            continue
        for field in dataclasses.fields(fields):
            value = getattr(fields, field.name)
            is_pattern = isinstance(value, str) and field.name not in ATTRIBUTE_FIELDS
            reading[f"{part}.{field.name}"] = _reads(model, value) if is_pattern else value
    norms = row.norms
    reading["norms"] = (
        None if norms is None else (sorted(_reads(model, norms.modules, every=True)), norms.form, norms.rms_offset)
    )
    return reading


@pytest.mark.parametrize("family", INFERRED_FAMILIES)
def test_the_inferred_row_of_a_built_in_family_reads_what_its_hand_row_reads(tiny_loaded, family):
    model = tiny_loaded(family)
    inferred = verified_row(model.hf_model, model.adapter.kind)
    assert inferred.inferred and not inferred.unverified
    assert _what_a_row_reads(inferred, model.hf_model) == _what_a_row_reads(model.adapter, model.hf_model)
    assert inferred.provides == model.adapter.provides


@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_the_inferred_row_of_a_variant_reads_what_its_test_row_reads(variant_loaded, family):
    """Parallel blocks (Phi, GPT-J), post-norms (OLMo-2), sandwich norms (Gemma 2), sinks and a
    mixture of experts (GPT-OSS): rows written by hand for the routes tests are the oracle."""
    model = variant_loaded(family)
    inferred = verified_row(model.hf_model, "decoder")
    assert not inferred.unverified
    if family == "gpt_oss":  # its test row reads the mixture of experts whole; inference splits it
        assert inferred.experts is not None and model.adapter.experts is None
        inferred = dataclasses.replace(inferred, experts=None)
    assert _what_a_row_reads(inferred, model.hf_model) == _what_a_row_reads(model.adapter, model.hf_model)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_the_inferred_row_of_a_mixture_of_experts_reads_what_its_test_row_reads(tiny_moe, family):
    model = tiny_moe(family)
    inferred = verified_row(model.hf_model, "decoder")
    assert inferred.experts is not None and not inferred.unverified
    assert _what_a_row_reads(inferred, model.hf_model) == _what_a_row_reads(model.adapter, model.hf_model)
    assert inferred.provides == model.adapter.provides


def test_a_model_type_without_a_hand_row_loads_through_inference_and_runs_every_method(tmp_path, caplog):
    import attnflow

    model = attnflow.load(str(build_tiny("olmo2", tmp_path / "olmo2")), device="cpu")
    assert model.adapter.inferred and model.adapter.family == "olmo2"
    assert "inferring one from the model" in caplog.text
    # Post-norms (x + norm(attention(x))): sites at the norms; the value-aware methods read the
    # values through the norm (its statistic fixed), as for Gemma's sandwich.
    assert {"sites", "streams", "norms", "query_key", "gated_mlp", "values"} <= model.adapter.provides
    text = "the movie was great but the acting"
    rollout = model.explain(text, method="rollout")
    assert rollout.scores.shape == (len(rollout.tokens),)
    assert model.explain(text, method="norm").scores.shape == rollout.scores.shape
    lrp = model.explain(text, method="attnlrp")
    assert np.isfinite(lrp.scores).all() and np.abs(lrp.scores).max() > 0
    routes = attnflow.routes(model, text)
    assert routes.edges and routes.graph.n_layers == 2


def test_a_causal_lm_whose_class_name_says_no_lm_loads_with_its_head(tmp_path):
    """BertGenerationDecoder (and Gemma 3's ForConditionalGeneration, Reformer's ModelWithLMHead)
    are causal LMs by transformers' own table: the model loads with its LM head, and the next-token
    target is the head's own prediction."""
    from transformers import BertGenerationDecoder

    import attnflow

    folder = build_tiny("bert-generation", tmp_path / "bert-generation")
    model = attnflow.load(str(folder), device="cpu")
    assert type(model.hf_model) is BertGenerationDecoder and model.adapter.target_kind == "next_token"
    text = "the movie was great but the acting"
    own = BertGenerationDecoder.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = own(**model.tokenizer(text, return_tensors="pt")).logits[0, -1]  # [vocabulary]
    assert model.explain(text, method="attnlrp").target["index"] == int(logits.argmax())


def _same_numbers(model, row, text: str, methods: tuple[str, ...]) -> None:
    """``model`` explained through ``row`` gives its hand row's numbers, method by method."""
    import attnflow

    inferred = attnflow.AttentionModel(model.hf_model, model.tokenizer, name=model.name, adapter=row)
    for method in methods:
        expected, found = model.explain(text, method=method), inferred.explain(text, method=method)
        np.testing.assert_allclose(found.scores, expected.scores, rtol=1e-6, atol=1e-6, err_msg=method)


@pytest.mark.parametrize("family", ["llama", "gemma3", "bert"])
def test_the_inferred_row_gives_the_hand_rows_numbers(tiny_loaded, family):
    model = tiny_loaded(family)
    methods = {"bert": ("rollout", "alti", "norm_rollout"), "gemma3": ("rollout", "attnlrp", "gim")}
    _same_numbers(
        model,
        verified_row(model.hf_model, model.adapter.kind),
        "the movie was great",
        methods.get(family, ("rollout", "norm", "attnlrp", "gim")),
    )


def test_smollm2_through_its_inferred_row_gives_the_same_numbers(smollm2):
    """Real weights: the inferred row of smollm2 reads what the llama row reads, to the same numbers."""
    row = verified_row(smollm2.hf_model, "decoder")
    assert _what_a_row_reads(row, smollm2.hf_model) == _what_a_row_reads(smollm2.adapter, smollm2.hf_model)
    _same_numbers(smollm2, row, "The capital of France is", ("rollout", "attnlrp"))


def test_a_part_whose_check_fails_is_left_out_and_the_refusal_names_the_check(tiny_loaded, monkeypatch):
    from attnflow.errors import InputError
    from attnflow.rows import infer

    model = tiny_loaded("llama")
    right = infer.infer_row(model.hf_model, "decoder")
    keys_for_values = dataclasses.replace(right.values, value=right.values.key)  # a planted mistake

    monkeypatch.setattr(infer, "infer_row", lambda *_: dataclasses.replace(right, values=keys_for_values))
    row = infer.verified_row(model.hf_model, "decoder")
    assert row.values is None and row.sites is not None and row.norms is not None
    assert [note.split(":")[0] for note in row.unverified] == ["head_slices"]
    import attnflow

    wrapped = attnflow.AttentionModel(model.hf_model, model.tokenizer, name="planted", adapter=row)
    with pytest.raises(InputError, match=r"requires values .*head_slices: layer 0.*docs/extending.md"):
        wrapped.explain("the movie was great", method="norm")
    assert wrapped.explain("the movie was great", method="rollout").scores is not None


def test_a_gated_product_that_fails_takes_the_backward_rules_with_it(tiny_loaded, monkeypatch):
    """The rules cannot split a product they cannot find: the gated MLP and the query and key go,
    the values (which no rule needs) stay."""
    from attnflow.rows import infer

    model = tiny_loaded("llama")
    right = infer.infer_row(model.hf_model, "decoder")
    wrong_up = dataclasses.replace(right.gated_mlp, up="gate_proj")
    monkeypatch.setattr(infer, "infer_row", lambda *_: dataclasses.replace(right, gated_mlp=wrong_up))
    row = infer.verified_row(model.hf_model, "decoder")
    assert row.gated_mlp is None and row.values.query is None and row.values.key is None
    assert row.values.value == right.values.value and "query_key" not in row.provides and "values" in row.provides
    assert [note.split(":")[0] for note in row.unverified] == ["gated_product"]


def test_values_that_inference_cannot_carry_through_are_refused_naming_why(tmp_path):
    """Differential attention (DiffLlama) subtracts a second softmax's A·V from the first one's before
    the output projection: no projection times the returned weights gives the heads, so the value-aware
    methods are refused in one line that says what stands between A·V and the output projection."""
    import attnflow
    from attnflow.errors import InputError

    model = attnflow.load(str(build_tiny("diffllama", tmp_path / "diffllama")), device="cpu", progress=False)
    assert model.adapter.values is None and model.adapter.missing[0].startswith("values: no projection of")
    with pytest.raises(InputError, match=r"requires values .*between A·V and the output projection.*extending.md"):
        model.explain("the movie was great", method="norm")
    assert model.explain("the movie was great", method="rollout").scores is not None


def test_a_model_without_attention_weights_is_refused_naming_the_part(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=160, hidden_size=32, num_hidden_layers=2, state_size=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(InferenceError, match=r"no head count.*docs/extending.md"):
        verified_row(model, "decoder")


def test_inference_costs_one_short_forward_pass(tiny_loaded):
    """Inference traces one 2 × 7 forward pass: the hooks it registers are gone afterwards."""
    from attnflow.rows.hook_points import hooks_on

    model = tiny_loaded("gemma3")
    infer_row(model.hf_model, "decoder")
    assert hooks_on(model.hf_model) == 0
