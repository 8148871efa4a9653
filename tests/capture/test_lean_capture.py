"""The memory-lean capture (``fuse_heads="mean"``): each layer's weights reduced to the heads' mean
inside the hook give the same rollout, raw and flow maps as the full capture, on every text family
(MPNet, whose attention returns weights only when asked, included); the front door uses it for
methods that read only the heads' mean and the full capture otherwise."""

from __future__ import annotations

import numpy as np
import pytest

import attnflow
from attnflow.errors import CaptureError
from attnflow.methods.registry import get_method
from attnflow.model import reads_head_mean

TEXTS = ["the movie was terrible but the acting was great", "a cat sat on the mat"]


@pytest.mark.parametrize("family", ["bert", "distilbert", "mpnet", "gpt2", "llama", "gemma3"])
def test_lean_capture_gives_the_same_rollout(tiny_loaded, family):
    model = tiny_loaded(family)
    full = model.trace(TEXTS, needs=("attentions",))
    lean = model.trace(TEXTS, needs=("attentions",), fuse_heads="mean")
    for whole, fused in zip(full, lean, strict=True):
        layers, _, n, _ = whole.attentions.shape
        assert fused.attentions.shape == (layers, 1, n, n)
        assert fused.meta["fused_heads"] == "mean"
        np.testing.assert_allclose(fused.attentions[:, 0], whole.attentions.mean(axis=1), atol=1e-6)
        for method in ("rollout", "raw", "flow"):
            np.testing.assert_allclose(
                attnflow.explain(fused, method).scores, attnflow.explain(whole, method).scores, atol=1e-6
            )


def test_front_door_uses_the_lean_capture_when_the_method_allows(tiny_loaded, monkeypatch):
    model = tiny_loaded("llama")
    asked = []
    trace = type(model).trace

    def spy(self, *args, **kwargs):
        asked.append(kwargs.get("fuse_heads"))
        return trace(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "trace", spy)
    reference = attnflow.explain(model.trace(TEXTS[0], needs=("attentions",))[0], "rollout", discard_ratio=0.5)
    lean = model.explain(TEXTS[0], method="rollout", discard_ratio=0.5)
    np.testing.assert_allclose(lean.scores, reference.scores, atol=1e-6)
    assert asked[-1] == "mean"
    model.explain(TEXTS[0], method="rollout", head_fusion="max")
    assert asked[-1] is None  # max needs every head
    model.explain(TEXTS[0], method="norm")
    assert asked[-1] is None


def test_lean_capture_with_a_classifier_target(tiny_classifier_path):
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    lean = model.explain(TEXTS, method="rollout")
    full = [attnflow.explain(trace, "rollout") for trace in model.trace(TEXTS, needs=("attentions",))]
    for a, b in zip(lean, full, strict=True):
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-6)
        assert a.prediction is not None  # the classifier's prediction still comes with it


def test_which_methods_read_only_the_head_mean():
    assert reads_head_mean(get_method("rollout"), {})
    assert reads_head_mean(get_method("flow"), {"head_fusion": None})
    assert not reads_head_mean(get_method("rollout"), {"head_fusion": "none"})
    assert not reads_head_mean(get_method("rollout"), {"weights": [1.0, 0.0, 0.0, 0.0]})
    assert not reads_head_mean(get_method("grad_rollout"), {})


def test_no_gradients_through_fused_heads(tiny_classifier_path):
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    with pytest.raises(CaptureError, match="need every head"):
        model.trace(TEXTS[0], needs=("attention_grads",), fuse_heads="mean")


def test_cli_explain_uses_the_lean_capture_unless_the_trace_is_saved(tiny_model_path, monkeypatch, tmp_path, capsys):
    """`attnflow explain --method rollout,raw` captures head means; with --save-trace, every head."""
    from attnflow.cli import main
    from attnflow.model import AttentionModel

    asked = []
    trace_for = AttentionModel.trace_for

    def spy(self, *args, **kwargs):
        asked.append(kwargs.get("fuse_heads"))
        return trace_for(self, *args, **kwargs)

    monkeypatch.setattr(AttentionModel, "trace_for", spy)
    model = str(tiny_model_path("llama"))
    assert main(["explain", TEXTS[0], "--model", model, "--method", "rollout,raw", "--json", "--quiet"]) == 0
    assert asked[-1] == "mean"
    saving = ["--save-trace", "--out", str(tmp_path / "out")]
    assert main(["explain", TEXTS[0], "--model", model, "--method", "rollout", *saving]) == 0
    assert asked[-1] is None  # a saved trace keeps every head
    capsys.readouterr()
