"""Conversions between ROS 2 messages and numpy arrays.

Imports ROS message classes only (no rclpy, no torch), so everything here is
testable without a running graph.

Frames (see also ``lingbot_map_ros.geometry``):

- The model's world frame ``W`` is the first camera's frame in OpenCV optical
  axes: x right, y down, z forward.  Its poses are camera-to-world matrices
  ``c2w = T_W_C`` (``p_W = R @ p_C + t``), with ``C`` the camera's optical frame.
- The published map frame ``M`` follows REP 103: x forward, y left, z up, with
  the same origin as ``W``.  ``OPTICAL_TO_REP103 = T_M_W`` re-expresses points
  of ``W`` in ``M``; ``T_M_C = OPTICAL_TO_REP103 @ c2w`` is the pose of the
  camera's optical frame in the map (the TF map -> <camera>_optical_frame), and
  ``OPTICAL_TO_REP103 @ c2w @ inv(OPTICAL_TO_REP103)`` the pose of a REP-103
  camera body frame (x forward) in the map.
- Every 4x4 matrix taken here is a rigid transform ``T_parent_child`` mapping
  points of the child frame into the parent frame; translations are in the
  model's units (metre-like).

Images: ``image_to_rgb`` and ``compressed_to_rgb`` return ``[H, W, 3] uint8``
RGB arrays and raise ``ImageConversionError`` (a ``ValueError``) naming what is
wrong with a message.  Raw encodings: ``SUPPORTED_ENCODINGS`` (RGB/BGR with or
without alpha, mono 8/16, YUV 4:2:2, Bayer 8/16 in all four patterns), decoded
with numpy alone (cv_bridge is not needed); depth encodings are refused.

Point clouds use one fixed little-endian layout (``CLOUD_FIELDS``): x, y, z, rgb
(0x00RRGGBB bit pattern stored in a FLOAT32, RViz's convention), confidence —
20 bytes a point.
"""
from __future__ import annotations

import array

import numpy as np
from geometry_msgs.msg import Point, Pose, Quaternion, Transform, TransformStamped, Vector3
from nav_msgs.msg import Odometry
from sensor_msgs.msg import CameraInfo, CompressedImage, Image, PointCloud2, PointField
from std_msgs.msg import Header

from lingbot_map_ros.geometry import (OPTICAL_TO_REP103, matrix_to_quaternion, optical_pose_to_map,
                                      points_to_map, quaternion_to_matrix)
from lingbot_map_ros.io.demosaic import BAYER_PATTERNS, demosaic_bilinear
from lingbot_map_ros.io.image_msgs import MAX_PIXELS, ImageDecodeError, decode_compressed

__all__ = ["CLOUD_DTYPE", "CLOUD_FIELDS", "DEFAULT_MAX_PIXELS", "ImageConversionError", "OPTICAL_TO_REP103",
           "SUPPORTED_ENCODINGS", "camera_info_msg", "compressed_to_rgb", "demosaic_bilinear",
           "depth_to_image_msg", "image_to_depth", "image_to_rgb", "sensor_depth_array", "make_pointcloud2",
           "matrix_to_quaternion", "odometry_msg", "optical_pose_to_map", "points_to_map", "pose_to_msg",
           "quaternion_to_matrix", "read_pointcloud2", "rgb_to_image_msg", "transform_stamped"]

DEFAULT_MAX_PIXELS = MAX_PIXELS
"""Largest accepted image (width x height, 64 Mpx); larger ones are rejected."""
ImageConversionError = ImageDecodeError
"""An image message cannot be converted (bad encoding, size or data): one error type for raw and
compressed images, live or from a bag (``io.image_msgs``)."""


# ----------------------------------------------------------------------------- raw images

