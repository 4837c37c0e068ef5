"""Synthetic keyframe trajectories with drifting odometry, for the pose-graph tests and benchmark
(numpy only).

World: OpenCV optical axes of a level camera (x right, y down, z forward); the paths lie near the
x–z plane and each camera looks along its direction of travel. Poses are camera-to-world.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .sim3 import Sim3, relative


def _heading_poses(centres: np.ndarray) -> list[Sim3]:
    """Cameras at ``centres`` [N, 3] looking along the path (z = travel direction, y = world down)."""
    ahead = np.roll(centres, -1, axis=0) - np.roll(centres, 1, axis=0)
    poses = []
    for c, d in zip(centres, ahead):
        z = d / np.linalg.norm(d)
        x = np.cross(np.array([0.0, 1.0, 0.0]), z)
        x /= np.linalg.norm(x)
        poses.append(Sim3(np.column_stack([x, np.cross(z, x), z]), c, 1.0))
    return poses


def square(n: int, side: float = 10.0, corner: float = 1.0) -> list[Sim3]:
    """``n`` poses along a square of edge ``side`` with rounded corners (radius ``corner``), one lap
    (the last pose stops one step before the first)."""
    straight, arc = side - 2 * corner, 0.5 * math.pi * corner
    lap = 4 * (straight + arc)
    centres = []
    for s in np.arange(n) * lap / n:
        side_idx, r = divmod(s, straight + arc)
        if r < straight:
            local = np.array([-side / 2 + corner + r, -side / 2])
        else:
            a = (r - straight) / corner
            local = np.array([side / 2 - corner + corner * math.sin(a), -side / 2 + corner - corner * math.cos(a)])
        ang = 0.5 * math.pi * side_idx
        rot = np.array([[math.cos(ang), -math.sin(ang)], [math.sin(ang), math.cos(ang)]])
        x, z = rot @ local
        centres.append([x, 0.1 * math.sin(2 * math.pi * s / lap), z])
    return _heading_poses(np.array(centres))


def figure_eight(n: int, size: float = 10.0) -> list[Sim3]:
    """``n`` poses along a lemniscate ``x = a·sin θ, z = a·sin θ·cos θ`` (crossing itself at the
    origin), one lap, with a gentle height change."""
    theta = np.arange(n) * 2 * math.pi / n + 0.5 * math.pi
    a = size / 2
    centres = np.stack([a * np.sin(theta), 0.2 * np.sin(3 * theta), a * np.sin(theta) * np.cos(theta)], axis=-1)
    return _heading_poses(centres)


@dataclass(frozen=True)
class Drift:
    """Odometry errors per keyframe step: a yaw bias and random rotation (degrees), a translation
    bias along the camera's x and random translation (fraction of the step), and a scale drift
    (each keyframe's unit is ``1 + scale_per_step`` times its predecessor's)."""

    yaw_bias_deg: float = 0.3
    rotation_noise_deg: float = 0.05
    translation_bias: float = 0.01
    translation_noise: float = 0.005
    scale_per_step: float = 0.003


def _small_rotation(vec: np.ndarray) -> np.ndarray:
    angle = float(np.linalg.norm(vec))
    if angle < 1e-15:
        return np.eye(3)
    k = vec / angle
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + math.sin(angle) * kx + (1 - math.cos(angle)) * kx @ kx


def drifted_odometry(truth: list[Sim3], drift: Drift, rng: np.random.Generator) -> list[Sim3]:
    """Odometry poses (scale 1, first = truth's first) chained from measured relative poses whose
    rotation, translation and scale drift as ``drift`` says."""
    odom = [truth[0]]
    unit = 1.0  # keyframe k's length unit relative to the world's
    for a, b in zip(truth[:-1], truth[1:]):
        rel = relative(a, b)
        step = float(np.linalg.norm(rel.translation))
        rot_err = np.radians(np.array([0.0, drift.yaw_bias_deg, 0.0]) + rng.normal(0, drift.rotation_noise_deg, 3))
        trans = rel.translation / unit + step / unit * (
            np.array([drift.translation_bias, 0, 0]) + rng.normal(0, drift.translation_noise, 3))
        odom.append(odom[-1] @ Sim3(rel.rotation @ _small_rotation(rot_err), trans, 1.0))
        unit *= 1.0 + drift.scale_per_step
    return odom


def true_units(n: int, drift: Drift) -> np.ndarray:
    """[n] world units per keyframe unit of the drifted keyframes (1 for the first)."""
    return (1.0 + drift.scale_per_step) ** np.arange(n, dtype=np.float64)


def loop_measurement(truth: list[Sim3], drift: Drift, i: int, j: int) -> Sim3:
    """The true ``X_i⁻¹·X_j`` of two drifted keyframes (their units from ``true_units``)."""
    units = true_units(max(i, j) + 1, drift)
    xi = Sim3(truth[i].rotation, truth[i].translation, units[i])
    xj = Sim3(truth[j].rotation, truth[j].translation, units[j])
    return relative(xi, xj)
