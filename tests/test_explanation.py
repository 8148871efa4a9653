"""`Explanation` and `explain()` on traces built from random arrays (no model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

import attnflow
from attnflow.errors import ExplanationWarning
from attnflow.explanation import OUTPUT_FILES, Explanation, default_row, explain, parse_row
from attnflow.methods import registry
from attnflow.methods.transforms import PruningCollapseWarning
from attnflow.trace import Trace


def random_trace(n=6, n_layers=3, n_heads=2, seed=0, causal=False, grid=None, prefix=0, **fields) -> Trace:
    """A Trace whose attentions are random softmax rows ``[layer, head, query, key]``."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n_layers, n_heads, n, n))
    if causal:
        logits = np.where(np.tril(np.ones((n, n), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    tokens = fields.pop("tokens", ["[CLS]"] + [f"w{i}" for i in range(1, n - 1)] + ["[SEP]"])
    return Trace(
        tokens=tokens,
        token_ids=np.arange(n),
        offsets=np.zeros((n, 2), dtype=np.int64),
        special_mask=np.isin(np.arange(n), [0, n - 1]),
        attentions=(weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32),
        model_name="random",
        grid=grid,
        n_prefix_tokens=prefix,
        **fields,
    )


def test_lazy_exports():
    assert attnflow.Explanation is Explanation
    assert attnflow.explain is explain


def test_rollout_explanation_matches_the_method_and_row():
    trace = random_trace()
    explanation = explain(trace, method="rollout", row="mean", discard_ratio=0.5, residual=0.7)
    expected = attnflow.rollout(trace.attentions, discard_ratio=0.5, residual=0.7)
    np.testing.assert_allclose(explanation.matrix, expected)
    np.testing.assert_allclose(explanation.scores, expected.mean(axis=0))
    assert explanation.tokens == trace.tokens and explanation.model == "random"
    assert explanation.row == "mean" and explanation.method == "rollout"
    # Options as used, with the method's defaults filled in.
    assert explanation.options == {
        "head_fusion": "mean",
        "weights": None,
        "residual": 0.7,
        "start_layer": 0,
        "threshold": None,
        "top_k": None,
        "discard_ratio": 0.5,
        "prune_on": "attention",
    }
    assert explanation.notes == []


def test_pruning_collapse_is_a_warning_and_a_note_on_the_page(tmp_path):
    trace = random_trace(n=6, seed=3)
    trace.attentions[:] = 0.8 * np.eye(6) + 0.2 * trace.attentions  # diagonal-heavy: top-1 keeps the diagonal
    with pytest.warns(PruningCollapseWarning, match="diagonal alone"):
        explanation = explain(trace, top_k=1)
    np.testing.assert_allclose(explanation.matrix, np.eye(6))
    assert len(explanation.notes) == 1 and "layer(s) 0, 1, 2 of 3" in explanation.notes[0]
    paths = explanation.save(tmp_path)
    assert json.loads(paths["json"].read_text())["notes"] == explanation.notes
    assert Explanation.load(tmp_path).notes == explanation.notes
    page = paths["html"].read_text()
    assert 'class="warning"' in page and "diagonal alone" in page


def test_raw_method_and_row_index():
    trace = random_trace()
    explanation = explain(trace, method="raw", row=2, layer=1, head_fusion="max")
    fused = trace.attentions[1].max(axis=0)  # max fusion renormalises the rows
    expected = fused / fused.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(explanation.matrix, expected, rtol=1e-6)
    np.testing.assert_allclose(explanation.scores, expected[2], rtol=1e-6)


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("raw", {"top_k": 2}, "does not take top_k;"),  # the library names its parameters, not flags
        ("rollout", {"layer": 1}, "does not take layer;"),
        ("rollout", {"bogus": 1, "top_k": 2}, "does not take bogus"),
        ("nope", {}, "unknown method 'nope'"),
    ],
)
def test_unknown_or_inapplicable_options_are_rejected(method, options, message):
    with pytest.raises(ValueError, match=message):
        explain(random_trace(), method=method, **options)


def test_options_given_as_none_mean_default():
    trace = random_trace()
    explanation = explain(trace, method="raw", top_k=None, threshold=None)
    np.testing.assert_allclose(explanation.matrix, attnflow.raw_attention(trace.attentions), rtol=1e-6)


def test_head_weights_shorthand():
    trace = random_trace()
    explanation = explain(trace, weights=np.array([3.0, 1.0]))
    np.testing.assert_allclose(explanation.matrix, attnflow.rollout(trace.attentions, weights=[0.75, 0.25]))
    assert explanation.options["head_fusion"] == "mean" and list(explanation.options["weights"]) == [3.0, 1.0]
    json.dumps(explanation.to_dict())  # weights stay JSON-serialisable
    with pytest.raises(ValueError, match="not both"):
        explain(trace, weights=[1, 1], head_fusion="max")


def test_per_head_rollout_is_averaged_and_kept():
    trace = random_trace()
    explanation = explain(trace, head_fusion="none")
    per_head = attnflow.rollout(trace.attentions, head_fusion="none")  # [head, query, key]
    np.testing.assert_allclose(explanation.head_matrices, per_head)
    np.testing.assert_allclose(explanation.matrix, per_head.mean(axis=0))
    np.testing.assert_allclose(explanation.matrix.sum(axis=-1), 1.0)


def test_methods_taking_a_trace_get_the_trace(monkeypatch):
    seen = {}

    def needs_trace(trace, scale=1.0):
        seen["trace"] = trace
        return np.full((trace.n_tokens, trace.n_tokens), scale / trace.n_tokens)

    monkeypatch.setattr(registry, "_METHODS", dict(registry._registered()))  # registrations undone after the test
    registry.register("needs_trace", "test method", takes="trace", options=(registry.Option("scale", "s"),))(
        needs_trace
    )
    trace = random_trace()
    explanation = explain(trace, method="needs_trace", scale=2.0)
    assert seen["trace"] is trace
    assert explanation.options == {"scale": 2.0}


def test_wrong_result_shape_is_reported(monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._registered()))
    registry.register("bad_shape", "test", takes="attentions")(lambda attentions: np.zeros(3))
    with pytest.raises(ValueError, match="returned shape"):
        explain(random_trace(), method="bad_shape")


