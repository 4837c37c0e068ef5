"""What loop closure keeps of each keyframe: ``LoopKeyframe``, ``KeyframeStore`` and the map they
render at corrected poses.

A keyframe (a stored frame of the stream) is kept as:

- its pose ``T_S_cam`` as the stream gave it (the sequence's map frame ``S``: REP-103 axes, model
  units; ``Sequence.path``'s entry) — the pose graph's odometry;
- its model input as JPEG bytes (the side session re-runs the model on it to verify a loop, and a
  relocalisation re-seeds the model's window with it);
- a place descriptor (``slam.gradient_descriptor`` of the model input);
- its depth, confidence and colours at 1/``THUMB`` of the model's resolution with the matching
  intrinsics: the scale anchor of a loop measurement and the keyframe's part of the map.

``KeyframeStore`` is bounded (``max_keyframes``; the oldest keyframe goes first) and renders the
map: every keyframe's confident points moved by its correction (``Corrections``), voxel
downsampled, at most ``max_points``. numpy and Pillow only; no ROS, no torch.
"""
from __future__ import annotations

import io
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..geometry import voxel_downsample
from ..slam import Sim3
from .corrections import Corrections

THUMB = 8  # keyframe depth and colours are kept at 1/THUMB of the model's resolution
JPEG_QUALITY = 92


@dataclass(frozen=True, eq=False)
class LoopKeyframe:
    """One keyframe as loop closure keeps it (module text)."""

    index: int  # 0-based frame index in the sequence
    stamp_s: float
    T: np.ndarray  # [4, 4] T_S_cam, camera optical frame -> sequence map frame (model units)
    image: bytes  # the model input as JPEG
    descriptor: np.ndarray  # [D] float32, L2-normalised
    depth: np.ndarray | None  # [h, w] float32 z-depth (model units), 0 where not confident (None: a
    # frame to relocalise, which the stream has not posed)
    colors: np.ndarray  # [h, w, 3] uint8
    K: np.ndarray  # [3, 3] intrinsics at [h, w]
    weight: float = 1.0  # the odometry edge's confidence (tracking health)

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(points [N, 3] float64 in the keyframe's camera frame, colours [N, 3] uint8) of its
        confident pixels."""
        v, u = np.nonzero(self.depth > 0)
        z = self.depth[v, u].astype(np.float64)
        K = self.K
        cam = np.stack([(u - K[0, 2]) * z / K[0, 0], (v - K[1, 2]) * z / K[1, 1], z], axis=1)
        return cam, self.colors[v, u]

    def rgb(self) -> np.ndarray:
        """The model input back as uint8 [H, W, 3] (decoded from JPEG)."""
        from PIL import Image

        return np.array(Image.open(io.BytesIO(self.image)).convert("RGB"))  # writable: the model takes it


def depth_thumbnail(depth: np.ndarray, confidence: np.ndarray, K: np.ndarray, conf_threshold: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(depth [h, w] float32 with 0 where not confident or not finite, K [3, 3]) at 1/THUMB of
    ``depth``'s resolution: the centre pixel of each THUMB x THUMB block (a private copy)."""
    o = THUMB // 2
    d = np.asarray(depth, np.float32)[o::THUMB, o::THUMB]
    c = np.asarray(confidence, np.float32)[o::THUMB, o::THUMB]
    keep = np.isfinite(d) & (d > 0) & np.isfinite(c) & (c > conf_threshold)
    small_K = np.array(K, np.float64, copy=True)
    small_K[0, 0] /= THUMB
    small_K[1, 1] /= THUMB
    small_K[0, 2] = (small_K[0, 2] - o) / THUMB
    small_K[1, 2] = (small_K[1, 2] - o) / THUMB
    return np.where(keep, d, 0.0).astype(np.float32), small_K


def color_thumbnail(rgb: np.ndarray) -> np.ndarray:
    """The colours [h, w, 3] uint8 at the pixels of ``depth_thumbnail``."""
    o = THUMB // 2
    return np.ascontiguousarray(rgb[o::THUMB, o::THUMB])


def jpeg(rgb: np.ndarray, quality: int = JPEG_QUALITY) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


class KeyframeStore:
    """The kept keyframes by index, oldest first, at most ``max_keyframes``. One writer (the loop
    thread); ``render`` may run on another thread (a lock)."""

    def __init__(self, max_keyframes: int) -> None:
        if max_keyframes < 1:
            raise ValueError(f"max_keyframes must be >= 1, got {max_keyframes}")
        self.max_keyframes = max_keyframes
        self._lock = threading.Lock()
        self._items: OrderedDict[int, LoopKeyframe] = OrderedDict()
        self.dropped = 0  # keyframes forgotten because the store was full
        self.version = 0  # moves on every change

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def __contains__(self, index: int) -> bool:
        with self._lock:
            return index in self._items

    def add(self, keyframe: LoopKeyframe) -> int | None:
        """Keep ``keyframe``; returns the index of the keyframe dropped to make room (or None)."""
        with self._lock:
            self._items[keyframe.index] = keyframe
            self._items.move_to_end(keyframe.index)
            gone = None
            if len(self._items) > self.max_keyframes:
                gone, _ = self._items.popitem(last=False)
                self.dropped += 1
            self.version += 1
            return gone

    def get(self, index: int) -> LoopKeyframe | None:
        with self._lock:
            return self._items.get(index)

    def indices(self) -> list[int]:
        with self._lock:
            return list(self._items)

    def around(self, index: int, count: int) -> list[LoopKeyframe]:
        """``count`` consecutive keyframes (oldest first) that hold keyframe ``index``, as centred on
        it as the store allows; fewer when the store holds fewer."""
        with self._lock:
            keys = list(self._items)
            if index not in self._items:
                return []
            at = keys.index(index)
            start = max(0, min(at - count // 2, len(keys) - count))
            return [self._items[k] for k in keys[start:start + count]]

    def forget_from(self, index: int) -> None:
        """Keyframes from ``index`` on left the sequence (a rollback)."""
        with self._lock:
            for k in [k for k in self._items if k >= index]:
                del self._items[k]
            self.version += 1

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.version += 1

    def render(self, corrections: Corrections, voxel_size: float, max_points: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """(points [M, 3] float32, colours [M, 3] uint8): every keyframe's points in the map frame at
        its corrected pose (model units), voxel downsampled, thinned to ``max_points``."""
        with self._lock:
            items = list(self._items.values())
        parts, cols = [], []
        for kf in items:
            cam, colors = kf.points()
            if not len(cam):
                continue
            X = corrections.at(kf.index) @ Sim3.from_pose(kf.T)
            parts.append(X.apply(cam))
            cols.append(colors)
        if not parts:
            return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8)
        points, colors = np.concatenate(parts).astype(np.float32), np.concatenate(cols)
        if voxel_size > 0:
            points, colors = voxel_downsample(points, colors, voxel_size)
        if len(points) > max_points:
            keep = np.linspace(0, len(points) - 1, max_points).astype(np.int64)
            points, colors = points[keep], colors[keep]
        return np.ascontiguousarray(points, np.float32), np.ascontiguousarray(colors, np.uint8)


__all__ = ["LoopKeyframe", "KeyframeStore", "THUMB", "depth_thumbnail", "color_thumbnail", "jpeg"]
