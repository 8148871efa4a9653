"""The explorer's generation view (attnflow.generation_exploration, viz/generation_explorer).

The page's data chunks are decoded here in Python (`test_exploration.chunked`: explicit loops)
and compared with `attnflow.explain_generation` run on its own; the per-layer rows with an
explicit rollout loop over a separate trace and with raw attention's ``layer`` option.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnflow
from attnflow.cli import main
from attnflow.errors import InputError
from attnflow.generation import GenerationExplanation
from attnflow.generation_exploration import GenerationExploration, GenerationView, explore_generation
from attnflow.methods.registry import get_method
from test_exploration import assert_within_quantisation, chunked, decode_page

PROMPT = "the movie was"
WORDS = ["good", "but", "the", "cat", "sat"]  # whole words of the tiny vocabulary
CONTINUATION = " ".join(WORDS)
METHODS = ["rollout", "raw", "grad_rollout", "grad_x_input", "leave_one_out"]
HOSTILE = ["<img src=x onerror=alert(1)>", "</script><script>alert(2)</script>", "a&b"]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def decoder(request, tiny_model_path):
    return attnflow.load(str(tiny_model_path(request.param)), device="cpu")


@pytest.fixture(scope="module")
def explored(decoder):
    return explore_generation(decoder, PROMPT, continuation=CONTINUATION, methods=METHODS, faithfulness=True)


def test_the_page_carries_explain_generations_numbers(decoder, explored):
    meta, chunks = decode_page(explored.to_html())
    expected = attnflow.explain_generation(
        decoder, PROMPT, continuation=CONTINUATION, method=METHODS, faithfulness=True
    )
    n_prompt, n_steps = 4, len(WORDS)  # [CLS] the movie was (the tokenizer's trailing [SEP] dropped)
    special = [0]
    assert meta["n_prompt"] == n_prompt and len(meta["steps"]) == n_steps
    assert meta["tokens"] == ["[CLS]", "the", "movie", "was", *WORDS]
    assert meta["special"] == [True] + [False] * 8
    assert "".join(meta["pieces"]) == "[CLS] the movie was good but the cat sat"  # the running text
    np.testing.assert_allclose([s["log_prob"] for s in meta["steps"]], expected[0].log_probs, atol=1e-9)
    np.testing.assert_allclose([s["probability"] for s in meta["steps"]], np.exp(expected[0].log_probs), atol=1e-9)
    assert [entry["name"] for entry in meta["methods"]] == METHODS
    for entry, generation in zip(meta["methods"], expected, strict=True):
        assert entry["matrix"]["shape"] == [1, n_steps, n_prompt + n_steps - 1]
        assert entry["matrix"]["exact_columns"] == special
        decoded = chunked(entry["matrix"], chunks)[0]  # [step, source]
        assert_within_quantisation(decoded, generation.matrix, special)
        for step in range(n_steps):
            assert np.all(decoded[step, n_prompt + step :] == 0)  # causally absent: blank
            top = [(index, score) for index, _, score in generation.top_sources(step, 3)]
            assert [index for index, _ in entry["top"][step]] == [index for index, _ in top]
            np.testing.assert_allclose([score for _, score in entry["top"][step]], [s for _, s in top], rtol=1e-9)
        np.testing.assert_allclose(entry["faithfulness"]["aopc"], generation.faithfulness["aopc"], atol=1e-9)
        assert entry["signed"] == (generation.method == "leave_one_out")


def test_layers_are_each_layers_row_predicting_the_token(decoder, explored):
    """rollout after layer l: R⁽ˡ⁾ = Ã⁽ˡ⁾ ⋯ Ã⁽⁰⁾ with Ã = ½(mean_h A + I), written out over a trace of
    the text (causal: rows before the continuation's last token do not see it); raw after layer l:
    explain_generation with raw's own ``layer`` option."""
    meta, chunks = decode_page(explored.to_html())
    n_prompt, sources = 4, 4 + len(WORDS) - 1
    trace = decoder.trace(f"{PROMPT} {CONTINUATION}")[0]
    assert trace.token_ids[:sources].tolist() == explored.first.token_ids[:sources].tolist()
    attentions = np.asarray(trace.attentions, dtype=np.float64)[:, :, :sources, :sources]
    joint = np.eye(sources)
    rollout = explored.method("rollout")
    raw = explored.method("raw")
    assert rollout.first_layer == raw.first_layer == 0 and rollout.layers.shape == (2, len(WORDS), sources)
    for layer in range(decoder.n_layers):
        joint = (0.5 * attentions[layer].mean(axis=0) + 0.5 * np.eye(sources)) @ joint
        by_layer = attnflow.explain_generation(decoder, PROMPT, continuation=CONTINUATION, method="raw", layer=layer)
        for step in range(len(WORDS)):
            n = n_prompt + step
            np.testing.assert_allclose(rollout.layers[layer, step, :n], joint[n - 1, :n], atol=1e-6)
            np.testing.assert_allclose(raw.layers[layer, step], by_layer.matrix[step], atol=1e-6)
            assert np.all(rollout.layers[layer, step, n:] == 0)
    np.testing.assert_allclose(rollout.layers[-1], rollout.explanation.matrix, atol=1e-9)  # the final scores
    entry = meta["methods"][METHODS.index("rollout")]
    assert len(entry["layers"]["chunks"]) == decoder.n_layers  # one chunk per layer
    assert_within_quantisation(chunked(entry["layers"], chunks), rollout.layers, [0])
    assert explored.method("grad_rollout").layers is None  # not layerwise: final scores only
    assert meta["methods"][METHODS.index("grad_rollout")]["layers"] is None


def test_default_methods_explain_generations_and_are_not_expensive(decoder):
    exploration = attnflow.explore_generation(decoder, PROMPT, max_new_tokens=2)
    family = decoder.adapter.family
    shown = [view.name for view in exploration.views]
    for name in attnflow.available_methods():
        spec = get_method(name)
        explains = spec.uses_target or (not spec.scores_only and spec.takes != "model")  # a target, or a matrix
        assert (name in shown) == (explains and spec.supports(decoder.adapter) and spec.cost != "expensive"), name
    assert "slow" in exploration.skipped["leave_one_out"] and "explain generated" in exploration.skipped["random"]
    if family == "gpt2":  # pre-LN: no layer norm after the attention block for ALTI
        assert exploration.skipped["alti"] == "does not support the gpt2 family"
    assert exploration.first.mode == "greedy" and exploration.first.n_steps <= 2


def hostile_exploration(tokens: list[str], model: str, prompt: str) -> GenerationExploration:
    """A 2-token prompt and 3 generated ``tokens[2:]`` as a rollout generation view, the strings as given."""
    generation = GenerationExplanation(
        model=model,
        method="rollout",
        options={},
        prompt=prompt,
        sources=tokens[:-1],
        generated=tokens[2:],
        token_ids=np.arange(5),
        n_prompt=2,
        special_mask=[True, False, False, False, False],
        matrix=np.tril(np.ones((3, 4)), k=1),
        log_probs=np.log([0.5, 0.25, 0.125]),
        mode="greedy",
    )
    return GenerationExploration([GenerationView(generation, "rollout")], pieces=tokens, n_layers=2)


def test_hostile_tokens_reach_the_page_as_data_only():
    tokens = ["[CLS]", "a", *HOSTILE]
    exploration = hostile_exploration(tokens, model='<b>"model"</b>', prompt="<i>prompt</i>")
    html = exploration.to_html()
    meta, chunks = decode_page(html)
    assert "<img" not in html and "alert(2)</script>" not in html and "<b>" not in html and "<i>" not in html
    assert html.count("<script") == 2 + len(chunks)  # the metadata, the chunks and the one script
    assert meta["tokens"] == tokens and meta["pieces"] == tokens


def test_bad_input_is_one_line(decoder, tiny_model_path):
    with pytest.raises(InputError, match=r"either max_new_tokens .* or continuation"):
        explore_generation(decoder, PROMPT)
    with pytest.raises(InputError, match="does not explain generated tokens; methods that do"):
        explore_generation(decoder, PROMPT, max_new_tokens=2, methods=["random"])
    with pytest.raises(ValueError, match="no methods"):
        explore_generation(decoder, PROMPT, max_new_tokens=2, methods=[])
    encoder = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    with pytest.raises(InputError, match="is an encoder model"):
        explore_generation(encoder, PROMPT, max_new_tokens=2, methods=["rollout"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--generate", "0"], "--generate takes the number of new tokens, at least 1; got 0"),
        (["--generate", "2", "--continuation", "good"], "not both"),
        (["--generate", "99"], "context of 60 tokens"),
        (["--generate", "2", "--methods", "random"], "does not explain generated tokens; methods that do:"),
        (["--generate", "2", "--row", "last"], "--row does not apply with --generate"),
        (["--generate", "2", "--target", "3"], "each step's target is its own token: drop --target*"),
        (["--generate", "2", "--max-tokens", "8"], "--max-length does not apply with --generate"),
        (["--faithfulness"], "--faithfulness and --steps-per-pass go with --generate N or --continuation TEXT"),
        (["--generate", "2", "--steps-per-pass", "0"], "--steps-per-pass must be at least 1"),
    ],
)
def test_cli_bad_input_is_one_line(tiny_model_path, tmp_path, capsys, extra, message):
    argv = ["explore", PROMPT, "--model", str(tiny_model_path("gpt2")), "--out", str(tmp_path / "o"), "--quiet"]
    assert main(argv + extra) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_cli_writes_the_page(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["explore", PROMPT, "--model", str(tiny_model_path("llama")), "--continuation", "good but"]
    assert main([*argv, "--methods", "rollout,gradient", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "teacher-forced continuation: 'good but'" in printed and "methods: rollout, gradient" in printed
    meta, _ = decode_page((out / "explorer.html").read_text(encoding="utf-8"))
    assert [entry["name"] for entry in meta["methods"]] == ["rollout", "gradient"]
    assert all(entry["faithfulness"] is None for entry in meta["methods"])  # only with --faithfulness
    assert main([*argv, "--out", str(out), "--quiet"]) == 2  # an earlier page is only replaced with --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--out", str(out), "--quiet", "--overwrite"]) == 0


def test_save_notebook_and_package_root(tmp_path, explored):
    assert attnflow.explore_generation is explore_generation
    path = explored.save(tmp_path / "page")
    assert path.name == "explorer.html" and path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    frame = explored._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in frame and "<script" not in frame


@pytest.mark.filterwarnings("ignore::attnflow.errors.ExplanationWarning")  # rollout's attention-sink note
def test_smollm2_generation_view(smollm2):
    exploration = attnflow.explore_generation(
        smollm2, "The capital of France is", max_new_tokens=3, methods=["rollout", "grad_x_input"]
    )
    first = exploration.first
    assert first.generated[0] == "ĠParis" and first.probabilities[0] > 0.5
    assert exploration.pieces[first.n_prompt] == " Paris"  # the running text keeps the space
    meta, chunks = decode_page(exploration.to_html())
    assert meta["display"][first.n_prompt] == "Paris"
    rollout = exploration.method("rollout")
    assert rollout.layers.shape == (smollm2.n_layers, 3, first.n_prompt + 2)
    decoded = chunked(meta["methods"][1]["matrix"], chunks)[0]
    assert meta["methods"][1]["matrix"]["exact_columns"] == [0]  # 'The', the attention sink (not special)
    assert_within_quantisation(decoded, exploration.method("grad_x_input").explanation.matrix, [0])
