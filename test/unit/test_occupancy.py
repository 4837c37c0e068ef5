"""The occupancy grid (lingbot_map_ros.robot.occupancy): a synthetic box room seen from its
centre, the height band, clearing, bounds, refusal, rebuild, layout, threads and config.

Scenes are built in the ground frame (z up, z = 0 on the floor, metres) and handed to the
grid in a map frame that differs from it (translated, yawed and, for one case, pitched like
a camera looking down), so every test also checks the map -> ground transform.
"""
from __future__ import annotations

import ast
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.robot.occupancy import (FREE, OCCUPIED, UNKNOWN, GridConfig, GridFrame, GroundReference,
                                             OccupancyGridBuilder)
from lingbot_map_ros.robot.occupancy_cells import axis_bounds, distinct_cells, ray_cells

REPO = Path(__file__).resolve().parents[2]
ROOM_X, ROOM_Y = 3.0, 2.0  # half sizes of the 6 m x 4 m room, centred on the ground origin
CAMERA = np.array([0.012, 0.012, 1.0])  # ground frame: near the room centre (not on a cell border), 1 m up


def rotation(yaw=0.0, pitch=0.0) -> np.ndarray:
    """[3, 3] rotation: yaw about z, then pitch about the new y."""
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    return np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]]) @ np.array([[cp, 0, sp], [0, 1, 0], [-sp, 0, cp]])


def transform(rot: np.ndarray, trans) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3], out[:3, 3] = rot, trans
    return out


# map_from_ground: a map frame whose origin is a camera 1 m up, yawed; and one pitched as a camera looking down
LEVEL = transform(rotation(yaw=0.4), [0.3, -0.2, -1.0])
PITCHED = transform(rotation(yaw=-0.7, pitch=0.25), [0.1, 0.5, -1.0])


def reference(map_from_ground: np.ndarray) -> GroundReference:
    return GroundReference(np.linalg.inv(map_from_ground))


def to_map(map_from_ground: np.ndarray, points: np.ndarray) -> np.ndarray:
    return (points @ map_from_ground[:3, :3].T + map_from_ground[:3, 3]).astype(np.float32)


def room_points(rng, spacing=0.025, wall_height=2.0, ceiling: float | None = None) -> np.ndarray:
    """[N, 3] ground-frame points of the room: four walls (1 cm noise across), the floor, optionally a ceiling."""
    xs = np.arange(-ROOM_X, ROOM_X + 1e-9, spacing)
    ys = np.arange(-ROOM_Y, ROOM_Y + 1e-9, spacing)
    zs = np.arange(0.0, wall_height + 1e-9, 2 * spacing)
    parts = []
    for x in (-ROOM_X, ROOM_X):
        yy, zz = np.meshgrid(ys, zs)
        parts.append(np.stack([np.full(yy.size, x) + rng.normal(0, 0.005, yy.size), yy.ravel(), zz.ravel()], 1))
    for y in (-ROOM_Y, ROOM_Y):
        xx, zz = np.meshgrid(xs, zs)
        parts.append(np.stack([xx.ravel(), np.full(xx.size, y) + rng.normal(0, 0.005, xx.size), zz.ravel()], 1))
    fx, fy = np.meshgrid(xs[1:-1], ys[1:-1])
    parts.append(np.stack([fx.ravel(), fy.ravel(), rng.normal(0, 0.01, fx.size)], 1))
    if ceiling is not None:
        parts.append(np.stack([fx.ravel(), fy.ravel(), np.full(fx.size, ceiling)], 1))
    return np.concatenate(parts)


def visible(points: np.ndarray, camera: np.ndarray, yaw: float, hfov_deg=90.0) -> np.ndarray:
    """The points within the horizontal field of view of a camera at ``camera`` looking along ``yaw``."""
    d = points[:, :2] - camera[:2]
    off = (np.arctan2(d[:, 1], d[:, 0]) - yaw + np.pi) % (2 * np.pi) - np.pi
    return points[np.abs(off) < math.radians(hfov_deg) / 2]


