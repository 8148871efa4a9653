"""What the patching metric is checked for: a contrast that is not one token is named as the contrast
(in Python and on the command line, whichever analysis reads it), and a metric that does not read
as what the clean text predicts (the clean text prefers the contrast, or the corruption does not
lower the metric) is said in one warning line, which `attnflow patch` prints."""

from __future__ import annotations

import warnings

import pytest
import torch
from causal_texts import CLEAN, CORRUPT

from attnflow.causal import patch
from attnflow.causal.edges import edge_scores
from attnflow.cli import main
from attnflow.errors import InputError, PatchingWarning
from attnflow.targets import Target

WORDS = ("the", "cat", "dog", "sat", "on", "mat", "a", "is", "was", "and")  # one token each (tiny vocabulary)


def quick(model, **options):
    return patch(model, CLEAN, CORRUPT, sites="residual", methods="exact", progress=False, **options)


def patching_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, PatchingWarning)]


def last_logits(model, text: str) -> torch.Tensor:
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return torch.log_softmax(model.model(input_ids=ids).logits[0, -1].double(), dim=-1)


def one_token_words(model) -> dict[str, int]:
    found = {word: model.tokenizer(word, add_special_tokens=False)["input_ids"] for word in WORDS}
    return {word: ids[0] for word, ids in found.items() if len(ids) == 1}


def test_a_contrast_of_several_tokens_is_named_as_the_contrast(tiny_patch_models):
    with pytest.raises(InputError) as error:
        quick(tiny_patch_models["llama"], target=Target(contrast="cat sat"))
    assert str(error.value).startswith("the contrast token 'cat sat' is 2 tokens")
    assert "target token" not in str(error.value) and error.value.parameter == "contrast"
    with pytest.raises(InputError) as error:  # the deprecated spelling reads the same
        quick(tiny_patch_models["llama"], target="cat", contrast="cat sat")
    assert str(error.value).startswith("the contrast token 'cat sat' is 2 tokens")
    with pytest.raises(InputError, match=r"^the contrast token 'cat sat' is 2 tokens"):
        edge_scores(tiny_patch_models["llama"], CLEAN, CORRUPT, target=Target(contrast="cat sat"), method="eap")


@pytest.mark.parametrize("analysis", [[], ["--versus", "rollout"], ["--edges", "eap"]])
def test_the_command_line_names_the_contrast_flag(tiny_model_path, tmp_path, capsys, analysis):
    argv = ["patch", CLEAN, "--corrupt", CORRUPT, "--model", str(tiny_model_path("llama")), "--device", "cpu"]
    code = main([*argv, "--contrast", "cat sat", *analysis, "--out", str(tmp_path / "out"), "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("attnflow: error: the contrast token 'cat sat' is 2 tokens")
    assert err.endswith("give exactly one token (--contrast)") and "target token" not in err


def test_a_clean_text_that_prefers_the_contrast_is_warned_about(tiny_patch_models):
    model = tiny_patch_models["llama"]
    clean = last_logits(model, CLEAN)
    words = one_token_words(model)
    liked, disliked = (max(words, key=lambda w: sign * float(clean[words[w]])) for sign in (1, -1))
    said = patching_warnings(lambda: quick(model, target=Target(disliked, contrast=liked)))
    assert len(said) == 1 and said[0].startswith("the clean text prefers the contrast (logit(")
    assert "swap the target and the contrast" in said[0] and "\n" not in said[0]
    said = patching_warnings(lambda: quick(model, target=Target(liked, contrast=disliked)))
    assert not [line for line in said if line.startswith("the clean text prefers the contrast")]


def test_a_corruption_that_does_not_lower_the_metric_is_warned_about(tiny_patch_models):
    model = tiny_patch_models["llama"]
    clean, corrupt = last_logits(model, CLEAN), last_logits(model, CORRUPT)
    words = one_token_words(model)
    raised = max(words, key=lambda w: float(corrupt[words[w]] - clean[words[w]]))  # more likely once corrupted
    lowered = max(words, key=lambda w: float(clean[words[w]] - corrupt[words[w]]))
    assert float(corrupt[words[raised]]) > float(clean[words[raised]])  # the pair this test needs
    (said,) = patching_warnings(lambda: quick(model, target=raised))
    assert said.startswith(f"the corruption does not lower the metric (log p('{raised}') = ")
    assert "choose a target the clean text prefers, or swap the texts" in said
    assert patching_warnings(lambda: quick(model, target=lowered)) == []  # a readable metric: nothing said
    (edges,) = patching_warnings(lambda: edge_scores(model, CLEAN, CORRUPT, target=raised, method="eap"))
    assert edges.startswith("the corruption does not lower the metric")  # edges read the same metric


def test_the_command_line_prints_the_warning_as_one_line(tiny_patch_models, tiny_model_path, tmp_path, capsys):
    model = tiny_patch_models["llama"]  # the same weights as the saved tiny llama
    clean, corrupt = last_logits(model, CLEAN), last_logits(model, CORRUPT)
    words = one_token_words(model)
    raised = max(words, key=lambda w: float(corrupt[words[w]] - clean[words[w]]))
    argv = ["patch", CLEAN, "--corrupt", CORRUPT, "--model", str(tiny_model_path("llama")), "--device", "cpu"]
    code = main([*argv, "--target", raised, "--sites", "residual", "--method", "exact", "--out", str(tmp_path), "-q"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "does not lower the metric" in line]
    assert code == 0 and len(lines) == 1 and lines[0].startswith("attnflow: WARNING: the corruption does not lower")
