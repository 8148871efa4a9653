"""`attnflow serve` on the real embedded classifier (minilm-sentiment): the library's numbers."""

from __future__ import annotations

import numpy as np
import pytest

TEXT = "The movie was terrible, but the acting was great."


def test_minilm_sentiment_answers_the_library_numbers_with_faithfulness(minilm_sentiment):
    from fastapi.testclient import TestClient

    from attnflow.evaluate.per_input import input_faithfulness
    from attnflow.explanation import explain
    from attnflow.serve import ModelPool, ServeConfig, create_app

    pool = ModelPool(["minilm-sentiment"], loader=lambda _name: minilm_sentiment)
    with TestClient(create_app(pool, ServeConfig())) as client:
        response = client.post("/api/explain", json={"text": TEXT, "methods": ["attnlrp", "rollout"]})
        assert response.status_code == 200, response.text
        served = response.json()["explanations"]
        negative = client.post("/api/explain", json={"text": "A dull, lifeless and boring film.", "methods": ["raw"]})
    trace = minilm_sentiment.trace_for(["attnlrp", "rollout"], [TEXT])[0]
    library = [explain(trace, method=name, model=minilm_sentiment) for name in ("attnlrp", "rollout")]
    records = input_faithfulness(minilm_sentiment, trace, [e.scores for e in library])
    for answer, explanation, record in zip(served, library, records, strict=True):
        np.testing.assert_allclose(answer["scores"], explanation.scores, atol=1e-6)
        # the same forward passes, in batches of other rankings once the random ones are kept: float32 digits
        assert answer["faithfulness"]["probability"] == pytest.approx(record["probability"], abs=1e-6)
        np.testing.assert_allclose(answer["faithfulness"]["comprehensiveness"], record["comprehensiveness"], atol=1e-6)
        assert (answer.get("target") or answer["prediction"])["label"] == trace.target.label
    assert served[0]["signed"] and not served[1].get("signed", False)
    assert negative.json()["explanations"][0]["prediction"]["label"] == "negative"
