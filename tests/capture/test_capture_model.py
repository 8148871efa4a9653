"""The capture layer alone (`CaptureModel`) and the user-facing `AttentionModel` built on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnflow
from attnflow.capture import CaptureModel
from attnflow.errors import CaptureError
from attnflow.targets import Target

TEXT = "the movie was terrible, but the acting was great."


def test_capture_traces_a_target_only_through_the_function_it_is_given(tiny_classifier_path):
    path = str(tiny_classifier_path("bert"))
    captured = attnflow.capture.load(path, device="cpu")
    model = attnflow.load(path, device="cpu")
    assert type(captured) is CaptureModel and not hasattr(captured, "explain")
    assert isinstance(model, attnflow.AttentionModel) and isinstance(model, CaptureModel)
    with pytest.raises(CaptureError, match="depend on a target"):
        captured.capture_texts(TEXT, needs={"target"})

    below = captured.capture_texts(TEXT, needs={"target"}, target_function=lambda: Target(1).objective(captured))[0]
    above = model.trace(TEXT, needs={"target"}, target=1)[0]
    # the oracle: the classifier's own logit of class 1, one plain forward pass
    encoded = model.tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad():
        logit = float(model.model(**encoded).logits[0, 1])
    assert below.target.index == above.target.index == 1
    np.testing.assert_allclose([below.target.value, above.target.value], [logit, logit], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(below.attentions, above.attentions, atol=1e-6)
