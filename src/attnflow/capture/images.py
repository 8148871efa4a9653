"""From an image file to a vision model's ``pixel_values``, and where the model's view lies in it.

`ImagePreprocessing` reads the standard keys of a Hugging Face ``preprocessor_config.json``
(resize, centre crop, rescale, normalise) and applies them with Pillow and numpy, so that the
crop box — the part of the original image the patch grid covers — is known exactly and the
overlay can be drawn on that part only. Models without the file (tiny test models) get the
plain ViT recipe: a square resize to ``config.image_size`` and mean = std = 0.5.

For ``dinov2-s`` (DINOv2 ViT-S/14) the folder states the standard DINOv2 recipe: shorter side
resized to 256 px (bicubic), centre crop 224 × 224, pixel values scaled to [0, 1] and normalised
with the ImageNet mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnflow.errors import InputError

log = logging.getLogger(__name__)

Box = tuple[float, float, float, float]  # (left, top, right, bottom) in original image pixels

_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
_MODE_NAMES = {
    "L": "grayscale",
    "LA": "grayscale + alpha",
    "RGBA": "RGBA",
    "P": "palette",
    "CMYK": "CMYK",
    "1": "black-and-white",
    "I": "32-bit grayscale",
    "I;16": "16-bit grayscale",
    "F": "float grayscale",
}


@dataclass(frozen=True)
class ImagePreprocessing:
    """How an RGB image becomes ``pixel_values [1, channel, height, width]``.

    Attributes:
        shortest_edge: resize so the shorter side has this many pixels (aspect kept), or None.
        resize_to: ``(height, width)`` to resize to directly when ``shortest_edge`` is None.
        crop: ``(height, width)`` of the centre crop taken after resizing, or None.
        resample: Pillow resampling filter (2 bilinear, 3 bicubic).
        rescale: factor applied to the 0–255 pixel values (1/255), or None.
        mean / std: per-channel normalisation ``(x - mean) / std``, or None.
    """

    shortest_edge: int | None = None
    resize_to: tuple[int, int] | None = None
    crop: tuple[int, int] | None = None
    resample: int = 2
    rescale: float | None = 1 / 255
    mean: tuple[float, float, float] | None = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] | None = (0.5, 0.5, 0.5)

    @classmethod
    def from_folder(cls, folder: str | Path, config: Any) -> "ImagePreprocessing":
        """The recipe in ``folder/preprocessor_config.json``; without it, a square resize to
        ``config.image_size`` with mean = std = 0.5 (the ViT default)."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.exists():
            side = config.image_size
            size = (side, side) if isinstance(side, int) else (int(side[0]), int(side[1]))
            return cls(resize_to=size)
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")), source=str(path))

    @classmethod
    def from_dict(cls, settings: dict[str, Any], source: str = "preprocessor_config.json") -> "ImagePreprocessing":
        """Parse the Hugging Face keys ``do_resize``, ``size``, ``resample``, ``do_center_crop``,
        ``crop_size``, ``do_rescale``, ``rescale_factor``, ``do_normalize``, ``image_mean``, ``image_std``."""
        size = settings.get("size") or {}
        shortest = resize_to = crop = None
        if settings.get("do_resize", True):
            if isinstance(size, dict) and "shortest_edge" in size:
                shortest = int(size["shortest_edge"])
            elif isinstance(size, dict) and {"height", "width"} <= set(size):
                resize_to = (int(size["height"]), int(size["width"]))
            elif isinstance(size, int):
                resize_to = (size, size)
            else:
                raise InputError(f"{source}: image size {size!r} is not supported (need shortest_edge or height/width)")
        if settings.get("do_center_crop", False):
            crop_size = settings.get("crop_size")
            crop_size = {"height": crop_size, "width": crop_size} if isinstance(crop_size, int) else crop_size
            if not isinstance(crop_size, dict) or not {"height", "width"} <= set(crop_size):
                raise InputError(f"{source}: do_center_crop needs a crop_size with height and width, got {crop_size!r}")
            crop = (int(crop_size["height"]), int(crop_size["width"]))
        normalize = settings.get("do_normalize", True)
        return cls(
            shortest_edge=shortest,
            resize_to=resize_to,
            crop=crop,
            resample=int(settings.get("resample", 2)),
            rescale=float(settings.get("rescale_factor", 1 / 255)) if settings.get("do_rescale", True) else None,
            mean=tuple(settings["image_mean"]) if normalize else None,
            std=tuple(settings["image_std"]) if normalize else None,
        )

    def describe(self) -> str:
        """One line for help texts and pages, e.g. ``shorter side -> 256 px (bicubic), centre crop 224x224, ...``."""
        steps = []
        filter_name = _RESAMPLE_NAMES.get(self.resample, f"filter {self.resample}")
        if self.shortest_edge is not None:
            steps.append(f"shorter side -> {self.shortest_edge} px ({filter_name})")
        elif self.resize_to is not None:
            steps.append(f"resize to {self.resize_to[1]}x{self.resize_to[0]} ({filter_name})")
        if self.crop is not None:
            steps.append(f"centre crop {self.crop[1]}x{self.crop[0]}")
        if self.rescale is not None:
            steps.append(f"x{self.rescale:.6g}")
        if self.mean is not None:
            steps.append(f"normalise mean {_floats(self.mean)} std {_floats(self.std)}")
        return ", ".join(steps)

    def __call__(self, image: Any) -> tuple[Any, Box]:
        """``(pixel_values [1, channel, height, width] float32 torch tensor, crop box)`` of an RGB
        PIL image; the box is the region of ``image`` (original pixels) the pixels show."""
        import torch

        width, height = image.size
        new_width, new_height = self.resized_size(width, height)
        resized = (
            image.resize((new_width, new_height), resample=self.resample)
            if (new_width, new_height) != (width, height)
            else image
        )
        left, top, crop_width, crop_height = 0, 0, new_width, new_height
        if self.crop is not None:
            crop_height, crop_width = self.crop
            if crop_height > new_height or crop_width > new_width:
                raise InputError(f"image of {width}x{height} px is too small for a {crop_width}x{crop_height} crop")
            top, left = (new_height - crop_height) // 2, (new_width - crop_width) // 2
            resized = resized.crop((left, top, left + crop_width, top + crop_height))
        array: np.ndarray = np.asarray(resized, dtype=np.float32)  # [height, width, channel]
        if self.rescale is not None:
            array = array * np.float32(self.rescale)
        if self.mean is not None and self.std is not None:
            array = (array - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.std, dtype=np.float32)
        pixels = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))[None]  # [1, channel, height, width]
        scale_x, scale_y = new_width / width, new_height / height
        box = (left / scale_x, top / scale_y, (left + crop_width) / scale_x, (top + crop_height) / scale_y)
        return pixels, box

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` after the resize step (Hugging Face's rounding: the longer side truncated)."""
        if self.shortest_edge is not None:
            if width <= height:
                return self.shortest_edge, int(self.shortest_edge * height / width)
            return int(self.shortest_edge * width / height), self.shortest_edge
        if self.resize_to is not None:
            return self.resize_to[1], self.resize_to[0]
        return width, height


def read_image(path: str | Path) -> Any:
    """Open an image file with Pillow (fully decoded); FileNotFoundError or one-line InputError otherwise."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no image file at {path}")
    try:
        with Image.open(path) as opened:
            opened.load()
            return opened.copy()
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        reason = "" if isinstance(error, UnidentifiedImageError) else f" ({error})"
        raise InputError(f"{path} is not an image file Pillow can read{reason}") from None


def small_image_note(size: tuple[int, int], grid: tuple[int, int], source: str = "the image") -> str | None:
    """A note, also logged as a warning, when an image of ``size`` (width, height) has fewer pixels
    on a side than the ``grid`` (rows, cols) has patches: it is upscaled, neighbouring patches see
    the same pixels and the saliency map says little. None for a large enough image."""
    (width, height), (rows, cols) = size, grid
    if width >= cols and height >= rows:
        return None
    note = (
        f"{source}: only {width}x{height} pixels, fewer than the {cols}x{rows} patches; it was upscaled, "
        "so neighbouring patches see the same pixels and the map says little"
    )
    log.warning(note)
    return note


CROP_NOTE_BELOW = 0.9  # one side kept less than 0.9 times as much as the other: a wide or tall image, noted


def crop_note(size: tuple[int, int], box: Box, source: str = "the image") -> str | None:
    """A note, also logged as a warning, when the centre crop (``box`` in original pixels) cuts one
    side of the image much more than the other (a wide or tall image: its share kept is below
    `CROP_NOTE_BELOW` times the other side's): the map covers only the middle, what lies outside it
    is not explained. None for an image cut alike on both sides (a square one: the recipe's margin)."""
    width, height = size
    left, top, right, bottom = box
    kept_width, kept_height = (right - left) / width, (bottom - top) / height
    if min(kept_width, kept_height) >= CROP_NOTE_BELOW * max(kept_width, kept_height):
        return None
    note = (
        f"{source}: {width}x{height} pixels, centre-cropped to the middle {kept_width:.0%} of its width and "
        f"{kept_height:.0%} of its height (columns {left:.0f}-{right:.0f}, rows {top:.0f}-{bottom:.0f}); "
        "the map covers only that part, the rest of the image is not explained"
    )
    log.warning(note)
    return note


def to_rgb(image: Any, source: str = "the image") -> tuple[Any, str | None]:
    """``(RGB image, note)``: other modes (grayscale, RGBA, palette, ...) are converted and the note,
    also logged as a warning, says so; note is None for an RGB image."""
    if image.mode == "RGB":
        return image, None
    kind = _MODE_NAMES.get(image.mode, f"mode {image.mode}")
    dropped = " (transparency dropped)" if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info else ""
    note = f"{source}: {kind} image converted to RGB{dropped}"
    log.warning(note)
    if image.mode in ("I", "I;16", "F"):  # high bit depth: scale to 0..255 before the 8-bit conversion
        array = np.asarray(image, dtype=np.float64)
        span = array.max() - array.min()
        array = (array - array.min()) / span * 255.0 if span > 0 else np.zeros_like(array)
        from PIL import Image

        image = Image.fromarray(array.astype(np.uint8))
    return image.convert("RGB"), note


def _floats(values: tuple[float, ...] | None) -> str:
    return "(" + ", ".join(f"{value:g}" for value in values or ()) + ")"
