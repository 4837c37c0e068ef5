"""Geometric verification of a loop candidate from depth (numpy only).

A candidate loop between keyframes a and b comes with a relative ``Sim3`` ``rel = X_a⁻¹·X_b``
(camera b's pose in camera a's axes and units, scale = a's units per b's unit, so
``p_a = rel.apply(p_b)``), e.g. from the model run on both frames together, and each frame's
z-depth map (its own model units, OpenCV optical axes), confidence (≥ 1) and intrinsics.

``reprojection``: confident pixels of a (every ``stride``-th row and column) are lifted with a's
depth, moved into b by ``rel⁻¹`` and projected with b's intrinsics (nearest pixel). A point
*lands* when it is in front of b, inside b's image, on a confident pixel of b. Then:

- overlap = landed / lifted points;
- relative depth error = |z_projected − depth_b| / depth_b of each landed point;
- inlier ratio = landed points with error < ``depth_tolerance`` / landed points;
- median error over the landed points.

``spread``: several estimates of the same relative pose (e.g. the side session run in both
orders, or with different partners) must agree: the largest pairwise rotation angle (degrees),
the largest pairwise translation distance divided by a's median confident depth (scale-free),
and the range of their log-scales.

``verify_loop`` applies ``LoopCheck``'s thresholds in that order and returns a ``LoopVerdict``
whose reason names the first failed test (e.g. "inlier ratio 0.12 < 0.8").

Limits: the default thresholds are set on synthetic depth (``test/unit/test_slam_verify.py``) and
must be tuned on the model's side-session depth, which is noisier. Depth consistency is blind to
motions that slide a planar scene along itself: in the synthetic box room a 0.25-unit sideways
error at ~5 units depth still keeps 0.78 of the points within 5 % (the right pose: > 0.95), so
large planes need the agreement of several estimates (``spread``) or an appearance check as well.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..geometry import rotation_angle_deg
from .sim3 import Sim3, check_finite


@dataclass(frozen=True)
class LoopCheck:
    """Thresholds of ``verify_loop``.

    Attributes:
        conf_threshold: pixels with confidence above it count (the model's confidence is ≥ 1).
        stride: every ``stride``-th row and column of a is tested.
        depth_tolerance: relative depth error below which a landed point is an inlier.
        min_points: fewest confident points of a to test.
        min_overlap, min_inlier_ratio, max_median_error: the reprojection's bounds.
        max_rotation_spread_deg, max_translation_spread, max_log_scale_spread: bounds on the
            agreement of several estimates (translation relative to a's median depth).
    """

    conf_threshold: float = 1.5
    stride: int = 4
    depth_tolerance: float = 0.05
    min_points: int = 200
    min_overlap: float = 0.3
    min_inlier_ratio: float = 0.8
    max_median_error: float = 0.03
    max_rotation_spread_deg: float = 3.0
    max_translation_spread: float = 0.05
    max_log_scale_spread: float = 0.05

    def __post_init__(self) -> None:
        for name in ("depth_tolerance", "max_median_error", "max_rotation_spread_deg", "max_translation_spread",
                     "max_log_scale_spread"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"LoopCheck.{name} must be finite and > 0, got {value!r}")
        for name in ("min_overlap", "min_inlier_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"LoopCheck.{name} must be in [0, 1], got {value!r}")
        if not math.isfinite(self.conf_threshold):
            raise ValueError(f"LoopCheck.conf_threshold must be finite, got {self.conf_threshold!r}")
        for name in ("stride", "min_points"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoopCheck.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, eq=False)
class DepthView:
    """One keyframe's depth: ``depth`` [H, W] z-depth (its model units, > 0 where valid),
    ``confidence`` [H, W] (≥ 1), ``intrinsics`` [3, 3] pixels at that resolution."""

    depth: np.ndarray
    confidence: np.ndarray
    intrinsics: np.ndarray

    def __post_init__(self) -> None:
        depth = np.asarray(self.depth, dtype=np.float64)
        conf = np.asarray(self.confidence, dtype=np.float64)
        if depth.ndim != 2 or conf.shape != depth.shape:
            raise ValueError(f"depth must be [H, W] and confidence the same shape, got {depth.shape} and {conf.shape}")
        k = check_finite(self.intrinsics, "intrinsics", (3, 3))
        if not (k[0, 0] > 0 and k[1, 1] > 0):
            raise ValueError(f"intrinsics need positive focal lengths, got fx={k[0, 0]}, fy={k[1, 1]}")
        object.__setattr__(self, "depth", depth)
        object.__setattr__(self, "confidence", conf)
        object.__setattr__(self, "intrinsics", k)


@dataclass(frozen=True)
class Reprojection:
    points: int  # confident points of a tested
    landed: int
    overlap: float
    inlier_ratio: float
    median_error: float  # NaN when nothing landed
    median_depth_a: float  # of the tested points


@dataclass(frozen=True)
class Spread:
    rotation_deg: float
    translation: float  # relative to a's median depth
    log_scale: float


@dataclass(frozen=True)
class LoopVerdict:
    accepted: bool
    reason: str
    reprojection: Reprojection
    spread: Spread | None


def _confident(view: DepthView, threshold: float) -> np.ndarray:
    return (view.confidence > threshold) & np.isfinite(view.depth) & (view.depth > 0)


def reprojection(a: DepthView, b: DepthView, rel: Sim3, check: LoopCheck) -> Reprojection:
    """Project a's confident pixels into b with ``rel⁻¹`` (module text)."""
    rows = np.arange(0, a.depth.shape[0], check.stride)
    cols = np.arange(0, a.depth.shape[1], check.stride)
    v, u = np.meshgrid(rows, cols, indexing="ij")
    ok = _confident(a, check.conf_threshold)[v, u]
    v, u = v[ok], u[ok]
    z = a.depth[v, u]
    ka = a.intrinsics
    cam_a = np.stack([(u - ka[0, 2]) * z / ka[0, 0], (v - ka[1, 2]) * z / ka[1, 1], z], axis=-1)
    cam_b = rel.inverse().apply(cam_a)
    zb = cam_b[:, 2]
    kb = b.intrinsics
    with np.errstate(divide="ignore", invalid="ignore"):
        ub = np.rint(kb[0, 0] * cam_b[:, 0] / zb + kb[0, 2])
        vb = np.rint(kb[1, 1] * cam_b[:, 1] / zb + kb[1, 2])
    h, w = b.depth.shape
    inside = (zb > 0) & (ub >= 0) & (ub < w) & (vb >= 0) & (vb < h)
    ub, vb, zb = ub[inside].astype(int), vb[inside].astype(int), zb[inside]
    good = _confident(b, check.conf_threshold)[vb, ub]
    ub, vb, zb = ub[good], vb[good], zb[good]
    landed = int(zb.size)
    errors = np.abs(zb - b.depth[vb, ub]) / b.depth[vb, ub]
    points = int(z.size)
    return Reprojection(points=points, landed=landed, overlap=landed / points if points else 0.0,
                        inlier_ratio=float(np.mean(errors < check.depth_tolerance)) if landed else 0.0,
                        median_error=float(np.median(errors)) if landed else math.nan,
                        median_depth_a=float(np.median(z)) if points else math.nan)


def spread(estimates: Sequence[Sim3], reference_length: float) -> Spread:
    """Largest pairwise disagreement of ``estimates`` (module text); zeros for fewer than two."""
    if not (math.isfinite(reference_length) and reference_length > 0):
        raise ValueError(f"reference_length must be finite and > 0, got {reference_length!r}")
    rot = trans = 0.0
    for x, y in itertools.combinations(estimates, 2):
        rot = max(rot, float(rotation_angle_deg(x.rotation, y.rotation)))
        trans = max(trans, float(np.linalg.norm(x.translation - y.translation)) / reference_length)
    logs = [math.log(e.scale) for e in estimates]
    return Spread(rot, trans, (max(logs) - min(logs)) if logs else 0.0)


def verify_loop(a: DepthView, b: DepthView, rel: Sim3, others: Sequence[Sim3] = (),
                check: LoopCheck | None = None) -> LoopVerdict:
    """Accept or reject the loop ``rel = X_a⁻¹·X_b`` (module text); ``others`` are further
    estimates of the same relative pose, checked for agreement with ``rel`` and each other."""
    check = check or LoopCheck()
    rep = reprojection(a, b, rel, check)
    agree = spread([rel, *others], rep.median_depth_a) if others and rep.points else None

    def verdict(ok: bool, reason: str) -> LoopVerdict:
        return LoopVerdict(ok, reason, rep, agree)

    if rep.points < check.min_points:
        return verdict(False, f"only {rep.points} confident points < {check.min_points}")
    if rep.overlap < check.min_overlap:
        return verdict(False, f"overlap {rep.overlap:.2f} < {check.min_overlap:g}")
    if rep.inlier_ratio < check.min_inlier_ratio:
        return verdict(False, f"inlier ratio {rep.inlier_ratio:.2f} < {check.min_inlier_ratio:g}")
    if rep.median_error > check.max_median_error:
        return verdict(False, f"median depth error {rep.median_error:.3f} > {check.max_median_error:g}")
    if agree is not None:
        for name, value, bound, unit in (("rotation", agree.rotation_deg, check.max_rotation_spread_deg, "°"),
                                         ("translation", agree.translation, check.max_translation_spread, ""),
                                         ("log-scale", agree.log_scale, check.max_log_scale_spread, "")):
            if value > bound:
                return verdict(False, f"{name} spread {value:.3g}{unit} > {bound:g}{unit}")
    return verdict(True, f"accepted: inlier ratio {rep.inlier_ratio:.2f}, overlap {rep.overlap:.2f}, "
                         f"median depth error {rep.median_error:.3f}")
