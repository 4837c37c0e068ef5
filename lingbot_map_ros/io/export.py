"""Writing results to disk: PLY point clouds, TUM trajectories and a top-down
trajectory plot (Pillow only).

Frames: poses are camera-to-world transforms [N, 4, 4] in OpenCV axes
(x right, y down, z forward) in the model's world frame and units (SPEC §6).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import BinaryIO, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from lingbot_map_ros.geometry import matrix_to_quaternion, quaternion_to_matrix
from lingbot_map_ros.io.atomic import atomic_write

CHUNK_BYTES = 1 << 24
"""Size of the pieces a PLY body is written in (16 MiB)."""

# ----------------------------------------------------------------------------- PLY

_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
    "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}


def write_ply(path: str | Path, points: np.ndarray, colors: np.ndarray | None = None,
              comments: Sequence[str] = ()) -> None:
    """Write a binary little-endian PLY point cloud, crash-safely (``atomic.atomic_write``).

    The file appears complete or not at all; a symbolic link at ``path`` is
    refused (``atomic.UnsafeDestinationError``), never followed.

    Args:
        path: output file.
        points: [N, 3] coordinates (world units), stored as float32 x, y, z.
        colors: [N, 3] RGB, uint8 — or floats in [0, 1], scaled by 255 and
            rounded — stored as uchar red, green, blue; None for no colour.
        comments: header ``comment`` lines (one line of ASCII each).
    """
    vertices, header = ply_content(points, colors, comments)
    atomic_write(path, lambda f: write_ply_to(f, header, vertices))


def ply_content(points: np.ndarray, colors: np.ndarray | None,
                 comments: Sequence[str]) -> tuple[np.ndarray, bytes]:
    """(vertex records [N] structured, header bytes) of a PLY; validates the arrays."""
    points = np.asarray(points)
    if points.ndim != 2 or points.shape[1] != 3:
        raise ValueError(f"points must be [N, 3], got {points.shape}")
    fields = [("x", "<f4"), ("y", "<f4"), ("z", "<f4")]
    if colors is not None:
        colors = _colors_to_uint8(colors, points.shape[0])
        fields += [("red", "u1"), ("green", "u1"), ("blue", "u1")]
    vertices = np.empty(points.shape[0], dtype=fields)
    for i, axis in enumerate("xyz"):
        vertices[axis] = points[:, i]
    if colors is not None:
        for i, channel in enumerate(("red", "green", "blue")):
            vertices[channel] = colors[:, i]
    header = ["ply", "format binary_little_endian 1.0"]
    header += [f"comment {_one_line(c)}" for c in comments]
    header.append(f"element vertex {points.shape[0]}")
    header += [f"property {'float' if t == '<f4' else 'uchar'} {name}" for name, t in fields]
    header.append("end_header")
    return vertices, ("\n".join(header) + "\n").encode("ascii")


def write_ply_to(f: BinaryIO, header: bytes, vertices: np.ndarray) -> None:
    f.write(header)
    _write_chunked(f, vertices.view(np.uint8) if vertices.size else b"")


def _write_chunked(f: BinaryIO, data) -> None:
    """Write a bytes-like object in CHUNK_BYTES pieces (no full copy of a large cloud)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), CHUNK_BYTES):
        f.write(view[start:start + CHUNK_BYTES])


def _one_line(text: str) -> str:
    if "\n" in text or "\r" in text or not text.isascii():
        raise ValueError(f"a header comment must be one line of ASCII, got {text!r}")
    return text


def _colors_to_uint8(colors: np.ndarray, n: int) -> np.ndarray:
    colors = np.asarray(colors)
    if colors.shape != (n, 3):
        raise ValueError(f"colors must be [{n}, 3], got {colors.shape}")
    if colors.dtype == np.uint8:
        return colors
    if np.issubdtype(colors.dtype, np.floating):
        if colors.size and (np.nanmin(colors) < 0 or np.nanmax(colors) > 1):
            raise ValueError("float colors must lie in [0, 1]")
        return np.rint(np.nan_to_num(colors) * 255).astype(np.uint8)
    raise ValueError(f"colors must be uint8 or float in [0, 1], got {colors.dtype}")


