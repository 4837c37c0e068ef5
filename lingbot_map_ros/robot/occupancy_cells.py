"""Per-frame cell geometry of the occupancy grid (numpy only; no state, no ROS, no torch).

Everything here works on the ground frame's **absolute cell lattice**: cell ``(i, j)``
covers ``[i·r, (i+1)·r) × [j·r, (j+1)·r)`` in ground-frame metres (``r`` the
resolution), whatever part of the lattice the grid currently stores. ``occupancy.py``
owns the stored window and the log-odds; this module only answers "which cells does
this frame hit, which does it see through, and which rectangle of the lattice holds
them".

Rules of one frame (``classify_frame``):

* points are moved into the ground frame (z up, z = 0 on the floor, metres);
* non-finite points, points above ``max_height``, points below ``min_floor_height``
  and points further than ``max_range_m`` from the camera (horizontal distance) are
  **ignored**: they neither hit nor clear. A point above the band says nothing about
  the column under it (a ray to the ceiling passes over tables), so it does not clear
  its ray either; a point well below the floor is a hole, a stair down or noise, never
  free floor;
* points in ``[min_height, max_height]`` are obstacle points; their cell is a **hit**
  when it holds at least ``min_points_per_cell`` of them in this frame, and is never
  cleared by this frame (hit or not);
* points in ``[min_floor_height, min_height)`` are floor: their cell and the ray to
  it are free;
* every obstacle or floor cell is the end of one ray from the camera's cell: the
  cells on the ray (the camera's cell included) are **seen free** in this frame.

Rays (``ray_cells``) join cell centres with a vectorised DDA: a ray of ``n =
max(|Δi|, |Δj|)`` steps visits ``n + 1`` cells, one per step along its major axis
(8-connected, like Bresenham's line), with no Python loop per ray. A frame casts one
ray per distinct end cell, not one per point.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FrameCells", "axis_bounds", "classify_frame", "distinct_cells", "ray_cells"]


@dataclass(frozen=True)
class FrameCells:
    """One frame's cells on the absolute lattice (int64 arrays of lattice indices).

    ``free_i, free_j``: the cells on the frame's rays, each once. ``band_i, band_j``: every cell
    holding obstacle points (never cleared by this frame). ``hit_i, hit_j``: the band
    cells with at least ``min_points_per_cell`` points. ``camera``: the camera's cell.
    ``points_used``: obstacle + floor points within range; ``points_ignored``: the rest.
    """

    camera: tuple[int, int]
    free_i: np.ndarray
    free_j: np.ndarray
    band_i: np.ndarray
    band_j: np.ndarray
    hit_i: np.ndarray
    hit_j: np.ndarray
    points_used: int
    points_ignored: int

    def bounds(self) -> tuple[int, int, int, int] | None:
        """``(i_lo, i_hi, j_lo, j_hi)``, half-open, of every cell of the frame; None when it has none."""
        if self.free_i.size == 0 and self.band_i.size == 0:
            return None
        ii = np.concatenate([self.free_i, self.band_i])
        jj = np.concatenate([self.free_j, self.band_j])
        return int(ii.min()), int(ii.max()) + 1, int(jj.min()), int(jj.max()) + 1


def classify_frame(points_ground: np.ndarray, camera_ground: np.ndarray, *, resolution: float,
                   min_floor_height: float, min_height: float, max_height: float,
                   max_range_m: float, min_points_per_cell: int) -> FrameCells:
    """Cells hit and seen free by one frame (see the module rules).

    Args:
        points_ground: [N, 3] points in the ground frame, metres (non-finite rows allowed).
        camera_ground: [3] camera centre in the ground frame, metres (finite).
        resolution: cell size, metres.
        min_floor_height: the lowest floor point, metres (below 0: floor noise).
        min_height, max_height: the obstacle band, metres above the floor.
        max_range_m: horizontal distance beyond which points are ignored, metres.
        min_points_per_cell: obstacle points a cell needs in this frame to be a hit.
    """
    cam_ij = np.floor(camera_ground[:2] / resolution).astype(np.int64)
    pts = np.asarray(points_ground, dtype=np.float64)
    z = pts[:, 2]
    rel_xy = pts[:, :2] - camera_ground[None, :2]
    with np.errstate(invalid="ignore"):
        keep = (np.isfinite(pts).all(axis=1) & (z <= max_height) & (z >= min_floor_height)
                & ((rel_xy * rel_xy).sum(axis=1) <= max_range_m * max_range_m))
    kept = pts[keep]
    used = int(kept.shape[0])
    # Relative lattice coordinates stay within ±reach, so a cell packs into one small int64 key.
    ij = np.floor(kept[:, :2] / resolution).astype(np.int64) - cam_ij
    reach = int(np.ceil(max_range_m / resolution)) + 2
    side = 2 * reach + 1
    keys = (ij[:, 0] + reach) * side + (ij[:, 1] + reach)
    in_band = kept[:, 2] >= min_height
    band_keys, counts = np.unique(keys[in_band], return_counts=True)
    hit_keys = band_keys[counts >= min_points_per_cell]
    end_keys = np.union1d(band_keys, keys[~in_band])
    ends = np.stack([end_keys // side - reach, end_keys % side - reach], axis=1)
    free_i, free_j = distinct_cells(*ray_cells(ends))
    ci, cj = int(cam_ij[0]), int(cam_ij[1])
    return FrameCells(
        camera=(ci, cj),
        free_i=free_i + ci, free_j=free_j + cj,
        band_i=band_keys // side - reach + ci, band_j=band_keys % side - reach + cj,
        hit_i=hit_keys // side - reach + ci, hit_j=hit_keys % side - reach + cj,
        points_used=used, points_ignored=int(pts.shape[0]) - used)


def distinct_cells(i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each cell of ``(i, j)`` once (sorted by i, then j), through a mask over their bounding box.

    O(len + box area) instead of a sort; a frame's box is at most ``(2·max_range_m / r)²`` cells.
    """
    if i.size == 0:
        return i.astype(np.int64), j.astype(np.int64)
    i_lo, j_lo = int(i.min()), int(j.min())
    nj = int(j.max()) - j_lo + 1
    mask = np.zeros((int(i.max()) - i_lo + 1) * nj, dtype=bool)
    mask[(i - i_lo).astype(np.int64) * nj + (j - j_lo)] = True
    flat = np.flatnonzero(mask)
    return flat // nj + i_lo, flat % nj + j_lo


