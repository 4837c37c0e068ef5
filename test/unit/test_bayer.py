"""Bayer encodings of ``conversions.image_to_rgb``: bilinear demosaicing, 8 and 16 bit, all four patterns.

Mosaics are built from known RGB images by keeping, at each pixel, the channel the
pattern puts there; the result is compared with the original and with a slow
per-pixel reference written independently of the vectorised code.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "sensor_msgs.msg",
    reason="ROS 2 message packages not importable (run scripts/bootstrap.sh to install them)")

from sensor_msgs.msg import Image  # noqa: E402

from lingbot_map_ros.ros import conversions as cv  # noqa: E402

PATTERNS = ["rggb", "bggr", "gbrg", "grbg"]
CHANNEL = {"r": 0, "g": 1, "b": 2}


def site_channels(pattern: str, height: int, width: int) -> np.ndarray:
    """[H, W] index of the colour (0 R, 1 G, 2 B) sampled at each pixel."""
    rows, cols = np.mgrid[0:height, 0:width]
    table = np.array([CHANNEL[c] for c in pattern]).reshape(2, 2)
    return table[rows % 2, cols % 2]


def mosaic_of(rgb: np.ndarray, pattern: str) -> np.ndarray:
    """[H, W, 3] image -> [H, W] Bayer mosaic (same dtype)."""
    chan = site_channels(pattern, *rgb.shape[:2])
    return np.take_along_axis(rgb, chan[..., None], axis=2)[..., 0]


def bayer_msg(mosaic: np.ndarray, pattern: str, pad: int = 0, bigendian: bool = False) -> Image:
    """Image message of a uint8 or uint16 mosaic, rows followed by ``pad`` junk bytes."""
    bits = 16 if mosaic.dtype == np.uint16 else 8
    payload = mosaic.astype((">" if bigendian else "<") + ("u2" if bits == 16 else "u1"))
    rows = np.ascontiguousarray(payload).view(np.uint8).reshape(mosaic.shape[0], -1)
    data = np.concatenate([rows, np.full((rows.shape[0], pad), 0xCD, np.uint8)], axis=1)
    return Image(height=mosaic.shape[0], width=mosaic.shape[1], encoding=f"bayer_{pattern}{bits}",
                 is_bigendian=int(bigendian), step=data.shape[1], data=data.tobytes())


def reference_demosaic(mosaic: np.ndarray, pattern: str) -> np.ndarray:
    """Slow bilinear reference: each missing colour is the mean of the nearest samples of that colour
    in the 3x3 neighbourhood, coordinates mirrored at the borders (-1 -> 1, H -> H - 2)."""
    h, w = mosaic.shape
    chan = site_channels(pattern, h, w)
    values = mosaic.astype(np.float64) / (257.0 if mosaic.dtype == np.uint16 else 1.0)
    out = np.zeros((h, w, 3), np.uint8)
    for y in range(h):
        for x in range(w):
            for c in range(3):
                best, samples = None, []
                for oy in (-1, 0, 1):
                    for ox in (-1, 0, 1):
                        yy, xx = abs(y + oy), abs(x + ox)
                        yy, xx = (2 * (h - 1) - yy if yy >= h else yy), (2 * (w - 1) - xx if xx >= w else xx)
                        if chan[yy, xx] != c:
                            continue
                        d = oy * oy + ox * ox
                        if best is None or d < best:
                            best, samples = d, [values[yy, xx]]
                        elif d == best:
                            samples.append(values[yy, xx])
                out[y, x, c] = np.rint(np.mean(samples))
    return out


def smooth_rgb(h: int, w: int, scale: float = 1.0) -> np.ndarray:
    """A smooth colour image: three different gentle gradients (float64, [0, 255 * scale])."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    rgb = np.stack([40 + 3.0 * x + 1.5 * y, 220 - 2.0 * x + 0.5 * y, 30 + 1.0 * x + 3.0 * y], axis=-1)
    return np.clip(rgb, 0, 255) * scale


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("size", [(7, 6), (6, 9), (2, 2), (3, 2), (5, 5)])
def test_matches_the_reference(pattern, bits, size):
    rng = np.random.default_rng(sum(size) + bits)
    mosaic = rng.integers(0, 256 if bits == 8 else 65536, size, dtype=np.uint8 if bits == 8 else np.uint16)
    out = cv.image_to_rgb(bayer_msg(mosaic, pattern))
    ref = reference_demosaic(mosaic, pattern)
    assert out.shape == size + (3,) and out.dtype == np.uint8
    if bits == 8:
        np.testing.assert_array_equal(out, ref)
    else:  # float32 vs float64 rounding of x / 257
        assert np.abs(out.astype(int) - ref).max() <= 1


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_own_samples_are_kept(pattern, bits):
    rng = np.random.default_rng(5)
    mosaic = rng.integers(0, 256, (9, 11), dtype=np.uint8)
    expected = mosaic
    if bits == 16:
        mosaic = mosaic.astype(np.uint16) * 257
    out = cv.image_to_rgb(bayer_msg(mosaic, pattern))
    np.testing.assert_array_equal(mosaic_of(out, pattern), expected)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_smooth_image_is_recovered(pattern, bits):
    h, w = 31, 40  # odd height
    scale = 257.0 if bits == 16 else 1.0
    truth = smooth_rgb(h, w, scale)
    mosaic = np.rint(mosaic_of(truth, pattern)).astype(np.uint16 if bits == 16 else np.uint8)
    out = cv.image_to_rgb(bayer_msg(mosaic, pattern)).astype(np.float64)
    err = np.abs(out - truth / scale)
    assert err[1:-1, 1:-1].mean() < 0.6 and err[1:-1, 1:-1].max() <= 1.5  # linear: exact up to rounding
    assert err.mean() < 2.0 and err.max() <= 4.0  # borders mirror, off by at most a gradient step


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("size", [(2, 2), (3, 5), (8, 7)])
def test_constant_colour_is_exact(pattern, size):
    colour8 = np.array([200, 17, 90], np.uint8)
    img8 = np.broadcast_to(colour8, size + (3,))
    np.testing.assert_array_equal(cv.image_to_rgb(bayer_msg(mosaic_of(img8, pattern), pattern)), img8)
    colour16 = np.array([51_000, 4_400, 23_131], np.uint16)
    img16 = np.broadcast_to(colour16, size + (3,))
    expected = ((colour16.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)  # as mono16 scales
    out = cv.image_to_rgb(bayer_msg(mosaic_of(img16, pattern), pattern))
    np.testing.assert_array_equal(out, np.broadcast_to(expected, size + (3,)))


@pytest.mark.parametrize("actual,declared", [("rggb", "bggr"), ("gbrg", "grbg")])
def test_pattern_matters(actual, declared):
    truth = smooth_rgb(20, 24)
    mosaic = np.rint(mosaic_of(truth, actual)).astype(np.uint8)
    right = cv.image_to_rgb(bayer_msg(mosaic, actual)).astype(float)
    wrong = cv.image_to_rgb(bayer_msg(mosaic, declared)).astype(float)
    inner = (slice(1, -1), slice(1, -1))
    assert np.abs(right - truth)[inner].mean() < 0.6
    swap_gap = np.abs(truth - truth[..., ::-1])[inner].mean()  # how different the R/B-swapped image is
    assert swap_gap > 10 and np.abs(wrong - truth)[inner].mean() > 0.9 * swap_gap  # red and blue exchanged
    assert np.abs(wrong - truth[..., ::-1])[inner].mean() < 0.6


@pytest.mark.parametrize("pattern", PATTERNS)
def test_16bit_big_endian_and_step_padding(pattern):
    mosaic = np.random.default_rng(9).integers(0, 65536, (5, 7), dtype=np.uint16)
    plain = cv.image_to_rgb(bayer_msg(mosaic, pattern))
    np.testing.assert_array_equal(cv.image_to_rgb(bayer_msg(mosaic, pattern, pad=6, bigendian=True)), plain)
    swapped = cv.image_to_rgb(bayer_msg(mosaic.byteswap(), pattern, bigendian=False))
    assert not np.array_equal(swapped, plain)  # the byte order is honoured, not guessed
    np.testing.assert_array_equal(cv.image_to_rgb(bayer_msg(mosaic.astype(np.uint8), pattern, pad=3)),
                                  cv.image_to_rgb(bayer_msg(mosaic.astype(np.uint8), pattern)))


def test_all_eight_encodings_supported():
    names = {f"bayer_{p}{b}" for p in PATTERNS for b in (8, 16)}
    assert names <= set(cv.SUPPORTED_ENCODINGS)


@pytest.mark.parametrize("width,height", [(1, 4), (5, 1)])
def test_too_small_for_a_pattern(width, height):
    msg = Image(width=width, height=height, encoding="bayer_rggb8", step=width, data=bytes(width * height))
    with pytest.raises(cv.ImageConversionError, match="bayer_rggb8 image must be at least 2x2 pixels, got"):
        cv.image_to_rgb(msg)


def test_16bit_step_counts_two_bytes():
    msg = Image(width=4, height=2, encoding="bayer_gbrg16", step=4, data=bytes(8))
    with pytest.raises(cv.ImageConversionError, match="2 bytes per pixel"):
        cv.image_to_rgb(msg)


def test_demosaic_function_checks_its_input():
    from lingbot_map_ros.io.demosaic import demosaic_bilinear

    with pytest.raises(ValueError, match="one of"):
        demosaic_bilinear(np.zeros((4, 4), np.float32), "rgbg")
    with pytest.raises(ValueError, match=r"H >= 2, W >= 2"):
        demosaic_bilinear(np.zeros((1, 4), np.float32), "rggb")
