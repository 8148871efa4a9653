"""Capture against independent oracles: the model's own `output_attentions`, and head outputs
recomputed from each layer's own weights (A·V for every family; the full softmax(QKᵀ/√d)V for
the families with plain scaled dot-product attention)."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import CaptureError, InputError, ModelLoadError
from attnflow.rows.adapters import find_layers

from tiny_models import TEXT_FAMILIES, VISION_FAMILIES

TEXT = "the movie was terrible, but the acting was great."
SHORT = "hi there."


def _value_states(family: str, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """V = hidden · W_V + b_V from the attention module's own projection: [batch, token, kv_heads * d]."""
    if family in ("bert", "roberta", "electra"):
        return module.value(hidden)
    if family == "distilbert":
        return module.v_lin(hidden)
    if family in ("mpnet", "t5"):
        return module.v(hidden)
    if family == "gpt2":
        return module.c_attn(hidden).split(module.split_size, dim=2)[2]
    return module.v_proj(hidden)  # llama, vit, deit, dinov2, bart


def _scores(family: str, module: torch.nn.Module, hidden: torch.Tensor, n_heads: int) -> torch.Tensor | None:
    """softmax logits QKᵀ/√d from the layer's own weights, for plain scaled dot-product families."""
    if family in ("bert", "roberta", "electra"):
        q, k = module.query(hidden), module.key(hidden)
    elif family == "distilbert":
        q, k = module.q_lin(hidden), module.k_lin(hidden)
    elif family == "gpt2":
        q, k, _ = module.c_attn(hidden).split(module.split_size, dim=2)
    elif family in ("vit", "deit", "dinov2"):
        q, k = module.q_proj(hidden), module.k_proj(hidden)
    else:
        return None
    q, k = (_split_heads(t, n_heads) for t in (q, k))  # [batch, head, token, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if family == "gpt2":
        n = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores


def _split_heads(states: torch.Tensor, n_heads: int) -> torch.Tensor:
    batch, tokens, width = states.shape
    return states.reshape(batch, tokens, n_heads, width // n_heads).transpose(1, 2)


@contextmanager
def _attention_inputs(model: torch.nn.Module, pattern: str):
    """Test-side hooks recording each attention module's input hidden states."""
    inputs: list[torch.Tensor] = []
    handles = []

    def hook(module, args, kwargs):
        inputs.append(args[0] if args else kwargs["hidden_states"])

    try:
        for _, module in find_layers(model, pattern):
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


def _check_head_outputs(family: str, model: "attnflow.AttentionModel", trace: attnflow.Trace, hidden_states):
    modules = [module for _, module in find_layers(model.model, model.adapter.stack.attention)]
    for layer, (module, hidden) in enumerate(zip(modules, hidden_states)):
        values = _split_heads(_value_states(family, module, hidden), -1 if False else _kv_heads(model))
        values = values.repeat_interleave(model.n_heads // values.shape[1], dim=1)  # GQA: share kv heads
        attention = torch.from_numpy(trace.attentions[layer])[None]  # [1, head, query, key]
        expected = (attention @ values)[0].transpose(0, 1)  # [token, head, d_head]
        np.testing.assert_allclose(trace.head_outputs[layer], expected.detach().numpy(), atol=2e-5, rtol=1e-4)
        scores = _scores(family, module, hidden, model.n_heads)
        if scores is not None:
            recomputed = (torch.softmax(scores, dim=-1) @ values)[0].transpose(0, 1)
            np.testing.assert_allclose(trace.head_outputs[layer], recomputed.detach().numpy(), atol=2e-5, rtol=1e-4)


def _kv_heads(model) -> int:
    return getattr(model.config, "num_key_value_heads", None) or model.n_heads


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_text_capture_matches_output_attentions_and_weights(family, tiny_model_path):
    model = attnflow.load(str(tiny_model_path(family)), device="cpu")
    with _attention_inputs(model.model, model.adapter.stack.attention) as hidden_states:
        trace = model.trace(TEXT, targets="the film was good." if model.kind == "encoder-decoder" else None)[0]
    n = len(trace.tokens)
    assert trace.attentions.shape == (2, 4, n, n) and trace.head_outputs.shape == (2, n, 4, 8)
    assert trace.special_mask[0] and trace.tokens[0] == "[CLS]"
    np.testing.assert_allclose(trace.attentions.sum(-1), 1.0, atol=1e-5)

    ids = torch.tensor(trace.token_ids)[None]
    if model.kind == "encoder-decoder":
        decoder_ids = torch.tensor(model.tokenizer.convert_tokens_to_ids(trace.decoder_tokens))[None]
        out = model.model(input_ids=ids, decoder_input_ids=decoder_ids, output_attentions=True)
        pairs = [
            (trace.attentions, out.encoder_attentions),
            (trace.decoder_attentions, out.decoder_attentions),
            (trace.cross_attentions, out.cross_attentions),
        ]
        assert trace.cross_attentions.shape[-2:] == (len(trace.decoder_tokens), n)
    else:
        out = model.model(input_ids=ids, output_attentions=True)
        pairs = [(trace.attentions, out.attentions)]
    for captured, reference in pairs:
        np.testing.assert_allclose(captured, torch.stack(reference, dim=1)[0].detach().numpy(), atol=1e-6)
    _check_head_outputs(family, model, trace, hidden_states[: model.n_layers])
    if model.kind == "decoder":
        assert np.allclose(np.triu(trace.attentions, k=1), 0.0), "decoder attention must be causal"


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_vision_capture(family, tiny_model_path, tmp_path):
    from PIL import Image

    image = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(0).random((24, 20, 3)) * 255).astype("uint8")).save(image)
    model = attnflow.load(str(tiny_model_path(family)), device="cpu")
    with _attention_inputs(model.model, model.adapter.stack.attention) as hidden_states:
        trace = model.trace_image(image)
    prefix = 2 if family == "deit" else 1
    assert trace.grid == (4, 4) and trace.n_prefix_tokens == prefix  # 16 px image / 4 px patches
    assert trace.attentions.shape == (2, 4, prefix + 16, prefix + 16)
    _check_head_outputs(family, model, trace, hidden_states)
    with pytest.raises(FileNotFoundError, match="no image file"):
        model.trace_image(tmp_path / "missing.png")
    with pytest.raises(InputError, match="vision model"):
        model.trace("text")


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "mpnet"])
def test_batched_mixed_lengths_equal_one_by_one(family, tiny_model_path):
    model = attnflow.load(str(tiny_model_path(family)), device="cpu")
    texts = [TEXT, SHORT, "a cat sat on the mat and the dog ran."]
    batched = model.trace(texts, batch_size=3)
    for text, trace in zip(texts, batched):
        single = model.trace(text)[0]
        assert single.tokens == trace.tokens
        np.testing.assert_allclose(trace.attentions, single.attentions, atol=1e-5)
        np.testing.assert_allclose(trace.head_outputs, single.head_outputs, atol=1e-5)
        np.testing.assert_array_equal(trace.offsets, single.offsets)


def test_output_weights_rebuild_the_projection(tiny_model_path):
    """Σ_h Z_h W_Oʰ + b_O equals the output projection's own output: the per-head slices are right."""
    for family in ("bert", "gpt2"):
        model = attnflow.load(str(tiny_model_path(family)), device="cpu")
        trace = model.trace(TEXT)[0]
        projection = find_layers(model.model, model.adapter.stack.output_projection)[0][1]
        z = torch.from_numpy(trace.head_outputs[0])  # [token, head, d_head]
        expected = projection(z.reshape(z.shape[0], -1)).detach().numpy()
        rebuilt = (
            np.einsum("thd,hdm->tm", trace.head_outputs[0], trace.output_weights[0]) + projection.bias.detach().numpy()
        )
        np.testing.assert_allclose(rebuilt, expected, atol=1e-5)