def ray_cells(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells of the rays from cell (0, 0) to each of ``ends``, both ends included.

    Args:
        ends: [M, 2] integer end cells, relative to the start cell (|Δ| < 2**16).

    Returns:
        (i, j): int32 arrays of length ``sum(max(|Δi|, |Δj|) + 1)``, ray after ray, duplicates
        across rays kept. Step ``k`` of a ray with ``n`` steps is ``round(k·Δ/n)`` per axis
        (in float32: exact to ~1e-4 cell; a tie may round either way), so consecutive cells are
        8-neighbours, the major axis advances one cell per step and the last cell is the end.
    """
    ends = np.asarray(ends).reshape(-1, 2).astype(np.int32)
    if ends.shape[0] == 0:
        empty = np.zeros(0, np.int32)
        return empty, empty.copy()
    steps = np.abs(ends).max(axis=1)
    lengths = steps + 1
    k = np.arange(int(lengths.sum()), dtype=np.float32)
    k -= np.repeat((np.cumsum(lengths) - lengths).astype(np.float32), lengths)  # step within its ray
    slope = (ends / np.maximum(steps, 1)[:, None]).astype(np.float32)  # [M, 2] cells per step
    out = []
    for axis in (0, 1):
        cell = np.repeat(slope[:, axis], lengths)
        cell *= k
        cell += 0.5
        out.append(np.floor(cell, out=cell).astype(np.int32))
    return out[0], out[1]


def axis_bounds(current: tuple[int, int] | None, want: tuple[int, int], camera: int,
                step: int, cap: int) -> tuple[int, int]:
    """The stored range of one lattice axis after a frame asks for ``want``.

    The range is the union of ``current`` and ``want`` widened to multiples of ``step``
    (so the result does not depend on the order of the frames) unless that exceeds
    ``cap`` cells; then it is a window of exactly ``cap`` cells that still holds
    ``current`` (nothing stored is dropped) and is as centred on ``camera`` as that
    allows. Cells of the frame outside the window are not stored.

    Args:
        current: the stored half-open range, or None for an empty grid.
        want: the frame's half-open range.
        camera: the camera's cell on this axis.
        step: growth block, cells (≥ 1).
        cap: the most cells on this axis (≥ 1).
    """
    lo = (want[0] // step) * step
    hi = -((-want[1]) // step) * step
    if current is not None:
        lo, hi = min(lo, current[0]), max(hi, current[1])
    if hi - lo <= cap:
        return lo, hi
    lo = min(max(camera - cap // 2, lo), hi - cap)
    if current is not None:
        lo = max(min(lo, current[0]), current[1] - cap)
    return lo, lo + cap
