"""Preprocessing (SPEC §7) against the reference fixture and edge cases."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fixtures_path import fixture_dir as find_fixtures
from PIL import Image

from lingbot_map_ros.io.preprocess import (
    ImageLoadError,
    list_images,
    load_image,
    load_sequence,
    preprocess_array,
    preprocess_pil,
    target_size,
)



def fixture_dir() -> Path:
    """The reference fixture set, or skip the test (see test/fixtures_path.py)."""
    path = find_fixtures()
    if path is None:
        pytest.skip("reference fixtures not found: ../shared/fixtures/upstream_tiny (or $LINGBOT_FIXTURES)")
    return path


# ----------------------------------------------------------------------------- fixture parity

def test_fixture_images_reproduced():
    fdir = fixture_dir()
    config = json.loads((fdir / "config.json").read_text())
    expected = np.load(fdir / "reference_kf1.npz")["images"]
    assert [p.name for p in list_images(fdir / "frames")] == config["frames"]
    images = load_sequence(fdir / "frames", width=config["preprocess_width"])
    assert images.shape == expected.shape == (12, 3, 56, 98)
    assert images.dtype == np.float32
    np.testing.assert_allclose(images, expected, rtol=0, atol=1e-6)


def test_preprocess_array_matches_file_path():
    fdir = fixture_dir()
    path = list_images(fdir / "frames")[3]
    rgb = np.asarray(Image.open(path).convert("RGB"))
    np.testing.assert_array_equal(preprocess_array(rgb, 98), preprocess_pil(load_image(path), 98))


def test_load_sequence_max_frames():
    fdir = fixture_dir()
    assert load_sequence(fdir / "frames", 98, max_frames=3).shape == (3, 3, 56, 98)
    with pytest.raises(ValueError, match="max_frames"):
        load_sequence(fdir / "frames", 98, max_frames=0)


# ----------------------------------------------------------------------------- sizes

@pytest.mark.parametrize(
    "w, h, width, expected",
    [
        (1920, 1080, 518, (518, 294)),  # 16:9
        (640, 480, 518, (518, 392)),  # 4:3
        (518, 294, 98, (98, 56)),
        (2, 5, 14, (14, 28)),  # h·W/w/14 = 2.5 → 2 (ties to even), not 3
        (2, 7, 14, (14, 56)),  # 3.5 → 4
    ],
)
def test_target_size(w, h, width, expected):
    assert target_size(w, h, width) == expected


@pytest.mark.parametrize("width", [0, -14, 100, 517, 14.0])
def test_width_must_be_positive_multiple_of_14(width):
    with pytest.raises(ValueError, match="width"):
        preprocess_pil(Image.new("RGB", (64, 48)), width)


def test_too_flat_image_rejected():
    with pytest.raises(ValueError, match="too small"):
        preprocess_pil(Image.new("RGB", (100, 1)), 14)


def test_output_range_and_layout():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(30, 50, 3), dtype=np.uint8)
    out = preprocess_array(rgb, 28)
    assert out.shape == (3, 14, 28) and out.dtype == np.float32
    assert out.min() >= 0 and out.max() <= 1
    np.testing.assert_array_equal(np.rint(out * 255), out * 255)  # multiples of 1/255


def test_identity_size_keeps_pixels():
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, size=(28, 42, 3), dtype=np.uint8)
    out = preprocess_array(rgb, 42)
    np.testing.assert_array_equal(out, rgb.transpose(2, 0, 1) / np.float32(255))


def test_preprocess_array_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8 RGB"):
        preprocess_array(np.zeros((28, 28, 3), dtype=np.float32), 28)
    with pytest.raises(ValueError, match="uint8 RGB"):
        preprocess_array(np.zeros((28, 28, 4), dtype=np.uint8), 28)


# ----------------------------------------------------------------------------- crop, alpha, EXIF

def test_tall_image_centre_cropped():
    # 28 wide × 84 tall, each row a distinct grey; width 28 → no resampling, 84 rows → crop 28.
    rows = np.arange(84, dtype=np.uint8) * 3
    rgb = np.repeat(np.repeat(rows[:, None, None], 28, axis=1), 3, axis=2)
    out = preprocess_array(rgb, 28)
    assert out.shape == (3, 28, 28)
    top = (84 - 28) // 2
    np.testing.assert_array_equal(out[0, :, 0] * 255, rows[top : top + 28].astype(np.float32))


def test_rgba_composited_on_white(tmp_path):
    rgba = np.zeros((28, 28, 4), dtype=np.uint8)
    rgba[:, :14] = (255, 0, 0, 0)  # fully transparent red → white
    rgba[:, 14:] = (0, 0, 0, 255)  # opaque black → black
    rgba[0, 20] = (0, 0, 255, 128)  # half-transparent blue
    img = Image.fromarray(rgba)
    assert img.mode == "RGBA"
    path = tmp_path / "alpha.png"
    img.save(path)
    for out in (preprocess_pil(img, 28), preprocess_pil(load_image(path), 28)):
        assert out.shape == (3, 28, 28)
        np.testing.assert_array_equal(out[:, :, :14], 1.0)
        np.testing.assert_array_equal(out[:, 1:, 14:], 0.0)
        r, g, b = np.rint(out[:, 0, 20] * 255)
        assert r == g and abs(r - 127) <= 1 and b == 255


def test_exif_orientation_applied(tmp_path):
    stored = np.zeros((14, 28, 3), dtype=np.uint8)  # 28 wide × 14 tall as stored
    stored[:, :14] = (255, 0, 0)
    stored[:, 14:] = (0, 0, 255)
    img = Image.fromarray(stored)
    exif = Image.Exif()
    exif[0x0112] = 6  # display = stored rotated 90° clockwise
    path = tmp_path / "rotated.png"
    img.save(path, exif=exif.tobytes())
    loaded = load_image(path)
    assert loaded.size == (14, 28)  # (width, height) after transpose
    arr = np.asarray(loaded)
    np.testing.assert_array_equal(arr[:14], np.broadcast_to([255, 0, 0], (14, 14, 3)))
    np.testing.assert_array_equal(arr[14:], np.broadcast_to([0, 0, 255], (14, 14, 3)))


# ----------------------------------------------------------------------------- errors

def test_missing_file(tmp_path):
    path = tmp_path / "nope.png"
    with pytest.raises(ImageLoadError, match="nope.png"):
        load_image(path)


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.jpg"
    path.write_bytes(b"this is not an image at all" * 10)
    with pytest.raises(ImageLoadError, match="garbage.jpg"):
        load_image(path)


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_truncated_file(tmp_path, fmt):
    rng = np.random.default_rng(2)
    good = tmp_path / f"good.{fmt}"
    Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(good)
    data = good.read_bytes()
    bad = tmp_path / f"cut.{fmt}"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageLoadError, match=f"cut.{fmt}"):
        load_image(bad)
    assert issubclass(ImageLoadError, ValueError)


def test_list_images(tmp_path):
    for name in ["b.PNG", "a.jpg", "c.JpEg", "d.bmp", "e.webp", "notes.txt", "f.tif"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub.png").mkdir()
    names = [p.name for p in list_images(tmp_path)]
    assert names == ["a.jpg", "b.PNG", "c.JpEg", "d.bmp", "e.webp"]


def test_list_images_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        list_images(tmp_path / "missing")
    (tmp_path / "file.png").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        list_images(tmp_path / "file.png")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match="no image files"):
        list_images(empty)


def test_mixed_sizes_padded_with_ones(tmp_path):
    Image.new("RGB", (28, 28), (0, 0, 0)).save(tmp_path / "0.png")  # → 28×28
    Image.new("RGB", (84, 28), (0, 0, 0)).save(tmp_path / "1.png")  # → 28 wide × 14 tall
    seq = load_sequence(tmp_path, 28)
    assert seq.shape == (2, 3, 28, 28)
    np.testing.assert_array_equal(seq[0], 0.0)
    np.testing.assert_array_equal(seq[1, :, 7:21], 0.0)
    np.testing.assert_array_equal(seq[1, :, :7], 1.0)
    np.testing.assert_array_equal(seq[1, :, 21:], 1.0)


@pytest.mark.parametrize("height,width", [(378, 518), (294, 518), (518, 518), (380, 518), (378, 520), (600, 518)])
def test_preprocess_array_shortcut_for_model_sized_frames_equals_the_pil_path(height, width):
    """Frames already at the model's size skip PIL (no resize, no crop); bit-identical output."""
    rgb = np.random.default_rng(height + width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    fast = preprocess_array(rgb, 518)
    reference = preprocess_pil(Image.fromarray(rgb), 518)
    assert fast.dtype == np.float32 and fast.flags.c_contiguous
    np.testing.assert_array_equal(fast, reference)
