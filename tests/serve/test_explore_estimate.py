"""`/api/explore`'s estimate counts what the explorer runs: the forward passes of its traces, its
methods and its per-input faithfulness, which the pool's hook counts independently (`Job.tokens`),
and the page's work, which grows with the matrices it holds; on the real minilm-sentiment (slow) its
seconds are within 2x of the time taken at 512 tokens."""

from __future__ import annotations

import time

import pytest

from .test_api import TEXT

REVIEW = (
    "I went to see this film on a rainy Sunday afternoon with two friends who had loved the book, and we all "
    "left a little puzzled. The first hour is slow but beautifully shot, the actors are clearly committed, and "
    "the music carries several scenes that the script leaves empty. Then the plot falls apart, the villain "
    "becomes a cartoon, and the ending arrives without any reason. Still, the lead performance is wonderful and "
    "worth the ticket. "
)


def _explored(pool, text: str, methods: list[str] | None):
    """The explorer's run as the server makes it: its job (forward passes counted by the pool's hook)
    and the work its estimate counted."""
    from attnflow.costs import Rates, Shape, count_tokens, explore_parts
    from attnflow.serve import work
    from attnflow.serve.costs import Costs
    from attnflow.serve.pool import Job

    costs = Costs(10_000)
    costs.set_rates("tiny-a", Rates(pass_s=0.001, token_s=1e-5))
    job = Job()
    asked = work.Asked(text, ("tiny-a",), methods)
    work.explore_text(pool, job, costs, asked)
    model = pool.model_if_loaded("tiny-a")
    n = count_tokens(model.tokenizer, text)
    parts = explore_parts(methods, n, Shape.of(model), True)
    return job, parts, n


def test_the_explore_estimate_counts_the_forward_passes_the_explorer_runs_faithfulness_included(tiny_loader):
    from attnflow.serve import ModelPool

    pool = ModelPool(["tiny-a"], loader=tiny_loader, known=["tiny-a"])
    methods = ["rollout", "raw", "leave_one_out"]  # no backward pass: the hook counts every pass there is
    job, parts, n = _explored(pool, " ".join([TEXT] * 3), methods)
    estimated = sum(part.tokens for part in parts.values())
    assert job.tokens / 2 <= estimated <= 2 * job.tokens, (estimated, job.tokens, parts)
    assert parts["faithfulness"].tokens > n  # the explorer scores every view on this input


def test_the_explore_estimate_counts_the_page_of_every_layer_and_head():
    from attnflow.costs import PAGE, Shape, explore_parts

    shape = Shape(layers=6, heads=12, width=384)
    small, large = (explore_parts(["rollout", "raw", "alti"], n, shape, False) for n in (128, 256))
    assert large[PAGE].elements == 4 * small[PAGE].elements  # every matrix: n x n
    assert small[PAGE].elements >= (6 * 13 * 2 + 6) * 128 * 128  # rollout and raw: each layer, fused and per head
    assert small["alti"].alti > 0 and small["raw"].alti == 0  # ALTI's views compute their contributions


def _alti_trace(n: int, layers: int, heads: int, width: int):
    """A trace with what ALTI reads, random numbers of the shapes a real one holds."""
    import numpy as np

    from attnflow.trace import Trace

    rng = np.random.default_rng(7)
    scores = rng.normal(size=(layers, heads, n, n))
    attention = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)  # [layer, head, q, k]
    return Trace(
        tokens=[f"w{i}" for i in range(n)],
        token_ids=np.arange(n),
        offsets=np.zeros((n, 2), dtype=np.int64),
        special_mask=np.zeros(n, dtype=bool),
        attentions=attention.astype(np.float32),
        values=rng.normal(size=(layers, n, heads, width // heads)).astype(np.float32),
        output_weights=(rng.normal(size=(layers, heads, width // heads, width)) / 8).astype(np.float32),
        layer_inputs=rng.normal(size=(layers, n, width)).astype(np.float32),
        output_bias=rng.normal(size=(layers, width)).astype(np.float32),
        layer_norms={"weight": np.ones((layers, width)), "bias": np.zeros((layers, width)), "eps": 1e-5},
    )


def test_alti_s_estimate_follows_its_work_in_tokens_and_width():
    """ALTI's estimated seconds (`alti_ops` at the rate `alti_op_seconds` measures on a small
    synthetic layer of 64 tokens) against ALTI itself timed on larger traces: 2 layers of 128
    tokens, at the width of minilm (384) and twice it. The old estimate counted only the attention's L·H·n²
    elements, the same at both widths, where ALTI's [query, key, d_model] work doubles."""
    from attnflow.costs import Rates, Shape, Work, alti_op_seconds, alti_ops
    from attnflow.methods.relevance import alti_matrices

    n, layers, heads = 128, 2, 12
    taken, estimated = [], []
    for width in (384, 768):
        rates = Rates(pass_s=0.0, token_s=0.0, alti_s=alti_op_seconds(heads, width))
        estimated.append(rates.seconds(Work(alti=alti_ops(n, Shape(layers, heads, width)))))
        trace = _alti_trace(n, layers, heads, width)
        fastest = float("inf")
        for _ in range(2):
            began = time.perf_counter()
            alti_matrices(trace)
            fastest = min(fastest, time.perf_counter() - began)
        taken.append(fastest)
        assert fastest / 2 <= estimated[-1] <= 2 * fastest, (width, estimated, taken)
    assert alti_ops(n, Shape(layers, heads, 768)) == 2 * alti_ops(n, Shape(layers, heads, 384))


@pytest.mark.slow
def test_explore_at_512_tokens_takes_within_twice_its_estimate(minilm_sentiment):
    """The issue's case: 512 tokens on minilm-sentiment, every method it supports (the expensive ones
    left out, as the explorer does above 128 tokens), estimated 2.44 s where it took 36.9 s, later
    19.1 s for 45.6 s (ALTI counted as attention elements). Held in CPU seconds: the model's speed
    measured in CPU time (`calibrate(..., clock=time.process_time)`) against the CPU time the
    request took, so that a machine whose load moves between the calibration and the run (other
    work beside the tests) does not decide it."""
    from fastapi.testclient import TestClient

    from attnflow.costs import calibrate
    from attnflow.serve import ModelPool, ServeConfig, create_app

    pool = ModelPool(["minilm-sentiment"], loader=lambda _name: minilm_sentiment)
    app = create_app(pool, ServeConfig(time_limit_s=600))
    with TestClient(app) as client:
        assert client.post("/api/load", json={}).status_code == 200  # loaded and measured
        app.state.costs.set_rates("minilm-sentiment", calibrate(minilm_sentiment, clock=time.process_time))
        text = REVIEW * 8
        began, cpu = time.perf_counter(), time.process_time()
        answer = client.post("/api/explore", json={"text": text})
        taken, cpu_taken = time.perf_counter() - began, time.process_time() - cpu
    assert answer.status_code == 200, answer.text
    estimated = answer.json()["estimated_s"]
    assert minilm_sentiment.tokenizer(text, truncation=True, max_length=512)["input_ids"].__len__() == 512
    assert cpu_taken / 2 <= estimated <= 2 * cpu_taken, (estimated, cpu_taken, taken)
