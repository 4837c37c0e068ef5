"""A camera's occupancy grid as part of its sequence: ``SequenceGrid`` (no ROS, no torch).

The grid (``robot.occupancy.OccupancyGridBuilder``) lies on the floor of the PUBLISHED map frame
in metres; the sequence keeps its frames in its own map frame and in model units. Each frame's
points (the map's: confident, every ``point_stride``-th) and camera centre therefore go through
the frame's ``OutputTransform`` (metric scale, map offset) before they reach the grid, and only
once that transform is metric (``scale_source`` not ``none`` and the scale converged, or
``fixed``).

Ground reference (``GroundFromBase``): the floor under the robot's base at the first metric
frame, ``T_map_base = T_map_cam · T_cam_base`` with the camera extrinsic ``T_cam_base`` read from
TF (``extrinsic``, the ROS side's look-up; the URDF's static transforms) and ``base_height`` the
base frame's height above the floor (REP 103: the base's z is up). The grid keeps the map's
heading (``GroundReference.aligned_with_map``), as Nav2's static layer wants. Without
``base_frame``, without the extrinsic in TF or without a metric scale the grid is off and
``state.reason`` says why (~/status, /diagnostics).

Frames that came before the grid could be on (the scale not converged yet, the extrinsic not
yet in TF) are not lost: the last ``HISTORY_FRAMES`` frames are kept (model units, thinned to
``HISTORY_POINTS`` points each) and the grid is rebuilt from them when it turns on, and again
when the frames' transform changes (a scale refit, a map offset). A rebuild covers only those
frames: after a long run a scale change forgets the cells older than the history.

What the sequence's own changes do to the grid:

- a new sequence (``clear``: ~/reset, a time jump, an error, a lost reset) forgets the cells,
  the history and the ground reference: the next metric frame starts a new grid;
- a rollback (``forget_from``, a keyframe dropped over ~/rollback_last_frame) removes the frames
  from the history but keeps their cells: the frame was tracked, its pose finite, and what it saw
  (free space, obstacles) stays true; the session forgets its tokens, not the observation;
- loop closure's corrections (``correct``: a closed loop, a relocalisation, a pose from outside)
  move each frame by its keyframe's correction before its transform, as the published map does:
  the grid is rebuilt from the history when they change (cells older than it are forgotten).

Threads: every change runs on the camera's output thread (the sequence queues them in order
with the frames); ``snapshot`` and ``state`` may be read from any thread (the builder's lock,
and a state replaced as a whole).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..robot.map_offset import OutputTransform
from ..robot.occupancy import GridConfig, GridFrame, GridSnapshot, GroundReference, OccupancyGridBuilder
from .corrections import NO_CORRECTIONS, Corrections

HISTORY_FRAMES = 200  # frames kept for a rebuild (when the grid turns on, when the transform changes)
HISTORY_POINTS = 4000  # points kept per frame of the history (every k-th)

# GridConfig field -> the node parameter that sets it (error messages name the parameter)
GRID_PARAMETER_NAMES = {"resolution": "grid_resolution", "min_height": "grid_min_height",
                        "max_height": "grid_max_height", "max_range_m": "grid_max_range",
                        "max_extent_m": "grid_max_extent"}

# camera optical frame -> T_cam_base [4, 4] (metres; the TF camera -> base_frame), None while TF lacks it
Extrinsic = Callable[[str], "np.ndarray | None"]


def grid_config(settings: Any) -> GridConfig:
    """The ``GridConfig`` of the node's grid_* parameters (ValueError naming the GridConfig field)."""
    s = settings
    return GridConfig(resolution=s.grid_resolution, min_height=s.grid_min_height, max_height=s.grid_max_height,
                      max_range_m=s.grid_max_range, max_extent_m=s.grid_max_extent)


@dataclass(frozen=True)
class GridState:
    """What ~/status and /diagnostics say about the grid (replaced as a whole)."""

    on: bool = False
    reason: str = "grid off: no frame yet"  # "" when on
    width: int = 0
    height: int = 0
    version: int = 0
    frames: int = 0  # frames added since the grid last started
    rebuilds: int = 0


class GroundFromBase:
    """The ground reference from the robot's base frame (see the module docstring).

    ``base_frame`` "" = no robot: no ground reference. ``extrinsic``: the TF look-up, never waiting
    (None: no look-up available)."""

    def __init__(self, base_frame: str, base_height: float, extrinsic: Extrinsic | None) -> None:
        self.base_frame, self.base_height, self.extrinsic = base_frame, float(base_height), extrinsic

    def reference(self, T_map_cam: np.ndarray, camera_frame: str) -> tuple[GroundReference | None, str]:
        """(the ground under the base when the camera's published pose [4, 4] (metres) is ``T_map_cam``,
        or None and why not)."""
        if not self.base_frame:
            return None, ("grid off: no ground reference (base_frame is empty: set it to the robot's base "
                          "frame, REP 103 z up, with the camera's transform in TF)")
        if self.base_frame == camera_frame:
            return None, (f"grid off: no ground reference (base_frame {self.base_frame} is the camera's optical "
                          "frame, whose z is the viewing direction: name the robot's base frame)")
        T_cam_base = None
        if self.extrinsic is not None:
            try:
                T_cam_base = self.extrinsic(camera_frame)
            except Exception:  # a look-up must never cost the frame
                T_cam_base = None
        if T_cam_base is None:
            return None, (f"grid off: no ground reference yet (no TF {camera_frame} -> {self.base_frame}, the "
                          "camera extrinsic)")
        T_map_base = np.asarray(T_map_cam, np.float64) @ np.asarray(T_cam_base, np.float64)
        try:
            return GroundReference.aligned_with_map(T_map_base, self.base_height), ""
        except ValueError as exc:  # a non-rigid or non-finite transform
            return None, f"grid off: the base pose gives no ground plane ({exc})"


