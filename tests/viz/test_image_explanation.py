"""Image explanations: the crop-box overlay, flow's single saliency row, the saturating colour scale."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from attnflow import attention_flow, rollout
from attnflow.explanation import Explanation, explain
from attnflow.viz.plot import overlay_image, patch_color_range
from test_explanation import random_trace


def _image(tmp_path, width=40, height=30):
    path = tmp_path / "image.png"
    left_half = np.zeros((height, width, 3), dtype=np.uint8)
    left_half[:, : width // 2] = 255  # white left half, black right half
    Image.fromarray(left_half).save(path)
    return path


def test_overlay_covers_the_crop_box_only(tmp_path):
    path = _image(tmp_path)
    scores = np.zeros((2, 2))
    whole = overlay_image(str(path), scores)
    cropped = overlay_image(str(path), scores, box=(20.0, 5.0, 40.0, 25.0))  # the black right half, 20 x 20
    assert whole.size == (40, 30) and cropped.size == (20, 20)
    assert np.asarray(cropped).max() < np.asarray(whole).max()  # none of the white half is in the crop


def test_image_box_travels_from_trace_to_json(tmp_path):
    path = _image(tmp_path)
    trace = random_trace(n=5, grid=(2, 2), prefix=1, meta={"image": str(path), "image_box": (20, 5, 40, 25)})
    explanation = explain(trace, method="rollout")
    assert explanation.image_box == (20.0, 5.0, 40.0, 25.0)
    paths = explanation.save(tmp_path / "out")
    assert Image.open(paths["overlay"]).size == (20, 20)
    data = json.loads(paths["json"].read_text())
    assert data["image_box"] == [20.0, 5.0, 40.0, 25.0]
    assert Explanation.from_dict(data).image_box == explanation.image_box


def test_flow_on_an_image_computes_only_the_saliency_row(tmp_path):
    path = _image(tmp_path)
    trace = random_trace(n=10, grid=(3, 3), prefix=1, meta={"image": str(path)})
    for row, index in (("cls", 0), (4, 4), ("last", 9)):
        explanation = explain(trace, method="flow", row=row, residual="renorm")
        assert explanation.matrix is None and explanation.options["rows"] == [index]
        full = attention_flow(trace.attentions, residual="renorm")  # the oracle: every row
        np.testing.assert_allclose(explanation.scores, full[index], atol=1e-12)
    mean_row = explain(trace, method="flow", row="mean")  # needs every row: the matrix is computed
    assert mean_row.matrix.shape == (10, 10) and "rows" not in mean_row.options
    paths = explanation.save(tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["matrix"] is None and data["options"]["rows"] == [9]
    restored = Explanation.from_dict(data)
    assert restored.matrix is None
    np.testing.assert_allclose(restored.scores, explanation.scores)
    html = paths["html"].read_text()
    assert "computed for the saliency row only" in html and "relevance matrix heatmap" not in html
    assert Image.open(paths["png"]).size[0] > 0


def test_text_flow_keeps_its_full_matrix():
    trace = random_trace(n=6)
    explanation = explain(trace, method="flow", row="cls")
    np.testing.assert_allclose(explanation.matrix, attention_flow(trace.attentions), atol=1e-12)


def test_rollout_on_an_image_keeps_its_matrix():
    trace = random_trace(n=5, grid=(2, 2), prefix=1)
    explanation = explain(trace, method="rollout")
    np.testing.assert_allclose(explanation.matrix, rollout(trace.attentions), atol=1e-12)


def test_colour_scale_saturates_at_the_99th_percentile(tmp_path):
    scores = np.full((16, 16), 0.002)
    scores[3:6, 4:8] = 0.01  # a "face" of 12 patches
    scores[15, 2] = 0.08  # one artifact patch, 8x the face
    low, high = patch_color_range(scores)
    assert low == pytest.approx(0.002) and high == pytest.approx(0.01)
    grey = tmp_path / "grey.png"
    Image.new("RGB", (64, 64), (128, 128, 128)).save(grey)
    overlay = np.asarray(overlay_image(str(grey), scores), dtype=float)  # 4 px per patch
    face, artifact, background = overlay[4 * 4 + 2, 5 * 4 + 2], overlay[15 * 4 + 2, 2 * 4 + 2], overlay[0, 0]
    from matplotlib import colormaps

    top = 0.45 * 128 + 0.55 * np.array(colormaps["inferno"](1.0)[:3]) * 255  # grey blended with the top colour
    np.testing.assert_allclose(face, top, atol=2)  # saturated: the artifact does not wash the face out
    assert face.sum() >= artifact.sum() and face.sum() > background.sum() + 100


def test_comparison_page_shows_each_method_over_the_image(tmp_path):
    from attnflow.viz.html import methods_comparison_html

    path = _image(tmp_path)
    trace = random_trace(n=5, grid=(2, 2), prefix=1, meta={"image": str(path), "image_box": (20, 5, 40, 25)})
    html = methods_comparison_html([explain(trace, method="rollout"), explain(trace, method="flow")])
    assert html.count('class="overlay"') == 2  # one overlay per method
    assert 'class="tok"' not in html  # patches are not listed as coloured tokens
    assert str(path) in html and "box left, top, right, bottom = 20, 5, 40, 25 px" in html
