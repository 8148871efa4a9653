"""Contrastive targets ("A rather than B") on tiny models: y = logit(A) − logit(B), so a method
linear in y (signed gradient × input) gives map(A) − map(B); the page names both targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import InputError
from attnflow.evaluate.per_input import input_faithfulness
from attnflow.explanation import explain

PROMPT = "the cat sat on the mat and the"


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_path):
    return attnflow.load(str(tiny_model_path("llama")), device="cpu")


def signed_scores(model, text, **target):
    return model.explain(text, "grad_x_input", signed=True, **target).scores


def test_contrast_map_of_a_linear_method_is_the_difference_of_the_two_maps(tiny_llama):
    tokenizer = tiny_llama.tokenizer
    a, b = (tokenizer.convert_ids_to_tokens(i) for i in (40, 41))
    contrast = tiny_llama.explain(PROMPT, "grad_x_input", signed=True, target=40, contrast=41)
    expected = signed_scores(tiny_llama, PROMPT, target=40) - signed_scores(tiny_llama, PROMPT, target=41)
    np.testing.assert_allclose(contrast.scores, expected, atol=1e-5)
    # y is logit(A) − logit(B), read here from the module itself
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        logits = tiny_llama.model(input_ids=ids).logits[0, -1].double()
    assert contrast.target["value"] == pytest.approx(float(logits[40] - logits[41]), abs=1e-4)
    assert contrast.target["contrast_index"] == 41
    assert "rather than" in contrast.to_html() and "rather than" in contrast.plot().get_suptitle()
    assert a is not None and b is not None
    # per-input faithfulness drops p(A) − p(B)
    trace = tiny_llama.trace_for(["grad_x_input"], [PROMPT], target=40, contrast=41)[0]
    record = input_faithfulness(tiny_llama, trace, [contrast.scores])[0]
    p = torch.softmax(logits, dim=-1)
    assert record["probability"] == pytest.approx(float(p[40] - p[41]), abs=1e-6)
    assert record["quantity"].count("p(") == 2


def test_contrast_on_a_classifier_is_the_difference_of_the_class_maps(tiny_classifier_path):
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    text = "the movie was great"
    contrast = model.explain(text, "grad_x_input", signed=True, target=1, contrast=0)
    expected = signed_scores(model, text, target=1) - signed_scores(model, text, target=0)
    np.testing.assert_allclose(contrast.scores, expected, atol=1e-5)
    names = model.model.config.id2label
    assert f"{names[1]} rather than {names[0]}" in attnflow.targets.ResolvedTarget(**contrast.target).describe()


def test_contrast_errors_are_one_clear_line(tiny_llama):
    with pytest.raises(InputError, match="contrast token .* is 3 tokens"):
        tiny_llama.explain(PROMPT, "grad_x_input", target=40, contrast="abc")
    with pytest.raises(InputError, match="is the target itself"):
        tiny_llama.explain(PROMPT, "grad_x_input", target=40, contrast=40)
    with pytest.raises(InputError, match="does not depend on a target"):
        tiny_llama.explain(PROMPT, "rollout", contrast=40)


def test_generation_with_a_contrast_explains_each_token_rather_than_it(tiny_llama):
    plain = attnflow.explain_generation(tiny_llama, PROMPT, max_new_tokens=2, method="grad_x_input", signed=True)
    contrasted = attnflow.explain_generation(
        tiny_llama, PROMPT, max_new_tokens=2, method="grad_x_input", signed=True, contrast=41
    )
    np.testing.assert_allclose(contrasted.log_probs, plain.log_probs, atol=1e-6)  # p(t_k) as before
    # step 0 by hand: Σ_d e_jd ∂(log p(t_1) − log p(B))/∂e_jd over the prompt's embeddings
    prompt_ids = torch.as_tensor(plain.token_ids[: plain.n_prompt])[None]
    embeddings = tiny_llama.model.get_input_embeddings()(prompt_ids).detach().requires_grad_(True)
    log_p = torch.log_softmax(tiny_llama.model(inputs_embeds=embeddings).logits[0, -1], dim=-1)
    (gradient,) = torch.autograd.grad(log_p[int(plain.token_ids[plain.n_prompt])] - log_p[41], embeddings)
    expected = (gradient * embeddings)[0].sum(dim=-1).detach().numpy()
    np.testing.assert_allclose(contrasted.step_scores(0), expected, atol=1e-5)
    assert contrasted.contrast is not None and "rather than" in contrasted.to_html()
    assert contrasted.to_dict()["contrast"] == contrasted.contrast
