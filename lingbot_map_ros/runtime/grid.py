"""The node's occupancy grid (``GridMap``) and each camera's sequence feeding it (``SequenceGrid``);
no ROS, no torch.

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

Several cameras, one grid (``GridMap``): every camera's sequence feeds the node's one grid through
its own ``SequenceGrid`` (its history, corrections and transform), placed in the first camera's
map frame by the camera's map alignment (``place``: ``runtime.multi_map.MapAligner`` on the ROS
side). A camera whose map is not joined to the first one yet keeps its frames in its history and
adds none (its ~/status says why); once it joins, the grid is rebuilt with them. The ground
reference comes from the first camera that can give one (every camera is on the same base). A
new sequence of the FIRST camera (a new map) clears the grid; another camera's new sequence only
empties its history (its cells stay: the map is the same). A camera's placement changing (its
scale, its map offset, its alignment, its loop corrections) rebuilds the grid from every
camera's history. One camera is the set of one.

Threads: every change runs on a camera's output thread (the sequence queues them in order with
the frames) under the grid's lock (cameras' output threads take turns), except the long part of
a rebuild: it runs on the thread that caused it with the lock free, and other cameras' frames
that come meanwhile are added after it (``GridMap.rebuild``); ``snapshot`` and ``state`` may be
read from any thread (the builder's lock, and a state replaced as a whole).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..robot.map_offset import OutputTransform
from ..robot.occupancy import GridConfig, GridFrame, GridSnapshot, GroundReference, OccupancyGridBuilder
from .corrections import NO_CORRECTIONS, Corrections
from .multi_map import transform_points

HISTORY_FRAMES = 200  # frames kept for a rebuild (when the grid turns on, when the transform changes)
HISTORY_POINTS = 4000  # points kept per frame of the history (drawn at random, ``_thinned``)

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


# OutputTransform -> (T_map_mapc [4, 4] or None = identity, "") where the camera's map is joined to the
# grid's map frame, else (None, why not): how a camera's published frames reach the first camera's map
Place = Callable[[OutputTransform], "tuple[np.ndarray | None, str]"]


def _in_own_map(_transform: OutputTransform) -> tuple[None, str]:
    return None, ""


class GridMap:
    """The node's occupancy grid, fed by its cameras' ``SequenceGrid``s (``feed``; see the module
    docstring). ``state`` and ``snapshot`` are the grid's own, for ~/grid, /diagnostics and the files."""

    def __init__(self, config: GridConfig) -> None:
        self.builder = OccupancyGridBuilder(config)
        self.feeds: list[SequenceGrid] = []
        self.lock = threading.RLock()
        self.reference: GroundReference | None = None
        self.frames = self.rebuilds = 0
        self.rebuilding = self.again = False  # a rebuild runs (on some camera's thread) / must run again
        self.late: list[tuple[np.ndarray, np.ndarray]] = []  # frames added while it runs (placed)
        self.state = GridState()

    def feed(self, ground: GroundFromBase, scale_source: str, camera: str = "", place: Place | None = None,
             history: int = HISTORY_FRAMES, history_points: int = HISTORY_POINTS) -> "SequenceGrid":
        """A camera's feed (the first one added is the first camera's: its new sequence clears the grid)."""
        with self.lock:
            fed = SequenceGrid(self, ground, scale_source, camera, place or _in_own_map, history, history_points)
            self.feeds.append(fed)
            return fed

    def snapshot(self) -> GridSnapshot:
        """The grid now (immutable; the same object while nothing changed)."""
        return self.builder.snapshot()

    def rebuild(self) -> None:
        """The cells made again from every joined camera's history, each at its placement now. Called
        WITHOUT the lock: the histories are taken under it, the cells are made outside it (other
        cameras' frames meanwhile wait in ``late`` and are added after the swap); a rebuild asked for
        while one runs makes the running one go again (on its thread)."""
        with self.lock:
            if self.rebuilding:
                self.again = True
                return
            self.rebuilding = True
        try:
            while True:
                with self.lock:
                    self.again, self.late = False, []
                    if self.reference is None:  # a new map since it was asked for
                        self.rebuilding = False
                        return
                    self.builder.set_reference(self.reference, metric=True)
                    frames = [GridFrame(*placed) for fed in self.feeds for placed in fed.placed_history()]
                result = self.builder.rebuild(frames)  # the long part, the lock free
                with self.lock:
                    late = [r for r in (self.builder.add_frame(*f) for f in self.late) if r.applied]
                    if result.applied:
                        self.frames, self.rebuilds = len(frames) - result.frames_skipped + len(late), self.rebuilds + 1
                        self.publish_state()
                    if not self.again:  # done: frames from now on are added as they come
                        self.rebuilding, self.late = False, []
                        return
        except BaseException:
            with self.lock:
                self.rebuilding, self.late = False, []
            raise

    # ------------------------------------------------------------------ under the lock (feeds)
    def clear(self, reason: str) -> None:
        """A new map: no cells, no ground reference (each camera's history stays, see ``SequenceGrid.clear``)."""
        self.reference = None
        self.frames = 0
        self.builder.set_reference(None, metric=False)  # clears the cells
        self.state = GridState(reason=reason, version=self.builder.snapshot().version, rebuilds=self.rebuilds)

    def off(self, reason: str) -> None:
        """No grid yet, and why (a camera's reason while no camera gave the grid a reference)."""
        if self.reference is None and self.state.reason != reason:
            self.state = GridState(reason=reason, version=self.state.version, frames=self.frames,
                                   rebuilds=self.rebuilds)

    def publish_state(self) -> None:
        snap = self.builder.snapshot()
        self.state = GridState(on=snap.ready, reason=snap.reason, width=snap.width, height=snap.height,
                               version=snap.version, frames=self.frames, rebuilds=self.rebuilds)


