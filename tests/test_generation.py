"""Explaining generated tokens (attnflow.generation) on tiny random GPT-2 and Llama models.

The oracle of every step is an independent one-step explanation: `model.explain` of the prompt
and the tokens before t_k written as text, with target t_k (its own tokenization, trace and
target). The tiny models' tokenizer is a WordPiece one that appends [SEP]; the `decoder` fixture
gives it a BOS-only template (``[CLS] text``, like Llama's tokenizer) so that a prefix written as
text is exactly prompt + t_1 … t_{k-1}. The default [SEP]-appending template is tested on its own.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import attnflow
from attnflow.cli import main
from attnflow.errors import InputError
from attnflow.generation import condensed_notes, generation_methods, prepare_continuation, step_traces

PROMPT = "the movie was"
WORDS = ["good", "but", "the", "cat", "sat"]  # whole words of the tiny vocabulary: text and ids agree
CONTINUATION = " ".join(WORDS)
METHODS = ["rollout", "raw", "grad_rollout", "gradient", "grad_x_input", "leave_one_out", "integrated_gradients"]
METHODS += ["norm_rollout", "cp_lrp", "attnlrp"]  # value-aware and LRP: GPT-2's fused q/k/v split by its row
OPTIONS = {"integrated_gradients": {"n_steps": 8}}

# 8 integrated-gradient steps leave a completeness error: irrelevant to comparing two computations
pytestmark = pytest.mark.filterwarnings("ignore::attnflow.errors.ExplanationWarning")


def bos_only(model):
    """The model with its tokenizer writing ``[CLS] text`` (no trailing [SEP])."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = model.tokenizer
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", tokenizer.cls_token_id)]
    )
    return model


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def decoder(request, tiny_model_path):
    return bos_only(attnflow.load(str(tiny_model_path(request.param)), device="cpu"))


@pytest.fixture(scope="module")
def explained(decoder):
    """Every method's teacher-forced explanation of CONTINUATION, computed together."""
    result = {}
    for name in METHODS:
        result[name] = attnflow.explain_generation(
            decoder, PROMPT, continuation=CONTINUATION, method=name, steps_per_pass=3, **OPTIONS.get(name, {})
        )
    return result


def test_a_method_the_family_does_not_support_is_refused_in_one_line(decoder):
    family = decoder.adapter.family  # pre-LN decoders: ALTI needs a layer norm after the attention block
    with pytest.raises(ValueError, match=f"alti.*does not support the {family} family"):
        attnflow.explain_generation(decoder, PROMPT, continuation=CONTINUATION, method="alti")


@pytest.mark.parametrize("method", METHODS)
def test_each_step_equals_a_one_step_explanation_of_its_prefix(decoder, explained, method):
    generation = explained[method]
    assert generation.n_prompt == 4 and generation.n_steps == len(WORDS)
    for step, word in enumerate(WORDS):
        prefix = " ".join([PROMPT, *WORDS[:step]])
        target = decoder.tokenizer.convert_tokens_to_ids(word)
        uses_target = attnflow.get_method(method).uses_target
        single = decoder.explain(
            prefix, method=method, row="last", target=target if uses_target else None, **OPTIONS.get(method, {})
        )
        assert list(generation.token_ids[: 4 + step]) == decoder.tokenizer(prefix)["input_ids"]
        np.testing.assert_allclose(generation.step_scores(step), single.scores, rtol=0, atol=1e-5)
        assert np.all(generation.matrix[step, 4 + step :] == 0)  # causal: nothing at or after t_k
        if uses_target:
            assert single.target["index"] == target
            assert generation.log_probs[step] == pytest.approx(single.target["value"], abs=1e-5)
        if single.extras:  # LRP's conservation, per step
            assert generation.step_extras[step] == pytest.approx(single.extras, abs=1e-5)


