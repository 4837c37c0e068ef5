"""Image loading and preprocessing into model input (SPEC §7, reference "crop" mode).

Pipeline for one image: EXIF transpose; an RGBA image is composited on white
(only that mode — other modes are converted directly); convert to RGB; resize
the 8-bit image with Pillow's antialiased bicubic to width ``W`` and height
``round(h·W/w/14)·14`` (Python's ``round``, ties to even); divide by 255; if the
height exceeds ``W``, centre-crop rows to ``W`` (offset ``floor((h'−W)/2)``).

The resize must be Pillow's (it rounds back to 8 bits); a float bicubic resize
in torch does not reproduce the reference fixtures. Everything here is
numpy/Pillow only, so it runs on machines without torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageOps

PATCH_SIZE = 14
DEFAULT_WIDTH = 518
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})


class ImageLoadError(ValueError):
    """An image file is missing, unreadable or corrupt (message names the file)."""


def load_image(path: str | Path) -> Image.Image:
    """Read an image file as an RGB ``PIL.Image`` (SPEC §7, first steps).

    The file is fully decoded here, so truncated or corrupt data fails now and
    not later. EXIF orientation is applied; an RGBA image is alpha-composited
    on an opaque white background; the result is converted to RGB.

    Raises:
        ImageLoadError: the file is missing, is not an image, or fails to decode.
    """
    path = Path(path)
    try:
        with Image.open(path) as img:
            img.load()  # force a full decode: catches truncated/corrupt data
            img = ImageOps.exif_transpose(img)
    except FileNotFoundError as exc:
        raise ImageLoadError(f"image file not found: {path}") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageLoadError(f"cannot read image {path}: {exc}") from exc
    return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGBA → composite on white; every mode → RGB."""
    if img.mode == "RGBA":
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, img)
    return img.convert("RGB")


def target_size(width_in: int, height_in: int, width: int = DEFAULT_WIDTH) -> tuple[int, int]:
    """Resize target ``(W, H')`` in pixels for an input of ``width_in × height_in``.

    ``H' = round(height_in · width / width_in / 14) · 14`` (before any crop).

    Raises:
        ValueError: ``width`` is not a positive multiple of 14, or the input is
            so flat that ``H'`` would be 0.
    """
    _check_width(width)
    if width_in <= 0 or height_in <= 0:
        raise ValueError(f"image size must be positive, got {width_in}x{height_in}")
    height = round(height_in * width / width_in / PATCH_SIZE) * PATCH_SIZE
    if height <= 0:
        raise ValueError(
            f"image {width_in}x{height_in} (WxH) is too small/flat: resized to width "
            f"{width} its height rounds to 0 patch rows of {PATCH_SIZE} px"
        )
    return width, height


def preprocess_pil(img: Image.Image, width: int = DEFAULT_WIDTH) -> np.ndarray:
    """Turn an image into model input.

    Args:
        img: any-mode PIL image; RGBA is composited on white, everything else
            converted to RGB. EXIF orientation is NOT applied here (``load_image``
            does that when reading a file).
        width: target width in pixels, a positive multiple of 14.

    Returns:
        float32 array [3, H, W] with values in [0, 1] (multiples of 1/255),
        ``W = width`` and ``H = min(round(h·W/w/14)·14, W)``.
    """
    img = _to_rgb(img)
    w_out, h_out = target_size(img.width, img.height, width)
    resized = img.resize((w_out, h_out), Image.Resampling.BICUBIC)
    arr = np.asarray(resized, dtype=np.float32) / np.float32(255.0)  # [H', W, 3]
    if h_out > w_out:
        top = (h_out - w_out) // 2
        arr = arr[top : top + w_out]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))  # [3, H, W]


def preprocess_array(rgb: np.ndarray, width: int = DEFAULT_WIDTH) -> np.ndarray:
    """Preprocess a decoded RGB frame (e.g. from a ROS image message).

    Args:
        rgb: uint8 array [H, W, 3] in RGB channel order.
        width: target width in pixels, a positive multiple of 14.

    Returns:
        float32 array [3, H', W] in [0, 1], exactly as ``preprocess_pil``.
    """
    rgb = _checked_rgb(rgb)
    if _is_model_sized(rgb, width):
        # already the model's size (a camera set to it): the resize would be the identity and
        # there is no crop; one pass, the same float32 division as preprocess_pil
        return uint8_to_image(rgb)
    return preprocess_pil(Image.fromarray(np.ascontiguousarray(rgb)), width)