class SequenceGrid:
    """One camera's sequence feeding the grid (see the module docstring): its frames' history in the
    sequence's map frame and model units, its loop corrections and the placement its frames were
    added with. Made by ``GridMap.feed``; the sequence calls it on the camera's output thread."""

    def __init__(self, grid: GridMap, ground: GroundFromBase, scale_source: str, camera: str, place: Place,
                 history: int, history_points: int) -> None:
        self.grid, self.ground, self.scale_source = grid, ground, scale_source
        self.camera, self.place = camera, place
        self._history: deque[tuple[int, np.ndarray, np.ndarray]] = deque(maxlen=history)
        self._history_points = history_points
        self._transform: OutputTransform | None = None  # the camera's transform at its last metric frame
        self._joined: np.ndarray | None = None  # T_map_mapc the cells were made with (None: identity)
        self._in = False  # whether the grid holds (or a rebuild would take) this camera's history
        self._corrections = NO_CORRECTIONS  # loop closure's, the cells were made with (identity without)
        self._why = ""  # why this camera's frames do not reach the grid now ("" when they do)

    @property
    def state(self) -> GridState:
        """The grid's state, with this camera's reason when its frames do not reach the grid."""
        st = self.grid.state
        return st if not self._why or self._why == st.reason else GridState(
            on=False, reason=self._why, width=st.width, height=st.height, version=st.version,
            frames=st.frames, rebuilds=st.rebuilds)

    # ------------------------------------------------------------------ output thread
    def add(self, frame_index: int, T_seq_cam: np.ndarray, points: np.ndarray, transform: OutputTransform,
            scale_ready: bool, camera_frame: str) -> bool:
        """One frame: its camera pose ``T_seq_cam`` [4, 4] and points [N, 3] in the sequence's map frame and
        model units, the ``transform`` it was published with, whether its scale is ready. Returns whether
        the grid took it (else ``state.reason`` says why)."""
        centre = np.asarray(T_seq_cam, np.float64)[:3, 3].copy()
        kept = _thinned(points, self._history_points, frame_index)
        with self.grid.lock:
            self._history.append((frame_index, centre, kept))
            if self.scale_source == "none" or not scale_ready:
                why = ("the scale is model units (scale_source none: set fixed, odometry or depth)"
                       if self.scale_source == "none" else f"waiting for the metric scale (scale_source "
                       f"{self.scale_source}) to converge")
                return self._off(f"grid off: no metric scale ({why})")
            joined, why = self.place(transform)
            if why:
                return self._off(f"grid: camera {self.camera}'s frames wait to join the map ({why})")
            grid = self.grid
            if grid.reference is None:
                T_map_cam = transform.pose(self._corrections.pose(frame_index, T_seq_cam))
                reference, why = self.ground.reference(T_map_cam if joined is None else joined @ T_map_cam,
                                                       camera_frame)
                if reference is None:
                    return self._off(why)
                grid.reference = reference
            self._why = ""
            moved = not self._in or transform != self._transform or not _same(joined, self._joined)
            self._transform, self._joined, self._in = transform, joined, True
            if not moved and (grid.state.on or grid.rebuilding):
                placed = self._placed(frame_index, centre, points)
                if grid.rebuilding:  # added once the running rebuild has swapped its cells in
                    grid.late.append(placed)
                    return True
                result = grid.builder.add_frame(*placed)
                if not result.applied:
                    return self._off(f"grid: frame {frame_index + 1} not added: {result.reason}")
                grid.frames += 1
                grid.publish_state()
                return True
        grid.rebuild()  # every camera's history (this frame included) at its placement now
        return True

    def forget_from(self, frame_index: int) -> None:
        """A rollback: frames from 0-based ``frame_index`` on leave the history; their cells stay."""
        with self.grid.lock:
            while self._history and self._history[-1][0] >= frame_index:
                self._history.pop()

    def correct(self, corrections: Corrections) -> None:
        """Loop closure's corrections changed: the cells are made again from the histories with them."""
        with self.grid.lock:
            if corrections.version == self._corrections.version:
                return
            self._corrections = corrections
            if not self._in or self.grid.reference is None:
                return
        self.grid.rebuild()

    def clear(self) -> None:
        """A new sequence: no history, no corrections; the first camera's is a new map (no cells, no
        ground reference); another camera's cells stay where they are."""
        with self.grid.lock:
            self._history.clear()
            self._transform = self._joined = None
            self._in, self._why = False, ""
            self._corrections = NO_CORRECTIONS
            if self.grid.feeds and self.grid.feeds[0] is self:
                self.grid.clear("grid off: a new sequence started (no frame yet)")

    def placed_history(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Under the grid's lock: this camera's history as the grid takes it (camera centres and points
        in the grid's map frame, metres), at its placement now; none while it is not joined."""
        if not self._in or self._transform is None:
            return []
        joined, why = self.place(self._transform)  # the first camera's scale may have moved it since
        if why:
            self._in = False
            return []
        self._joined = joined
        return [self._placed(i, c, p) for i, c, p in self._history]

    def _placed(self, frame_index: int, centre: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A frame's camera centre and points as published: its keyframe's correction, its transform, then
        its camera's placement in the grid's map."""
        if not self._corrections.identity:
            c = self._corrections.at(frame_index)
            centre, points = c.apply(centre), c.apply(points).astype(np.float32)
        centre, points = self._transform.pose(_pose_at(centre))[:3, 3], self._transform.points(points)
        return transform_points(self._joined, centre[None])[0], transform_points(self._joined, points)

    def _off(self, reason: str) -> bool:
        self._why = reason
        self.grid.off(reason)
        return False

    # ------------------------------------------------------------------ any thread
    def history(self) -> list[int]:
        """The 0-based indices of the frames a rebuild would use."""
        return [index for index, _, _ in list(self._history)]

    def snapshot(self) -> GridSnapshot:
        """The grid now (immutable; the same object while nothing changed)."""
        return self.grid.snapshot()


def _thinned(points: np.ndarray, most: int, seed: int) -> np.ndarray:
    """At most ``most`` of ``points`` [N, 3] (float32, in their order), drawn at random (seeded: the same
    frame keeps the same points): every k-th point would alias with the image's rows and leave whole
    columns of cells without a point, and rays grazing them would clear walls in a rebuild."""
    points = np.asarray(points)
    if len(points) <= most:
        return np.array(points, np.float32)
    keep = np.sort(np.random.default_rng(seed).choice(len(points), most, replace=False))
    return points[keep].astype(np.float32)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and bool(np.array_equal(a, b)))


def _pose_at(centre: np.ndarray) -> np.ndarray:
    """A [4, 4] pose with translation ``centre`` (the transform of a centre is that of its pose's translation)."""
    T = np.eye(4)
    T[:3, 3] = centre
    return T


__all__ = ["GridMap", "SequenceGrid", "Place", "GroundFromBase", "GridState", "grid_config", "GRID_PARAMETER_NAMES", "HISTORY_FRAMES",
           "HISTORY_POINTS", "Extrinsic"]