class SequenceGrid:
    """A sequence's occupancy grid (see the module docstring). ``scale_source``: the node's, for the
    reason given while the scale is not metric."""

    def __init__(self, config: GridConfig, ground: GroundFromBase, scale_source: str,
                 history: int = HISTORY_FRAMES, history_points: int = HISTORY_POINTS) -> None:
        self.builder = OccupancyGridBuilder(config)
        self.ground, self.scale_source = ground, scale_source
        self._history: deque[tuple[int, np.ndarray, np.ndarray]] = deque(maxlen=history)
        self._history_points = history_points
        self._reference: GroundReference | None = None
        self._transform: OutputTransform | None = None  # the transform the cells were made with
        self._corrections = NO_CORRECTIONS  # loop closure's, the cells were made with (identity without)
        self._frames = self._rebuilds = 0
        self.state = GridState()

    # ------------------------------------------------------------------ output thread
    def add(self, frame_index: int, T_seq_cam: np.ndarray, points: np.ndarray, transform: OutputTransform,
            scale_ready: bool, camera_frame: str) -> bool:
        """One frame: its camera pose ``T_seq_cam`` [4, 4] and points [N, 3] in the sequence's map frame and
        model units, the ``transform`` it was published with, whether its scale is ready. Returns whether
        the grid took it (else ``state.reason`` says why)."""
        centre = np.asarray(T_seq_cam, np.float64)[:3, 3].copy()
        step = max(1, math.ceil(len(points) / self._history_points))
        self._history.append((frame_index, centre, np.array(points[::step], np.float32)))
        if self.scale_source == "none" or not scale_ready:
            why = ("the scale is model units (scale_source none: set fixed, odometry or depth)"
                   if self.scale_source == "none" else f"waiting for the metric scale (scale_source "
                   f"{self.scale_source}) to converge")
            return self._off(f"grid off: no metric scale ({why})")
        if self._reference is None:
            reference, why = self.ground.reference(transform.pose(self._corrections.pose(frame_index, T_seq_cam)),
                                                   camera_frame)
            if reference is None:
                return self._off(why)
            self._reference = reference
        if self._transform is None or transform != self._transform:
            self._rebuild(transform)  # the history (this frame included) in the new transform
            return True
        result = self.builder.add_frame(*self._placed(frame_index, centre, points, transform))
        if not result.applied:
            return self._off(f"grid: frame {frame_index + 1} not added: {result.reason}")
        self._frames += 1
        self._publish_state()
        return True

    def forget_from(self, frame_index: int) -> None:
        """A rollback: frames from 0-based ``frame_index`` on leave the history; their cells stay."""
        while self._history and self._history[-1][0] >= frame_index:
            self._history.pop()

    def correct(self, corrections: Corrections) -> None:
        """Loop closure's corrections changed: the cells are made again from the history with them."""
        if corrections.version == self._corrections.version:
            return
        self._corrections = corrections
        if self._transform is not None and self._reference is not None:
            self._rebuild(self._transform)

    def clear(self) -> None:
        """A new sequence: no cells, no history, no ground reference, no corrections."""
        self._history.clear()
        self._reference = self._transform = None
        self._corrections = NO_CORRECTIONS
        self._frames = 0
        self.builder.set_reference(None, metric=False)  # clears the cells
        self.state = GridState(reason="grid off: a new sequence started (no frame yet)",
                               version=self.builder.snapshot().version, rebuilds=self._rebuilds)

    def _rebuild(self, transform: OutputTransform) -> None:
        self.builder.set_reference(self._reference, metric=True)
        frames = [GridFrame(*self._placed(i, c, p, transform)) for i, c, p in self._history]
        result = self.builder.rebuild(frames)
        self._transform = transform
        self._frames, self._rebuilds = len(frames) - result.frames_skipped, self._rebuilds + 1
        self._publish_state()

    def _placed(self, frame_index: int, centre: np.ndarray, points: np.ndarray,
                transform: OutputTransform) -> tuple[np.ndarray, np.ndarray]:
        """A frame's camera centre and points as published: its keyframe's correction, then ``transform``."""
        if not self._corrections.identity:
            c = self._corrections.at(frame_index)
            centre, points = c.apply(centre), c.apply(points).astype(np.float32)
        return transform.pose(_pose_at(centre))[:3, 3], transform.points(points)

    def _off(self, reason: str) -> bool:
        if self.state.reason != reason:
            self.state = GridState(reason=reason, version=self.state.version, frames=self._frames,
                                   rebuilds=self._rebuilds)
        return False

    def _publish_state(self) -> None:
        snap = self.builder.snapshot()
        self.state = GridState(on=snap.ready, reason=snap.reason, width=snap.width, height=snap.height,
                               version=snap.version, frames=self._frames, rebuilds=self._rebuilds)

    # ------------------------------------------------------------------ any thread
    def history(self) -> list[int]:
        """The 0-based indices of the frames a rebuild would use."""
        return [index for index, _, _ in list(self._history)]

    def snapshot(self) -> GridSnapshot:
        """The grid now (immutable; the same object while nothing changed)."""
        return self.builder.snapshot()


def _pose_at(centre: np.ndarray) -> np.ndarray:
    """A [4, 4] pose with translation ``centre`` (the transform of a centre is that of its pose's translation)."""
    T = np.eye(4)
    T[:3, 3] = centre
    return T


__all__ = ["SequenceGrid", "GroundFromBase", "GridState", "grid_config", "GRID_PARAMETER_NAMES", "HISTORY_FRAMES",
           "HISTORY_POINTS", "Extrinsic"]
