"""Loading a folder whose config is the text part of a composite model saved alone (`attnflow.load`):
the class its config names loads it where the causal-LM Auto class has no entry for that config
class; an input embedding that is not one token table is refused in one line."""

from __future__ import annotations

import pytest

import attnflow
from attnflow.errors import ModelLoadError
from attnflow.rows.tiny import build_tiny


def test_the_class_the_config_names_loads_a_text_part_saved_alone(tmp_path):
    """Emu3's text model: model_type emu3_text_model, which AutoModelForCausalLM does not map."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = build_tiny("emu3", tmp_path)
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.architectures == ["Emu3ForCausalLM"]
    model = attnflow.load(str(folder), device="cpu", progress=False)
    assert type(model.hf_model).__name__ == "Emu3ForCausalLM"
    explanation = model.explain("the cat sat on the mat", method="rollout")
    assert explanation.scores.shape == (len(explanation.tokens),)


@pytest.mark.parametrize(
    ("model_type", "task", "what"),
    [
        ("musicgen", "causal-lm", "a ModuleList"),  # MusicGen's decoder: one embedding table per codebook
        ("canine", "sequence-classification", "undeclared"),  # CANINE hashes characters: no table to name
    ],
)
def test_an_input_embedding_that_is_not_one_token_table_is_refused_in_one_line(tmp_path, model_type, task, what):
    folder = build_tiny(model_type, tmp_path, task)
    with pytest.raises(ModelLoadError, match=rf"input embedding is {what}, not one .*docs/extending\.md") as caught:
        attnflow.load(str(folder), device="cpu", progress=False)
    assert "\n" not in str(caught.value)
