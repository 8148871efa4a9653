"""Fixtures of the viz tests: an explanation full of hostile strings, built without a model."""

from __future__ import annotations

import numpy as np
import pytest

from attnflow.explanation import explain
from attnflow.trace import Trace

SCRIPT = "<script>alert(1)</script>"
HOSTILE_TEXT = f'The movie {SCRIPT} was "great" & <b>bold</b> $x$ indeed'


def _span(word: str, start: int = 0) -> list[int]:
    begin = HOSTILE_TEXT.index(word, start)
    return [begin, begin + len(word)]


@pytest.fixture
def hostile_trace() -> Trace:
    """A Trace over HOSTILE_TEXT whose tokens include a script tag, quotes, & and markup."""
    words = ["The", "movie", SCRIPT, "was", '"great"', "&", "<b>bold</b>", "$x$", "indeed"]
    tokens = ["[CLS]"] + words + ["[SEP]"]
    offsets = [[0, 0]] + [_span(word) for word in words] + [[0, 0]]
    n = len(tokens)
    rng = np.random.default_rng(7)
    attentions = rng.dirichlet(np.ones(n), size=(2, 3, n)).astype(np.float32)  # [layer, head, query, key]
    return Trace(
        tokens=tokens,
        token_ids=np.arange(n),
        offsets=np.asarray(offsets),
        special_mask=np.isin(np.arange(n), [0, n - 1]),
        attentions=attentions,
        text=HOSTILE_TEXT,
        model_name='<img src=x onerror="alert(2)">',
    )


@pytest.fixture
def hostile_explanation(hostile_trace):
    return explain(hostile_trace, method="rollout", row="mean", discard_ratio=0.2)
