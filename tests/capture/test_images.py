"""Image reading, RGB conversion and `ImagePreprocessing` on small synthetic images (fast)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from attnflow.capture.images import ImagePreprocessing, read_image, small_image_note, to_rgb
from attnflow.capture.onnx_dinov2 import PREPROCESSOR
from attnflow.errors import InputError

# The dinov2-s recipe, shrunk so that sizes are easy to check by hand.
DINOV2 = {**PREPROCESSOR, "size": {"shortest_edge": 8}, "crop_size": {"height": 6, "width": 6}}


def test_shortest_edge_resize_centre_crop_and_box_by_hand():
    recipe = ImagePreprocessing.from_dict(DINOV2)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8))  # 30 wide, 20 high
    assert recipe.resized_size(30, 20) == (12, 8)  # shorter side 20 -> 8, scale 0.4
    assert recipe.resized_size(20, 30) == (8, 12)
    assert recipe.resized_size(7, 10) == (8, 11)  # 8 * 10 / 7 = 11.43, truncated as Hugging Face does
    pixels, box = recipe(image)
    assert tuple(pixels.shape) == (1, 3, 6, 6)
    # crop (12 - 6) // 2 = 3 from the left, (8 - 6) // 2 = 1 from the top, in the 12 x 8 image; / 0.4
    assert box == pytest.approx((7.5, 2.5, 22.5, 17.5))
    resized = np.asarray(image.resize((12, 8), Image.Resampling.BICUBIC), dtype=np.float32)[1:7, 3:9]
    expected = (resized / 255 - np.array(DINOV2["image_mean"])) / np.array(DINOV2["image_std"])
    np.testing.assert_allclose(pixels[0].numpy().transpose(1, 2, 0), expected, atol=1e-5)


def test_square_resize_without_crop_covers_the_whole_image():
    recipe = ImagePreprocessing.from_dict(
        {"size": {"height": 4, "width": 4}, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    )
    image = Image.new("RGB", (10, 6), (255, 0, 128))
    pixels, box = recipe(image)
    assert box == (0.0, 0.0, 10.0, 6.0)
    np.testing.assert_allclose(pixels[0, :, 0, 0].numpy(), [1.0, -1.0, 128 / 255 * 2 - 1], atol=1e-6)


def test_without_a_preprocessor_file_the_vit_default(tmp_path):
    recipe = ImagePreprocessing.from_folder(tmp_path, SimpleNamespace(image_size=16))
    assert recipe == ImagePreprocessing(resize_to=(16, 16))
    assert (
        recipe.describe()
        == "resize to 16x16 (bilinear), x0.00392157, normalise mean (0.5, 0.5, 0.5) std (0.5, 0.5, 0.5)"
    )


def test_describe_the_dinov2_recipe():
    recipe = ImagePreprocessing.from_dict(
        {**DINOV2, "size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224}}
    )
    assert recipe.describe() == (
        "shorter side -> 256 px (bicubic), centre crop 224x224, x0.00392157, "
        "normalise mean (0.485, 0.456, 0.406) std (0.229, 0.224, 0.225)"
    )


def test_unsupported_size_and_too_small_image():
    with pytest.raises(InputError, match="longest_edge"):
        ImagePreprocessing.from_dict({"size": {"longest_edge": 224}})
    recipe = ImagePreprocessing(resize_to=(4, 4), crop=(6, 6))
    with pytest.raises(InputError, match="too small for a 6x6 crop"):
        recipe(Image.new("RGB", (10, 10)))


@pytest.mark.parametrize(
    "mode, note",
    [
        ("L", "grayscale image converted to RGB"),
        ("RGBA", "RGBA image converted to RGB (transparency dropped)"),
        ("LA", "grayscale + alpha image converted to RGB (transparency dropped)"),
        ("P", "palette image converted to RGB"),
        ("CMYK", "CMYK image converted to RGB"),
    ],
)
def test_other_modes_are_converted_with_a_note(mode, note, caplog):
    image = Image.new("RGB", (4, 3), (200, 100, 50)).convert(mode)
    with caplog.at_level(logging.WARNING):
        converted, message = to_rgb(image, "x.png")
    assert converted.mode == "RGB" and converted.size == (4, 3)
    assert message == f"x.png: {note}"
    assert [record.getMessage() for record in caplog.records] == [message]


def test_rgb_passes_without_a_note(caplog):
    image = Image.new("RGB", (2, 2))
    with caplog.at_level(logging.WARNING):
        assert to_rgb(image) == (image, None)
    assert not caplog.records


def test_sixteen_bit_grayscale_is_scaled_not_clipped_to_white():
    values = np.array([[0, 1000], [2000, 4000]], dtype=np.uint16)  # a 12-bit scan: every value > 255
    converted, note = to_rgb(Image.fromarray(values), "scan.png")
    assert "grayscale image converted to RGB" in note
    np.testing.assert_array_equal(np.asarray(converted)[..., 0], [[0, 63], [127, 255]])  # 255 * v / 4000, truncated


def test_read_image_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no image file"):
        read_image(tmp_path / "missing.png")
    text = tmp_path / "notes.png"
    text.write_text("hello")
    with pytest.raises(InputError, match=r"is not an image file Pillow can read$"):
        read_image(text)
    truncated = tmp_path / "cut.png"
    Image.new("RGB", (50, 50), (1, 2, 3)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:60])
    with pytest.raises(InputError, match="is not an image file Pillow can read"):
        read_image(truncated)
    good = tmp_path / "good.png"
    Image.new("L", (3, 2)).save(good)
    assert read_image(good).size == (3, 2) and read_image(good).mode == "L"


@pytest.mark.parametrize(
    "size, grid, expected",
    [
        ((1, 1), (16, 16), "x.png: only 1x1 pixels, fewer than the 16x16 patches"),
        ((300, 10), (16, 16), "x.png: only 300x10 pixels, fewer than the 16x16 patches"),
        ((16, 16), (16, 16), None),
        ((640, 480), (16, 16), None),
    ],
)
def test_an_image_smaller_than_the_patch_grid_gets_a_note(size, grid, expected, caplog):
    with caplog.at_level(logging.WARNING):
        note = small_image_note(size, grid, "x.png")
    if expected is None:
        assert note is None and not caplog.records
    else:
        assert note is not None and note.startswith(expected) and "upscaled" in note
        assert [record.getMessage() for record in caplog.records] == [note]


def test_a_one_pixel_image_is_explained_with_the_note(tiny_model_path, tmp_path):
    import attnflow

    path = tmp_path / "dot.png"
    Image.new("RGB", (1, 1), (200, 30, 30)).save(path)
    model = attnflow.load(str(tiny_model_path("dinov2")), device="cpu")  # 4x4 patches of 4 px
    explanation = attnflow.explain(model.trace_image(path), method="rollout")
    assert explanation.notes == [
        f"{path}: only 1x1 pixels, fewer than the 4x4 patches; it was upscaled, so "
        "neighbouring patches see the same pixels and the map says little"
    ]


def test_a_wide_image_gets_a_note_on_what_the_crop_leaves_out(caplog):
    """30x20 px through the shrunk dinov2 recipe: the box (7.5, 2.5, 22.5, 17.5) keeps 15/30 = 50 %
    of the width and 15/20 = 75 % of the height (worked out by hand in the test above)."""
    from attnflow.capture.images import crop_note

    recipe = ImagePreprocessing.from_dict(DINOV2)
    _, box = recipe(Image.new("RGB", (30, 20)))
    with caplog.at_level(logging.WARNING):
        note = crop_note((30, 20), box, "wide.png")
    assert note == (
        "wide.png: 30x20 pixels, centre-cropped to the middle 50% of its width and 75% of its height "
        "(columns 8-22, rows 2-18); the map covers only that part, the rest of the image is not explained"
    )
    assert note in caplog.text
    assert crop_note((30, 20), (0.0, 0.0, 30.0, 20.0)) is None  # nothing cut
    assert crop_note((256, 256), (16.0, 16.0, 240.0, 240.0)) is None  # dinov2's square margin (87.5 % each way)
    assert crop_note((270, 256), (23.0, 16.0, 247.0, 240.0)) is None  # 83 % vs 87.5 % kept: 0.95 of it
    assert crop_note((300, 256), (38.0, 16.0, 262.0, 240.0)) is not None  # 74.7 % vs 87.5 %: 0.85 of it
