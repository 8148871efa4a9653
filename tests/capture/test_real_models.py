"""The embedded real models: mpnet (split zip reassembled, sha256 checked) and smollm2 (GGUF)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_capture import TEXT, _attention_inputs, _check_head_outputs

import attnflow
from attnflow.capture import loading
from attnflow.errors import ModelLoadError


def test_mpnet_install_checks_the_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "MPNET_SAFETENSORS_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        loading.install_mpnet()
    assert not (tmp_path / "all-mpnet-base-v2").exists()  # nothing half-installed is left behind
    monkeypatch.undo()
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    folder = loading.install_mpnet()
    assert (folder / "model.safetensors").stat().st_size == 437_971_872
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["all-mpnet-base-v2"]  # no scratch left


def test_mpnet_trace_against_its_own_weights(mpnet):
    model = mpnet
    assert (model.n_layers, model.n_heads, model.d_head, model.adapter.family) == (12, 12, 64, "mpnet")
    with _attention_inputs(model.model, model.adapter.stack.attention) as hidden_states:
        trace = model.trace(TEXT)[0]
    assert trace.tokens[0] == "<s>" and trace.tokens[-1] == "</s>"
    _check_head_outputs("mpnet", model, trace, hidden_states)
    out = model.model(**model.tokenizer(TEXT, return_tensors="pt"), output_attentions=True)
    np.testing.assert_allclose(trace.attentions, torch.stack(out.attentions, 1)[0].detach().numpy(), atol=1e-5)


def test_smollm2_decoder_trace_with_grouped_query_attention(smollm2):
    model = smollm2
    assert (model.n_layers, model.n_heads, model.kind, model.default_row) == (30, 9, "decoder", "last")
    assert model.config.num_key_value_heads == 3  # grouped-query attention: 3 kv heads for 9 query heads
    with _attention_inputs(model.model, model.adapter.stack.attention) as hidden_states:
        traces = model.trace([TEXT, "Hello world."])
    trace = traces[0]
    assert np.allclose(np.triu(trace.attentions, 1), 0.0, atol=1e-7)  # causal
    n = len(trace.tokens)
    _check_head_outputs("llama", model, trace, [h[:1, :n] for h in hidden_states])
    single = model.trace("Hello world.")[0]
    np.testing.assert_allclose(traces[1].attentions, single.attentions, atol=1e-4)
    saliency = attnflow.saliency_row(attnflow.rollout(trace.attentions), "last")
    np.testing.assert_allclose(saliency.sum(), 1.0)