# encoding -> (channels, bytes per channel, decoder); YUV 4:2:2 is 2 bytes a pixel.
_BGR, _RGB, _MONO, _YUV, _BAYER = "bgr", "rgb", "mono", "yuv", "bayer"
_ENCODINGS: dict[str, tuple[int, int, str]] = {
    "rgb8": (3, 1, _RGB),
    "rgba8": (4, 1, _RGB),
    "bgr8": (3, 1, _BGR),
    "bgra8": (4, 1, _BGR),
    "8UC3": (3, 1, _BGR),  # OpenCV's default channel order
    "8UC4": (4, 1, _BGR),
    "mono8": (1, 1, _MONO),
    "8UC1": (1, 1, _MONO),
    "mono16": (1, 2, _MONO),
    "yuv422": (2, 1, _YUV),  # UYVY byte order: U0 Y0 V0 Y1
    "uyvy": (2, 1, _YUV),
    "yuv422_yuy2": (2, 1, _YUV),  # YUYV byte order: Y0 U0 Y1 V0
    "yuyv": (2, 1, _YUV),
}
# Bayer colour filter arrays: the pattern names the colours of the top-left 2x2 block, row by row.
_BAYER_PATTERNS = {f"bayer_{pattern}{bits}": pattern for bits in (8, 16) for pattern in BAYER_PATTERNS}
_ENCODINGS.update({name: (1, 2 if name.endswith("16") else 1, _BAYER) for name in _BAYER_PATTERNS})
_YUYV_ORDER = {"yuv422_yuy2", "yuyv"}
SUPPORTED_ENCODINGS = tuple(_ENCODINGS)
_DEPTH_ENCODINGS = ("16UC1", "16SC1", "32SC1", "32FC1", "64FC1")
"""Single-channel encodings that depth cameras and depth_image_proc publish; refused on the colour input."""


def image_to_rgb(msg: Image, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Convert a ``sensor_msgs/Image`` to an RGB array (numpy only; cv_bridge is not needed).

    Row padding (``step``) is skipped and ``is_bigendian`` is honoured for 16-bit
    data.  Alpha is dropped; mono is replicated to three channels; 16-bit data
    (``mono16``, ``bayer_*16``) is scaled linearly from [0, 65535] to [0, 255]; YUV
    4:2:2 is decoded with the BT.601 video-range matrix (as OpenCV does); Bayer
    mosaics (``bayer_{rggb,bggr,gbrg,grbg}{8,16}``) are demosaiced bilinearly
    (``demosaic_bilinear``).  Depth encodings (``16UC1``, ``32FC1``, ...) are
    refused: they are what a depth topic remapped to the colour input by mistake
    looks like, and tracking them as grey images would fail silently.

    Args:
        msg: the image; ``encoding`` one of ``SUPPORTED_ENCODINGS``.
        max_pixels: largest accepted ``width * height``.

    Returns:
        [H, W, 3] uint8 RGB array (a new array, not a view of the message).

    Raises:
        ImageConversionError: depth or unsupported encoding, zero or absurd size,
            ``step`` too small for the width, ``data`` shorter than ``step * height``,
            an odd width for YUV 4:2:2, or a Bayer image smaller than 2x2.
    """
    encoding = msg.encoding
    if encoding in _DEPTH_ENCODINGS:
        raise ImageConversionError(
            f"encoding {encoding!r} is a depth image, not a colour image: is a depth topic remapped to this "
            "node's image input? (mono16 is accepted as 16-bit greyscale)")
    if encoding not in _ENCODINGS:
        raise ImageConversionError(
            f"unsupported image encoding {encoding!r} (supported: {', '.join(SUPPORTED_ENCODINGS)})")
    channels, depth, kind = _ENCODINGS[encoding]
    pixels = _packed_pixels(msg, channels * depth, max_pixels)
    height, width = msg.height, msg.width

    if kind == _YUV:
        if width % 2:
            raise ImageConversionError(f"{encoding} image needs an even width, got {width}")
        return _yuv422_to_rgb(pixels.reshape(height, width * 2), yuyv=encoding in _YUYV_ORDER)
    if kind == _BAYER:
        if width < 2 or height < 2:
            raise ImageConversionError(f"{encoding} image must be at least 2x2 pixels, got {width}x{height}")
        if depth == 2:  # scaled to [0, 255] before interpolation: 65535 / 257 = 255
            mosaic = _uint16_plane(pixels, msg.is_bigendian, height, width).astype(np.float32) * np.float32(1 / 257)
        else:
            mosaic = pixels.reshape(height, width).astype(np.float32)
        return demosaic_bilinear(mosaic, _BAYER_PATTERNS[encoding])
    if depth == 2:
        mono16 = _uint16_plane(pixels, msg.is_bigendian, height, width).astype(np.uint32)
        mono = ((mono16 * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(mono[:, :, None], 3, axis=2)
    pixels = pixels.reshape(height, width, channels)
    if kind == _MONO:
        return np.repeat(pixels, 3, axis=2)
    rgb = pixels[:, :, :3] if kind == _RGB else pixels[:, :, 2::-1]
    return np.array(rgb, order="C")  # always a copy: an unpadded rgb8 slice would still view msg.data


def _uint16_plane(pixels: np.ndarray, bigendian: bool, height: int, width: int) -> np.ndarray:
    """[H, 2W] packed bytes of one 16-bit channel -> [H, W] uint16 in the message's byte order."""
    return pixels.view((">" if bigendian else "<") + "u2").reshape(height, width)


def _packed_pixels(msg: Image, bytes_per_pixel: int, max_pixels: int) -> np.ndarray:
    """The pixel bytes of ``msg`` without row padding, as [height, width * bpp] uint8."""
    height, width, step = msg.height, msg.width, msg.step
    if width == 0 or height == 0:
        raise ImageConversionError(f"empty image: {width}x{height}")
    if width * height > max_pixels:
        raise ImageConversionError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}")
    row_bytes = width * bytes_per_pixel
    if step < row_bytes:
        raise ImageConversionError(
            f"step {step} is smaller than width {width} x {bytes_per_pixel} bytes per pixel "
            f"= {row_bytes} for encoding {msg.encoding!r}")
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if data.size < step * height:
        raise ImageConversionError(
            f"image data has {data.size} bytes, expected step {step} x height {height} "
            f"= {step * height}")
    return data[: step * height].reshape(height, step)[:, :row_bytes]


