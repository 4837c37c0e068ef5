"""Uncertainties of pose-graph edges: standard deviations from a confidence weight, and ROS pose
covariances converted to GTSAM's tangent space (numpy only).

Tangent order (GTSAM's): rotation (3, radians), translation (3), and for Sim(3) the log of the
scale (1). A perturbation ``ξ`` of a pose ``X`` is applied on the right, ``X · Exp(ξ)``, so the
rotation and translation parts are in the keyframe's own camera axes and, for Sim(3), its own
units (``sim3`` module: GTSAM's ``Similarity3(R, t/s, s)`` is our ``Sim3(R, t, s)``).

Edge sigmas from a weight (``EdgeNoise.sigmas``): information grows linearly with the weight
``w`` in [``min_weight``, 1], so every sigma is its base value divided by √w:

    rotation    = radians(rotation_deg) / √w                      (each of the 3 axes)
    translation = (translation + translation_fraction · step) / √w  (each axis; step = the edge's
                                                                     translation length)
    log-scale   = log_scale / √w

``HEALTH_WEIGHTS`` maps the node's tracking states to weights: the inverses of the variance
factors that ``robot/health.py`` puts on ``~/odometry`` (×1, ×10, ×100, ×1000), so a degraded
step is trusted as the published odometry says.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .sim3 import Sim3, check_covariance, check_finite

HEALTH_WEIGHTS = {"tracking": 1.0, "degraded": 0.1, "initializing": 0.01, "lost": 0.001}



@dataclass(frozen=True)
class EdgeNoise:
    """Base standard deviations of a relative-pose edge at weight 1 (see the module text).

    Attributes:
        rotation_deg: per-axis rotation sigma, degrees.
        translation: per-axis translation sigma floor, in the edge's source keyframe units.
        translation_fraction: added sigma per unit of step length (dimensionless).
        log_scale: sigma of the log of the relative scale (Sim(3) graphs only).
        min_weight: weights are clipped to [min_weight, 1].
    """

    rotation_deg: float = 0.5
    translation: float = 0.01
    translation_fraction: float = 0.02
    log_scale: float = 0.005
    min_weight: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("rotation_deg", "translation", "log_scale", "min_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"EdgeNoise.{name} must be finite and > 0, got {value!r}")
        if not (math.isfinite(self.translation_fraction) and self.translation_fraction >= 0):
            raise ValueError(f"EdgeNoise.translation_fraction must be >= 0, got {self.translation_fraction!r}")
        if self.min_weight > 1:
            raise ValueError(f"EdgeNoise.min_weight must be <= 1, got {self.min_weight!r}")

    def sigmas(self, weight: float = 1.0, step: float = 0.0, with_scale: bool = True) -> np.ndarray:
        """[7] (``with_scale``) or [6] sigmas in GTSAM tangent order for an edge of confidence
        ``weight`` (clipped to [min_weight, 1]) whose translation is ``step`` long."""
        if not math.isfinite(weight):
            raise ValueError(f"weight must be finite, got {weight!r}")
        if not (math.isfinite(step) and step >= 0):
            raise ValueError(f"step must be finite and >= 0, got {step!r}")
        inv_sqrt = 1.0 / math.sqrt(min(1.0, max(self.min_weight, weight)))
        rot = math.radians(self.rotation_deg) * inv_sqrt
        trans = (self.translation + self.translation_fraction * step) * inv_sqrt
        out = [rot] * 3 + [trans] * 3 + ([self.log_scale * inv_sqrt] if with_scale else [])
        return np.array(out)

    def sigmas_for(self, relative: Sim3, weight: float = 1.0, with_scale: bool = True) -> np.ndarray:
        """``sigmas`` with ``step`` = the length of ``relative``'s translation."""
        return self.sigmas(weight, float(np.linalg.norm(relative.translation)), with_scale)


