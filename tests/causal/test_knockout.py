"""Attention knockout (the ``knockout`` site kind) against an independent oracle: the same run with
the attention weights changed after the softmax, A[target, source] = 0 and the row renormalised,
in the window's layers only; blocking an edge a query cannot see changes nothing, bit for bit;
blocking every key but the query itself leaves one-hot attention; `attnflow.patch` and
`attnflow patch --sites knockout` report (m_clean − m_blocked) / (m_clean − m_corrupted)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from causal_texts import CLEAN, CORRUPT

import attnflow
from attnflow.capture.hooks import record_stack
from attnflow.causal import patch
from attnflow.causal.patching import Metric, Patches, PatchRunner
from attnflow.causal.sites import Site
from attnflow.errors import CaptureError, InputError
from attnflow.rows.adapters import ADAPTERS, Stack, find_layers, register_adapter, unregister_adapter

# Decoders and the BERT-like encoders; their eager attention adds the mask each module receives.
FAMILIES = ("llama", "qwen2", "gemma3", "gpt2", "bert", "distilbert", "mpnet")
DECODERS = ("llama", "qwen2", "gemma3", "gpt2")


def ids_of(model, text: str = CLEAN) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt")["input_ids"]


def knocked_out(model, ids: torch.Tensor, edges: list[tuple[int, int]], layers: tuple[int, ...], record=False):
    """``(output [batch, token, ...], attention weights per layer)`` of one row with each edge
    (query, key) blocked at ``layers`` through the site table's knockout hooks."""
    runner = PatchRunner(model, Metric("class", 0))
    patches = Patches()
    for query, key in edges:
        patches.add(0, Site("knockout", layers[0], key, query, layers), None)
    with torch.no_grad(), runner._hooks(patches, {}, None, False, {}):
        return _run(model, ids, record)


