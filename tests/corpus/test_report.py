"""The study report draws what the statistics say, offline, with every token escaped."""

from __future__ import annotations

import numpy as np

from attnflow.corpus.report import build_report, study_figures
from attnflow.corpus.stats import StudyStats
from study_stats import random_study_stats


def hostile_stats() -> StudyStats:
    """A 2-layer, 2-head accumulator fed random batches whose tokens include markup (`VOCAB`)."""
    return random_study_stats({"<s>": 0, "</s>": 2})


VOCAB = {0: "<s>", 2: "</s>", 3: "<script>alert(1)</script>", 4: ".", 5: "&amp;", 6: '"quoted"', 7: "Ġword"}


def test_report_is_self_contained_and_escapes_tokens():
    stats = hostile_stats()
    summary = stats.summary(VOCAB.__getitem__)
    summary.update(model={"name": "<b>model</b>"}, config={**summary["config"], "stride": 10})
    html = build_report(summary, stats.arrays())
    assert "<script" not in html and "alert(1)</script>" not in html
    assert "&lt;script&gt;" in html and "&lt;b&gt;model&lt;/b&gt;" in html
    assert "http://" not in html.split("</head>")[1] and "https://" not in html
    assert html.count('src="data:image/png;base64,') == 6


def test_figures_draw_from_the_arrays():
    stats = hostile_stats()
    summary = stats.summary(VOCAB.__getitem__)
    figures = study_figures(summary, stats.arrays())
    assert set(figures) == {
        "distance_by_layer",
        "layer_trends",
        "same_sentence",
        "similarity_grid",
        "head_maps",
        "attention_targets",
    }
    grid = figures["similarity_grid"]
    assert len(grid.axes) == 4 + 1  # layer × head panels and the colour bar
    image = grid.axes[0].images[0].get_array()
    np.testing.assert_allclose(image, stats.arrays()["mean_similarity"][0, 0])


def test_attention_targets_legend_is_readable_and_names_every_chance_line():
    stats = hostile_stats()
    figure = study_figures(stats.summary(VOCAB.__getitem__), stats.arrays())["attention_targets"]
    left, right = figure.axes[:2]
    legend = left.get_legend()
    labels = [text.get_text() for text in legend.get_texts()]
    assert "“.” full stop" in labels  # not a bare 7-pt "."
    assert min(text.get_fontsize() for text in legend.get_texts()) >= 8
    # <s> and </s> occur once per window: one shared chance line, named in the legend.
    chance_lines = [line for line in left.get_lines() if line.get_linestyle() == ":"]
    levels = [line.get_ydata()[0] for line in chance_lines]
    assert len(levels) == len(set(levels)) == 2
    assert "chance of <s>, </s>: 0.083" in labels and any(label.startswith("chance of “.”") for label in labels)
    assert any(text.get_text() == "chance: 1/n = 1/12" for text in right.get_legend().get_texts())
    assert left.get_ylabel() and right.get_ylabel()


def test_trend_panels_have_y_labels_and_name_their_baseline():
    stats = hostile_stats()
    figure = study_figures(stats.summary(VOCAB.__getitem__), stats.arrays())["layer_trends"]
    for ax in figure.axes:
        assert ax.get_ylabel()
        assert any(text.get_text().startswith("chance: ") for text in ax.get_legend().get_texts())
    same_sentence = next(ax for ax in figure.axes if ax.get_title() == "same-sentence share")
    assert "non-special" in " ".join(text.get_text() for text in same_sentence.get_legend().get_texts())


def test_similarity_grid_has_a_colour_bar_and_says_each_head_has_its_own_scale():
    stats = hostile_stats()
    grid = study_figures(stats.summary(VOCAB.__getitem__), stats.arrays())["similarity_grid"]
    assert len(grid.axes) == 4 + 1  # 2 × 2 panels and the colour bar
    assert "own scale" in grid.axes[-1].get_ylabel()
    assert "each head has its own colour scale" in grid.get_suptitle()


def test_page_states_each_baseline():
    stats = hostile_stats()
    html = build_report(stats.summary(VOCAB.__getitem__), stats.arrays())
    assert "over all pairs of the same windows (chance)" not in html  # the old blanket statement
    for phrase in (
        "share of all pairs of non-special tokens that lie in one sentence",
        "(n + 1)/3",
        "k_M / P",
        "most pair-covering token",
        "1 / n (a uniform attention row)",
    ):
        assert phrase in html, phrase