def room_frames(map_from_ground, n_frames=12, seed=0, **room) -> list[GridFrame]:
    rng = np.random.default_rng(seed)
    points = room_points(rng, **room)
    centre = to_map(map_from_ground, CAMERA[None])[0].astype(np.float64)
    return [GridFrame(centre, to_map(map_from_ground, visible(points, CAMERA, 2 * math.pi * k / n_frames)))
            for k in range(n_frames)]


def builder(map_from_ground=LEVEL, **config) -> OccupancyGridBuilder:
    grid = OccupancyGridBuilder(GridConfig(**config))
    assert grid.set_reference(reference(map_from_ground), metric=True).applied
    return grid


def value_at(snap, x: float, y: float) -> int:
    """The snapshot's value at ground point (x, y); unknown outside the grid."""
    i = math.floor((x - snap.origin_xy[0]) / snap.resolution)
    j = math.floor((y - snap.origin_xy[1]) / snap.resolution)
    if not (0 <= i < snap.width and 0 <= j < snap.height):
        return UNKNOWN
    return int(snap.data[i + j * snap.width])


# ----------------------------------------------------------------------------- the box room

@pytest.mark.parametrize("map_from_ground", [LEVEL, PITCHED], ids=["level", "pitched"])
def test_room_seen_from_its_centre(map_from_ground):
    grid = builder(map_from_ground)
    for frame in room_frames(map_from_ground):
        result = grid.add_frame(*frame)
        assert result.applied and result.cells_outside == 0 and 5_000 < result.points_used < 25_000
    snap = grid.snapshot()
    res = snap.resolution
    cells = snap.cells()
    xc = snap.origin_xy[0] + (np.arange(snap.width) + 0.5) * res
    yc = snap.origin_xy[1] + (np.arange(snap.height) + 0.5) * res
    dx = np.abs(xc)[None, :] - ROOM_X
    dy = np.abs(yc)[:, None] - ROOM_Y
    near_wall = ((np.abs(dx) <= 1.5 * res) & (dy <= 1.5 * res)) | ((np.abs(dy) <= 1.5 * res) & (dx <= 1.5 * res))
    interior = (dx < -1.5 * res) & (dy < -1.5 * res)
    outside = (dx > 1.5 * res) | (dy > 1.5 * res)
    assert not np.any(cells[interior] == OCCUPIED), "an occupied cell inside the room"
    assert np.mean(cells[interior] == FREE) > 0.99
    assert np.all(cells[outside] == UNKNOWN), "something known behind the walls"
    # every cell on the ideal wall lines has an occupied cell within one cell
    occupied = np.argwhere(cells == OCCUPIED)
    wall_cells = np.argwhere(near_wall & (np.minimum(np.abs(dx), np.abs(dy)) <= 0.5 * res + 1e-9) & (
        (dx <= 0.5 * res) & (dy <= 0.5 * res)))
    found = [np.abs(occupied - cell).max(axis=1).min() <= 1 for cell in wall_cells]
    assert len(wall_cells) > 350 and np.mean(found) > 0.97
    assert np.all(near_wall[cells == OCCUPIED]), "occupied cells away from the walls"


@pytest.mark.parametrize("start,end", [((-4.0, 0.0), (4.0, 0.0)), ((0.0, -3.0), (0.0, 3.0)),
                                       ((-4.0, -1.0), (4.0, 1.5))], ids=["x", "y", "slant"])
def test_lines_through_the_room_read_unknown_wall_free_wall_unknown(start, end):
    grid = builder(LEVEL)
    for frame in room_frames(LEVEL):
        grid.add_frame(*frame)
    snap = grid.snapshot()
    t = np.linspace(0.0, 1.0, 2000)
    xs, ys = start[0] + t * (end[0] - start[0]), start[1] + t * (end[1] - start[1])
    values = np.array([value_at(snap, x, y) for x, y in zip(xs, ys)])
    runs = [values[0]] + [v for a, v in zip(values, values[1:]) if v != a]
    assert runs == [UNKNOWN, OCCUPIED, FREE, OCCUPIED, UNKNOWN], runs
    # where the line crosses a wall, the occupied runs are within one cell of it
    walls = [k for k in range(len(values)) if values[k] == OCCUPIED]
    first, last = (xs[walls[0]], ys[walls[0]]), (xs[walls[-1]], ys[walls[-1]])
    for x, y in (first, last):
        assert min(abs(abs(x) - ROOM_X), abs(abs(y) - ROOM_Y)) <= 2 * snap.resolution


