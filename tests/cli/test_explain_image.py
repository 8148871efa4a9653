"""`attnflow explain --image PHOTO --model dinov2-s` on real photos, and bad image input.

The in-process runs share one loaded dinov2-s (the CLI's loader is patched to return it); the
bad-input cases run `attnflow.cli.main` as the installed script does (tests/cli/test_explain.py
runs the script itself).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from PIL import Image
from test_explain import assert_one_line_error, run_in_process

import attnflow
from attnflow.cli import explain as explain_command
from attnflow.cli import main

GRID = (16, 16)


def grace_hopper() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"  # 512 x 600 px


@pytest.fixture
def with_dinov2(dinov2, monkeypatch):
    loads = []

    def load(name, device, quiet, dtype="float32"):
        loads.append(name)
        return dinov2

    monkeypatch.setattr(explain_command, "load_model", load)
    return loads


def explain_image(image: Path, out: Path, *options: str) -> dict:
    assert main(["explain", "--image", str(image), "--model", "dinov2-s", "--out", str(out), "-q", *options]) == 0
    return json.loads((out / "explanation.json").read_text())


def test_rollout_on_grace_hopper_writes_overlay_html_and_trace(with_dinov2, tmp_path):
    data = explain_image(grace_hopper(), tmp_path, "--save-trace")
    assert with_dinov2 == ["dinov2-s"]
    assert {p.name for p in tmp_path.iterdir()} == {
        "explanation.json",
        "explanation.html",
        "explanation.png",
        "explanation_overlay.png",
        "trace.npz",
    }
    assert data["grid"] == list(GRID) and data["n_prefix_tokens"] == 1 and data["row"] == "cls"
    assert np.asarray(data["patch_scores"]).shape == GRID
    assert data["image_box"] == [32.0, 76.0, 480.0, 524.0]  # the centre crop, in original pixels
    assert Image.open(tmp_path / "explanation_overlay.png").size == (448, 448)  # the crop, not the 512 x 600 photo
    with np.load(tmp_path / "trace.npz") as saved:
        attentions = saved["attentions"]
        assert attentions.shape == (12, 6, 257, 257) and attentions.dtype == np.float32
        assert "head_outputs" not in saved  # rollout needs only the attentions: nothing else is captured
    np.testing.assert_allclose(data["scores"], attnflow.rollout(attentions)[0], atol=1e-6)
    html = (tmp_path / "explanation.html").read_text()
    assert "Patch grid 16x16" in html and "box left, top, right, bottom = 32, 76, 480, 524 px" in html


def test_flow_computes_the_cls_row_only(with_dinov2, tmp_path):
    data = explain_image(grace_hopper(), tmp_path, "--method", "flow", "--save-trace")
    assert data["matrix"] is None and data["options"]["rows"] == [0]
    with np.load(tmp_path / "trace.npz") as saved:
        expected = attnflow.attention_flow(saved["attentions"], rows=[0])[0]
    np.testing.assert_allclose(data["scores"], expected, atol=1e-9)
    assert abs(sum(data["scores"]) - 1.0) < 1e-9
    assert "computed for the saliency row only" in (tmp_path / "explanation.html").read_text()
    assert (tmp_path / "explanation.png").exists() and (tmp_path / "explanation_overlay.png").exists()


def test_raw_last_layer_cls_row(with_dinov2, tmp_path):
    data = explain_image(grace_hopper(), tmp_path, "--method", "raw", "--save-trace")
    with np.load(tmp_path / "trace.npz") as saved:
        expected = saved["attentions"][-1].mean(axis=0)[0]  # last layer, mean over heads, CLS row
    np.testing.assert_allclose(data["scores"], expected, atol=1e-6)
    patches = np.asarray(data["patch_scores"])
    assert patches[1:10, 4:12].mean() > 2 * patches[0:8, 13:16].mean()  # face over the wall on the right


def test_grayscale_photo_is_converted_with_a_note(with_dinov2, tmp_path, caplog):
    camera = Path(skimage.data.__file__).parent / "camera.png"  # a grayscale photo (mode L)
    assert Image.open(camera).mode == "L"
    with caplog.at_level(logging.WARNING):
        data = explain_image(camera, tmp_path)
    notes = [record.getMessage() for record in caplog.records]
    assert notes == [f"{camera}: grayscale image converted to RGB"]
    assert np.asarray(data["patch_scores"]).shape == GRID


def test_rgba_image_converted_with_a_one_line_note(with_dinov2, tmp_path, capsys, caplog):
    image = tmp_path / "logo.png"
    rgba = np.random.default_rng(0).integers(0, 255, (60, 60, 4), dtype=np.uint8)  # square: no crop note
    Image.fromarray(rgba, "RGBA").save(image)
    with caplog.at_level(logging.WARNING):
        result = run_in_process(
            capsys, "--image", str(image), "--model", "dinov2-s", "--out", str(tmp_path / "out"), "-q"
        )
    assert result.returncode == 0 and not result.stderr, result.stderr
    notes = [record.getMessage() for record in caplog.records]
    assert notes == [f"{image}: RGBA image converted to RGB (transparency dropped)"]
    assert (tmp_path / "out" / "explanation_overlay.png").exists()


def test_a_file_that_is_not_an_image_fails_before_loading(tmp_path, capsys):
    fake = tmp_path / "photo.jpg"
    fake.write_text("not a picture")
    result = run_in_process(capsys, "--image", str(fake), "--model", "no-such-model", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, f"{fake} is not an image file Pillow can read")  # the model was never resolved
    assert not (tmp_path / "out").exists()


def test_an_image_given_to_a_text_model(tmp_path, capsys):
    result = run_in_process(
        capsys, "--image", str(grace_hopper()), "--model", "minilm", "--out", str(tmp_path / "out"), "-q"
    )
    assert_one_line_error(result, "minilm is a text model (encoder), not a vision model", "dinov2-s")
    assert not (tmp_path / "out").exists()


def test_a_text_given_to_a_vision_model(tmp_path, capsys):
    result = run_in_process(
        capsys, "A cat sat on the mat.", "--model", "dinov2-s", "--out", str(tmp_path / "out"), "-q"
    )
    assert_one_line_error(result, "dinov2-s is a vision model: it explains images, not text", "--image")
    assert not (tmp_path / "out").exists()


def test_help_states_the_preprocessing(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in (
        "shorter side is resized to 256 px (bicubic)",
        "centre 224x224",
        "ImageNet mean (0.485, 0.456, 0.406)",
        "std (0.229, 0.224, 0.225)",
        "16x16 grid",
        "flow computes only the saliency row",
    ):
        assert fragment in text


def test_value_aware_norm_rollout_on_the_grid(with_dinov2, tmp_path):
    data = explain_image(grace_hopper(), tmp_path, "--method", "norm_rollout")
    patches = np.asarray(data["patch_scores"])
    assert patches.shape == GRID and abs(sum(data["scores"]) - 1.0) < 1e-9
    assert patches[1:10, 4:12].mean() > 2 * patches[0:8, 13:16].mean()  # face over the wall on the right