def health_weight(state: str) -> float:
    """Weight of a tracking state name (``HEALTH_WEIGHTS``); an unknown name is refused."""
    try:
        return HEALTH_WEIGHTS[state]
    except KeyError:
        raise ValueError(f"unknown tracking state {state!r}; known: {sorted(HEALTH_WEIGHTS)}") from None


def ros_to_tangent_jacobian(pose: Sim3, with_scale: bool) -> np.ndarray:
    """J with ``ξ_gtsam = J · δ_ros`` at ``pose``.

    ``δ_ros`` = (δx, δy, δz, δrx, δry, δrz) [+ δlog s]: the position change along the world axes
    and a small rotation about the world's fixed X, Y, Z axes (``R' = Exp(δr)·R``), as
    geometry_msgs/PoseWithCovariance describes its covariance ("fixed-axis representation ...
    rotation about X axis, ..."), both in the pose's parent frame; plus the log-scale change in
    Sim(3). ``ξ_gtsam`` = (ω, u) [+ λ], the right perturbation of Pose3 / Similarity3:
    ``ω = Rᵀ·δr``, ``u = Rᵀ·δt / s``, ``λ = δlog s`` (GTSAM's ``X·Exp(0, u, λ)`` moves the centre
    by ``s·R·u`` whatever λ). Shapes [6, 6], or [7, 7] with ``with_scale``.

    The rotation block is the world-axis reading: it equals a roll/pitch/yaw-increment reading at
    zero attitude, differs from it elsewhere, and has no gimbal lock (the model's optical world
    has its "yaw" about y, where roll/pitch/yaw would lock at a 90° turn).
    """
    rot_t = pose.rotation.T
    dim = 7 if with_scale else 6
    jac = np.zeros((dim, dim))
    jac[0:3, 3:6] = rot_t
    jac[3:6, 0:3] = rot_t / pose.scale if with_scale else rot_t
    if with_scale:
        jac[6, 6] = 1.0
    return jac


def ros_covariance_to_tangent(pose: Sim3, covariance, log_scale_sigma: float | None = None) -> np.ndarray:
    """A ROS 6×6 pose covariance (x, y, z, rx, ry, rz; row-major 36 values or [6, 6]) at
    ``pose`` → GTSAM's tangent covariance: [6, 6] Pose3 when ``log_scale_sigma`` is None, else
    [7, 7] Similarity3 with that sigma on the log-scale (independent of the rest)."""
    cov = check_finite(covariance, "pose covariance")
    if cov.shape == (36,):
        cov = cov.reshape(6, 6)
    cov = check_covariance(cov, "pose covariance (x y z rx ry rz)", 6)
    with_scale = log_scale_sigma is not None
    if with_scale:
        if not (math.isfinite(log_scale_sigma) and log_scale_sigma > 0):
            raise ValueError(f"log_scale_sigma must be finite and > 0, got {log_scale_sigma!r}")
        full = np.zeros((7, 7))
        full[:6, :6] = cov
        full[6, 6] = log_scale_sigma ** 2
        cov = full
    jac = ros_to_tangent_jacobian(pose, with_scale)
    out = jac @ cov @ jac.T
    return 0.5 * (out + out.T)


def tangent_covariance_to_ros(pose: Sim3, covariance) -> np.ndarray:
    """Inverse of ``ros_covariance_to_tangent``: GTSAM's [6, 6] or [7, 7] tangent covariance at
    ``pose`` → the ROS [6, 6] (x, y, z, rx, ry, rz) covariance (the scale part dropped)."""
    cov = check_finite(covariance, "tangent covariance")
    if cov.shape not in ((6, 6), (7, 7)):
        raise ValueError(f"tangent covariance must be [6, 6] or [7, 7], got {cov.shape}")
    inv = np.linalg.inv(ros_to_tangent_jacobian(pose, cov.shape[0] == 7))
    out = inv @ cov @ inv.T
    return 0.5 * (out + out.T)[:6, :6]