def test_floor_and_ceiling_make_no_obstacle_and_the_band_edges_hold():
    rng = np.random.default_rng(3)
    ground = room_points(rng, wall_height=0.0, ceiling=2.5)
    ground = ground[ground[:, 2] > -0.05]  # floor and ceiling, no walls (wall_height 0 leaves a floor ring)
    floor_near = ground[(np.hypot(ground[:, 0], ground[:, 1]) < 1.5) & (ground[:, 2] < 1.0)]
    ceiling = ground[ground[:, 2] > 1.0]
    probes = np.array([[2.01, 1.01, 1.49], [2.01, -1.01, 1.51], [-2.01, 1.01, 0.09], [-2.01, -1.01, 0.11],
                       [0.01, 1.81, -0.30]])  # in band, above, floor, in band, a hole
    grid = builder(LEVEL, min_height=0.10, max_height=1.50, min_floor_height=-0.15)
    centre = to_map(LEVEL, CAMERA[None])[0]
    for _ in range(3):
        grid.add_frame(centre, to_map(LEVEL, np.concatenate([floor_near, ceiling, probes])))
    snap = grid.snapshot()
    occupied = np.argwhere(snap.cells() == OCCUPIED)
    assert len(occupied) == 2, "only the two in-band probes are obstacles"
    assert value_at(snap, 2.01, 1.01) == OCCUPIED and value_at(snap, -2.01, -1.01) == OCCUPIED
    assert value_at(snap, 2.01, -1.01) == UNKNOWN, "a point above max_height neither hits nor clears"
    assert value_at(snap, -2.01, 1.01) == FREE, "a floor point is free"
    assert value_at(snap, 0.01, 1.81) == UNKNOWN, "a point below min_floor_height is not free floor"
    assert value_at(snap, 0.5, 0.5) == FREE
    assert value_at(snap, 2.5, 0.3) == UNKNOWN, "ceiling points beyond the seen floor do not clear"


# ----------------------------------------------------------------------------- clearing

def logit(p):
    return math.log(p / (1 - p))


def test_a_moving_obstacle_clears_after_the_clamped_number_of_frames():
    config = GridConfig()
    grid = builder(LEVEL)
    centre = to_map(LEVEL, CAMERA[None])[0]
    post = np.array([[2.02, 0.02, z] for z in np.arange(0.2, 1.2, 0.05)])  # an obstacle 2 m ahead
    floor = np.array([[x, 0.02, 0.0] for x in np.arange(0.3, 3.5, 0.02)])  # the floor through and behind it
    for _ in range(20):
        grid.add_frame(centre, to_map(LEVEL, np.concatenate([post, floor[floor[:, 0] < 1.9]])))
    assert value_at(grid.snapshot(), 2.02, 0.02) == OCCUPIED
    hi, miss = logit(config.clamp_max), -logit(config.miss_probability)
    to_unknown = math.floor((hi - logit(config.occupied_threshold)) / miss) + 1
    to_free = math.ceil((hi - logit(config.free_threshold)) / miss)
    seen = []
    for _ in range(to_free + 2):
        grid.add_frame(centre, to_map(LEVEL, floor))  # the obstacle left: seen through
        seen.append(value_at(grid.snapshot(), 2.02, 0.02))
    assert seen[:to_unknown - 1] == [OCCUPIED] * (to_unknown - 1), "one free view must not erase an obstacle"
    assert seen[to_unknown - 1] == UNKNOWN and seen[to_free - 1] == FREE and seen[-1] == FREE
    assert 5 <= to_unknown < to_free <= 12


def test_a_cell_hit_in_a_frame_is_not_cleared_by_the_same_frame():
    grid = builder(LEVEL, min_points_per_cell=2)
    centre = to_map(LEVEL, CAMERA[None])[0]
    # a far wall point's ray passes through the cell of a near obstacle with one point (not a hit)
    frame = np.array([[1.01, 0.01, 0.5], [2.01, 0.01, 0.5], [2.01, 0.01, 0.6]])
    for _ in range(3):
        grid.add_frame(centre, to_map(LEVEL, frame))
    snap = grid.snapshot()
    assert value_at(snap, 2.01, 0.01) == OCCUPIED
    assert value_at(snap, 1.01, 0.01) == UNKNOWN, "a cell with obstacle points stays uncleared by its own frame"
    assert value_at(snap, 0.51, 0.01) == FREE


