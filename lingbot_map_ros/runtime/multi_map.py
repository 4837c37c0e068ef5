"""One map for several cameras: each camera's map frame aligned to the first camera's.

Every camera of ``cameras`` streams its own sequence, so each has its own world: the
REP-103 frame at ITS first camera pose (``map_c``; see ``tf_tools``). The first camera
listed is the reference: its world is the node's ``map_frame``. Another camera ``c``
joins ``map_frame`` through the camera extrinsics of the robot (TF ``base_frame ->``
each camera's optical frame, the URDF's static transforms) and one pair of poses taken
at (nearly) the same time, one of the reference camera and one of ``c``:

    T_map_mapc = S(T_map_ref, s_ref) · inv(T_base_ref) · D · T_base_c · inv(S(T_mapc_c, s_c))

- ``T_map_ref``: the reference camera's pose in ``map`` at time ``t_ref``, ``T_mapc_c``:
  camera c's pose in its own map at ``t_c`` (both in model units, optical frames);
- ``T_base_ref``, ``T_base_c``: the extrinsics (metres);
- ``D = T_base(t_ref)_base(t_c) = inv(T_odom_base(t_ref)) · T_odom_base(t_c)``: how the base
  moved between the two stamps, from the odometry in TF when it is there, else the
  identity (the base is assumed not to have moved in between);
- ``S(T, s)``: translation times the camera's metric scale ``s`` (metres per model unit,
  1 with ``scale_source none``: then metres of the extrinsics are mixed with model units,
  and the node warns); more generally the pose as the camera's engine publishes it
  (``OutputTransform``: the scale, then the map offset a lost reset may give a sequence).

The pair: at the later of the two sequence starts ``t*`` (the first poses after a start
or reset of either camera), each camera's pose nearest in time to ``t*``. So the rule is
"the base did not move between the two poses' stamps" (at most ``max_gap_s`` apart unless
the odometry gives ``D``). A reset of camera c re-aligns c; a reset of the reference
camera starts a new ``map`` and re-aligns every camera.

Until a camera is aligned (the reference has no pose yet, an extrinsic is not in TF)
its outputs are published in its own frame ``<map_frame>_<c>`` and a throttled warning
says why; with ``base_frame`` empty every camera, the reference included, keeps its own
``<map_frame>_<c>`` (one warning at start). One camera is the set of one: the node's single
camera (named "") is the reference, and its map is ``map_frame`` whatever ``base_frame`` says.
Pure numpy + threading, no ROS.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..robot.scale import apply_scale
from ..robot.map_offset import invert_rigid
from .worker import Throttle

MAX_GAP_S = 0.5  # longest time between the pair's two poses when no odometry says how the base moved
HISTORY = 256  # poses kept per camera to pick the pair from
WARN_PERIOD_S = 5.0


# ------------------------------------------------------------------ maths
def map_alignment(T_map_ref: np.ndarray, T_base_ref: np.ndarray, T_base_cam: np.ndarray, T_mapc_cam: np.ndarray,
                  base_motion: np.ndarray | None = None, ref_scale: float = 1.0,
                  cam_scale: float = 1.0) -> np.ndarray:
    """``T_map_mapc`` [4, 4] (see the module docstring): the transform taking points of camera c's
    own map frame (c's scaled units) into the reference camera's map frame (the reference's
    scaled units).

    Args:
        T_map_ref: [4, 4] reference camera optical frame -> map, model units, at ``t_ref``.
        T_base_ref: [4, 4] reference camera optical frame -> base (extrinsic, metres).
        T_base_cam: [4, 4] camera c optical frame -> base (extrinsic, metres).
        T_mapc_cam: [4, 4] camera c optical frame -> c's own map, model units, at ``t_c``.
        base_motion: [4, 4] ``T_base(t_ref)_base(t_c)`` (``base_motion_from_odometry``); None = identity.
        ref_scale, cam_scale: metres per model unit of each camera (1 = model units).
    """
    D = np.eye(4) if base_motion is None else np.asarray(base_motion, np.float64)
    T_map_cam = apply_scale(T_map_ref, ref_scale) @ invert_rigid(T_base_ref) @ D @ np.asarray(T_base_cam, np.float64)
    return T_map_cam @ invert_rigid(apply_scale(T_mapc_cam, cam_scale))


def base_motion_from_odometry(T_odom_base_ref: np.ndarray, T_odom_base_cam: np.ndarray) -> np.ndarray:
    """``T_base(t_ref)_base(t_c) = inv(T_odom_base(t_ref)) · T_odom_base(t_c)`` [4, 4]."""
    return invert_rigid(T_odom_base_ref) @ np.asarray(T_odom_base_cam, np.float64)


def published(T_model: np.ndarray, output: Any) -> np.ndarray:
    """A model-unit pose [4, 4] as its engine publishes it: ``output`` is a scale (metres per model
    unit) or an ``OutputTransform`` (``robot.map_offset``: scale, then the map offset)."""
    if isinstance(output, (int, float)):
        return np.asarray(T_model, np.float64) if output == 1.0 else apply_scale(T_model, output)
    return output.pose(T_model)


def unpublished(T_published: np.ndarray, output: Any) -> np.ndarray:
    """The inverse of ``published``: the model-unit pose [4, 4] behind a published one."""
    if isinstance(output, (int, float)):
        scale, offset = float(output), None
    else:
        scale, offset = output.scale, output.offset
    T = np.asarray(T_published, np.float64) if offset is None else invert_rigid(offset) @ T_published
    return T if scale in (0.0, 1.0) else apply_scale(T, 1.0 / scale)


def own_map_frame(map_frame: str, camera: str) -> str:
    """The frame of a camera that is not aligned: ``<map_frame>_<camera>`` (the single camera's,
    named "", is ``map_frame``)."""
    return f"{map_frame}_{camera}" if camera else map_frame


def transform_points(T: np.ndarray | None, points: np.ndarray) -> np.ndarray:
    """Points [N, 3] through ``T`` [4, 4] (None = unchanged); float32 stays float32."""
    if T is None:
        return points
    pts = np.asarray(points)
    R, t = T[:3, :3].astype(pts.dtype), T[:3, 3].astype(pts.dtype)
    return pts @ R.T + t


def transform_poses(T: np.ndarray | None, poses: np.ndarray) -> np.ndarray:
    """Poses [..., 4, 4] left-multiplied by ``T`` (None = unchanged)."""
    return poses if T is None else np.asarray(T, np.float64) @ poses


# ------------------------------------------------------------------ state
@dataclass(frozen=True)
class Placement:
    """Where a camera's outputs go now: ``frame`` (header frame_id) and ``transform`` (T_frame_mapc
    [4, 4] applied to its scaled poses and points; None = none, the camera's own map is ``frame``).
    ``version`` changes whenever either may have changed (caches of messages compare it)."""

    frame: str
    transform: np.ndarray | None
    version: int


@dataclass
class _Pair:
    """The poses an alignment was computed from (model units; scales are applied on use)."""

    T_map_ref: np.ndarray
    T_base_ref: np.ndarray
    T_base_cam: np.ndarray
    T_mapc_cam: np.ndarray
    motion: np.ndarray | None
    gap_s: float


@dataclass
class _Sequence:
    """One camera's current sequence: its start stamp and recent poses (stamp s, T model units, optical frame)."""

    first_stamp: float
    last_index: int
    history: deque


class MapAligner:
    """Decides each camera's map frame and ``T_map_mapc`` (see the module docstring).

    ``observe`` runs on the inference thread for every published pose (it also notes how the
    camera publishes then: its ``OutputTransform``); ``placement`` and ``describe`` may be called
    from any thread.

    Args:
        cameras: names in order; the first is the reference.
        map_frame, base_frame: the node's parameters (``base_frame`` empty = no alignment).
        extrinsic: optical frame id -> ``T_base_cam`` [4, 4] from TF, or None while unknown.
        base_motion: (t_ref, t_c) seconds -> ``T_base(t_ref)_base(t_c)`` from the odometry in TF, or
            None when it is not there (then the pair's poses must be at most ``max_gap_s`` apart).
        scale_frames: num_scale_frames (a frame index at most this after a lower one = a new sequence).
        warn, info: log callables.
    """

    def __init__(self, cameras: tuple[str, ...] | list[str], map_frame: str, base_frame: str,
                 extrinsic: Callable[[str], np.ndarray | None],
                 base_motion: Callable[[float, float], np.ndarray | None] | None = None, scale_frames: int = 1,
                 warn: Callable[[str], Any] = lambda _m: None, info: Callable[[str], Any] = lambda _m: None,
                 max_gap_s: float = MAX_GAP_S, history: int = HISTORY, clock: Callable[[], float] | None = None
                 ) -> None:
        if not cameras:
            raise ValueError("MapAligner needs at least one camera")
        self.cameras = tuple(cameras)
        self.reference = self.cameras[0]
        self.map_frame, self.base_frame = map_frame, base_frame
        self._extrinsic, self._base_motion = extrinsic, base_motion
        self.scale_frames = max(1, int(scale_frames))
        self._warn, self._info = warn, info
        self.max_gap_s, self._history = max_gap_s, history
        self._throttle = Throttle(WARN_PERIOD_S, clock) if clock is not None else Throttle(WARN_PERIOD_S)
        self._lock = threading.Lock()
        self._seq: dict[str, _Sequence] = {}
        self._pair: dict[str, _Pair] = {}
        self._why: dict[str, str] = {c: "no pose yet" for c in self.cameras}
        self._frames: dict[str, str] = {}  # optical frame each camera reported last
        self._outputs: dict[str, Any] = {}  # how each camera published its last pose (scale, map offset)
        self._version = 0

    @property
    def enabled(self) -> bool:
        """Whether cameras can join one map (``base_frame`` is set)."""
        return bool(self.base_frame)

    # -------------------------------------------------------------- inference thread
    def observe(self, camera: str, index: int, stamp_s: float, camera_frame: str, T_model: np.ndarray,
                output: Any = 1.0) -> None:
        """Note a published pose of ``camera`` (1-based frame ``index``, ``T_model`` [4, 4] optical frame ->
        its own map, model units; ``output``: how the camera published it, see ``placement``) and align
        whatever can be aligned now."""
        with self._lock:
            self._outputs[camera] = output
            self._check_frame(camera, camera_frame)
            seq = self._seq.get(camera)
            if seq is None or index <= min(seq.last_index, self.scale_frames):
                self._start_sequence(camera, stamp_s)
                seq = self._seq[camera]
            seq.last_index = index
            seq.history.append((float(stamp_s), np.array(T_model, dtype=np.float64), camera_frame))
            if self.enabled:
                for other in self.cameras[1:]:
                    if other not in self._pair:
                        self._try_align(other)

    def _check_frame(self, camera: str, camera_frame: str) -> None:
        """Under the lock: warn (throttled) when another camera reports the same optical frame (their
        extrinsics, TF children and alignment would be one camera's)."""
        self._frames[camera] = camera_frame
        same = sorted(c for c, f in self._frames.items() if f == camera_frame and c != camera)
        if same:
            self._throttle.emit(self._warn, f"cameras {camera} and {', '.join(same)} report the same optical frame "
                                f"{camera_frame!r}: set camera.<name>.camera_frame for each (their extrinsics and TF "
                                "frames must differ)", kind=f"same frame {camera_frame}")

    def _start_sequence(self, camera: str, stamp_s: float) -> None:
        self._seq[camera] = _Sequence(float(stamp_s), 0, deque(maxlen=self._history))
        dropped = [c for c in (self.cameras[1:] if camera == self.reference else (camera,)) if c in self._pair]
        for c in dropped:
            del self._pair[c]
            self._why[c] = (f"camera {camera} started a new sequence: re-aligning" if camera == self.reference
                            else "new sequence: re-aligning")
        self._version += 1

    def _try_align(self, camera: str) -> None:
        """Under the lock: align ``camera`` to the reference's map if the pair and the extrinsics allow."""
        ref_seq, seq = self._seq.get(self.reference), self._seq.get(camera)
        if ref_seq is None or seq is None:
            self._why[camera] = f"waiting for the first pose of camera {self.reference}" if seq is not None \
                else "no pose yet"
            return
        t_star = max(ref_seq.first_stamp, seq.first_stamp)
        t_ref, T_ref, frame_ref = _nearest(ref_seq.history, t_star)
        t_cam, T_cam, frame_cam = _nearest(seq.history, t_star)
        motion = self._base_motion(t_ref, t_cam) if self._base_motion is not None else None
        gap = abs(t_ref - t_cam)
        if motion is None and gap > self.max_gap_s:
            self._why[camera] = (f"waiting for poses of {self.reference} and {camera} within {self.max_gap_s} s of "
                                 f"each other (nearest {gap:.2f} s apart, no odometry in TF)")
            return
        E_ref, E_cam = self._extrinsic(frame_ref), self._extrinsic(frame_cam)
        missing = [f for f, E in ((frame_ref, E_ref), (frame_cam, E_cam)) if E is None]
        if missing:
            self._why[camera] = (f"waiting for TF {self.base_frame} -> {' and '.join(missing)} (the camera "
                                 "extrinsics, normally static transforms of the URDF)")
            self._throttle.emit(self._warn, f"camera {camera}: outputs stay in "
                                f"{own_map_frame(self.map_frame, camera)}: {self._why[camera]}",
                                kind=f"align {camera}")
            return
        self._pair[camera] = _Pair(T_ref, E_ref, E_cam, T_cam, motion, gap)
        self._why[camera] = (f"aligned to {self.map_frame} (camera {self.reference}) through TF {self.base_frame} -> "
                             f"{frame_ref} and -> {frame_cam}, poses {gap:.3f} s apart"
                             + (", base motion from odometry" if motion is not None else ""))
        self._version += 1
        self._info(f"camera {camera}: {self._why[camera]}")

    # -------------------------------------------------------------- any thread
    def placement(self, camera: str, ref_output: Any = None, cam_output: Any = None) -> Placement:
        """The frame and transform of ``camera``'s outputs now. ``ref_output`` / ``cam_output``: how the
        reference camera's and ``camera``'s engines publish their model-unit poses, a scale (metres
        per model unit) or an ``OutputTransform`` (scale and map offset, ``robot.map_offset``); None:
        as each published its last pose (``observe``)."""
        with self._lock:
            version = self._version
            ref_output = self._outputs.get(self.reference, 1.0) if ref_output is None else ref_output
            cam_output = self._outputs.get(camera, 1.0) if cam_output is None else cam_output
            if camera == "":  # the single camera: its map is map_frame
                return Placement(self.map_frame, None, version)
            if not self.enabled:
                return Placement(own_map_frame(self.map_frame, camera), None, version)
            if camera == self.reference:
                return Placement(self.map_frame, None, version)
            pair = self._pair.get(camera)
            if pair is None:
                return Placement(own_map_frame(self.map_frame, camera), None, version)
        T = map_alignment(published(pair.T_map_ref, ref_output), pair.T_base_ref, pair.T_base_cam,
                          published(pair.T_mapc_cam, cam_output), pair.motion)
        return Placement(self.map_frame, T, version)

    def describe(self, camera: str) -> str:
        """One line: where ``camera``'s outputs go and why."""
        with self._lock:
            if camera == "":
                return f"{self.map_frame} (the node's one camera)"
            if not self.enabled:
                return f"own map frame {own_map_frame(self.map_frame, camera)}: base_frame is empty (no extrinsics)"
            if camera == self.reference:
                return f"{self.map_frame} (the reference camera)"
            if camera in self._pair:
                return self._why[camera]
            return f"own map frame {own_map_frame(self.map_frame, camera)}: {self._why[camera]}"

    def aligned(self, camera: str) -> bool:
        with self._lock:
            return camera == "" or (self.enabled and (camera == self.reference or camera in self._pair))


def _nearest(history: deque, t: float) -> tuple[float, np.ndarray, str]:
    return min(history, key=lambda item: abs(item[0] - t))


__all__ = ["map_alignment", "base_motion_from_odometry", "own_map_frame", "published", "unpublished", "transform_points", "transform_poses",
           "Placement", "MapAligner", "MAX_GAP_S"]