def read_ply(path: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Read a binary little-endian PLY whose first element is ``vertex``.

    Returns:
        (points [N, 3] float32, colors [N, 3] uint8 or None when the file has
        no red/green/blue properties).
    """
    with open(path, "rb") as f:
        if f.readline().strip() != b"ply":
            raise ValueError(f"{path}: not a PLY file")
        fields, count, fmt = [], None, None
        element = None
        while True:
            line = f.readline()
            if not line:
                raise ValueError(f"{path}: PLY header has no end_header")
            words = line.decode("ascii").split()
            if not words or words[0] in ("comment", "obj_info"):
                continue
            if words[0] == "end_header":
                break
            if words[0] == "format":
                fmt = words[1]
            elif words[0] == "element":
                element = words[1]
                if element == "vertex":
                    count = int(words[2])
            elif words[0] == "property" and element == "vertex":
                if words[1] == "list" or words[1] not in _PLY_TYPES:
                    raise ValueError(f"{path}: unsupported vertex property {' '.join(words[1:])}")
                fields.append((words[2], "<" + _PLY_TYPES[words[1]]))
        if fmt != "binary_little_endian":
            raise ValueError(f"{path}: only binary_little_endian PLY is supported, got {fmt}")
        if count is None:
            raise ValueError(f"{path}: PLY file has no vertex element")
        data = np.frombuffer(f.read(count * np.dtype(fields).itemsize), dtype=fields, count=count)
    points = np.stack([data[a] for a in "xyz"], axis=-1).astype(np.float32)
    names = {name for name, _ in fields}
    colors = None
    if {"red", "green", "blue"} <= names:
        colors = np.stack([data[c] for c in ("red", "green", "blue")], axis=-1).astype(np.uint8)
    return points, colors


# ----------------------------------------------------------------------------- TUM

def write_tum(path: str | Path, timestamps: np.ndarray, c2w: np.ndarray,
              comments: Sequence[str] = ()) -> None:
    """Write a trajectory in TUM format: one line ``t tx ty tz qx qy qz qw`` per pose.

    Written crash-safely like ``write_ply`` (a symbolic link at ``path`` is refused).

    Args:
        path: output text file (a ``#`` header line is written first).
        timestamps: [N] seconds, written with 9 decimals (float64 itself
            resolves about 0.2 µs at Unix epoch times).
        c2w: [N, 4, 4] camera-to-world transforms; (tx, ty, tz) is the camera
            centre, (qx, qy, qz, qw) the rotation camera → world, w ≥ 0.
        comments: extra ``# `` lines after the header line (one line of ASCII each).
    """
    text = tum_text(timestamps, c2w, comments).encode("ascii")
    atomic_write(path, lambda f: f.write(text))


def tum_text(timestamps: np.ndarray, c2w: np.ndarray, comments: Sequence[str]) -> str:
    timestamps = np.asarray(timestamps, dtype=np.float64).reshape(-1)
    c2w = np.asarray(c2w, dtype=np.float64)
    if c2w.shape != (timestamps.shape[0], 4, 4):
        raise ValueError(f"c2w must be [{timestamps.shape[0]}, 4, 4], got {c2w.shape}")
    quat = matrix_to_quaternion(c2w[:, :3, :3])
    rows = np.concatenate([c2w[:, :3, 3], quat], axis=1)
    lines = ["# timestamp tx ty tz qx qy qz qw"] + [f"# {_one_line(c)}" for c in comments]
    lines += [f"{t:.9f} " + " ".join(f"{v:.9g}" for v in row) for t, row in zip(timestamps, rows)]
    return "\n".join(lines) + "\n"


def read_tum(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a TUM trajectory (``#`` comments and blank lines skipped).

    Returns:
        (timestamps [N] float64 seconds, c2w [N, 4, 4] float64).
    """
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        values = line.replace(",", " ").split()
        if len(values) != 8:
            raise ValueError(f"{path}:{lineno}: expected 8 values, got {len(values)}")
        try:
            rows.append([float(v) for v in values])
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
    data = np.asarray(rows, dtype=np.float64).reshape(-1, 8)
    c2w = np.tile(np.eye(4), (data.shape[0], 1, 1))
    c2w[:, :3, :3] = quaternion_to_matrix(data[:, 4:8])
    c2w[:, :3, 3] = data[:, 1:4]
    return data[:, 0], c2w


# ----------------------------------------------------------------------------- plot

_MARGIN = {"left": 20, "right": 20, "top": 36, "bottom": 48}
_COLORS = {
    "bg": (255, 255, 255), "box": (60, 60, 60), "grid": (225, 225, 225),
    "path": (31, 119, 180), "heading": (150, 150, 150),
    "start": (44, 160, 44), "end": (214, 39, 40), "text": (0, 0, 0),
}


def plot_trajectory_png(
    path: str | Path, c2w: np.ndarray, title: str = "", size: tuple[int, int] = (640, 480)
) -> None:
    """Draw a top-down view of a trajectory to a PNG (Pillow only), written crash-safely.

    The view looks down on the x–z plane of the OpenCV world (y points down,
    so this is the ground plane): x to the right, z (forward) up the image, equal
    scale on both axes. Drawn: axes box, camera path, short heading ticks
    (camera z axis), a green start disc, a red end square, and a scale bar
    labelled in world units.

    Args:
        path: output PNG file.
        c2w: [N, 4, 4] camera-to-world transforms; non-finite poses are skipped.
        title: text at the top.
        size: image (width, height) in pixels, at least 160×120.
    """
    width, height = size
    if width < 160 or height < 120:
        raise ValueError(f"plot size must be at least 160x120, got {width}x{height}")
    c2w = np.asarray(c2w, dtype=np.float64)
    if c2w.ndim != 3 or c2w.shape[1:] not in ((4, 4), (3, 4)):
        raise ValueError(f"c2w must be [N, 4, 4], got {c2w.shape}")
    c2w = c2w[np.isfinite(c2w[:, :3, :4]).all(axis=(1, 2))]
    if c2w.shape[0] == 0:
        raise ValueError("no finite poses to plot")
    ground = c2w[:, [0, 2], 3]  # [N, 2] (x, z) camera centres
    box = (_MARGIN["left"], _MARGIN["top"], width - _MARGIN["right"], height - _MARGIN["bottom"])
    to_px, px_per_unit = _fit_view(ground, box)

    img = Image.new("RGB", (width, height), _COLORS["bg"])
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    draw.rectangle(box, outline=_COLORS["box"], width=1)

    pixels = to_px(ground)
    _draw_headings(draw, pixels, c2w[:, [0, 2], 2])
    if len(pixels) > 1:
        draw.line([tuple(p) for p in pixels], fill=_COLORS["path"], width=2, joint="curve")
    sx, sy = pixels[0]
    draw.ellipse((sx - 5, sy - 5, sx + 5, sy + 5), fill=_COLORS["start"], outline=_COLORS["box"])
    ex, ey = pixels[-1]
    draw.rectangle((ex - 4, ey - 4, ex + 4, ey + 4), fill=_COLORS["end"], outline=_COLORS["box"])

    draw.text((box[0], 8), title, fill=_COLORS["text"], font=font)
    draw.text((box[2] - 10, box[3] + 4), "x", fill=_COLORS["text"], font=font)
    draw.text((box[0] + 4, box[1] + 2), "z", fill=_COLORS["text"], font=font)
    _draw_scale_bar(draw, font, box, px_per_unit)
    legend = f"start (green), end (red), {c2w.shape[0]} poses"
    legend_x = box[2] - draw.textlength(legend, font=font)
    draw.text((legend_x, box[3] + 32), legend, fill=_COLORS["text"], font=font)
    atomic_write(path, lambda f: img.save(f, format="PNG"))


def _fit_view(ground: np.ndarray, box: tuple[int, int, int, int]):
    """Equal-aspect map from (x, z) world units to pixel (col, row) inside ``box``
    (z grows upwards). Returns (function [N,2] → [N,2] float pixels, pixels per unit)."""
    lo, hi = ground.min(axis=0), ground.max(axis=0)
    centre = (lo + hi) / 2
    extent = np.maximum(hi - lo, 1e-9)
    inner_w, inner_h = (box[2] - box[0]) * 0.9, (box[3] - box[1]) * 0.9
    if np.all(hi - lo < 1e-9):  # a single place: show 1 unit across
        extent = np.ones(2)
    px_per_unit = float(min(inner_w / extent[0], inner_h / extent[1]))
    box_centre = np.array([(box[0] + box[2]) / 2, (box[1] + box[3]) / 2])

    def to_px(xz: np.ndarray) -> np.ndarray:
        d = (xz - centre) * px_per_unit
        return np.stack([box_centre[0] + d[:, 0], box_centre[1] - d[:, 1]], axis=-1)

    return to_px, px_per_unit


def _draw_headings(draw: ImageDraw.ImageDraw, pixels: np.ndarray, forward_xz: np.ndarray) -> None:
    """Short ticks along each camera's forward axis, projected on x–z (≤ 30 drawn)."""
    norm = np.linalg.norm(forward_xz, axis=-1, keepdims=True)
    direction = np.divide(forward_xz, norm, out=np.zeros_like(forward_xz), where=norm > 1e-9)
    step = max(1, len(pixels) // 30)
    for (px, py), (dx, dz) in zip(pixels[::step], direction[::step]):
        draw.line((px, py, px + 12 * dx, py - 12 * dz), fill=_COLORS["heading"], width=1)


def _nice_length(target: float) -> float:
    """Largest 1/2/5·10^k not above ``target`` (> 0)."""
    exp = math.floor(math.log10(target))
    for mult in (5, 2, 1):
        if mult * 10.0**exp <= target:
            return mult * 10.0**exp
    return 10.0**exp


def _draw_scale_bar(draw, font, box, px_per_unit: float) -> None:
    length = _nice_length(0.25 * (box[2] - box[0]) / px_per_unit)
    bar_px = length * px_per_unit
    x0, y0 = box[0], box[3] + 12
    draw.line((x0, y0, x0 + bar_px, y0), fill=_COLORS["text"], width=3)
    for x in (x0, x0 + bar_px):
        draw.line((x, y0 - 4, x, y0 + 4), fill=_COLORS["text"], width=1)
    label = f"{length:g} units (top view x-z)"
    draw.text((x0 + bar_px + 8, y0 - 6), label, fill=_COLORS["text"], font=font)
