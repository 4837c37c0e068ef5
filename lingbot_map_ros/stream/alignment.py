"""Sim(3) alignment of consecutive windows of a long stream (numpy only, no torch).

When a long stream restarts the model's cache, the new window's world is the first
camera of that window, at the model's own (per-window) scale. The last few keyframes
of the old window are re-fed as the new window's first frames, so the same images
have a pose (and a depth map) in both worlds; ``estimate_window_sim3`` turns those
pairs into the similarity transform that maps the new window's world into the
global map frame.

Conventions as in ``geometry``: camera-to-world matrices [..., 4, 4], OpenCV camera
axes, ``p_global = s · R · p_window + t``. Under that map a camera's pose becomes
``(R · R_c, s · R · t_c + t)`` and its z-depth becomes ``s · depth``.

Estimator (one closed form per quantity, chosen for short, nearly straight overlaps
where a Umeyama fit on the camera centres alone is ill-conditioned):

* rotation: the chordal mean of ``R_global_i · R_window_iᵀ`` over the overlap frames
  (SVD projection of their sum onto SO(3));
* scale: the median of ``depth_global / depth_window`` over the pixels valid in both
  maps (finite, > 0) and in the more confident half (min of the two confidences at
  or above its median); without depth maps, the ratio of the RMS spreads of the
  camera centres; 1 when neither is available;
* translation: the least-squares fit of the camera centres given R and s,
  ``t = mean_i(c_global_i − s · R · c_window_i)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..geometry import apply_sim3, apply_sim3_to_poses, rotation_angle_deg

_EPS = 1e-9


@dataclass(frozen=True, eq=False)
class Sim3:
    """``p_global = scale · rot @ p_window + trans`` (float64)."""

    scale: float = 1.0
    rot: np.ndarray = field(default_factory=lambda: np.eye(3))
    trans: np.ndarray = field(default_factory=lambda: np.zeros(3))

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and np.array_equal(self.rot, np.eye(3)) and not np.any(self.trans)

    def matrix(self) -> np.ndarray:
        """[4, 4] homogeneous matrix ``[[s·R, t], [0, 1]]``."""
        out = np.eye(4)
        out[:3, :3] = self.scale * self.rot
        out[:3, 3] = self.trans
        return out

    def apply_to_points(self, points: np.ndarray) -> np.ndarray:
        """Points [..., 3] in the window's world → the global frame."""
        return apply_sim3(self.scale, self.rot, self.trans, points)

    def apply_to_poses(self, c2w: np.ndarray) -> np.ndarray:
        """Camera-to-world [..., 4, 4] in the window's world → the global frame (float64)."""
        return apply_sim3_to_poses(self.scale, self.rot, self.trans, c2w)

    def inverse(self) -> "Sim3":
        rot_t = self.rot.T
        return Sim3(1.0 / self.scale, rot_t, -(rot_t @ self.trans) / self.scale)


@dataclass(frozen=True)
class AlignmentFit:
    """A window alignment and how well the overlap agreed with it."""

    sim3: Sim3
    scale_source: str  # "depth", "centres" or "none"
    pairs: int  # overlap frames with finite poses in both windows
    depth_pixels: int  # pixels behind the depth-ratio median (0 unless scale_source == "depth")
    rotation_residual_deg: float  # largest angle between a frame's aligned and global rotation
    centre_rmse: float  # RMS distance between aligned and global camera centres (global units)


def mean_rotation(rots: np.ndarray) -> np.ndarray:
    """Chordal L2 mean of rotations [N, 3, 3]: the rotation closest to their sum."""
    u, _, vt = np.linalg.svd(np.sum(rots, axis=0))
    fix = np.diag([1.0, 1.0, -1.0 if np.linalg.det(u @ vt) < 0 else 1.0])
    return u @ fix @ vt