# ----------------------------------------------------------------------------- bounds

def test_a_far_point_does_not_grow_the_grid_past_max_extent():
    grid = builder(LEVEL, resolution=0.1, max_extent_m=4.0, max_range_m=30.0, grow_step=8)
    centre = to_map(LEVEL, CAMERA[None])[0]
    near = np.array([[1.05, 0.55, 0.5]])
    first = grid.add_frame(centre, to_map(LEVEL, near))
    assert first.cells_outside == 0
    before = grid.snapshot()
    assert value_at(before, 1.05, 0.55) == OCCUPIED
    far = to_map(LEVEL, np.array([[15.05, 0.05, 0.5]]))
    results = [grid.add_frame(centre, far) for _ in range(2)]  # two free views make a cell free
    snap = grid.snapshot()
    assert all(r.applied and r.cells_outside > 0 for r in results)
    assert snap.width <= 40 and snap.height <= 40
    assert value_at(snap, 1.05, 0.55) == OCCUPIED, "stored cells are kept"
    x_hi = snap.origin_xy[0] + snap.width * snap.resolution
    assert x_hi < 15.0, "the far point's cell is not stored"
    assert value_at(snap, x_hi - 0.05, 0.05) == FREE, "its ray is cleared up to the edge of the grid"


def test_driving_far_keeps_the_grid_within_its_cap_and_the_first_cells():
    grid = builder(LEVEL, resolution=0.1, max_extent_m=6.0, grow_step=16)
    post = np.array([[0.55, 1.05, 0.5]])  # beside the path
    for x in np.arange(0.0, 40.0, 0.5):
        camera = np.array([x + 0.05, 0.05, 1.0])
        grid.add_frame(to_map(LEVEL, camera[None])[0], to_map(LEVEL, post + [x, 0, 0]))
        snap = grid.snapshot()
        assert snap.width <= 60 and snap.height <= 60
    assert value_at(snap, 0.55, 1.05) == OCCUPIED, "the first obstacle stays mapped"
    assert value_at(snap, 30.55, 1.05) == UNKNOWN, "later ones outside the full grid are not stored"


def test_axis_bounds_grow_in_steps_independent_of_order_then_cap():
    assert axis_bounds(None, (3, 10), 5, 8, 100) == (0, 16)
    a = axis_bounds(axis_bounds(None, (3, 10), 5, 8, 100), (-20, -12), -15, 8, 100)
    b = axis_bounds(axis_bounds(None, (-20, -12), -15, 8, 100), (3, 10), 5, 8, 100)
    assert a == b == (-24, 16)
    capped = axis_bounds((0, 16), (-200, 10), -150, 8, 40)
    assert capped == (-24, 16), "keeps the stored range, grows toward the camera up to the cap"
    assert axis_bounds(None, (-200, 200), 7, 8, 40) == (-13, 27), "an empty grid centres on the camera"
    assert axis_bounds(None, (0, 200), 195, 8, 40) == (160, 200), "... within what the frame asks for"
    assert axis_bounds((0, 16), (0, 200), 100, 8, 40) == (0, 40), "... and without dropping stored cells"


# ----------------------------------------------------------------------------- refusal

def test_without_ground_reference_or_metric_scale_the_grid_refuses_with_a_reason():
    grid = OccupancyGridBuilder(GridConfig())
    frame = room_frames(LEVEL, n_frames=4)[0]
    result = grid.add_frame(*frame)
    assert not result.applied and "no ground reference" in result.reason and "no metric scale" in result.reason
    snap = grid.snapshot()
    assert not snap.ready and snap.reason == result.reason and snap.width == snap.height == 0
    status = grid.set_reference(reference(LEVEL), metric=False)
    assert not status.applied and "no metric scale" in status.reason and "ground" not in status.reason
    assert not grid.add_frame(*frame).applied
    status = grid.set_reference(None, metric=True)
    assert not status.applied and "no ground reference" in status.reason and "metric" not in status.reason
    assert grid.set_reference(reference(LEVEL), metric=True).applied
    assert grid.add_frame(*frame).applied and grid.snapshot().ready