def _hook_count(module: torch.nn.Module) -> int:
    """attnflow's hooks left on the model (transformers keeps inactive recorder hooks of its own)."""
    hooks = [h for m in module.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    return sum(1 for h in hooks if getattr(h, "__module__", "").startswith("attnflow"))


def test_no_hook_survives_a_raising_forward(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    assert _hook_count(model.model) == 0
    first_feed_forward = find_layers(model.model, r"layer\.(\d+)\.output\.dense$")[0][1]

    seen_during_forward = []

    def explode(module, args):
        seen_during_forward.append(_hook_count(model.model))
        raise RuntimeError("boom")

    bomb = first_feed_forward.register_forward_pre_hook(explode)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model.trace(TEXT)
    finally:
        bomb.remove()
    assert seen_during_forward[0] == 2 * model.n_layers  # weights + head-output hooks were live
    assert _hook_count(model.model) == 0
    assert model.trace(TEXT)[0].attentions.shape[0] == 2  # and capture still works afterwards


def test_capture_stops_after_the_last_attention_layer(tiny_model_path):
    """Nothing after the last layer's head outputs is computed (its feed-forward block, the pooler),
    and the captured numbers still equal a full forward pass's (the tests above)."""
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    calls = []
    feed_forwards = find_layers(model.model, r"layer\.(\d+)\.output\.dense$")
    handles = [
        module.register_forward_hook(lambda *_, i=i: calls.append(i)) for i, (_, module) in enumerate(feed_forwards)
    ]
    try:
        capture = model.capture_batch(torch.tensor([[2, 20, 21, 3]]))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [0]  # layer 0's feed-forward ran, layer 1's (the last) did not
    assert len(capture.layer_attentions) == 2 and capture.head_outputs.shape == (1, 2, 4, 4, 8)
    assert _hook_count(model.model) == 0


def test_missing_attention_weights_is_a_clear_error(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    model.model.set_attn_implementation("sdpa")  # fused attention returns no weights
    try:
        with pytest.raises(CaptureError, match="eager"):
            model.trace(TEXT)
    finally:
        model.model.set_attn_implementation("eager")
    assert _hook_count(model.model) == 0


def test_unknown_model_names_list_the_aliases():
    with pytest.raises(ModelLoadError, match="minilm, mpnet, smollm2.*did you mean 'minilm'"):
        attnflow.load("minilmm")
    with pytest.raises(ModelLoadError, match="aliases"):
        attnflow.load("no such model!")


def test_local_folder_with_an_unknown_model_type_names_it(tiny_model_path, tmp_path):
    """A model type transformers does not know (one it knows but no hand row names is inferred)."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_model_path("bert") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no-such-family"}))
    with pytest.raises(
        ModelLoadError, match="model_type 'no-such-family', which transformers .* does not know.*docs/extending.md"
    ) as caught:
        attnflow.load(str(folder), device="cpu")
    assert "hub id" not in str(caught.value)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 32}))
    with pytest.raises(ModelLoadError, match="names no model_type"):
        attnflow.load(str(folder), device="cpu")


def test_gguf_progress_bar_follows_the_progress_switch():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from attnflow.capture.loading import _gguf_progress

    original = gguf_utils.tqdm
    with _gguf_progress(False):
        assert gguf_utils.tqdm(range(3)).disable  # what transformers' dequantisation loop calls
    with _gguf_progress(True):
        assert not gguf_utils.tqdm(range(3), file=None).disable
    assert gguf_utils.tqdm is original


def test_bad_text_and_truncation(tiny_model_path, caplog):
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    for bad in ["", "   \n"]:
        with pytest.raises(InputError, match="empty"):
            model.trace(bad)
    long_text = " ".join(["movie"] * 200)
    with caplog.at_level("WARNING"):
        trace = model.trace(long_text)[0]
    assert len(trace.tokens) == model.max_length == 60 and "truncated" in caplog.text
    assert len(model.trace(long_text, max_length=10)[0].tokens) == 10
    with pytest.raises(InputError, match="exceeds"):
        model.trace(long_text, max_length=1000)
    assert len(model.trace(long_text, max_length=3)[0].tokens) == 3  # [CLS] movie [SEP]
    with pytest.raises(InputError, match=r"max_length 2 leaves no token of the text.*give at least 3"):
        model.trace(long_text, max_length=2)  # [CLS] [SEP]: before, an all-zero map and status 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (None, r"no text given \(None\)"),
        (b"caf\xc3\xa9", "got bytes: decode it first"),
        (bytearray(b"abc"), "got bytearray"),
        (["fine", b"bytes"], r"got bytes.*\(text 1\)"),
        (["fine", None], r"got NoneType \(text 1\)"),
        (["fine", "  "], r"empty \(text 1\)"),
        ([], "the list of texts is empty"),
        (42, "got int"),
        ("caf\udce9 au lait", "not valid UTF-8: byte 0xe9 at character 3"),
    ],
)
def test_texts_that_are_not_text_are_clear_errors(tiny_model_path, bad, message):
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    with pytest.raises(InputError, match=message):
        model.trace(bad)


def test_transformers_too_long_warning_is_silenced(tiny_model_path, capfd, caplog):
    """attnflow warns about truncation itself; transformers' "indexing errors" line was a second, wrong one."""
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    with caplog.at_level("WARNING"):
        model.trace(" ".join(["movie"] * 200))
    assert "truncated to 60" in caplog.text
    assert "indexing errors" not in capfd.readouterr().err + caplog.text


# -- the real embedded model ------------------------------------------------------------------


def test_text_that_is_mostly_unknown_tokens_warns(minilm, caplog):
    with caplog.at_level("WARNING"):
        trace = minilm.trace(["😀 🎉 🙈", "😀 🎉 ok", "😀 ok", "The movie was terrible."])
    unknown = [(t.tokens.count("[UNK]"), len(t.tokens) - 2) for t in trace]
    assert unknown == [(3, 3), (2, 3), (1, 2), (0, 5)]  # half [UNK] ("😀 ok") is not "mostly"
    warnings = [r.getMessage() for r in caplog.records if "unknown token" in r.getMessage()]
    assert len(warnings) == 2
    assert warnings[0].startswith("text '😀 🎉 🙈': all of its 3 tokens are the unknown token [UNK]")
    assert warnings[1].startswith("text '😀 🎉 ok': 2 of its 3 tokens")


def test_minilm_capture_against_its_own_weights(minilm):
    with _attention_inputs(minilm.model, minilm.adapter.stack.attention) as hidden_states:
        traces = minilm.trace([TEXT, SHORT])
    # hidden_states holds the batched inputs; check the first text against its own rows
    trace = traces[0]
    n = len(trace.tokens)
    assert (minilm.n_layers, minilm.n_heads, minilm.d_head) == (6, 12, 32)
    assert trace.tokens[0] == "[CLS]" and trace.tokens[-1] == "[SEP]" and trace.tokens[4] == "terrible"
    _check_head_outputs("bert", minilm, trace, [h[:1, :n] for h in hidden_states])
    out = minilm.model(**minilm.tokenizer(TEXT, return_tensors="pt"), output_attentions=True)
    np.testing.assert_allclose(trace.attentions, torch.stack(out.attentions, 1)[0].detach().numpy(), atol=1e-5)
    single = minilm.trace(SHORT)[0]
    np.testing.assert_allclose(traces[1].attentions, single.attentions, atol=1e-5)


def test_default_rows(minilm, tiny_model_path):
    """Mean-pooled sentence encoders summarise with the mean row; decoders with the last; others CLS."""
    assert minilm.default_row == "mean"
    assert minilm.trace(SHORT)[0].meta["default_row"] == "mean"
    assert attnflow.load(str(tiny_model_path("bert")), device="cpu").default_row == "cls"
    assert attnflow.load(str(tiny_model_path("gpt2")), device="cpu").default_row == "last"
