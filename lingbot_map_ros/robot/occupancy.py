"""A 2-D occupancy grid (``nav_msgs/OccupancyGrid`` semantics) from the node's per-frame points.

numpy only: no ROS, no torch. The node feeds it on its output thread and publishes
``snapshot()`` from a timer; ``lingbot_map_ros.io.map_server`` writes a snapshot as files
that Nav2's map_server loads.

Frames and units
    Inputs are in the REP 103 ``map`` frame, in **metres**. The grid lies in a *ground
    frame* given by the caller (``GroundReference``: the transform map → ground, z up,
    z = 0 on the floor). For Nav2 build it with ``GroundReference.aligned_with_map`` from
    the base's pose at one instant (TF ``map -> base_link``, metric): the floor under the
    base with the map's heading, so that the grid's axes are the map's (Nav2's static
    layer ignores the origin's orientation). Cell
    ``(i, j)`` of the grid covers ``[x0 + i·r, x0 + (i+1)·r) × [y0 + j·r, y0 + (j+1)·r)``
    of the ground plane, ``(x0, y0)`` the lower-left corner of cell (0, 0) and ``r`` the
    resolution. ``data[i + j·width]``: row-major, row 0 at the origin, x right and y up in
    the ground frame (the OccupancyGrid convention). ``GridSnapshot.origin_position`` /
    ``origin_orientation`` give that corner as a pose in the map frame (yaw 0 in the
    ground frame), as ``OccupancyGrid.info.origin`` wants.

Without a ground reference or without metric scale the grid is **off**: ``add_frame``
returns a ``GridResult`` with ``applied=False`` and a ``reason`` for ``~/status``;
nothing raises.

Per frame (rules in ``occupancy_cells``): obstacle points (between ``min_height`` and
``max_height`` above the floor) hit their cell; floor points and every cell on the rays
from the camera to obstacle and floor points are seen free; points above ``max_height``
or below ``min_floor_height`` are ignored (they do not clear their ray either). Each
touched cell gets one log-odds update per frame (hit: ``logit(hit_probability)``, free:
``logit(miss_probability)``), clamped to ``[logit(clamp_min), logit(clamp_max)]`` so that
an obstacle that moves away clears after a bounded number of frames.

Output values (``output``): ``"trinary"`` (default): 100 at or above
``occupied_threshold``, 0 at or below ``free_threshold``, -1 otherwise and where never
seen. Nav2's static layer takes only 100 as lethal (``lethal_cost_threshold``), so
trinary is what it should get. ``"probability"``: ``round(100·p)`` for every cell ever
updated, -1 elsewhere.

Bounds: the grid grows with what is seen, in blocks of ``grow_step`` cells aligned on
the ground lattice, up to ``max_extent_m`` metres per axis (a **maximum extent**, not a
rolling window: what was mapped stays). A frame that would need more keeps the stored
cells; the window grows toward the camera up to the cap and the frame's cells outside it
are dropped (``GridResult.cells_outside``). ``GridConfig`` refuses an extent whose
square exceeds ``max_cells``.

Threads: one writer (``add_frame``, ``rebuild``, ``set_reference``, ``clear``) and any
number of readers (``snapshot``); a lock makes each update atomic for the readers.
``snapshot`` copies the int8 values only when the version changed (0.1 ms for 4 M cells
on the development CPU); frame geometry is computed outside the lock, ``rebuild`` builds the new grid
outside it and swaps it in.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import numpy as np

from lingbot_map_ros.robot.occupancy_cells import FrameCells, axis_bounds, classify_frame
from lingbot_map_ros.robot.occupancy_types import (FREE, OCCUPIED, UNKNOWN, GridConfig, GridResult,
                                                   GridSnapshot, GroundReference)

__all__ = ["FREE", "OCCUPIED", "UNKNOWN", "GridConfig", "GridFrame", "GridResult", "GridSnapshot",
           "GroundReference", "OccupancyGridBuilder"]

_LOG = logging.getLogger(__name__)


class GridFrame(NamedTuple):
    """One frame for ``rebuild``: camera centre [3] and points [N, 3], map frame, metres."""

    camera_centre: np.ndarray
    points: np.ndarray


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


class _Cells:
    """The stored window of the lattice: log-odds and output values, [height, width] each."""

    def __init__(self, i0: int = 0, j0: int = 0, width: int = 0, height: int = 0):
        self.i0, self.j0 = i0, j0
        self.logodds = np.zeros((height, width), np.float32)
        self.values = np.full((height, width), UNKNOWN, np.int8)

    @property
    def width(self) -> int:
        return self.logodds.shape[1]

    @property
    def height(self) -> int:
        return self.logodds.shape[0]

    def resized(self, i_range: tuple[int, int], j_range: tuple[int, int]) -> "_Cells":
        """A copy covering ``i_range × j_range`` (half-open lattice ranges that hold this window)."""
        out = _Cells(i_range[0], j_range[0], i_range[1] - i_range[0], j_range[1] - j_range[0])
        if self.width and self.height:
            di, dj = self.i0 - out.i0, self.j0 - out.j0
            out.logodds[dj:dj + self.height, di:di + self.width] = self.logodds
            out.values[dj:dj + self.height, di:di + self.width] = self.values
        return out


class OccupancyGridBuilder:
    """Accumulates frames into a bounded log-odds grid; see the module docstring.

    Args:
        config: a validated ``GridConfig``.
    """

    def __init__(self, config: GridConfig):
        self._config = config
        self._hit = _logit(config.hit_probability)
        self._miss = _logit(config.miss_probability)
        self._lo = _logit(config.clamp_min)
        self._hi = _logit(config.clamp_max)
        self._occ = _logit(config.occupied_threshold)
        self._free = _logit(config.free_threshold)
        self._cap = int(math.floor(config.max_extent_m / config.resolution + 1e-9))
        self._lock = threading.Lock()
        self._cells = _Cells()
        self._ground: GroundReference | None = None
        self._metric = False
        self._reason = _off_reason(None, False)
        self._version = 0
        self._snapshot: GridSnapshot | None = None

    @property
    def config(self) -> GridConfig:
        return self._config

    # ------------------------------------------------------------------ reference

    def set_reference(self, ground: GroundReference | None, *, metric: bool) -> GridResult:
        """Set the ground frame and whether inputs are in metres; returns whether the grid is on.

        The grid is on with a ground reference and metric scale. A reference other than
        the current one, or a change of ``metric``, clears the grid (its cells belong to
        the old frame or unit): pass a fixed ground frame for a whole sequence, not the
        robot's latest pose, and call ``rebuild`` with the frames in the new frame/unit.
        Setting the same reference again changes nothing.
        """
        with self._lock:
            same = (self._metric == bool(metric) and
                    (ground is None and self._ground is None or
                     ground is not None and self._ground is not None and ground.same_as(self._ground)))
            if not same:
                self._ground, self._metric = ground, bool(metric)
                self._reason = _off_reason(ground, self._metric)
                self._cells = _Cells()
                self._version += 1
                _LOG.info("occupancy grid %s", "on" if not self._reason else f"off: {self._reason}")
            return GridResult(applied=not self._reason, reason=self._reason, version=self._version)

    def clear(self) -> None:
        """Forget every cell (a new sequence); the reference stays."""
        with self._lock:
            self._cells = _Cells()
            self._version += 1

    # ------------------------------------------------------------------ updates

    def add_frame(self, camera_centre: np.ndarray, points: np.ndarray) -> GridResult:
        """Add one frame: the camera centre [3] and its points [N, 3] (map frame, metres).

        Touches only the frame's cells (and grows the grid when they leave it). Non-finite
        points are ignored; a non-finite camera centre refuses the frame.

        Returns:
            ``applied=False`` with the reason when the grid is off or the centre is bad.
        """
        with self._lock:
            ground, reason = self._ground, self._reason
        if reason:
            return GridResult(applied=False, reason=reason, version=self._version)
        cells = self._frame_cells(ground, camera_centre, points)
        if isinstance(cells, str):
            return GridResult(applied=False, reason=cells, version=self._version)
        with self._lock:
            if self._ground is not ground:  # the reference changed while we computed
                return GridResult(applied=False, reason="ground reference changed during the update",
                                  version=self._version)
            self._cells, outside = self._apply(self._cells, cells)
            self._version += 1
            return GridResult(applied=True, version=self._version, points_used=cells.points_used,
                              points_ignored=cells.points_ignored, cells_outside=outside)

    def rebuild(self, frames: Iterable[GridFrame | tuple[np.ndarray, np.ndarray]]) -> GridResult:
        """Replace the grid by the accumulation of ``frames`` (in order), e.g. after a loop closure.

        Gives exactly the grid that ``clear()`` and ``add_frame`` of each frame would give.
        The new grid is built without the lock and swapped in at once, so readers keep the
        old one meanwhile. Frames with a non-finite camera centre are skipped (counted in
        ``frames_skipped``).
        """
        with self._lock:
            ground, reason = self._ground, self._reason
        if reason:
            return GridResult(applied=False, reason=reason, version=self._version)
        grid, used, ignored, outside, skipped = _Cells(), 0, 0, 0, 0
        for centre, points in frames:
            cells = self._frame_cells(ground, centre, points)
            if isinstance(cells, str):
                skipped += 1
                continue
            grid, out = self._apply(grid, cells)
            used, ignored, outside = used + cells.points_used, ignored + cells.points_ignored, outside + out
        with self._lock:
            if self._ground is not ground:
                return GridResult(applied=False, reason="ground reference changed during the rebuild",
                                  version=self._version)
            self._cells = grid
            self._version += 1
            return GridResult(applied=True, version=self._version, points_used=used, points_ignored=ignored,
                              cells_outside=outside, frames_skipped=skipped)

    def _frame_cells(self, ground: GroundReference, centre: np.ndarray, points: np.ndarray) -> FrameCells | str:
        """The frame's cells on the ground lattice, or why the frame is refused."""
        centre = np.asarray(centre, dtype=np.float64).reshape(-1)
        points = np.asarray(points)
        if points.ndim != 2 or points.shape[1] != 3:
            raise ValueError(f"points must be [N, 3], got shape {points.shape}")
        if centre.shape != (3,) or not np.isfinite(centre).all():
            return f"camera centre {centre.tolist()} is not a finite 3-vector"
        rot = ground.ground_from_map[:3, :3]
        trans = ground.ground_from_map[:3, 3]
        c = self._config
        return classify_frame(points.astype(np.float64) @ rot.T + trans, rot @ centre + trans,
                              resolution=c.resolution, min_floor_height=c.min_floor_height,
                              min_height=c.min_height, max_height=c.max_height, max_range_m=c.max_range_m,
                              min_points_per_cell=c.min_points_per_cell)

    def _apply(self, grid: _Cells, cells: FrameCells) -> tuple[_Cells, int]:
        """Grow ``grid`` if needed and apply one frame's update; returns (grid, cells outside it)."""
        bounds = cells.bounds()
        if bounds is None:
            return grid, 0
        empty = grid.width == 0
        step, cap = self._config.grow_step, self._cap
        i_rng = axis_bounds(None if empty else (grid.i0, grid.i0 + grid.width), bounds[:2], cells.camera[0],
                            step, cap)
        j_rng = axis_bounds(None if empty else (grid.j0, grid.j0 + grid.height), bounds[2:], cells.camera[1],
                            step, cap)
        if empty or (i_rng, j_rng) != ((grid.i0, grid.i0 + grid.width), (grid.j0, grid.j0 + grid.height)):
            grid = grid.resized(i_rng, j_rng)
        free, _ = self._flat(grid, cells.free_i, cells.free_j)
        band, _ = self._flat(grid, cells.band_i, cells.band_j)
        hit, outside = self._flat(grid, cells.hit_i, cells.hit_j)
        log = grid.logodds.reshape(-1)
        band_before = log[band]
        hit_after = np.minimum(log[hit] + self._hit, self._hi)
        log[free] = np.maximum(log[free] + self._miss, self._lo)
        log[band] = band_before  # obstacle cells of this frame are never cleared by it
        log[hit] = hit_after
        touched = np.concatenate([free, hit])
        grid.values.reshape(-1)[touched] = self._classify(log[touched])
        return grid, outside + int(cells.free_i.size - free.size)

    @staticmethod
    def _flat(grid: _Cells, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, int]:
        """Flat indices ``li + lj·width`` of the lattice cells inside ``grid``, and how many were outside."""
        li, lj = i - grid.i0, j - grid.j0
        inside = (li >= 0) & (li < grid.width) & (lj >= 0) & (lj < grid.height)
        return (lj[inside] * grid.width + li[inside]), int(i.size - np.count_nonzero(inside))

    def _classify(self, logodds: np.ndarray) -> np.ndarray:
        """int8 output values of log-odds (see the module docstring)."""
        if self._config.output == "probability":
            prob = np.rint(100.0 / (1.0 + np.exp(-logodds.astype(np.float64))))
            return np.where(logodds == 0.0, UNKNOWN, prob).astype(np.int8)
        return np.where(logodds >= self._occ, OCCUPIED,
                        np.where(logodds <= self._free, FREE, UNKNOWN)).astype(np.int8)

    # ------------------------------------------------------------------ readers

    def snapshot(self) -> GridSnapshot:
        """The current grid as an immutable record (the same object while nothing changed)."""
        with self._lock:
            if self._snapshot is not None and self._snapshot.version == self._version:
                return self._snapshot
            grid, res = self._cells, self._config.resolution
            data = grid.values.reshape(-1).copy()
            data.flags.writeable = False
            self._snapshot = GridSnapshot(
                version=self._version, resolution=res, width=grid.width, height=grid.height, data=data,
                origin_xy=(grid.i0 * res, grid.j0 * res),
                map_from_ground=None if self._ground is None else self._ground.map_from_ground,
                ready=not self._reason, reason=self._reason)
            return self._snapshot


def _off_reason(ground: GroundReference | None, metric: bool) -> str:
    """Why the grid is off ("" when it is on)."""
    missing = []
    if ground is None:
        missing.append("no ground reference (the floor plane: a map -> ground transform with z up, "
                       "e.g. base_link from TF)")
    if not metric:
        missing.append("no metric scale (heights and cells are in metres; set scale_source and wait "
                       "for the scale to converge)")
    return ("occupancy grid off: " + "; ".join(missing)) if missing else ""