def test_parse_row():
    assert [parse_row(r) for r in ("cls", "mean", "last", "3", "-1", 2)] == ["cls", "mean", "last", 3, -1, 2]
    for bad in ("first", True, 1.5):
        with pytest.raises(ValueError, match="row must be"):
            parse_row(bad)
    with pytest.raises(ValueError, match="out of range"):
        explain(random_trace(n=4), row=7)


def test_default_row_follows_the_trace():
    assert default_row(random_trace()) == "cls"
    assert default_row(random_trace(causal=True)) == "last"
    assert default_row(random_trace(meta={"default_row": "mean"})) == "mean"
    assert default_row(random_trace(n=7, grid=(2, 3), prefix=1)) == "cls"
    assert default_row(random_trace(n=6, grid=(2, 3), prefix=0)) == "mean"
    causal = random_trace(causal=True)
    np.testing.assert_allclose(explain(causal).scores, attnflow.rollout(causal.attentions)[-1])


def test_image_explanation_patch_grid_overlay_and_save(tmp_path):
    image_path = tmp_path / "image.png"
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (30, 45, 3), dtype=np.uint8)).save(image_path)
    trace = random_trace(n=7, grid=(2, 3), prefix=1, meta={"image": str(image_path)})
    explanation = explain(trace)
    assert explanation.image == str(image_path) and explanation.row == "cls"
    np.testing.assert_allclose(explanation.patch_scores, explanation.scores[1:].reshape(2, 3))
    overlay = explanation.overlay()
    assert overlay.size == (45, 30) and overlay.mode == "RGB"
    paths = explanation.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(OUTPUT_FILES)
    assert Image.open(paths["overlay"]).size == (45, 30)
    data = json.loads(paths["json"].read_text())
    assert data["grid"] == [2, 3] and data["n_prefix_tokens"] == 1
    assert np.asarray(data["patch_scores"]).shape == (2, 3)


