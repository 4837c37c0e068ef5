"""Where loop closure puts the sequence's poses: ``Corrections``, one Sim(3) per keyframe.

The stream gives each frame a pose ``T_S_cam`` in the sequence's own map frame ``S`` (the front
end: continuous, drifting). The pose graph gives each keyframe ``k`` an optimised pose ``X_k``; its
correction is ``C_k = X_k · inv(T_S_k)`` (map <- S, a Sim(3) while the scale is the model's). A
frame is corrected by the correction of the latest keyframe at or before it:
``T_map_cam = C_k ∘ T_S_cam`` (rotation ``R_C·R``, centre ``C_k`` applied to the camera centre; the
camera pose stays rigid). Frames after the newest keyframe take the newest correction.

``Corrections`` is a value: a new optimisation replaces it as a whole (one assignment), and every
pose, the path and the map are derived from it when they are published. numpy only.
"""
from __future__ import annotations

import bisect
import itertools

import numpy as np

from ..slam import Sim3

IDENTITY = Sim3.identity()
_VERSIONS = itertools.count(1)  # every set of corrections made gets its own number (any thread: atomic)


class Corrections:
    """Per-keyframe corrections (map <- sequence), sorted by frame index; empty = identity."""

    __slots__ = ("indices", "_sims", "version")

    def __init__(self, by_index: dict[int, Sim3] | None = None) -> None:
        items = sorted((by_index or {}).items())
        self.indices = [int(i) for i, _ in items]
        self._sims = [s for _, s in items]
        # unique to this set (caches compare it): the loop thread's and the inference thread's
        # (a relocalisation's entry) never give two different sets the same number
        self.version = next(_VERSIONS)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def identity(self) -> bool:
        return not self.indices

    @property
    def newest(self) -> Sim3:
        return self._sims[-1] if self._sims else IDENTITY

    def at(self, frame_index: int) -> Sim3:
        """The correction of the latest keyframe at or before ``frame_index`` (the first keyframe's
        for a frame before it; identity when there is none)."""
        if not self._sims:
            return IDENTITY
        k = bisect.bisect_right(self.indices, frame_index) - 1
        return self._sims[max(k, 0)]

    def pose(self, frame_index: int, T: np.ndarray) -> np.ndarray:
        """``T_S_cam`` [4, 4] of frame ``frame_index`` in the map frame (a rigid [4, 4])."""
        if not self._sims:
            return T
        return correct_pose(self.at(frame_index), T)

    def items(self) -> list[tuple[int, Sim3]]:
        return list(zip(self.indices, self._sims))

    def with_entry(self, frame_index: int, correction: Sim3) -> "Corrections":
        """These corrections and ``correction`` from ``frame_index`` on (until a later entry)."""
        return Corrections({**dict(self.items()), int(frame_index): correction})



NO_CORRECTIONS = Corrections()  # the identity, shared (one version: caches keep what they made)

def correct_pose(correction: Sim3, T: np.ndarray) -> np.ndarray:
    """A rigid camera pose [4, 4] moved by a Sim(3): rotation ``R_C·R``, centre ``C(t)``."""
    out = np.array(T, dtype=np.float64, copy=True)
    out[:3, :3] = correction.rotation @ out[:3, :3]
    out[:3, 3] = correction.apply(out[:3, 3])
    return out


def rigid(T: np.ndarray) -> np.ndarray:
    """A pose [4, 4] with its rotation made exactly orthonormal (the model's float32/bf16 rotations
    are orthonormal to ~1e-6 only; the pose graph checks to 1e-6): the nearest rotation (SVD)."""
    out = np.array(T, np.float64)
    u, _, vt = np.linalg.svd(out[:3, :3])
    R = u @ vt
    if np.linalg.det(R) < 0:
        u[:, -1] *= -1
        R = u @ vt
    out[:3, :3] = R
    out[3] = (0.0, 0.0, 0.0, 1.0)
    return out


__all__ = ["Corrections", "NO_CORRECTIONS", "correct_pose", "rigid", "IDENTITY"]