def test_target_values_are_the_log_probabilities_of_each_token(decoder):
    generation = attnflow.explain_generation(decoder, PROMPT, continuation=CONTINUATION, method="rollout")
    ids = torch.as_tensor(generation.token_ids[None])
    with torch.no_grad():
        log_probs = torch.log_softmax(decoder.model(input_ids=ids).logits[0].double(), dim=-1)
    expected = [float(log_probs[3 + step, generation.token_ids[4 + step]]) for step in range(len(WORDS))]
    np.testing.assert_allclose(generation.log_probs, expected, atol=1e-6)
    np.testing.assert_allclose(generation.probabilities, np.exp(expected), atol=1e-6)


def test_greedy_continuation_equals_transformers_generate(decoder):
    sequence = prepare_continuation(decoder, PROMPT, max_new_tokens=7)
    prompt_ids = torch.as_tensor([decoder.tokenizer(PROMPT)["input_ids"]])
    reference = decoder.model.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=7, do_sample=False, num_beams=1
    )[0, prompt_ids.shape[1] :].tolist()
    eos = decoder.model.generation_config.eos_token_id
    if eos in reference:  # generate pads after the end-of-sequence token; the explanation stops there
        reference = reference[: reference.index(eos) + 1]
    assert sequence.targets.tolist() == reference
    assert sequence.mode == "greedy"


def test_each_step_copy_holds_its_own_gradient(decoder):
    """One shared forward pass, one backward per step (batched) against a per-step loop in plain torch."""
    sequence = prepare_continuation(decoder, PROMPT, continuation=CONTINUATION)
    lengths = [4 + step for step in range(len(WORDS))]
    traces = step_traces(decoder, sequence, range(len(WORDS)), frozenset({"embedding_grads", "target"}))
    embedding = decoder.model.get_input_embeddings()
    mixed = None
    for step, (trace, n) in enumerate(zip(traces, lengths, strict=True)):
        embeddings = embedding(torch.as_tensor(sequence.ids[None, :n])).detach().requires_grad_(True)
        logits = decoder.model(inputs_embeds=embeddings).logits[0, -1]
        y = torch.log_softmax(logits, dim=-1)[int(sequence.targets[step])]
        (expected,) = torch.autograd.grad(y, embeddings)
        np.testing.assert_allclose(trace.embedding_grads, expected[0].numpy(), rtol=1e-4, atol=1e-6)
        assert trace.target.index == int(sequence.targets[step])
    # One backward of sum_k y_k through a single copy mixes the steps: it is not any step's gradient.
    n = lengths[-1]
    embeddings = embedding(torch.as_tensor(sequence.ids[None, :n])).detach().requires_grad_(True)
    log_probs = torch.log_softmax(decoder.model(inputs_embeds=embeddings).logits[0], dim=-1)
    total = sum(log_probs[length - 1, int(sequence.targets[step])] for step, length in enumerate(lengths))
    (mixed,) = torch.autograd.grad(total, embeddings)
    assert not np.allclose(traces[-1].embedding_grads, mixed[0].numpy(), atol=1e-4)


