"""Tiny builds of architectures whose default config the generic shrink used to break, or which
transformers cannot build tiny as it stands (`attnflow.rows.tiny`): each builds, and its forward
pass returns attention weights over the input tokens."""

from __future__ import annotations

import pytest
import torch

from attnflow.rows.tiny import HEADS, HIDDEN, build_tiny, model_class, tiny_config, tiny_tokenizer


def _attentions(model_type: str, folder, task: str = "causal-lm") -> tuple[torch.Tensor, ...]:
    build_tiny(model_type, folder, task)
    model = model_class(model_type, task).from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.randint(5, 150, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    return tuple(weights for weights in output.attentions if weights is not None)


def test_a_size_per_layer_is_shrunk_like_the_size_it_lists():
    """Laguna lists its heads per layer; left at 48 they no longer fit the shrunk hidden size."""
    config = tiny_config("laguna")
    assert config.num_attention_heads_per_layer == [HEADS, HEADS] == [config.num_attention_heads] * 2


def test_a_width_that_is_a_multiple_of_the_hidden_size_keeps_its_ratio(tmp_path):
    """Zamba 2's attention reads the stream beside the embeddings: twice the hidden size."""
    assert tiny_config("zamba2").attention_hidden_size == 2 * HIDDEN
    weights = _attentions("zamba2", tmp_path)
    assert weights and all(w.shape[-2:] == (7, 7) for w in weights)


def test_a_part_width_tied_to_the_text_hidden_size_stays_tied():
    """Dots3-Note's vision adapter writes into the text stream: its output width is the text hidden size."""
    import transformers

    from attnflow.rows.tiny import _shrunk

    config = _shrunk(transformers.CONFIG_MAPPING["dots3_note"]())  # the whole, as built before the text part is taken
    assert config.vision_config.adapter_out_dim == config.text_config.hidden_size == HIDDEN
    assert tiny_config("dots3_note").hidden_size == HIDDEN


def test_prompt_rows_under_the_vocabulary_stay_few():
    """CPM-Ant stacks prompt_types × prompt_length rows under its vocabulary: the tiny tokenizer must
    still know at least half the embedding matrix's rows (what loading checks)."""
    config = tiny_config("cpmant")
    rows = config.vocab_size + config.prompt_types * config.prompt_length
    assert 2 * len(tiny_tokenizer()) >= rows and config.prompt_types >= 3  # its prompt ids are the third type's


@pytest.mark.parametrize("model_type", ["dbrx", "zamba"])
def test_transformers_quirks_of_default_configs_are_worked_around(tmp_path, model_type):
    """DBRX's attention reads attn_config.rope_theta and clip_qkv, unset by default; Zamba ties every
    hybrid layer to the first and fails with one: both build and attend (a released checkpoint sets them)."""
    weights = _attentions(model_type, tmp_path)
    assert weights
    for found in weights:
        torch.testing.assert_close(found.sum(dim=-1), torch.ones(found.shape[:-1]))


def test_a_default_config_that_fails_its_own_validation_is_built_from_valid_arguments(tmp_path):
    """Gemma 4's assistant (a draft model) validates that its text config has no per-layer inputs,
    yet its default text config has them: built from valid arguments, it then runs into what it
    really needs, its backbone's key/value states."""
    config = tiny_config("gemma4_assistant")
    assert config.get_text_config().hidden_size_per_layer_input == 0
    build_tiny("gemma4_assistant", tmp_path)
    model = model_class("gemma4_assistant", "causal-lm").from_pretrained(tmp_path, attn_implementation="eager")
    with pytest.raises(ValueError, match="shared_kv_states cannot be None"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("model_type", ["layoutlmv3", "lilt"])
def test_layout_embeddings_that_split_the_hidden_size_in_six_get_one_that_divides(tmp_path, model_type):
    """LayoutLMv3 and LiLT embed x, y, height and width in sixths of the hidden size (64 does not divide)."""
    weights = _attentions(model_type, tmp_path, "sequence-classification")
    assert len(weights) == 2 and all(found.shape == (2, HEADS, 7, 7) for found in weights)