def depth_ratio_scale(old_depth, new_depth, old_conf=None, new_conf=None) -> tuple[float | None, int]:
    """Median of ``old / new`` over valid, confident pixels of paired depth maps.

    Args:
        old_depth, new_depth: [N, H, W] z-depths of the same N frames in the global frame
            and in the new window.
        old_conf, new_conf: [N, H, W] confidences (≥ 1) or None: without them every valid
            pixel counts.

    Returns:
        (scale or None when no pixel qualifies, number of pixels used).
    """
    old = np.asarray(old_depth, dtype=np.float64)
    new = np.asarray(new_depth, dtype=np.float64)
    valid = np.isfinite(old) & np.isfinite(new) & (old > 0) & (new > 0)
    if old_conf is not None and new_conf is not None:
        conf = np.minimum(np.asarray(old_conf, dtype=np.float64), np.asarray(new_conf, dtype=np.float64))
        valid &= np.isfinite(conf)
        if valid.any():
            valid &= conf >= np.median(conf[valid])
    count = int(valid.sum())
    if count == 0:
        return None, 0
    return float(np.median(old[valid] / new[valid])), count


def estimate_window_sim3(old_c2w: np.ndarray, new_c2w: np.ndarray, old_depth=None, new_depth=None,
                         old_conf=None, new_conf=None) -> AlignmentFit:
    """Sim(3) mapping a new window's world onto the global frame from shared overlap frames.

    Args:
        old_c2w: [N, 4, 4] camera-to-world of the overlap frames in the global frame
            (as published before the restart).
        new_c2w: [N, 4, 4] the same frames' camera-to-world in the new window.
        old_depth, new_depth: [N, H, W] their z-depths (global units / window units), or None.
        old_conf, new_conf: [N, H, W] their confidences, or None.

    Frames whose pose is not finite in either window are left out; with none left the
    identity is returned (``pairs == 0``).
    """
    old_c2w = np.asarray(old_c2w, dtype=np.float64)
    new_c2w = np.asarray(new_c2w, dtype=np.float64)
    if old_c2w.shape != new_c2w.shape or old_c2w.ndim != 3 or old_c2w.shape[1:] != (4, 4):
        raise ValueError(f"old_c2w and new_c2w must both be [N, 4, 4], got {old_c2w.shape} and {new_c2w.shape}")
    ok = np.isfinite(old_c2w).all(axis=(1, 2)) & np.isfinite(new_c2w).all(axis=(1, 2))
    if not ok.any():
        return AlignmentFit(Sim3(), "none", 0, 0, float("nan"), float("nan"))
    old_c2w, new_c2w = old_c2w[ok], new_c2w[ok]
    rot = mean_rotation(old_c2w[:, :3, :3] @ np.swapaxes(new_c2w[:, :3, :3], -1, -2))

    c_old, c_new = old_c2w[:, :3, 3], new_c2w[:, :3, 3]
    scale, source, pixels = None, "none", 0
    if old_depth is not None and new_depth is not None:
        pick = (lambda a: None if a is None else np.asarray(a)[ok])
        scale, pixels = depth_ratio_scale(pick(old_depth), pick(new_depth), pick(old_conf), pick(new_conf))
        source = "depth" if scale is not None else "none"
    if scale is None:
        spread_new = np.sqrt(np.mean(np.sum((c_new - c_new.mean(0)) ** 2, axis=1)))
        spread_old = np.sqrt(np.mean(np.sum((c_old - c_old.mean(0)) ** 2, axis=1)))
        if spread_new > _EPS and spread_old > _EPS:
            scale, source = float(spread_old / spread_new), "centres"
        else:
            scale = 1.0
    trans = np.mean(c_old - scale * c_new @ rot.T, axis=0)
    sim3 = Sim3(float(scale), rot, trans)

    aligned = sim3.apply_to_poses(new_c2w)
    rot_res = float(np.max(rotation_angle_deg(aligned[:, :3, :3], old_c2w[:, :3, :3])))
    rmse = float(np.sqrt(np.mean(np.sum((aligned[:, :3, 3] - c_old) ** 2, axis=1))))
    return AlignmentFit(sim3, source, int(ok.sum()), pixels, rot_res, rmse)


__all__ = ["Sim3", "AlignmentFit", "estimate_window_sim3", "depth_ratio_scale", "mean_rotation"]
