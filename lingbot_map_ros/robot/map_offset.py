"""Published map frame across sequences: the metric scale and a map offset ``T_map_seq``.

The engine keeps each sequence's poses and points in the sequence's own map frame ``S``
(REP-103 axes, origin at the sequence's first camera) and in model units. What it publishes
is, for a pose ``T_S_cam`` [4, 4] and points ``p_S`` [N, 3]:

    T_map_cam = T_map_seq · A_s(T_S_cam)            p_map = T_map_seq · (s · p_S)

with ``s`` the metric scale (metres per model unit; 1 = model units), ``A_s`` the pose with
its translation times ``s`` (``scale.apply_scale``) and ``T_map_seq`` the sequence's map
offset (identity for a sequence that started the map). ``OutputTransform`` is this map.

A sequence started by ``on_lost=reset`` continues the previous map when odometry is
available (``odom_frame -> camera`` in TF at both stamps). With the last good published
pose ``T_map_cam(g)`` and a frame ``a`` of the new sequence (its first one with odometry):

    T_map_cam(a) = T_map_cam(g) · inv(T_odom_cam(t_g)) · T_odom_cam(t_a)        (``odometry_alignment``)

and every frame ``j`` of the new sequence follows ``a`` by the model's own relative motion:

    T_map_cam(j) = T_map_cam(a) · A_s(inv(T_S_cam(a)) · T_S_cam(j))

so ``T_map_seq = T_map_cam(a) · A_s(inv(T_S_cam(a)))`` (``SequenceAnchor.offset``; ``A_s``
commutes with products of rigid transforms). The odometry's translation is in metres:
consistent when the published units are metres (a metric scale known at ``g``); in model
units the motion between ``t_g`` and ``t_a`` is added as if a model unit were a metre (the
engine warns). Rotations are unit-free and always exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scale import apply_scale


def invert_rigid(T: np.ndarray) -> np.ndarray:
    """Inverse of a rigid [4, 4] transform: (R^T, -R^T t), float64."""
    T = np.asarray(T, dtype=np.float64)
    out = np.eye(4)
    out[:3, :3] = T[:3, :3].T
    out[:3, 3] = -T[:3, :3].T @ T[:3, 3]
    return out


def _rigid(name: str, T: np.ndarray) -> np.ndarray:
    T = np.asarray(T, dtype=np.float64)
    if T.shape != (4, 4) or not np.isfinite(T).all():
        raise ValueError(f"{name} must be a finite [4, 4] transform, got shape {T.shape}")
    return T


@dataclass(frozen=True, eq=False)
class OutputTransform:
    """Sequence map frame, model units -> published map frame (see the module docstring).

    scale: metres per model unit applied (1 = model units). offset: [4, 4] ``T_map_seq`` in
    published units, None = identity. Two transforms are equal when both fields are."""

    scale: float = 1.0
    offset: np.ndarray | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.offset is None

    def pose(self, T: np.ndarray) -> np.ndarray:
        """Poses [..., 4, 4] ``T_S_cam`` (model units) -> ``T_map_cam`` (published); a new float64 array."""
        out = apply_scale(T, self.scale) if self.scale != 1.0 else np.array(T, dtype=np.float64, copy=True)
        return out if self.offset is None else self.offset @ out

    def points(self, points: np.ndarray) -> np.ndarray:
        """Points [N, 3] of the sequence's map frame (model units) -> published map frame; float32
        stays float32 (the input itself is returned for the identity)."""
        p = np.asarray(points)
        if self.identity:
            return p
        dtype = p.dtype if np.issubdtype(p.dtype, np.floating) else np.float64
        out = p * np.asarray(self.scale, dtype=dtype) if self.scale != 1.0 else p
        if self.offset is not None:
            R, t = self.offset[:3, :3].astype(dtype), self.offset[:3, 3].astype(dtype)
            out = out @ R.T + t
        return out.astype(dtype, copy=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OutputTransform):
            return NotImplemented
        if self.scale != other.scale or (self.offset is None) != (other.offset is None):
            return False
        return self.offset is None or bool(np.array_equal(self.offset, other.offset))

    __hash__ = None  # mutable array inside: not a dict key


@dataclass(frozen=True, eq=False)
class SequenceAnchor:
    """Where a sequence sits in the published map: frame ``a`` of the sequence has the published
    pose ``base`` and its own pose ``first`` (``T_S_cam(a)``, model units)."""

    base: np.ndarray  # [4, 4] T_map_cam(a), published units
    first: np.ndarray  # [4, 4] T_S_cam(a), model units

    def __post_init__(self) -> None:
        _rigid("base", self.base)
        _rigid("first", self.first)

    def offset(self, scale: float) -> np.ndarray:
        """``T_map_seq`` [4, 4] for the scale ``s`` applied now: ``base · A_s(inv(first))``."""
        return np.asarray(self.base, dtype=np.float64) @ apply_scale(invert_rigid(self.first), scale)


def odometry_alignment(T_map_cam_good: np.ndarray, T_odom_cam_good: np.ndarray,
                       T_odom_cam_new: np.ndarray) -> np.ndarray:
    """Published pose [4, 4] of a new sequence's frame: the last good published pose moved by the
    odometry's camera motion between the two stamps,
    ``T_map_cam(g) · inv(T_odom_cam(t_g)) · T_odom_cam(t_new)`` (odometry translations in metres)."""
    return (_rigid("T_map_cam_good", T_map_cam_good) @ invert_rigid(_rigid("T_odom_cam_good", T_odom_cam_good))
            @ _rigid("T_odom_cam_new", T_odom_cam_new))


__all__ = ["OutputTransform", "SequenceAnchor", "invert_rigid", "odometry_alignment"]
