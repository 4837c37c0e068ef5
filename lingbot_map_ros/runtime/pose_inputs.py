"""Poses from outside for loop closure (``~/set_pose``, ``~/pose_prior``): checked, then put into
the model's units. numpy only, no ROS: the node hands the message's fields in as ``PoseInput``.

``check_pose_input`` refuses (``PoseRefused``, with the reason) a pose in another frame than the
map, one with a NaN or infinite value, a quaternion that is not of unit length (within
``QUATERNION_TOLERANCE``: a pose from outside must be meant, not normalised for the sender) and a
covariance that is not symmetric positive definite. ``to_model_units`` moves an accepted pose and
its covariance from the published map frame (metres and the map offset, when metric scale or an
offset is in force) into the sequence's frame in model units, the pose graph's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..geometry import quaternion_to_matrix

QUATERNION_TOLERANCE = 1e-3  # | |q| - 1 | above this is refused
SYMMETRY_TOLERANCE = 1e-9  # relative


class PoseRefused(ValueError):
    """A pose from outside that is not taken; the message says why. Nothing changed."""


@dataclass(frozen=True)
class PoseInput:
    """The fields of a geometry_msgs/PoseWithCovarianceStamped."""

    frame_id: str
    stamp_s: float  # 0 = not given
    position: tuple[float, float, float]
    orientation: tuple[float, float, float, float]  # x, y, z, w
    covariance: tuple[float, ...]  # 36, row-major: x y z, then rotations about x y z

    @classmethod
    def of(cls, msg) -> "PoseInput":
        """From a PoseWithCovarianceStamped (any object with its fields)."""
        p, q = msg.pose.pose.position, msg.pose.pose.orientation
        st = msg.header.stamp
        return cls(str(msg.header.frame_id), float(st.sec) + 1e-9 * float(st.nanosec), (p.x, p.y, p.z),
                   (q.x, q.y, q.z, q.w), tuple(float(c) for c in msg.pose.covariance))


def check_pose_input(p: PoseInput, map_frame: str) -> tuple[np.ndarray, np.ndarray]:
    """(T [4, 4] rigid pose in the published map frame, covariance [6, 6]) of ``p``; PoseRefused
    otherwise (module text)."""
    if not p.frame_id:
        raise PoseRefused(f"the pose has no frame_id: give it in the map frame {map_frame!r}")
    if p.frame_id.lstrip("/") != map_frame.lstrip("/"):
        raise PoseRefused(f"frame_id {p.frame_id!r} is not the map frame {map_frame!r}: poses from outside are "
                          "taken in the map frame only")
    position = np.asarray(p.position, np.float64)
    quat = np.asarray(p.orientation, np.float64)
    cov = np.asarray(p.covariance, np.float64)
    for name, value in (("position", position), ("orientation", quat), ("covariance", cov)):
        if not np.all(np.isfinite(value)):
            raise PoseRefused(f"the pose's {name} holds NaN or infinite values: {value.tolist()}")
    if not math.isfinite(p.stamp_s) or p.stamp_s < 0:
        raise PoseRefused(f"the pose's stamp is not a time: {p.stamp_s!r}")
    norm = float(np.linalg.norm(quat))
    if abs(norm - 1.0) > QUATERNION_TOLERANCE:
        raise PoseRefused(f"the orientation is not a unit quaternion (length {norm:.6g}): send a normalised one")
    if cov.size != 36:
        raise PoseRefused(f"the covariance has {cov.size} values, not 36")
    cov = cov.reshape(6, 6)
    scale = max(1.0, float(np.abs(cov).max()))
    if np.abs(cov - cov.T).max() > SYMMETRY_TOLERANCE * scale:
        raise PoseRefused("the covariance is not symmetric")
    smallest = float(np.linalg.eigvalsh(cov).min())
    if not smallest > 0:
        raise PoseRefused(f"the covariance is not positive definite (smallest eigenvalue {smallest:.3g}): give "
                          "every axis a variance > 0")
    T = np.eye(4)
    T[:3, :3] = quaternion_to_matrix(quat / norm)
    T[:3, 3] = position
    return T, cov


def to_model_units(T: np.ndarray, covariance: np.ndarray, scale: float, offset: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A pose and covariance of the published map frame (``OutputTransform``: ``scale`` metres per
    model unit, ``offset`` T_map_seq or None) in the sequence's frame, model units."""
    out = np.array(T, np.float64)
    J = np.eye(6)
    if offset is not None:
        inv = np.linalg.inv(offset)
        out = inv @ out
        J[:3, :3] = J[3:, 3:] = inv[:3, :3]
    out[:3, 3] /= scale
    J[:3, :3] /= scale
    return out, J @ np.asarray(covariance, np.float64) @ J.T


__all__ = ["PoseInput", "PoseRefused", "check_pose_input", "to_model_units", "QUATERNION_TOLERANCE"]