def _yuv422_to_rgb(rows: np.ndarray, yuyv: bool) -> np.ndarray:
    """[H, 2W] packed 4:2:2 bytes (UYVY, or YUYV if ``yuyv``) -> [H, W, 3] uint8 RGB."""
    height, width = rows.shape[0], rows.shape[1] // 2
    macro = rows.reshape(height, width // 2, 4).astype(np.float32)  # one chroma pair each
    if yuyv:
        y0, u, y1, v = (macro[..., i] for i in range(4))
    else:
        u, y0, v, y1 = (macro[..., i] for i in range(4))
    luma = np.stack([y0, y1], axis=-1).reshape(height, width)
    u = np.repeat(u, 2, axis=1) - 128.0
    v = np.repeat(v, 2, axis=1) - 128.0
    c = 1.164 * (luma - 16.0)
    rgb = np.stack([c + 1.596 * v, c - 0.391 * u - 0.813 * v, c + 2.018 * u], axis=-1)
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


def rgb_to_image_msg(rgb: np.ndarray, header: Header, encoding: str = "rgb8") -> Image:
    """Build a ``sensor_msgs/Image`` from an RGB (or mono) array.

    Args:
        rgb: [H, W, 3] uint8 RGB for ``rgb8`` / ``bgr8`` (channels are swapped for
            the latter); [H, W] uint8 for ``mono8``.
        header: copied by reference into the message (stamp, optical frame id).
        encoding: ``rgb8``, ``bgr8`` or ``mono8``.
    """
    arr = np.asarray(rgb)
    if arr.dtype != np.uint8:
        raise ValueError(f"rgb_to_image_msg needs uint8 data, got {arr.dtype}")
    if encoding == "mono8":
        if arr.ndim != 2:
            raise ValueError(f"mono8 needs an [H, W] array, got shape {arr.shape}")
    elif encoding in ("rgb8", "bgr8"):
        if arr.ndim != 3 or arr.shape[2] != 3:
            raise ValueError(f"{encoding} needs an [H, W, 3] array, got shape {arr.shape}")
        if encoding == "bgr8":
            arr = arr[:, :, ::-1]
    else:
        raise ValueError(f"rgb_to_image_msg: unsupported encoding {encoding!r} (rgb8, bgr8, mono8)")
    msg = Image(header=header, height=arr.shape[0], width=arr.shape[1], encoding=encoding,
                is_bigendian=0, step=arr.shape[1] * (1 if arr.ndim == 2 else 3))
    msg.data = _byte_array(arr)
    return msg


def depth_to_image_msg(depth: np.ndarray, header: Header) -> Image:
    """Build a ``32FC1`` ``sensor_msgs/Image`` from a depth map.

    Args:
        depth: [H, W] z-depth along the optical axis, model units; NaN (no
            depth) is preserved.
        header: copied by reference into the message (stamp, optical frame id).
    """
    arr = np.asarray(depth)
    if arr.ndim != 2:
        raise ValueError(f"depth must be [H, W], got shape {arr.shape}")
    arr = arr.astype("<f4", copy=False)
    msg = Image(header=header, height=arr.shape[0], width=arr.shape[1], encoding="32FC1",
                is_bigendian=0, step=arr.shape[1] * 4)
    msg.data = _byte_array(arr)
    return msg


def image_to_depth(msg: Image) -> np.ndarray:
    """[H, W] float32 from a ``32FC1`` ``sensor_msgs/Image`` (inverse of ``depth_to_image_msg``)."""
    if msg.encoding != "32FC1":
        raise ImageConversionError(f"expected a 32FC1 depth image, got {msg.encoding!r}")
    return _single_channel(msg, "f4", np.float32)


def sensor_depth_array(msg: Image) -> np.ndarray:
    """[H, W] of a depth camera's ``Image``: uint16 millimetres (``16UC1``, ``mono16``) or float32
    metres (``32FC1``), native byte order; ImageConversionError for any other encoding."""
    if msg.encoding == "32FC1":
        return image_to_depth(msg)
    if msg.encoding in ("16UC1", "mono16"):
        return _single_channel(msg, "u2", np.uint16)
    raise ImageConversionError(f"depth encoding {msg.encoding!r} is not 16UC1 (mm) or 32FC1 (m)")


def _single_channel(msg: Image, code: str, dtype: type) -> np.ndarray:
    """[H, W] ``dtype`` of a one-channel image whose samples are ``code`` (numpy type code), honouring
    ``step`` padding and ``is_bigendian``."""
    raw = _packed_pixels(msg, np.dtype(code).itemsize, DEFAULT_MAX_PIXELS)
    order = ">" if msg.is_bigendian else "<"
    return raw.copy().view(order + code).reshape(msg.height, msg.width).astype(dtype)


def _byte_array(arr: np.ndarray) -> array.array:
    """Message ``uint8[]`` payload from an array (one copy; skips per-element checks)."""
    out = array.array("B")
    out.frombytes(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
    return out


# ----------------------------------------------------------------------------- compressed images

def compressed_to_rgb(msg: CompressedImage, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """[H, W, 3] uint8 RGB from a JPEG or PNG ``sensor_msgs/CompressedImage``: the replay's decoder,
    ``io.image_msgs.decode_compressed`` (errors, the ``max_pixels`` guard and 16-bit PNGs there)."""
    return decode_compressed(msg.format, bytes(msg.data), max_pixels)


# ----------------------------------------------------------------------------- point clouds

CLOUD_DTYPE = np.dtype({
    "names": ["x", "y", "z", "rgb", "confidence"],
    "formats": ["<f4", "<f4", "<f4", "<u4", "<f4"],  # rgb: bit pattern, declared FLOAT32
    "offsets": [0, 4, 8, 12, 16],
    "itemsize": 20,
})
"""Point layout of ``make_pointcloud2`` (20 bytes, little-endian)."""

CLOUD_FIELDS = tuple(
    (name, CLOUD_DTYPE.fields[name][1], PointField.FLOAT32) for name in CLOUD_DTYPE.names)
"""(name, byte offset, PointField datatype) of each field of ``CLOUD_DTYPE``."""

_DEFAULT_RGB = 0xFFFFFF  # white, visible on RViz's dark background

_POINTFIELD_DTYPES = {
    PointField.INT8: "i1", PointField.UINT8: "u1", PointField.INT16: "i2",
    PointField.UINT16: "u2", PointField.INT32: "i4", PointField.UINT32: "u4",
    PointField.FLOAT32: "f4", PointField.FLOAT64: "f8",
}


def make_pointcloud2(points: np.ndarray, colors: np.ndarray | None, confidence: np.ndarray | None,
                     header: Header) -> PointCloud2:
    """Build an unorganised ``sensor_msgs/PointCloud2`` (height 1) in ``CLOUD_DTYPE`` layout.

    Args:
        points: [N, 3] positions in ``header.frame_id``, model units.
        colors: [N, 3] uint8 RGB, or None (white).
        confidence: [N] per-point confidence, or None (NaN).
        header: copied by reference into the message.

    ``is_dense`` is true when every position is finite.
    """
    pts = np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise ValueError(f"points must be [N, 3], got shape {pts.shape}")
    n = pts.shape[0]
    cloud = np.empty(n, dtype=CLOUD_DTYPE)
    cloud["x"], cloud["y"], cloud["z"] = pts[:, 0], pts[:, 1], pts[:, 2]
    if colors is None:
        cloud["rgb"] = _DEFAULT_RGB
    else:
        rgb = np.asarray(colors)
        if rgb.shape != (n, 3) or rgb.dtype != np.uint8:
            raise ValueError(f"colors must be [{n}, 3] uint8, got {rgb.dtype} {rgb.shape}")
        rgb = rgb.astype(np.uint32)
        cloud["rgb"] = (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]
    if confidence is None:
        cloud["confidence"] = np.nan
    else:
        conf = np.asarray(confidence)
        if conf.shape != (n,):
            raise ValueError(f"confidence must be [{n}], got shape {conf.shape}")
        cloud["confidence"] = conf
    msg = PointCloud2(
        header=header, height=1, width=n,
        fields=[PointField(name=name, offset=offset, datatype=datatype, count=1)
                for name, offset, datatype in CLOUD_FIELDS],
        is_bigendian=False, point_step=CLOUD_DTYPE.itemsize, row_step=CLOUD_DTYPE.itemsize * n,
        is_dense=bool(np.isfinite(pts).all()),
    )
    msg.data = _byte_array(cloud)
    return msg


def read_pointcloud2(msg: PointCloud2) -> dict[str, np.ndarray]:
    """Decode any ``sensor_msgs/PointCloud2`` into flat arrays (for tests and tools).

    Returns:
        One array per field, [height * width] (or [.., count] for count > 1), in
        the field's declared type; plus ``points`` [N, 3] float32 when x, y, z
        exist and ``colors`` [N, 3] uint8 unpacked from an ``rgb`` FLOAT32 /
        UINT32 field.
    """
    order = ">" if msg.is_bigendian else "<"
    names, formats, offsets = [], [], []
    for field in msg.fields:
        if field.datatype not in _POINTFIELD_DTYPES:
            raise ValueError(f"field {field.name!r} has unknown datatype {field.datatype}")
        base = order + _POINTFIELD_DTYPES[field.datatype]
        names.append(field.name)
        formats.append(base if field.count <= 1 else (base, (field.count,)))
        offsets.append(field.offset)
    dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets,
                      "itemsize": msg.point_step})
    row_bytes = msg.width * msg.point_step
    if msg.row_step < row_bytes:
        raise ValueError(f"row_step {msg.row_step} < width {msg.width} x point_step {msg.point_step}")
    raw = np.frombuffer(msg.data, dtype=np.uint8)
    if raw.size < msg.row_step * msg.height:
        raise ValueError(f"cloud data has {raw.size} bytes, expected {msg.row_step * msg.height}")
    rows = raw[: msg.row_step * msg.height].reshape(msg.height, msg.row_step)[:, :row_bytes]
    cloud = np.ascontiguousarray(rows).view(dtype).reshape(-1)
    out = {name: np.ascontiguousarray(cloud[name]) for name in names}
    if {"x", "y", "z"} <= out.keys():
        out["points"] = np.stack([out["x"], out["y"], out["z"]], axis=-1).astype(np.float32)
    if "rgb" in out and out["rgb"].dtype.itemsize == 4:
        packed = out["rgb"].astype(out["rgb"].dtype.newbyteorder("=")).view(np.uint32)
        out["colors"] = np.stack(
            [(packed >> 16) & 0xFF, (packed >> 8) & 0xFF, packed & 0xFF], axis=-1).astype(np.uint8)
    return out


# ----------------------------------------------------------------------------- poses and frames

def _check_transform(T: np.ndarray) -> np.ndarray:
    m = np.asarray(T, dtype=np.float64)
    if m.shape != (4, 4):
        raise ValueError(f"expected a 4x4 transform, got shape {m.shape}")
    if not np.isfinite(m).all():
        raise ValueError("transform has non-finite entries")
    return m


def pose_to_msg(T: np.ndarray) -> Pose:
    """``geometry_msgs/Pose`` of ``T = T_parent_child`` (4x4 rigid transform).

    The position is the child origin in the parent frame; the orientation is
    the rotation part as a unit quaternion with w >= 0.
    """
    m = _check_transform(T)
    x, y, z, w = (float(v) for v in matrix_to_quaternion(m[:3, :3]))
    t = m[:3, 3]
    return Pose(position=Point(x=float(t[0]), y=float(t[1]), z=float(t[2])),
                orientation=Quaternion(x=x, y=y, z=z, w=w))


def transform_stamped(T: np.ndarray, header: Header, child_frame: str) -> TransformStamped:
    """TF message for ``T = T_parent_child``; ``header.frame_id`` names the parent."""
    pose = pose_to_msg(T)
    p = pose.position
    return TransformStamped(
        header=header, child_frame_id=child_frame,
        transform=Transform(translation=Vector3(x=p.x, y=p.y, z=p.z), rotation=pose.orientation))


def odometry_msg(T: np.ndarray, header: Header, child_frame: str) -> Odometry:
    """``nav_msgs/Odometry`` with pose ``T = T_parent_child`` (``header.frame_id`` = parent).

    Twist and covariances are left at zero (not estimated).
    """
    msg = Odometry(header=header, child_frame_id=child_frame)
    msg.pose.pose = pose_to_msg(T)
    return msg


def camera_info_msg(K: np.ndarray, width: int, height: int, header: Header) -> CameraInfo:
    """Pinhole ``sensor_msgs/CameraInfo`` without distortion.

    Args:
        K: 3x3 intrinsics in pixels for an image of ``width`` x ``height``.
        header: stamp and the camera's optical frame id.
    """
    k = np.asarray(K, dtype=np.float64)
    if k.shape != (3, 3):
        raise ValueError(f"K must be 3x3, got shape {k.shape}")
    p = np.zeros((3, 4))
    p[:, :3] = k
    return CameraInfo(
        header=header, width=int(width), height=int(height), distortion_model="plumb_bob",
        d=[0.0] * 5, k=k.reshape(-1).tolist(), r=np.eye(3).reshape(-1).tolist(),
        p=p.reshape(-1).tolist())