def test_a_bad_camera_centre_is_refused_and_a_new_reference_clears():
    grid = builder(LEVEL)
    frame = room_frames(LEVEL, n_frames=4)[0]
    bad = grid.add_frame(np.array([np.nan, 0, 0]), frame.points)
    assert not bad.applied and "not a finite" in bad.reason
    assert grid.add_frame(*frame).applied
    version = grid.snapshot().version
    assert grid.set_reference(reference(LEVEL), metric=True).version == version, "the same reference keeps the grid"
    assert grid.snapshot().width > 0
    grid.set_reference(reference(PITCHED), metric=True)
    assert grid.snapshot().width == 0 and grid.snapshot().version > version


# ----------------------------------------------------------------------------- rebuild

def test_rebuild_equals_incremental_accumulation():
    frames = room_frames(PITCHED, n_frames=10, seed=5)
    incremental = builder(PITCHED)
    for frame in frames:
        incremental.add_frame(*frame)
    rebuilt = builder(PITCHED)
    rebuilt.add_frame(*room_frames(LEVEL, n_frames=3)[0])  # something to replace
    result = rebuilt.rebuild(frames)
    a, b = incremental.snapshot(), rebuilt.snapshot()
    assert result.applied and result.frames_skipped == 0
    assert (a.width, a.height, a.origin_xy) == (b.width, b.height, b.origin_xy)
    assert np.array_equal(a.data, b.data)
    assert np.array_equal(incremental._cells.logodds, rebuilt._cells.logodds)


def test_rebuild_with_corrected_poses_moves_the_walls():
    frames = room_frames(LEVEL, n_frames=12)
    grid = builder(LEVEL)
    for frame in frames:
        grid.add_frame(*frame)
    shift = np.array([0.5, 0.0, 0.0])  # loop closure: the whole sequence moves 0.5 m along map x
    moved = [GridFrame(f.camera_centre + shift, f.points + shift.astype(np.float32)) for f in frames]
    moved.insert(3, GridFrame(np.array([np.inf, 0.0, 0.0]), frames[0].points))
    result = grid.rebuild(moved)
    assert result.applied and result.frames_skipped == 1
    fresh = builder(LEVEL)
    for frame in moved[:3] + moved[4:]:
        fresh.add_frame(*frame)
    assert np.array_equal(grid.snapshot().data, fresh.snapshot().data)
    wall = np.array([ROOM_X, 0.0, 0.0]) + LEVEL[:3, :3].T @ shift  # the +x wall, moved, in the ground frame
    assert value_at(grid.snapshot(), wall[0] + 0.01, wall[1]) == OCCUPIED


# ----------------------------------------------------------------------------- layout and snapshots

def test_layout_row_major_row_zero_at_the_origin_and_origin_pose_in_the_map_frame():
    grid = builder(LEVEL, resolution=0.1)
    centre = to_map(LEVEL, CAMERA[None])[0]
    grid.add_frame(centre, to_map(LEVEL, np.array([[1.23, 0.57, 0.5]])))
    snap = grid.snapshot()
    occupied = np.flatnonzero(snap.data == OCCUPIED)
    assert len(occupied) == 1
    i, j = occupied[0] % snap.width, occupied[0] // snap.width
    assert snap.origin_xy[0] + i * 0.1 <= 1.23 < snap.origin_xy[0] + (i + 1) * 0.1
    assert snap.origin_xy[1] + j * 0.1 <= 0.57 < snap.origin_xy[1] + (j + 1) * 0.1
    corner = LEVEL @ np.array([snap.origin_xy[0], snap.origin_xy[1], 0.0, 1.0])
    assert np.allclose(snap.origin_position, corner[:3])
    q = snap.origin_orientation  # yaw 0.4 about z
    assert np.allclose(q, [0, 0, math.sin(0.2), math.cos(0.2)])
    x, y, yaw = snap.planar_origin()
    assert np.allclose([x, y, yaw], [corner[0], corner[1], 0.4])
    grid_p = builder(PITCHED)
    grid_p.add_frame(*room_frames(PITCHED, n_frames=4)[0])
    with pytest.raises(ValueError, match="tilted 14.3"):
        grid_p.snapshot().planar_origin()


