"""Signed explanations (orange for the target, blue against it) and the faithfulness badge, on
hand-made Explanations: the ranking, the HTML page, the comparison page's order, the PNG bars."""

from __future__ import annotations

import re

import numpy as np
from matplotlib.colors import to_hex

from attnflow.explanation import Explanation
from attnflow.viz.html import methods_comparison_html
from attnflow.viz.plot import plot_explanation

TOKENS = ["[CLS]", "terrible", "but", "great", "acting", "[SEP]"]
TARGET = {"kind": "class", "index": 0, "label": "negative", "value": 2.0, "probability": 0.9}
ORANGE, BLUE = "217,72,15", "33,102,172"


def _faithfulness(comprehensiveness: float) -> dict:
    return {
        "target": "negative",
        "probability": 0.9,
        "replace": "remove",
        "bins": [0.1, 0.2, 0.5],
        "comprehensiveness": [comprehensiveness] * 3,
        "sufficiency": [0.05] * 3,
        "aopc_comprehensiveness": comprehensiveness,
        "aopc_sufficiency": 0.05,
        "random": {
            "comprehensiveness": [0.1] * 3,
            "sufficiency": [0.3] * 3,
            "aopc_comprehensiveness": 0.1,
            "aopc_sufficiency": 0.3,
            "rankings": 5,
        },
    }


def _explanation(method: str, scores, signed: bool, comprehensiveness: float | None = None) -> Explanation:
    return Explanation(
        tokens=TOKENS,
        matrix=None,
        scores=np.asarray(scores, dtype=float),
        method=method,
        options={},
        row=None,
        model="m",
        text="terrible but great acting",
        special_mask=np.array([True, False, False, False, False, True]),
        target=TARGET,
        prediction=TARGET,
        signed=signed,
        faithfulness=None if comprehensiveness is None else _faithfulness(comprehensiveness),
    )


SIGNED = [0.0, 0.41, -0.05, -0.22, 0.1, 0.0]


def test_signed_scores_rank_by_their_signed_value():
    explanation = _explanation("shap", SIGNED, signed=True)
    assert [token for _, token, _ in explanation.top(4)] == ["terrible", "acting", "but", "great"]
    assert [(token, score) for _, token, score in explanation.against(3)] == [("great", -0.22), ("but", -0.05)]


def test_the_page_colours_support_orange_and_evidence_against_blue():
    markup = _explanation("shap", SIGNED, signed=True, comprehensiveness=0.4).to_html()
    spans = re.findall(r'class="tok" style="background: rgba\(([\d,]+),[\d.]+\)[^>]*>([^<]*)<', markup)
    colours = {text.strip(): colour for colour, text in spans}
    assert colours == {"terrible": ORANGE, "great": BLUE, "acting": ORANGE, "but": BLUE}
    assert "scale signed" in markup and "for negative" in markup and "against" in markup
    assert "comprehensiveness 0.40 (random 0.10) · sufficiency 0.05 (random 0.30)" in markup


def test_the_comparison_page_sorts_by_comprehensiveness_and_shows_each_badge():
    explanations = [
        _explanation("rollout", [0.3, 0.2, 0.1, 0.1, 0.1, 0.2], signed=False, comprehensiveness=0.15),
        _explanation("shap", SIGNED, signed=True, comprehensiveness=0.4),
        _explanation("gradient", [0.0, 0.3, 0.1, 0.2, 0.1, 0.0], signed=False, comprehensiveness=0.25),
    ]
    explanations[1].chosen_by = "--method auto chose shap: the highest comprehensiveness on this input"
    markup = methods_comparison_html(explanations)
    order = [markup.index(f'id="method-{name}"') for name in ("shap", "gradient", "rollout")]
    assert order == sorted(order)
    assert markup.count('class="badge') == 3 and "--method auto chose shap" in markup


def test_png_bars_are_blue_below_zero_and_orange_above():
    figure = plot_explanation(_explanation("shap", SIGNED, signed=True))
    bars = figure.axes[0].patches
    colours = [to_hex(bar.get_facecolor()) for bar in bars]
    assert colours[1] == "#d9480f" and colours[3] == "#2166ac" and colours[2] == "#2166ac"
    assert bars[3].get_height() < 0


def test_a_badge_barely_above_random_is_not_green():
    """Random rankings' comprehensiveness is 0.1: 0.12 is barely above (amber), 0.09 below (red),
    0.25 clearly above (the plain, green badge); the class and the hover text say which."""
    from attnflow.explanation import faithfulness_level

    for comprehensiveness, level in (
        (0.09, "weak"),
        (0.1, "weak"),
        (0.12, "marginal"),
        (0.149, "marginal"),
        (0.25, "clear"),
    ):
        assert faithfulness_level(_faithfulness(comprehensiveness)) == level, comprehensiveness
        markup = _explanation(
            "rollout", [0.3, 0.2, 0.1, 0.1, 0.1, 0.2], signed=False, comprehensiveness=comprehensiveness
        ).to_html()
        badge = re.search(r'<span class="(badge[^"]*)" title="([^"]*)"', markup)
        assert badge is not None
        assert badge.group(1) == ("badge" if level == "clear" else f"badge {level}")
        assert ("Barely above random" in badge.group(2)) == (level == "marginal")


def test_the_deletion_curves_legend_covers_no_curve():
    """16 methods (evaluate --methods all): the drawn legend lies outside the plotting area."""
    from attnflow.viz.plot import deletion_curves_figure

    names = [f"method_{i}" for i in range(15)] + ["random"]
    x = np.linspace(0, 1, 11)
    curves = [{"x": x, "mean": 0.9 - 0.5 * x * (i + 1) / 16, "se": np.full(11, 0.01)} for i in range(16)]
    figure = deletion_curves_figure(names, curves)
    figure.draw_without_rendering()  # the constrained layout is computed on drawing
    axis = figure.axes[0]
    legend = figure.legends[0]
    plot_area, legend_box = axis.get_window_extent(), legend.get_window_extent()
    assert legend_box.x0 >= plot_area.x1  # beside the plot, not over it
    assert legend_box.x1 <= figure.bbox.x1 + 1  # and not cut off
    assert [text.get_text() for text in legend.get_texts()] == names