def test_a_trailing_special_token_is_dropped_and_specials_are_never_top_sources(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu")  # its tokenizer appends [SEP]
    generation = attnflow.explain_generation(model, PROMPT, continuation="good", method="gradient")
    assert generation.sources == ["[CLS]", "the", "movie", "was"]
    assert generation.special_mask.tolist() == [True, False, False, False, False]
    assert all(token != "[CLS]" for _, token, _ in generation.top_sources(0, k=10))


def test_several_methods_share_one_generation(decoder):
    first, second = attnflow.explain_generation(decoder, PROMPT, max_new_tokens=3, method=["rollout", "gradient"])
    assert first.method == "rollout" and second.method == "gradient"
    assert first.generated == second.generated and np.array_equal(first.log_probs, second.log_probs)


def test_faithfulness_removes_each_steps_top_sources(decoder):
    generation = attnflow.explain_generation(
        decoder, PROMPT, continuation=CONTINUATION, method="gradient", faithfulness=True
    )
    faithfulness = generation.faithfulness
    step = 2  # 6 sources, 5 content ones: the 50 % bin removes the top ceil(2.5) = 3
    ranking = np.argsort(-np.where(generation.special_mask[:6], -np.inf, generation.step_scores(step)))[:3]
    kept = [int(t) for i, t in enumerate(generation.token_ids[:6]) if i not in set(ranking.tolist())]
    with torch.no_grad():
        logits = decoder.model(input_ids=torch.as_tensor([kept])).logits[0, -1]
    expected = float(torch.softmax(logits.double(), dim=-1)[generation.token_ids[6]])
    assert faithfulness["bins"][-1] == 0.5
    assert faithfulness["perturbed_probability"][step][-1] == pytest.approx(expected, abs=1e-6)
    drops = generation.probabilities[step] - np.asarray(faithfulness["perturbed_probability"][step])
    assert faithfulness["aopc"][step] == pytest.approx(drops.mean(), abs=1e-9)


def test_bad_input_is_one_clear_line(decoder, tiny_model_path):
    with pytest.raises(InputError, match="at least 1; got 0"):
        attnflow.explain_generation(decoder, PROMPT, max_new_tokens=0)
    with pytest.raises(InputError, match=r"exceed .* context of 60 tokens \(at most 56 new tokens\)"):
        attnflow.explain_generation(decoder, PROMPT, max_new_tokens=61)
    with pytest.raises(InputError, match=r"either max_new_tokens .* or continuation"):  # the command line: --generate
        attnflow.explain_generation(decoder, PROMPT, max_new_tokens=2, continuation="good")
    with pytest.raises(InputError, match=r"does not explain generated tokens; methods that do: .*grad_rollout"):
        attnflow.explain_generation(decoder, PROMPT, max_new_tokens=2, method="random")
    assert "random" not in generation_methods() and "rollout" in generation_methods()
    encoder = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    with pytest.raises(InputError, match=r"is an encoder model: .* needs a causal LM"):
        attnflow.explain_generation(encoder, PROMPT, max_new_tokens=2)
    vision = attnflow.load(str(tiny_model_path("vit")), device="cpu")
    with pytest.raises(InputError, match="is a vision model"):
        attnflow.explain_generation(vision, PROMPT, max_new_tokens=2)


def test_cli_writes_matrix_page_and_figure(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "out"
    path = str(tiny_model_path("gpt2"))
    argv = ["explain", PROMPT, "--model", path, "--continuation", "good < > cat", "--method", "rollout,gradient"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    data = json.loads((out / "gradient" / "generation.json").read_text())
    assert data["generated"] == ["good", "<", ">", "cat"] and data["mode"] == "teacher-forced"
    assert [len(row) for row in data["matrix"]] == [4, 5, 6, 7]  # [CLS] the movie was ([SEP] dropped), then causal
    assert len(data["steps"]) == 4 and 0 < data["steps"][0]["probability"] < 1
    page = (out / "rollout" / "generation.html").read_text()
    assert "<span>&lt;</span>" in page and "<span><</span>" not in page  # every token escaped
    assert 'title="&#x27;&lt;&#x27; → &#x27;&gt;&#x27;' in page  # hover: source → generated, escaped
    assert (out / "rollout" / "generation.png").stat().st_size > 0
    comparison = (out / "comparison.html").read_text()  # several methods: side by side on one page
    assert comparison.index('id="method-rollout"') < comparison.index('id="method-gradient"')  # as asked
    assert 'href="gradient/generation.html"' in comparison and "<span><</span>" not in comparison
    for method in ("rollout", "gradient"):  # each method's own heatmap rows, as on its own page
        own = (out / method / "generation.html").read_text()
        rows = re.findall(r"<tr>.*?</tr>", own.split('id="matrix"')[1].split("</table>")[0], flags=re.S)
        assert rows and all(row in comparison for row in rows)
    assert main([*argv, "--out", str(out), "--quiet"]) == 2  # an earlier run is only replaced with --overwrite
    assert "--overwrite" in capsys.readouterr().err
    single = ["explain", PROMPT, "--model", path, "--continuation", "good", "--method", "rollout"]
    assert main([*single, "--out", str(out), "--quiet", "--overwrite"]) == 0  # replaced, nothing stale left
    assert sorted(entry.name for entry in out.iterdir()) == ["generation.html", "generation.json", "generation.png"]
    assert json.loads((out / "generation.json").read_text())["generated"] == ["good"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--generate", "0"], "--generate takes the number of new tokens, at least 1; got 0"),
        (["--generate", "2", "--continuation", "good"], "not both"),
        (["--generate", "99"], "context of 60 tokens"),
        (["--generate", "2", "--method", "random"], "does not explain generated tokens; methods that do:"),
    ],
)
def test_cli_bad_input_is_one_line(tiny_model_path, tmp_path, capsys, extra, message):
    argv = ["explain", PROMPT, "--model", str(tiny_model_path("gpt2")), "--out", str(tmp_path / "o"), "--quiet"]
    assert main(argv + extra) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


@pytest.mark.parametrize(("family", "kind"), [("bert", "an encoder"), ("vit", "a vision")])
def test_cli_refuses_generation_on_encoders_and_vision_models(tiny_model_path, tmp_path, capsys, family, kind):
    argv = ["explain", PROMPT, "--model", str(tiny_model_path(family)), "--generate", "2", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err.strip()
    assert f"is {kind} model" in error and len(error.splitlines()) == 1


def test_cli_json_without_out_prints_one_object_per_method(tiny_model_path, capsys):
    argv = ["explain", PROMPT, "--model", str(tiny_model_path("llama")), "--generate", "3", "--json", "--quiet"]
    assert main([*argv, "--method", "rollout,grad_x_input"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [data["method"] for data in printed] == ["rollout", "grad_x_input"]
    assert printed[0]["generated"] == printed[1]["generated"] and len(printed[0]["steps"]) <= 3


@pytest.mark.slow
def test_smollm2_explains_its_greedy_continuation():
    model = attnflow.load("smollm2", device="cpu")
    rollout, gradient = attnflow.explain_generation(
        model, "The capital of France is", max_new_tokens=3, method=["rollout", "grad_x_input"]
    )
    assert rollout.generated[0] == "ĠParis" and rollout.probabilities[0] > 0.5
    assert gradient.matrix.shape == (3, 5 + 2) and np.all(gradient.matrix[0, 5:] == 0)
    assert "Paris" in rollout.to_html()


def test_the_steps_notes_are_given_once_per_kind():
    """Notes that differ only in their numbers (a collapse note per step) are one note, naming its steps."""
    steps = [
        ["55 % on the first token 'Once'"],
        [],
        ["51 % on the first token 'Once'", "other"],
        ["60.5 % on the first token 'Once'"],
    ]
    assert condensed_notes(steps) == [
        "55 % on the first token 'Once' (step 1; this note on 3 of 4 steps: 1, 3–4)",
        "other (step 3; this note on 1 of 4 steps: 3)",
    ]
    assert condensed_notes([["a note"]]) == ["a note"]


def test_a_one_pass_method_is_checked_step_by_step_like_the_target_methods(tiny_model_path, monkeypatch):
    """One rule for every method: the row of each step (not the whole sequence's last row) is checked
    for a collapse, the note names the method and is said once for the run with the steps it concerns."""
    from attnflow import generation
    from attnflow.errors import ExplanationWarning

    model = bos_only(attnflow.load(str(tiny_model_path("llama")), device="cpu"))
    real = generation.sequence_trace

    def sinking(model, sequence, needs):  # every row that can see it puts all its attention on "the"
        trace = real(model, sequence, needs)
        sink = np.zeros((trace.n_tokens, trace.n_tokens), dtype=np.float32)
        sink[:, 1] = 1.0
        sink[0, 0], sink[0, 1] = 1.0, 0.0  # row 0 sees only itself
        trace.attentions[:] = sink
        return trace

    monkeypatch.setattr(generation, "sequence_trace", sinking)
    with pytest.warns(ExplanationWarning) as said:
        explanation = attnflow.explain_generation(model, PROMPT, continuation=CONTINUATION, method="rollout")
    (message,) = [str(warning.message) for warning in said]
    assert message.startswith("rollout: 75% of the relevance is on one token, 'the'"), message
    assert message.endswith("(step 1; this note on 5 of 5 steps: 1–5)")
    assert explanation.notes == [message.removeprefix("rollout: ")]