def test_snapshot_is_immutable_cached_and_versioned():
    grid = builder(LEVEL)
    frames = room_frames(LEVEL, n_frames=4)
    grid.add_frame(*frames[0])
    first = grid.snapshot()
    assert grid.snapshot() is first
    with pytest.raises(ValueError):
        first.data[0] = 1
    copy = first.data.copy()
    grid.add_frame(*frames[1])
    second = grid.snapshot()
    assert second.version > first.version and np.array_equal(first.data, copy)
    assert second.data.dtype == np.int8 and second.data.shape == (second.width * second.height,)


def test_probability_output():
    grid = builder(LEVEL, output="probability")
    centre = to_map(LEVEL, CAMERA[None])[0]
    grid.add_frame(centre, to_map(LEVEL, np.array([[1.01, 0.01, 0.5]])))
    snap = grid.snapshot()
    assert value_at(snap, 1.01, 0.01) == 70 and value_at(snap, 0.51, 0.01) == 40
    assert value_at(snap, -0.5, 0.5) == UNKNOWN
    assert set(np.unique(snap.data)) == {UNKNOWN, 40, 70}


def test_readers_on_another_thread_see_whole_updates():
    grid = builder(LEVEL)
    frames = room_frames(LEVEL, n_frames=12)
    seen, errors, done = [], [], threading.Event()

    def read():
        while not done.is_set():
            snap = grid.snapshot()
            if snap.data.shape != (snap.width * snap.height,):
                errors.append(snap)
            seen.append(snap.version)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for frame in frames:
            grid.add_frame(*frame)
        grid.rebuild(frames)
    finally:
        done.set()
        reader.join(timeout=30)
    assert not reader.is_alive() and not errors
    assert seen == sorted(seen)
    assert np.array_equal(grid.snapshot().data, builder_from(frames).snapshot().data)


def builder_from(frames) -> OccupancyGridBuilder:
    grid = builder(LEVEL)
    for frame in frames:
        grid.add_frame(*frame)
    return grid


# ----------------------------------------------------------------------------- rays

def test_rays_are_8_connected_lines_from_the_start_to_each_end():
    rng = np.random.default_rng(7)
    ends = np.concatenate([rng.integers(-60, 61, (300, 2)), [[0, 0], [5, 0], [0, -5], [7, 7], [-3, 9]]])
    i, j = ray_cells(ends)
    lengths = np.abs(ends).max(axis=1) + 1
    assert len(i) == lengths.sum()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for (ei, ej), a, b in zip(ends, offsets[:-1], offsets[1:]):
        ri, rj = i[a:b], j[a:b]
        assert (ri[0], rj[0]) == (0, 0) and (ri[-1], rj[-1]) == (ei, ej)
        assert np.all(np.abs(np.diff(ri)) <= 1) and np.all(np.abs(np.diff(rj)) <= 1)
        n = max(abs(ei), abs(ej))
        if n:  # every cell within half a cell of the ideal line along the minor axis
            k = np.arange(n + 1)
            assert np.all(np.abs(ri - k * ei / n) <= 0.5) and np.all(np.abs(rj - k * ej / n) <= 0.5)


def test_distinct_cells_equals_a_sorted_unique():
    rng = np.random.default_rng(8)
    i, j = rng.integers(-40, 30, 5000).astype(np.int32), rng.integers(-5, 90, 5000).astype(np.int32)
    di, dj = distinct_cells(i, j)
    pairs = np.unique(np.stack([i, j], 1), axis=0)
    assert np.array_equal(np.stack([di, dj], 1), pairs)
    assert [a.size for a in distinct_cells(i[:0], j[:0])] == [0, 0]


# ----------------------------------------------------------------------------- config and reference