def _run(model, ids, record):
    if not record:
        return model.model(input_ids=ids, attention_mask=torch.ones_like(ids))[0], None
    with record_stack(model.model, model.adapter.stack, head_outputs=False) as recording:
        output = model.model(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
    return output, recording.layer_weights()


def renormalised_after_softmax(model, ids, query: int, key: int, layers: tuple[int, ...], monkeypatch):
    """The oracle: the model run with A[query, key] = 0 and row ``query`` renormalised, written
    after the softmax of the attention modules of ``layers`` (every head)."""
    inside: list[bool] = []
    original = torch.nn.functional.softmax

    def softmax(*args, **kwargs):
        weights = original(*args, **kwargs)
        if not inside or not inside[-1]:
            return weights
        weights = weights.clone()  # [batch, head, query, key]
        row = weights[:, :, query]  # [batch, head, key]
        row[:, :, key] = 0
        weights[:, :, query] = row / row.sum(dim=-1, keepdim=True)
        return weights

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)

    def leave(*_) -> None:
        inside.pop()

    handles = []
    for layer, (_, module) in enumerate(find_layers(model.model, model.adapter.stack.attention)):
        handles.append(module.register_forward_pre_hook(lambda *_, on=layer in layers: inside.append(on)))
        handles.append(module.register_forward_hook(leave))
    try:
        with torch.no_grad():
            return model.model(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
    finally:
        for handle in handles:
            handle.remove()
        monkeypatch.undo()


@pytest.mark.parametrize("family", FAMILIES)
def test_knockout_equals_zeroing_the_weight_and_renormalising_the_row(tiny_loaded, family, monkeypatch):
    model = tiny_loaded(family)
    ids = ids_of(model)
    query, key, layers = ids.shape[1] - 1, 2, (1,)
    if family == "gemma3":
        key = ids.shape[1] - 2  # inside the local layer's window as well
    blocked, _ = knocked_out(model, ids, [(query, key)], layers)
    expected = renormalised_after_softmax(model, ids, query, key, layers, monkeypatch)
    plain, _ = _run(model, ids, False)
    assert (blocked - plain).abs().max() > 1e-4  # the edge matters: the comparison can fail
    torch.testing.assert_close(blocked, expected, rtol=1e-5, atol=1e-5)


def test_knockout_through_an_integer_mask_equals_zeroing_the_weight(tmp_path, monkeypatch):
    """DeBERTa-v2 passes its attention a 0/1 integer mask, which it turns boolean: the knocked-out
    edge is written as the value the query's own key does not hold, as for a boolean mask."""
    from attnflow.rows.tiny import build_tiny

    folder = build_tiny("deberta-v2", tmp_path / "deberta-v2", "sequence-classification")
    model = attnflow.load(str(folder), device="cpu")
    ids = ids_of(model)
    query, key, layers = 0, 2, (1,)  # the classifier reads position 0
    blocked, _ = knocked_out(model, ids, [(query, key)], layers)
    expected = renormalised_after_softmax(model, ids, query, key, layers, monkeypatch)
    plain, _ = _run(model, ids, False)
    assert (blocked - plain).abs().max() > 1e-6  # the edge matters: the comparison can fail
    torch.testing.assert_close(blocked, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", DECODERS)
def test_blocking_an_edge_the_query_cannot_see_changes_nothing(tiny_loaded, family):
    model = tiny_loaded(family)
    ids = ids_of(model)
    plain, _ = _run(model, ids, False)
    blocked, _ = knocked_out(model, ids, [(2, 4), (0, 3)], (0, 1))  # later keys: already masked
    assert torch.equal(blocked, plain)  # bit-exact: the weight was already exactly 0


@pytest.mark.parametrize("family", ("gpt2", "bert", "mpnet"))
def test_a_row_without_knockouts_is_the_plain_run_bit_for_bit(tiny_loaded, family):
    model = tiny_loaded(family)
    ids = ids_of(model).expand(2, -1)
    runner = PatchRunner(model, Metric("class", 0))
    patches = Patches()
    patches.add(1, Site("knockout", 0, 1, 3, (0, 1)), None)  # row 1 only
    with torch.no_grad():
        plain = model.model(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
        with runner._hooks(patches, {}, None, False, {}):
            blocked = model.model(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
    assert torch.equal(blocked[0], plain[0])
    assert (blocked[1] - plain[1]).abs().max() > 1e-4


@pytest.mark.parametrize("family", ("llama", "gpt2", "bert"))
def test_blocking_every_other_key_leaves_one_hot_attention_in_the_window_only(tiny_loaded, family):
    model = tiny_loaded(family)
    ids = ids_of(model)
    n_tokens, query = ids.shape[1], 3
    keys = range(n_tokens) if model.target_kind != "next_token" else range(query + 1)
    _, plain = _run(model, ids, True)
    _, weights = knocked_out(model, ids, [(query, key) for key in keys if key != query], (1,), record=True)
    one_hot = torch.zeros(n_tokens)
    one_hot[query] = 1
    assert torch.equal(weights[1][0, :, query], one_hot.expand(model.n_heads, -1))
    assert torch.equal(weights[0], plain[0])  # the layer before the window is untouched
    assert torch.equal(weights[1][0, :, :query], plain[1][0, :, :query])  # and the other queries


@pytest.mark.parametrize("family", ("llama", "bert"))
def test_patch_reports_the_normalised_change_of_the_metric(tiny_patch_models, family):
    model = tiny_patch_models[family]
    result = patch(
        model, CLEAN, CORRUPT, sites="knockout,heads", methods="exact,atp", knockout_window=3, progress=False
    )
    knockout = result.effects["exact"]["knockout"]
    n_tokens = len(result.tokens)
    assert knockout.shape == (model.n_layers, n_tokens)
    assert set(result.effects["atp"]) == {"heads"}  # the approximations do not estimate knockouts
    target = 0 if model.target_kind == "class" else n_tokens - 1  # the predicting position
    assert result.knockout_target == target and result.knockout_window == 3
    # a window of 3 around either of 2 layers covers both: every row blocks the same edge
    np.testing.assert_array_equal(knockout[0], knockout[1])
    runner = PatchRunner(model, result_metric(model))
    ids = ids_of(model)
    patches = Patches()
    patches.add(0, Site("knockout", 0, 1, target, (0, 1)), None)
    with torch.no_grad():
        blocked = runner.forward(ids, 1, patches=patches)[0].item()
    by_hand = (result.clean_metric - blocked) / (result.clean_metric - result.corrupt_metric)
    assert abs(by_hand) > 1e-4
    # rel: float32 rounding differs between a batch of 1 and the sweep's batches (BERT's amplified head)
    assert knockout[0, 1] == pytest.approx(by_hand, rel=1e-3, abs=1e-5)


def result_metric(model):
    from attnflow.causal.api import resolve_metric

    return resolve_metric(model, ids_of(model))


def test_knockout_sources_target_and_a_query_left_nothing(tiny_patch_models):
    model = tiny_patch_models["llama"]
    result = patch(
        model,
        CLEAN,
        CORRUPT,
        sites="knockout",
        methods="exact,atp",
        knockout_target=3,
        knockout_sources=[1, -1],
        progress=False,
    )
    knockout = result.effects["exact"]["knockout"]
    n_tokens = len(result.tokens)
    assert set(result.effects) == {"exact"}  # nothing for atp to estimate
    assert np.isnan(knockout[:, [0, 2, 3]]).all() and result.knockout_sources == [1, n_tokens - 1]
    assert np.all(knockout[:, -1] == 0.0)  # the last key is after the target: no edge to block
    assert np.abs(knockout[:, 1]).max() > 1e-4
    with pytest.raises(InputError, match="leaves query position 0 no key"):
        patch(model, CLEAN, CORRUPT, sites="knockout", methods="exact", knockout_target=0, progress=False)
    with pytest.raises(InputError, match="knockout_target 99 is outside"):
        patch(model, CLEAN, CORRUPT, sites="knockout", knockout_target=99, progress=False)


def test_a_family_whose_attention_takes_no_mask_is_refused_in_one_line(tiny_model_path):
    llama = next(row for row in ADAPTERS if row.family == "llama")
    # A row whose attention pattern names the output projection: a Linear, which receives no mask.
    stack = Stack(r"layers\.(\d+)\.self_attn\.o_proj$", llama.stack.output_projection)
    register_adapter(type(llama)("maskless", "decoder", ("llama",), stack, sites=llama.sites))
    try:
        model = attnflow.load(str(tiny_model_path("llama")), device="cpu")
        with pytest.raises(CaptureError) as error:
            knocked_out(model, ids_of(model), [(3, 1)], (0,))
    finally:
        unregister_adapter("maskless")
    message = str(error.value)
    assert "\n" not in message and "knockout" in message and "'attention_mask'" in message


def test_attnflow_patch_sites_knockout(tiny_model_path, tmp_path):
    from attnflow.cli import main

    out = tmp_path / "out"
    code = main(
        ["patch", CLEAN, "--corrupt", CORRUPT, "--model", str(tiny_model_path("llama")), "--sites", "knockout,mlp",
         "--knockout-window", "2", "--knockout-sources", "0,-2", "--out", str(out), "--quiet", "--device", "cpu"]
    )  # fmt: skip
    assert code == 0
    saved = json.loads((out / "patch.json").read_text())
    n_tokens = len(saved["tokens"])
    knockout = np.asarray(saved["effects"]["exact"]["knockout"], dtype=float)
    assert knockout.shape == (2, n_tokens) and saved["knockout_window"] == 2
    assert saved["knockout_sources"] == [0, n_tokens - 2] and saved["knockout_target"] == n_tokens - 1
    assert set(saved["effects"]["atp"]) == {"mlp"}
    page = (out / "patch.html").read_text()
    assert page.count('data-kind="knockout"') >= 2 and "attention knockout: key → token" in page