def uint8_to_image(rgb: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W] in [0, 1]: the float32 division of preprocessing."""
    out = np.empty((3, *rgb.shape[:2]), np.float32)
    np.divide(rgb.transpose(2, 0, 1), np.float32(255.0), out=out, dtype=np.float32)
    return out


def _checked_rgb(rgb: np.ndarray) -> np.ndarray:
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(
            f"expected a uint8 RGB array of shape [H, W, 3], got {rgb.dtype} {rgb.shape}"
        )
    return rgb


def _is_model_sized(rgb: np.ndarray, width: int) -> bool:
    """Preprocessing would neither resize nor crop this [H, W, 3] frame."""
    height, width_in = rgb.shape[:2]
    return target_size(width_in, height, width) == (width_in, height) and height <= width_in


def model_input(rgb: np.ndarray, width: int = DEFAULT_WIDTH) -> np.ndarray:
    """What to push for a decoded RGB frame (uint8 [H, W, 3]): the frame itself when it is
    already the model's size (the session converts it on the device, 4x less to copy and
    no host conversion), else ``preprocess_array``'s float32 [3, H', W].

    Either gives the model the same float32 values."""
    rgb = _checked_rgb(rgb)
    return np.ascontiguousarray(rgb) if _is_model_sized(rgb, width) else preprocess_array(rgb, width)


def input_size(image: np.ndarray) -> tuple[int, int]:
    """(H, W) of a model input from ``model_input``: uint8 [H, W, 3] or float [3, H, W]."""
    return (image.shape[0], image.shape[1]) if image.dtype == np.uint8 else (image.shape[1], image.shape[2])


def list_images(directory: str | Path) -> list[Path]:
    """Image files directly inside ``directory``, sorted by file name.

    Extensions jpg, jpeg, png, bmp, webp (case-insensitive).

    Raises:
        FileNotFoundError: ``directory`` does not exist.
        NotADirectoryError: ``directory`` is a file.
        ValueError: the directory holds no image files.
    """
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"image directory not found: {directory}")
    if not directory.is_dir():
        raise NotADirectoryError(f"not a directory: {directory}")
    paths = sorted(
        p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    )
    if not paths:
        exts = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise ValueError(f"no image files ({exts}) in {directory}")
    return paths


def load_sequence(
    directory: str | Path, width: int = DEFAULT_WIDTH, max_frames: int | None = None
) -> np.ndarray:
    """Load and preprocess the sorted images of a directory.

    Args:
        directory: folder of frames (see ``list_images``); order = file name order.
        width: target width in pixels, a positive multiple of 14.
        max_frames: keep only the first ``max_frames`` images (None = all).

    Returns:
        float32 array [S, 3, H, W] in [0, 1]. Frames of different sizes are
        padded, centred, with 1.0 to the largest height and width (SPEC §7).
        Use ``list_images`` for the matching file paths.
    """
    _check_width(width)
    paths = list_images(directory)
    if max_frames is not None:
        if max_frames <= 0:
            raise ValueError(f"max_frames must be positive or None, got {max_frames}")
        paths = paths[:max_frames]
    return pad_and_stack([preprocess_pil(load_image(p), width) for p in paths])


def pad_and_stack(frames: Sequence[np.ndarray]) -> np.ndarray:
    """Stack [3, H_i, W_i] frames into [S, 3, H, W], padding each with 1.0,
    centred (top/left get ``floor(pad/2)``), to the largest H and W."""
    if not frames:
        raise ValueError("no frames to stack")
    h_max = max(f.shape[1] for f in frames)
    w_max = max(f.shape[2] for f in frames)
    out = np.ones((len(frames), 3, h_max, w_max), dtype=np.float32)
    for i, f in enumerate(frames):
        top = (h_max - f.shape[1]) // 2
        left = (w_max - f.shape[2]) // 2
        out[i, :, top : top + f.shape[1], left : left + f.shape[2]] = f
    return out


def _check_width(width: int) -> None:
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise ValueError(f"width must be an int, got {width!r}")
    if width <= 0 or width % PATCH_SIZE:
        raise ValueError(f"width must be a positive multiple of {PATCH_SIZE}, got {width}")