@pytest.mark.parametrize("kwargs,name", [
    ({"resolution": 0.0}, "resolution"), ({"resolution": float("nan")}, "resolution"),
    ({"min_height": 2.0, "max_height": 1.0}, "min_height < max_height"),
    ({"min_floor_height": 0.2}, "min_floor_height"),
    ({"max_range_m": -1.0}, "max_range_m"), ({"max_range_m": 3000.0}, "max_range_m 3000.0 is over 50000 cells"), ({"max_extent_m": 0.0}, "max_extent_m"),
    ({"max_extent_m": 1000.0}, "max_cells"), ({"grow_step": 0}, "grow_step"),
    ({"min_points_per_cell": 1.5}, "min_points_per_cell"),
    ({"hit_probability": 0.4}, "hit_probability"), ({"miss_probability": 0.6}, "miss_probability"),
    ({"free_threshold": 0.7}, "free_threshold 0.7"), ({"occupied_threshold": 0.99}, "occupied_threshold 0.99"),
    ({"clamp_min": 0.5}, "clamp_min 0.5"), ({"output": "binary"}, "output"),
])
def test_config_names_the_bad_value(kwargs, name):
    with pytest.raises(ValueError, match=name.replace("(", r"\(")) as info:
        GridConfig(**kwargs)
    assert "GridConfig" in str(info.value)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        GridConfig().resolution = 0.1


def test_ground_reference_checks_and_from_base():
    with pytest.raises(ValueError, match="not a rotation"):
        GroundReference(np.diag([2.0, 2.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match="4x4"):
        GroundReference(np.eye(3))
    map_from_base = transform(rotation(yaw=0.3), [1.0, 2.0, 0.25])
    ground = GroundReference.from_base(map_from_base, base_height=0.25)
    floor_under_base = map_from_base @ np.array([0.0, 0.0, -0.25, 1.0])
    assert np.allclose(ground.ground_from_map @ floor_under_base, [0, 0, 0, 1])
    assert np.allclose(ground.map_from_ground @ ground.ground_from_map, np.eye(4))
    with pytest.raises(ValueError):
        ground.ground_from_map[0, 0] = 5.0


def test_ground_aligned_with_a_level_map_keeps_its_axes_and_lattice():
    map_from_base = transform(rotation(yaw=1.1), [2.0, -1.0, -0.7])  # base 0.3 m above a floor at z = -1
    ground = GroundReference.aligned_with_map(map_from_base, base_height=0.3)
    assert np.allclose(ground.ground_from_map, transform(np.eye(3), [0, 0, 1.0]))
    grid = OccupancyGridBuilder(GridConfig(resolution=0.1))
    grid.set_reference(ground, metric=True)
    grid.add_frame(np.array([0.03, 0.02, 0.0]), np.array([[1.23, -0.57, -0.5]], np.float32))
    x, y, yaw = grid.snapshot().planar_origin()
    assert yaw == 0.0 and abs(x / 0.1 - round(x / 0.1)) < 1e-9 and abs(y / 0.1 - round(y / 0.1)) < 1e-9
    assert value_at(grid.snapshot(), 1.23, -0.57) == OCCUPIED


def test_ground_aligned_with_a_tilted_map_uses_the_base_up_and_the_map_heading():
    map_from_base = transform(rotation(pitch=-0.3), [0.0, 0.0, -1.0])  # map pitched like a camera looking down
    ground = GroundReference.aligned_with_map(map_from_base)
    map_from_ground = ground.map_from_ground
    assert np.allclose(map_from_ground[:3, 2], map_from_base[:3, 2])  # z = the base's up
    assert abs(map_from_ground[1, 0]) < 1e-12 and map_from_ground[0, 0] > 0  # x in the map's xz plane
    assert abs((ground.ground_from_map @ map_from_base @ [0, 0, 0, 1])[2]) < 1e-12  # the base is on the floor
    # the map origin (the first camera) lies straight above the ground origin
    assert np.allclose(ground.ground_from_map @ [0, 0, 0, 1], [0, 0, math.cos(0.3), 1])


def test_the_grid_modules_import_neither_ros_nor_torch():
    for name in ("occupancy.py", "occupancy_cells.py", "occupancy_types.py"):
        tree = ast.parse((REPO / "lingbot_map_ros" / "robot" / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert imported <= {"__future__", "logging", "math", "threading", "dataclasses", "typing", "numpy",
                            "lingbot_map_ros"}, (name, imported)