def test_overlay_needs_an_image():
    with pytest.raises(ValueError, match="image"):
        explain(random_trace()).overlay()


def test_save_writes_json_html_png_and_round_trips(tmp_path):
    trace = random_trace(n=5, text="a b c", tokens=["[CLS]", "a", "b", "c", "[SEP]"])
    explanation = explain(trace, top_k=2)
    paths = explanation.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"explanation.json", "explanation.html", "explanation.png"}
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert {"model", "method", "options", "tokens", "row", "scores", "matrix"} <= set(data)
    assert len(data["scores"]) == 5 and np.asarray(data["matrix"]).shape == (5, 5)
    assert data["options"]["top_k"] == 2
    assert Image.open(paths["png"]).size[0] > 100
    loaded = Explanation.load(tmp_path)
    np.testing.assert_allclose(loaded.matrix, explanation.matrix)
    np.testing.assert_allclose(loaded.scores, explanation.scores)
    assert (loaded.tokens, loaded.row, loaded.options, loaded.text) == (
        explanation.tokens,
        explanation.row,
        explanation.options,
        explanation.text,
    )
    np.testing.assert_array_equal(loaded.special_mask, explanation.special_mask)


def test_plot_is_a_headless_figure_and_tolerates_odd_tokens(tmp_path):
    tokens = ["[CLS]", "$x$", "$", "<b>", "\\frac", "_a^b", "[SEP]"]
    explanation = explain(random_trace(n=7, tokens=tokens))
    figure = explanation.plot()
    assert isinstance(figure, Figure)
    figure.savefig(tmp_path / "odd.png")  # mathtext would choke on "$" or "\frac"
    labels = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert labels == ["[CLS]", "$x$", "$", "<b>", "\\frac", "_a^b", "[SEP]"]


def test_many_tokens_plot_without_labels(tmp_path):
    """Beyond 64 tokens the axes show positions (numbers), not 80 unreadable token strings."""
    figure = explain(random_trace(n=80, n_layers=2)).plot()
    figure.savefig(tmp_path / "many.png")  # draws, so the default locators have placed their ticks
    bars_axes, matrix_axes = figure.axes[:2]
    for axis in (bars_axes.xaxis, matrix_axes.xaxis, matrix_axes.yaxis):
        labels = [label.get_text() for label in axis.get_ticklabels()]
        assert 2 <= len(labels) <= 20
        assert not any(label.startswith("w") or label.startswith("[") for label in labels)
        assert all(float(label.replace("\u2212", "-")) == int(float(label.replace("\u2212", "-"))) for label in labels)
    few = explain(random_trace(n=10, n_layers=2)).plot()
    assert [label.get_text() for label in few.axes[1].get_yticklabels()][1] == "w1"


def test_top_tokens_skip_special_tokens():
    explanation = explain(random_trace(n=6))
    top = explanation.top(3)
    assert len(top) == 3 and all(index not in (0, 5) for index, _, _ in top)
    assert [score for _, _, score in top] == sorted((score for _, _, score in top), reverse=True)
    assert len(explanation.top(10, include_special=True)) == 6


def test_repr_html_is_a_fragment():
    fragment = explain(random_trace())._repr_html_()
    assert fragment.startswith('<div class="attnflow">') and "<html" not in fragment
    assert "w1" in fragment


def test_explanation_checks_shapes():
    with pytest.raises(ValueError, match="matrix"):
        Explanation(["a", "b"], np.eye(3), np.ones(2), "rollout", {}, "cls")
    with pytest.raises(ValueError, match="scores"):
        Explanation(["a", "b"], np.eye(2), np.ones(3), "rollout", {}, "cls")


