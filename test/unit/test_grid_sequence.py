"""The occupancy grid fed by a camera's engine (runtime/grid.py through runtime/sequence.py and the
output thread): a stand-in session renders the depth of a box room seen from its centre, the
engine turns it into points as it does for the map, and the grid must show the walls occupied,
the inside free and the outside unknown within one cell, in metres of the published map frame.
Without a metric scale or a ground reference the grid stays off and says why (~/status)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lingbot_map_ros.robot.occupancy import FREE, OCCUPIED, UNKNOWN
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.corrections import Corrections
from lingbot_map_ros.runtime.grid import GroundFromBase, SequenceGrid, grid_config
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.config import ConfigError
from lingbot_map_ros.slam import Sim3

from engine_fakes import Log, Sink
from room_scene import CAMERA, RESOLUTION, ROOM_X, ROOM_Y, SCALE, RoomSession, T_cam_base, classes


def room_engine(extrinsic=lambda frame: T_cam_base(), base_frame="base_link", **params):
    values = {"image_width": 42, "device": "cpu", "grid": True, "grid_resolution": RESOLUTION,
              "scale_source": "fixed", "metric_scale": SCALE, "base_frame": base_frame, "point_stride": 1,
              "conf_threshold": 0.0, "map_voxel_size": 0.0, "publish_path": False, **params}
    settings = resolve_settings(values)
    sink = Sink(wants=())
    engine = InferenceEngine(RoomSession(), settings, sink, Log(), now=lambda: 100.0, monotonic=lambda: 100.0)
    engine.seq.attach_grid(SequenceGrid(grid_config(settings), GroundFromBase(settings.base_frame, 0.0, extrinsic),
                                        settings.scale_source))
    return engine, sink


def run(engine, n: int) -> None:
    """``n`` frames, each waited for on the output thread (which would skip a frame's clouds when it
    falls behind)."""
    for _ in range(n):
        stamp = engine.seq.counter_values().frames_received + 1
        engine.submit_frame(InputFrame(rgb=np.zeros((28, 42, 3), np.uint8), stamp=stamp, stamp_s=float(stamp),
                                       camera_frame="cam_optical"))
        assert engine.run_once(0.0)
        assert engine.outputs.flush(30.0)


def test_box_room_seen_from_its_centre_gives_walls_free_inside_unknown_outside():
    engine, sink = room_engine()
    run(engine, 12)
    grid = engine.seq.grid
    assert grid.state.on and grid.state.reason == "" and grid.state.frames == 12, grid.state
    snap = grid.snapshot()
    assert snap.ready and snap.resolution == RESOLUTION
    # the ground frame is the map frame 1 m down (the camera's height): level, the map's heading
    assert np.allclose(snap.map_from_ground[:3, :3], np.eye(3)) and snap.map_from_ground[2, 3] == pytest.approx(-1.0)
    cells = snap.cells()
    wall, inside, outside = classes(snap)
    assert not np.any(cells[inside] == OCCUPIED) and np.mean(cells[inside] == FREE) > 0.99
    assert np.all(cells[outside] == UNKNOWN)
    # every occupied cell lies within one cell of a wall, and they go all round (the perimeter in cells)
    occupied = cells == OCCUPIED
    assert np.all(wall[occupied]) and occupied.sum() >= 0.95 * 4 * (ROOM_X + ROOM_Y) / RESOLUTION
    res = snap.resolution
    for side_x in (-ROOM_X, ROOM_X):  # each wall is closed (no gap longer than a cell)
        i = math.floor((side_x - CAMERA[0] - snap.origin_xy[0]) / res)
        column = occupied[:, max(i - 1, 0):i + 2].any(axis=1)
        j0 = math.floor((-ROOM_Y + res - CAMERA[1] - snap.origin_xy[1]) / res)
        j1 = math.floor((ROOM_Y - res - CAMERA[1] - snap.origin_xy[1]) / res)
        assert column[j0:j1 + 1].all(), side_x
    # the status says nothing about the grid once it is on
    assert "grid" not in sink.statuses[-1][0].state_text


def test_without_metric_scale_or_ground_reference_the_grid_is_off_with_the_reason():
    engine, sink = room_engine(scale_source="none")
    run(engine, 2)
    assert not engine.seq.grid.state.on and "no metric scale" in engine.seq.grid.state.reason
    assert engine.seq.grid.snapshot().width == 0
    engine, sink = room_engine(base_frame="")
    run(engine, 2)
    reason = engine.seq.grid.state.reason
    assert reason.startswith("grid off: no ground reference (base_frame is empty"), reason
    run(engine, 1)  # the next status carries it
    assert reason in sink.statuses[-1][0].state_text
    engine, sink = room_engine(extrinsic=lambda frame: None)
    run(engine, 1)
    assert "no TF cam_optical -> base_link" in engine.seq.grid.state.reason


def test_frames_before_the_extrinsic_arrives_are_rebuilt_into_the_grid():
    known = {"yes": False}
    engine, _ = room_engine(extrinsic=lambda frame: T_cam_base() if known["yes"] else None)
    run(engine, 11)  # the camera has turned almost all the way; TF has no extrinsic yet
    assert not engine.seq.grid.state.on
    known["yes"] = True
    run(engine, 1)
    grid = engine.seq.grid
    assert grid.state.on and grid.state.rebuilds == 1 and grid.state.frames == 12
    cells = grid.snapshot().cells()
    wall, inside, outside = classes(grid.snapshot())
    assert np.mean(cells[inside] == FREE) > 0.99 and np.all(cells[outside] == UNKNOWN)


def test_a_rollback_keeps_the_cells_and_a_reset_clears_the_grid():
    engine, sink = room_engine()
    run(engine, 3)
    before = engine.seq.grid.snapshot()
    assert engine.keyframes.rollback(3) == 3  # the last stored frame is dropped
    assert engine.outputs.flush(5.0)
    after = engine.seq.grid.snapshot()
    assert after is before  # the observation stays: nothing changed
    assert engine.seq.grid.history() == [0, 1]
    engine.commands.reset()
    assert engine.outputs.flush(5.0)
    grid = engine.seq.grid
    assert not grid.state.on and grid.snapshot().width == 0 and "new sequence" in grid.state.reason
    run(engine, 1)
    assert grid.state.on and grid.state.frames == 1


@pytest.mark.parametrize("values, message", [
    ({"grid_min_height": 2.0, "grid_max_height": 1.0}, "grid_min_height"),
    ({"grid_resolution": 0.01, "grid_max_extent": 2000.0}, "parameter grid_max_extent 2000.0 at grid_resolution 0.01 allows .* cells.*: lower "
                                                             "grid_max_extent, coarsen grid_resolution$"),
    ({"accumulate_map": False}, "grid needs accumulate_map true"),
])
def test_bad_grid_parameters_are_refused_naming_them(values, message):
    with pytest.raises(ConfigError, match=message):
        resolve_settings({"image_width": 42, "device": "cpu", "grid": True, **values})
    resolve_settings({"image_width": 42, "device": "cpu", "grid": False, **values})  # off: not checked


def test_loop_corrections_move_the_grid_with_the_map():
    """A loop closure's correction (a Sim(3) per keyframe, as ``Sequence.correct`` gets it) moves the
    grid's cells as it moves the published map: 0.5 model units along the map's x (× the metric
    scale) shift the walls by that many metres, the free inside with them; identity corrections
    give the grid back."""
    engine, _ = room_engine()
    run(engine, 12)
    grid = engine.seq.grid

    def occupied_x(snap) -> float:
        cells = snap.cells()
        _, i = np.nonzero(cells == OCCUPIED)
        return float(np.mean(snap.origin_xy[0] + (i + 0.5) * snap.resolution))

    before = grid.snapshot()
    x0, rebuilds = occupied_x(before), grid.state.rebuilds
    engine.seq.correct(Corrections({0: Sim3(np.eye(3), np.array([0.5, 0.0, 0.0]), 1.0)}))
    assert engine.outputs.flush(30.0)
    moved = grid.snapshot()
    assert grid.state.rebuilds == rebuilds + 1 and grid.state.on
    assert occupied_x(moved) - x0 == pytest.approx(0.5 * SCALE, abs=RESOLUTION)
    run(engine, 2)  # new frames land with the correction too: the walls stay where they moved
    assert occupied_x(grid.snapshot()) - x0 == pytest.approx(0.5 * SCALE, abs=RESOLUTION)
    engine.seq.correct(Corrections())
    assert engine.outputs.flush(30.0)
    back = grid.snapshot()
    assert occupied_x(back) == pytest.approx(x0, abs=RESOLUTION)
