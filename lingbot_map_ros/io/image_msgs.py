"""Decoding ``sensor_msgs/Image`` and ``sensor_msgs/CompressedImage`` read from a bag
into RGB arrays, without ROS: the messages are the ``rosbags`` typestore's dataclasses
(or anything with the same fields; ``data`` a uint8 numpy array or bytes).

Raw encodings: rgb8, rgba8, bgr8, bgra8, mono8, mono16 and their OpenCV aliases
(8UC1, 8UC3 = BGR, 8UC4 = BGRA, 16UC1). Row padding (``step``) is skipped; 16-bit
data honours ``is_bigendian`` and is scaled from [0, 65535] to [0, 255]; alpha is
dropped; mono is replicated to three channels. Compressed: JPEG or PNG, decoded
with Pillow in full (a truncated image fails here, not later) by ``decode_compressed``, which the
node's live messages go through too (``ros.conversions.compressed_to_rgb``).

Every failure raises ``ImageDecodeError`` (a ``ValueError``) with a one-line reason; the node's
conversions raise the same type.
"""
from __future__ import annotations

import io

import numpy as np

MAX_PIXELS = 8192 * 8192  # larger images are refused (decompression-bomb guard)

IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/Image")
COMPRESSED_TYPES = ("sensor_msgs/msg/CompressedImage", "sensor_msgs/CompressedImage")

# encoding -> (channels, bytes per channel, channel order of the first three: "rgb", "bgr", "mono")
_RAW_ENCODINGS: dict[str, tuple[int, int, str]] = {
    "rgb8": (3, 1, "rgb"), "rgba8": (4, 1, "rgb"),
    "bgr8": (3, 1, "bgr"), "bgra8": (4, 1, "bgr"), "8UC3": (3, 1, "bgr"), "8UC4": (4, 1, "bgr"),
    "mono8": (1, 1, "mono"), "8UC1": (1, 1, "mono"),
    "mono16": (1, 2, "mono"), "16UC1": (1, 2, "mono"),
}
RAW_ENCODINGS = tuple(_RAW_ENCODINGS)


class ImageDecodeError(ValueError):
    """An image message cannot be decoded (unsupported encoding, bad size, truncated data)."""


def is_image_type(msgtype: str | None) -> bool:
    return msgtype in IMAGE_TYPES or msgtype in COMPRESSED_TYPES