def test_save_replaces_an_explanation_only_with_overwrite(tmp_path):
    first = explain(random_trace(n=5, seed=1, text="first"))
    image = Image.new("RGB", (4, 4))
    image.save(tmp_path / "photo.png")
    (tmp_path / "notes.txt").write_text("mine")
    first.save(tmp_path)
    (tmp_path / "explanation_overlay.png").write_bytes(b"an old image run's overlay")
    second = explain(random_trace(n=5, seed=2, text="second"))
    with pytest.raises(FileExistsError, match="pass overwrite to replace it"):
        second.save(tmp_path)
    assert Explanation.load(tmp_path).text == "first"
    second.save(tmp_path, overwrite=True)
    assert Explanation.load(tmp_path).text == "second"
    assert {p.name for p in tmp_path.iterdir()} == {*OUTPUT_FILES[:3], "notes.txt", "photo.png"}  # no stale overlay


def test_repr_is_one_short_line():
    explanation = explain(random_trace(n=40, text="x"), method="rollout", row="cls")
    text = repr(explanation)
    top = explanation.top(1)[0]
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("Explanation(method='rollout', model='random', row='cls', n_tokens=40, top=[")
    assert f"'{top[1]}' {top[2]:.3f}" in text


def test_a_row_collapsed_on_the_first_token_is_noted_as_the_attention_sink():
    """Every head of a causal trace puts 97 % of each row on token 0: rollout's last row does too."""
    n = 6
    trace = random_trace(n=n, causal=True, tokens=["Paris", "is", "the", "capital", "of", "France"])
    trace.special_mask[:] = False  # like smollm2: no BOS token, the first word is the sink
    sink = np.tril(np.full((n, n), 0.03 / (n - 1)))
    sink[:, 0] = 0.97
    sink[0, 0] = 1.0
    sink /= sink.sum(axis=-1, keepdims=True)
    trace.attentions[:] = sink.astype(np.float32)
    with pytest.warns(ExplanationWarning, match="attention-sink"):
        explanation = explain(trace, method="rollout", row="last")
    share = explanation.scores[0] / explanation.scores.sum()
    assert share > 0.5
    assert explanation.notes == [
        f"rollout: {share:.0%} of the relevance is on the first token 'Paris': the attention-sink collapse (models "
        "park attention on their first token, and composing layers piles it up there); a value-aware method "
        "(norm_rollout, alti) shows what the other tokens carry"
    ]
    assert explain(random_trace(n=n, causal=True), method="rollout", row="last").notes == []  # spread out: no note
    assert explain(trace, method="rollout", row="cls").notes == []  # row 0's mass on itself is no collapse
    trace.special_mask[:] = np.arange(n) == 0  # a special first token: the summary line reports its share
    assert explain(trace, method="rollout", row="last").notes == []


@pytest.mark.parametrize(
    "family, remedy",
    [
        ("llama", "a value-aware method (norm_rollout) shows"),  # alti does not support Llama's gated MLP
        ("bert", "a value-aware method (norm_rollout, alti) shows"),
        ("gpt2", "a value-aware method (norm_rollout) shows"),  # GPT-2 is pre-LN too
    ],
)
def test_the_attention_sink_note_recommends_only_methods_the_model_supports(family, remedy):
    from types import SimpleNamespace

    from attnflow.methods.registry import methods_for
    from attnflow.rows.adapters import ADAPTERS

    adapter = next(row for row in ADAPTERS if row.family == family)
    n = 5
    trace = random_trace(n=n, causal=True)
    trace.special_mask[:] = False
    trace.attentions[:] = 0.0
    trace.attentions[..., 0] = 1.0  # every row on token 0
    with pytest.warns(ExplanationWarning, match="attention-sink"):
        explanation = explain(trace, method="rollout", row="last", model=SimpleNamespace(adapter=adapter))
    assert remedy in explanation.notes[0]
    recommended = explanation.notes[0].split("(")[-1].split(")")[0].split(", ")
    assert all(name in methods_for(adapter) for name in recommended if name != "--method auto")


def test_the_random_baseline_summary_says_it_is_a_baseline():
    sentence = explain(random_trace(), method="random").summary()
    assert sentence.startswith("random scores (a baseline, not a finding): "), sentence
    assert not explain(random_trace(), method="rollout").summary().startswith("random")
