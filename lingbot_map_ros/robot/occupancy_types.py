"""Records of the occupancy grid: its configuration, ground reference, results and snapshots.

numpy only. ``occupancy.py`` explains the grid; this module holds the immutable values
that cross its boundary (``GridConfig`` in, ``GroundReference`` in, ``GridResult`` and
``GridSnapshot`` out).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lingbot_map_ros.geometry import matrix_to_quaternion

__all__ = ["FREE", "OCCUPIED", "OUTPUT_MODES", "UNKNOWN", "GridConfig", "GridResult", "GridSnapshot",
           "GroundReference"]

UNKNOWN, FREE, OCCUPIED = -1, 0, 100
"""OccupancyGrid cell values: unknown, free, occupied."""
OUTPUT_MODES = ("trinary", "probability")


@dataclass(frozen=True)
class GridConfig:
    """Occupancy grid parameters; lengths in metres of the ground frame, probabilities in (0, 1).

    Attributes:
        resolution: cell side, m.
        min_floor_height: points below are ignored (holes, stairs down, noise), m (≤ 0 usually).
        min_height, max_height: obstacle band above the floor, m; points in
            ``[min_floor_height, min_height)`` are floor (free), above ``max_height`` ignored.
        max_range_m: points further from the camera (horizontally) are ignored, m.
        max_extent_m: most metres the grid covers per axis (the grid grows up to it).
        max_cells: refuse an extent whose square, in cells, exceeds this.
        grow_step: the grid grows in blocks of this many cells, aligned on the lattice.
        min_points_per_cell: obstacle points a cell needs in one frame to count as a hit.
        hit_probability, miss_probability: the update of a hit cell / a cell seen free.
        occupied_threshold, free_threshold: output 100 at or above / 0 at or below.
        clamp_min, clamp_max: bounds of a cell's probability (how fast a change clears).
        output: ``"trinary"`` (100 / 0 / -1) or ``"probability"`` (0..100, -1 never seen).
    """

    resolution: float = 0.05
    min_floor_height: float = -0.15
    min_height: float = 0.10
    max_height: float = 1.50
    max_range_m: float = 8.0
    max_extent_m: float = 100.0
    max_cells: int = 16_000_000
    grow_step: int = 64
    min_points_per_cell: int = 1
    hit_probability: float = 0.7
    miss_probability: float = 0.4
    occupied_threshold: float = 0.65
    free_threshold: float = 0.35
    clamp_min: float = 0.12
    clamp_max: float = 0.97
    output: str = "trinary"

    def __post_init__(self):
        for name in ("resolution", "min_floor_height", "min_height", "max_height", "max_range_m", "max_extent_m",
                     "hit_probability", "miss_probability", "occupied_threshold", "free_threshold",
                     "clamp_min", "clamp_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"GridConfig.{name} must be a finite number, got {value!r}")
        for name in ("max_cells", "grow_step", "min_points_per_cell"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GridConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("resolution", "max_range_m", "max_extent_m"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GridConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.min_floor_height < self.min_height < self.max_height:
            raise ValueError("GridConfig needs min_floor_height < min_height < max_height, got "
                             f"{self.min_floor_height!r}, {self.min_height!r}, {self.max_height!r}")
        if self.max_range_m / self.resolution > 50_000:
            raise ValueError(f"GridConfig.max_range_m {self.max_range_m!r} is over 50000 cells at resolution "
                             f"{self.resolution!r}: rays that long are not supported")
        self._check_probabilities()
        side = math.floor(self.max_extent_m / self.resolution + 1e-9)
        if side < 1:
            raise ValueError(f"GridConfig.max_extent_m {self.max_extent_m!r} is less than one cell "
                             f"(resolution {self.resolution!r})")
        if side * side > self.max_cells:
            raise ValueError(f"GridConfig.max_extent_m {self.max_extent_m!r} at resolution {self.resolution!r} "
                             f"allows {side}x{side} = {side * side} cells, above max_cells {self.max_cells}: "
                             "lower max_extent_m, coarsen resolution or raise max_cells")
        if self.output not in OUTPUT_MODES:
            raise ValueError(f"GridConfig.output must be one of {OUTPUT_MODES}, got {self.output!r}")

    def _check_probabilities(self) -> None:
        if not 0.0 < self.miss_probability < 0.5 < self.hit_probability < 1.0:
            raise ValueError("GridConfig needs 0 < miss_probability < 0.5 < hit_probability < 1, got "
                             f"miss_probability {self.miss_probability!r}, hit_probability {self.hit_probability!r}")
        order = [("clamp_min", self.clamp_min), ("free_threshold", self.free_threshold), ("0.5", 0.5),
                 ("occupied_threshold", self.occupied_threshold), ("clamp_max", self.clamp_max)]
        values = [0.0] + [v for _, v in order] + [1.0]
        if not all(a < b for a, b in zip(values, values[1:])):
            got = ", ".join(f"{n} {v!r}" for n, v in order if n != "0.5")
            raise ValueError("GridConfig needs 0 < clamp_min < free_threshold < 0.5 < occupied_threshold < "
                             f"clamp_max < 1 (a never-seen cell is unknown; both classes reachable), got {got}")


@dataclass(frozen=True, eq=False)
class GroundReference:
    """The ground frame: z up, z = 0 on the floor, metres; fixed for a whole grid.

    Attributes:
        ground_from_map: [4, 4] rigid transform, ``p_ground = ground_from_map @ p_map``
            (homogeneous), metres. Stored as a read-only float64 copy.
    """

    ground_from_map: np.ndarray

    def __post_init__(self):
        m = np.array(self.ground_from_map, dtype=np.float64)
        if m.shape != (4, 4) or not np.isfinite(m).all():
            raise ValueError(f"GroundReference needs a finite 4x4 matrix, got shape {m.shape}")
        rot = m[:3, :3]
        if not np.allclose(m[3], [0, 0, 0, 1], atol=1e-9):
            raise ValueError(f"GroundReference: last row must be [0, 0, 0, 1], got {m[3].tolist()}")
        if np.abs(rot.T @ rot - np.eye(3)).max() > 1e-4 or np.linalg.det(rot) <= 0:
            raise ValueError("GroundReference: the rotation part is not a rotation (orthonormal, det +1); "
                             "is the transform scaled?")
        inv = np.eye(4)
        inv[:3, :3] = rot.T
        inv[:3, 3] = -rot.T @ m[:3, 3]
        m.flags.writeable = inv.flags.writeable = False
        object.__setattr__(self, "ground_from_map", m)
        object.__setattr__(self, "_inverse", inv)

    @classmethod
    def from_base(cls, map_from_base: np.ndarray, base_height: float = 0.0) -> "GroundReference":
        """The ground frame under a base frame (REP 103, z up) whose origin is ``base_height`` m above the floor.

        Args:
            map_from_base: [4, 4] pose of the base in the map frame, metres (e.g. ``base_link``
                or ``base_footprint`` at the first frame with TF).
            base_height: height of the base frame's origin above the floor, m (0 for a footprint).
        """
        down = np.eye(4)
        down[2, 3] = -float(base_height)
        map_from_ground = np.asarray(map_from_base, dtype=np.float64) @ down
        rot, trans = map_from_ground[:3, :3], map_from_ground[:3, 3]
        out = np.eye(4)
        out[:3, :3] = rot.T
        out[:3, 3] = -rot.T @ trans
        return cls(out)

    @classmethod
    def aligned_with_map(cls, map_from_base: np.ndarray, base_height: float = 0.0) -> "GroundReference":
        """The floor under a base frame, with the map frame's heading: what Nav2 needs.

        z is the base's z axis (the floor normal), the origin is the map origin dropped onto
        the floor along it, x is the map's x axis projected onto the floor (the map's y when
        the map's x is nearly vertical). For a level map frame this is the map frame moved
        down to the floor: the grid's axes are the map's and its origin lies on the map's
        cell lattice. Nav2's static layer reads only ``origin.position`` (no yaw), so a grid
        meant for Nav2 should use this reference rather than ``from_base``.

        Args:
            map_from_base: [4, 4] pose of the base in the map frame, metres (REP 103, z up).
            base_height: height of the base frame's origin above the floor, m.
        """
        base = np.asarray(map_from_base, dtype=np.float64)
        up = base[:3, 2] / np.linalg.norm(base[:3, 2])
        floor_height = float(up @ base[:3, 3]) - float(base_height)  # the plane: up · p = floor_height
        x_axis = np.array([1.0, 0.0, 0.0]) - up[0] * up
        if np.linalg.norm(x_axis) < 0.1:
            x_axis = np.array([0.0, 1.0, 0.0]) - up[1] * up
        x_axis /= np.linalg.norm(x_axis)
        map_from_ground = np.eye(4)
        map_from_ground[:3, :3] = np.stack([x_axis, np.cross(up, x_axis), up], axis=1)
        map_from_ground[:3, 3] = floor_height * up
        return cls(np.linalg.inv(map_from_ground))

    @property
    def map_from_ground(self) -> np.ndarray:
        """[4, 4] read-only inverse: ``p_map = map_from_ground @ p_ground``."""
        return self._inverse  # type: ignore[attr-defined]

    def same_as(self, other: "GroundReference", atol: float = 1e-9) -> bool:
        """True when both transforms agree within ``atol`` per element."""
        return bool(np.allclose(self.ground_from_map, other.ground_from_map, rtol=0.0, atol=atol))


@dataclass(frozen=True)
class GridResult:
    """Outcome of ``set_reference``, ``add_frame`` or ``rebuild``.

    Attributes:
        applied: the grid is on (``set_reference``) / the update was applied.
        reason: why not, one line for ``~/status``; "" when applied.
        version: the grid's version after the call.
        points_used: obstacle and floor points that updated the grid.
        points_ignored: non-finite, too high, too low or out-of-range points.
        cells_outside: the frame's hit and seen-free cells that fell outside the grid at
            ``max_extent_m`` (not stored); 0 while the grid has room.
        frames_skipped: ``rebuild`` only: frames with a non-finite camera centre.
    """

    applied: bool
    reason: str = ""
    version: int = 0
    points_used: int = 0
    points_ignored: int = 0
    cells_outside: int = 0
    frames_skipped: int = 0


@dataclass(frozen=True, eq=False)
class GridSnapshot:
    """An immutable copy of the grid for publishing or saving.

    Attributes:
        version: increases with every change of the grid.
        resolution: cell side, m.
        width, height: cells along the ground frame's x and y (0 × 0 before any frame).
        data: [height · width] int8, read-only; ``data[i + j·width]``, row 0 at the origin;
            100 occupied, 0 free, -1 unknown (0..100 with ``output="probability"``).
        origin_xy: lower-left corner of cell (0, 0) in the ground frame, m.
        map_from_ground: [4, 4] read-only, or None without a ground reference.
        ready: the grid is on; ``reason``: why not ("" when on).
    """

    version: int
    resolution: float
    width: int
    height: int
    data: np.ndarray
    origin_xy: tuple[float, float]
    map_from_ground: np.ndarray | None
    ready: bool
    reason: str

    def cells(self) -> np.ndarray:
        """``data`` as a read-only [height, width] view (row j = y, column i = x)."""
        return self.data.reshape(self.height, self.width)

    @property
    def origin_position(self) -> np.ndarray:
        """[3] the lower-left corner of cell (0, 0) in the map frame, m (``info.origin.position``)."""
        corner = np.array([self.origin_xy[0], self.origin_xy[1], 0.0, 1.0])
        return corner[:3] if self.map_from_ground is None else (self.map_from_ground @ corner)[:3]

    @property
    def origin_orientation(self) -> np.ndarray:
        """[4] quaternion (x, y, z, w) of the ground frame in the map frame (``info.origin.orientation``)."""
        if self.map_from_ground is None:
            return np.array([0.0, 0.0, 0.0, 1.0])
        return matrix_to_quaternion(self.map_from_ground[:3, :3])

    def planar_origin(self, max_tilt_deg: float = 1.0) -> tuple[float, float, float]:
        """``(x, y, yaw)`` of the origin in the map frame, as map.yaml's ``origin`` wants.

        map.yaml (and Nav2's static layer) know no roll or pitch, so the ground plane must
        be level in the map frame: its z axis within ``max_tilt_deg`` of the map's. The
        static layer ignores the yaw too: with ``GroundReference.aligned_with_map`` it is 0.

        Raises:
            ValueError: the ground frame is tilted against the map frame (the message says by how much).
        """
        if self.map_from_ground is None:
            return float(self.origin_xy[0]), float(self.origin_xy[1]), 0.0
        rot = self.map_from_ground[:3, :3]
        tilt = math.degrees(math.acos(max(-1.0, min(1.0, rot[2, 2]))))
        if tilt > max_tilt_deg:
            raise ValueError(f"the ground plane is tilted {tilt:.2f} deg against the map frame's xy plane "
                             f"(limit {max_tilt_deg} deg); map.yaml's origin has only x, y, yaw: "
                             "use a ground-aligned map frame")
        pos = self.origin_position
        return float(pos[0]), float(pos[1]), math.atan2(rot[1, 0], rot[0, 0])