def raw_to_rgb(msg) -> np.ndarray:
    """[H, W, 3] uint8 RGB from a ``sensor_msgs/Image`` (a new array, not a view of the message)."""
    encoding = msg.encoding
    if encoding not in _RAW_ENCODINGS:
        raise ImageDecodeError(f"unsupported image encoding {encoding!r} (supported: {', '.join(RAW_ENCODINGS)})")
    channels, depth, order = _RAW_ENCODINGS[encoding]
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height == 0 or width == 0:
        raise ImageDecodeError(f"empty image: {width}x{height}")
    if height * width > MAX_PIXELS:
        raise ImageDecodeError(f"image of {width}x{height} pixels exceeds the limit of {MAX_PIXELS}")
    row_bytes = width * channels * depth
    if step < row_bytes:
        raise ImageDecodeError(f"step {step} is smaller than a {encoding} row of {width} pixels ({row_bytes} bytes)")
    data = np.frombuffer(msg.data, dtype=np.uint8) if not isinstance(msg.data, np.ndarray) else msg.data
    if data.size < step * height:
        raise ImageDecodeError(f"truncated image data: {data.size} bytes, expected step {step} x height {height} "
                               f"= {step * height}")
    rows = data[:step * height].reshape(height, step)[:, :row_bytes]
    if depth == 2:
        words = np.ascontiguousarray(rows).view(">u2" if msg.is_bigendian else "<u2").astype(np.uint32)
        mono = ((words * 255 + 32767) // 65535).astype(np.uint8)  # rounded linear scaling
        return np.repeat(mono.reshape(height, width, 1), 3, axis=2)
    pixels = rows.reshape(height, width, channels)
    if order == "mono":
        return np.repeat(pixels, 3, axis=2)
    rgb = pixels[:, :, :3] if order == "rgb" else pixels[:, :, 2::-1]
    return np.ascontiguousarray(rgb)


def decode_compressed(fmt: str, data: bytes, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """[H, W, 3] uint8 RGB from the ``format`` and ``data`` of a ``sensor_msgs/CompressedImage``
    (JPEG or PNG), decoded with Pillow: the one decoder of compressed images, for bags and live
    messages alike.

    The whole image is decoded here, so truncated or corrupt data fails now rather than later.
    The size in the header is checked against ``max_pixels`` before decoding (decompression-bomb
    guard). 16-bit grey PNGs are scaled like ``mono16``; alpha is dropped.

    Raises:
        ImageDecodeError: depth-compressed or non-JPEG/PNG data, corrupt or truncated data, or
            an image larger than ``max_pixels``.
    """
    from PIL import Image

    fmt = str(fmt)
    if "compresseddepth" in fmt.lower():
        raise ImageDecodeError(f"compressed depth images are not colour images (format {fmt!r})")
    if not data:
        raise ImageDecodeError(f"empty compressed image (format {fmt!r})")
    try:
        img = Image.open(io.BytesIO(data), formats=["JPEG", "PNG"])
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(f"compressed image too large: {exc}") from exc
    except Image.UnidentifiedImageError as exc:  # its text names a BytesIO object: no use in a log
        raise ImageDecodeError(f"not a JPEG or PNG image (format {fmt!r}): unrecognised data") from exc
    except Exception as exc:  # Pillow raises several types for unrecognised data
        raise ImageDecodeError(f"not a JPEG or PNG image (format {fmt!r}): {exc}") from exc
    with img:
        width, height = img.size
        if width == 0 or height == 0:
            raise ImageDecodeError(f"empty compressed image: {width}x{height}")
        if width * height > max_pixels:
            raise ImageDecodeError(f"compressed image of {width}x{height} = {width * height} pixels exceeds the "
                                   f"limit of {max_pixels}")
        try:
            img.load()
        except Exception as exc:  # OSError for truncation; others for corrupt streams
            raise ImageDecodeError(f"corrupt or truncated {img.format} image (format {fmt!r}): {exc}") from exc
        if img.mode in ("I", "I;16", "I;16B", "I;16L"):
            words = np.clip(np.asarray(img).astype(np.int64), 0, 65535)
            mono = ((words * 255 + 32767) // 65535).astype(np.uint8)
            return np.repeat(mono[:, :, None], 3, axis=2)
        return np.array(img.convert("RGB"), dtype=np.uint8)


def compressed_to_rgb(msg) -> np.ndarray:
    """[H, W, 3] uint8 RGB from a JPEG or PNG ``sensor_msgs/CompressedImage`` (``decode_compressed``)."""
    return decode_compressed(msg.format, msg.data.tobytes() if isinstance(msg.data, np.ndarray) else bytes(msg.data))


def message_to_rgb(msg, msgtype: str) -> np.ndarray:
    """Decode an image message of type ``msgtype`` (raw or compressed) to [H, W, 3] uint8 RGB."""
    if msgtype in IMAGE_TYPES:
        return raw_to_rgb(msg)
    if msgtype in COMPRESSED_TYPES:
        return compressed_to_rgb(msg)
    raise ImageDecodeError(f"not an image message type: {msgtype}")


def stamp_ns(header) -> int:
    """Nanoseconds since the epoch of a ``std_msgs/Header`` stamp (rosbags reads ROS 1 stamps with the
    same sec/nanosec fields)."""
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


__all__ = ["ImageDecodeError", "IMAGE_TYPES", "COMPRESSED_TYPES", "RAW_ENCODINGS", "MAX_PIXELS", "is_image_type",
           "raw_to_rgb", "decode_compressed", "compressed_to_rgb", "message_to_rgb", "stamp_ns"]
