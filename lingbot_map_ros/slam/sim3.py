"""A similarity transform value (rotation, translation, scale) and the input checks of the
slam package.

``Sim3(R, t, s)`` maps a point ``p`` to ``s·R·p + t``; as a 4×4 matrix ``[[s·R, t], [0, 1]]``.
A keyframe pose is a Sim(3) from the camera (OpenCV optical axes: x right, y down, z forward,
in that keyframe's own model units) to the world (map or odom frame): R is the camera's
orientation, t its centre in world units, s the world units per camera unit (1 while the
world is the stream's own, see ``pose_graph``). With s = 1 it is the usual rigid
camera-to-world transform of ``lingbot_map_ros.geometry``.

Every check raises ``ValueError`` naming what was wrong (``what`` is the caller's name for
the value, e.g. "pose of keyframe 12").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..geometry import matrix_to_quaternion, quaternion_to_matrix

ROTATION_TOL = 1e-6  # max |RᵀR − I| entry and |det R − 1| of an accepted rotation
QUATERNION_TOL = 1e-6  # max | |q| − 1 | of an accepted quaternion


def check_finite(value, what: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """``value`` as a float64 array, refused when non-finite or (given ``shape``) of another shape."""
    arr = np.asarray(value, dtype=np.float64)
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} has non-finite values (NaN or inf): {arr.tolist()}")
    return arr


def check_rotation(rot, what: str) -> np.ndarray:
    """A [3, 3] rotation (orthonormal, det +1 within ``ROTATION_TOL``) as float64."""
    rot = check_finite(rot, what, (3, 3))
    err = float(np.abs(rot.T @ rot - np.eye(3)).max())
    if err > ROTATION_TOL:
        raise ValueError(f"{what} is not orthonormal: max |RᵀR − I| = {err:.3g} > {ROTATION_TOL}")
    det = float(np.linalg.det(rot))
    if abs(det - 1.0) > ROTATION_TOL:
        raise ValueError(f"{what} is not a proper rotation: det = {det:.6g}")
    return rot


def check_quaternion(quat, what: str) -> np.ndarray:
    """A unit quaternion (x, y, z, w) within ``QUATERNION_TOL`` as float64 [4]."""
    quat = check_finite(quat, what, (4,))
    norm = float(np.linalg.norm(quat))
    if abs(norm - 1.0) > QUATERNION_TOL:
        raise ValueError(f"{what} is not a unit quaternion: |q| = {norm:.9g}")
    return quat


def check_covariance(cov, what: str, dim: int) -> np.ndarray:
    """A symmetric positive definite [dim, dim] covariance as float64."""
    cov = check_finite(cov, what, (dim, dim))
    asym = float(np.abs(cov - cov.T).max())
    if asym > 1e-9 * max(1.0, float(np.abs(cov).max())):
        raise ValueError(f"{what} is not symmetric: max |C − Cᵀ| = {asym:.3g}")
    try:
        np.linalg.cholesky(cov)
    except np.linalg.LinAlgError:
        eig = float(np.linalg.eigvalsh(cov).min())
        raise ValueError(f"{what} is not positive definite: smallest eigenvalue {eig:.3g}") from None
    return cov


def check_sigmas(sigmas, what: str, dim: int) -> np.ndarray:
    """A [dim] vector of standard deviations, each finite and > 0."""
    sig = check_finite(sigmas, what, (dim,))
    if (sig <= 0).any():
        raise ValueError(f"{what} must all be > 0, got {sig.tolist()}")
    return sig


@dataclass(frozen=True, eq=False)
class Sim3:
    """``p ↦ scale·rotation·p + translation``.

    Attributes:
        rotation: [3, 3] float64, orthonormal with det +1.
        translation: [3] float64 (units of the target frame).
        scale: > 0, target units per source unit.
    """

    rotation: np.ndarray
    translation: np.ndarray
    scale: float = 1.0

    def __post_init__(self) -> None:
        rot = check_rotation(self.rotation, "Sim3 rotation")
        trans = check_finite(self.translation, "Sim3 translation", (3,))
        scale = float(self.scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"Sim3 scale must be finite and > 0, got {self.scale!r}")
        rot.setflags(write=False)
        trans.setflags(write=False)
        object.__setattr__(self, "rotation", rot)
        object.__setattr__(self, "translation", trans)
        object.__setattr__(self, "scale", scale)

    @classmethod
    def identity(cls) -> "Sim3":
        return cls(np.eye(3), np.zeros(3), 1.0)

    @classmethod
    def from_matrix(cls, matrix, what: str = "Sim3 matrix") -> "Sim3":
        """From a 4×4 ``[[s·R, t], [0, 1]]`` (a rigid pose when s = 1)."""
        m = check_finite(matrix, what, (4, 4))
        if np.abs(m[3] - (0.0, 0.0, 0.0, 1.0)).max() > 1e-9:
            raise ValueError(f"{what}: last row must be (0, 0, 0, 1), got {m[3].tolist()}")
        det = float(np.linalg.det(m[:3, :3]))
        if not det > 0:
            raise ValueError(f"{what}: the 3×3 block has det {det:.6g} (not s·R with s > 0)")
        scale = det ** (1.0 / 3.0)
        return cls(check_rotation(m[:3, :3] / scale, f"{what} (rotation part)"), m[:3, 3], scale)

    @classmethod
    def from_pose(cls, c2w, scale: float = 1.0, what: str = "pose") -> "Sim3":
        """From a rigid 4×4 camera-to-world pose (its 3×3 block must be a rotation) and a scale."""
        m = check_finite(c2w, what, (4, 4))
        if np.abs(m[3] - (0.0, 0.0, 0.0, 1.0)).max() > 1e-9:
            raise ValueError(f"{what}: last row must be (0, 0, 0, 1), got {m[3].tolist()}")
        return cls(check_rotation(m[:3, :3], f"{what} rotation"), m[:3, 3], scale)

    @classmethod
    def from_quaternion(cls, translation, quat_xyzw, scale: float = 1.0, what: str = "pose") -> "Sim3":
        """From a translation [3] and a unit quaternion (x, y, z, w); a non-unit one is refused."""
        quat = check_quaternion(quat_xyzw, f"{what} quaternion")
        return cls(quaternion_to_matrix(quat), translation, scale)

    def matrix(self) -> np.ndarray:
        """[4, 4] float64 ``[[s·R, t], [0, 1]]``."""
        out = np.eye(4)
        out[:3, :3] = self.scale * self.rotation
        out[:3, 3] = self.translation
        return out

    def pose(self) -> np.ndarray:
        """[4, 4] rigid ``[[R, t], [0, 1]]`` (the scale dropped)."""
        out = np.eye(4)
        out[:3, :3] = self.rotation
        out[:3, 3] = self.translation
        return out

    def quaternion(self) -> np.ndarray:
        """The rotation as a unit quaternion (x, y, z, w), w ≥ 0."""
        return matrix_to_quaternion(self.rotation)

    def inverse(self) -> "Sim3":
        rot_t = self.rotation.T
        return Sim3(rot_t, -(rot_t @ self.translation) / self.scale, 1.0 / self.scale)

    def __matmul__(self, other: "Sim3") -> "Sim3":
        """Composition: ``(a @ b)(p) = a(b(p))``."""
        return Sim3(self.rotation @ other.rotation,
                    self.scale * (self.rotation @ other.translation) + self.translation,
                    self.scale * other.scale)

    def apply(self, points) -> np.ndarray:
        """``s·R·p + t`` for points [..., 3]."""
        return self.scale * np.asarray(points, dtype=np.float64) @ self.rotation.T + self.translation

    def __repr__(self) -> str:
        t = ", ".join(f"{v:.4g}" for v in self.translation)
        q = ", ".join(f"{v:.4g}" for v in self.quaternion())
        return f"Sim3(t=({t}), q_xyzw=({q}), s={self.scale:.6g})"


def relative(a: Sim3, b: Sim3) -> Sim3:
    """``a⁻¹ · b``: b expressed in a's frame (for two camera-to-world poses: camera b in camera
    a's axes and units, scale = b's units per a's unit)."""
    return a.inverse() @ b


def rotation_angle(rot) -> float:
    """Angle (radians, in [0, π]) of a [3, 3] rotation."""
    cos = (float(np.trace(rot)) - 1.0) / 2.0
    return math.acos(min(1.0, max(-1.0, cos)))
