"""The occupancy grid fed by a camera's engine (runtime/grid.py through runtime/sequence.py and the
output thread): a stand-in session renders the depth of a box room seen from its centre, the
engine turns it into points as it does for the map, and the grid must show the walls occupied,
the inside free and the outside unknown within one cell, in metres of the published map frame.
Without a metric scale or a ground reference the grid stays off and says why (~/status)."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from lingbot_map_ros.robot.occupancy import FREE, OCCUPIED, UNKNOWN
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.corrections import Corrections
from lingbot_map_ros.runtime.grid import GridMap, GroundFromBase, grid_config
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.config import ConfigError
from lingbot_map_ros.slam import Sim3

from engine_fakes import Log, Sink
from room_scene import CAMERA, RESOLUTION, ROOM_X, ROOM_Y, SCALE, RoomSession, T_cam_base, classes


def room_engine(extrinsic=lambda frame: T_cam_base(), base_frame="base_link", session=None, grid=None, camera="",
                place=None, **params):
    """An engine on a ``RoomSession`` (``session``) feeding ``grid`` (a new ``GridMap`` of one camera
    when None) as camera ``camera`` placed by ``place``."""
    values = {"image_width": 42, "device": "cpu", "grid": True, "grid_resolution": RESOLUTION,
              "scale_source": "fixed", "metric_scale": SCALE, "base_frame": base_frame, "point_stride": 1,
              "conf_threshold": 0.0, "map_voxel_size": 0.0, "publish_path": False, **params}
    settings = resolve_settings(values)
    sink = Sink(wants=())
    engine = InferenceEngine(session or RoomSession(), settings, sink, Log(), now=lambda: 100.0,
                             monotonic=lambda: 100.0)
    grid = grid if grid is not None else GridMap(grid_config(settings))
    engine.seq.attach_grid(grid.feed(GroundFromBase(settings.base_frame, 0.0, extrinsic), settings.scale_source,
                                     camera=camera, place=place))
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
    assert_the_whole_room(grid.snapshot())
    # the status says nothing about the grid once it is on
    assert "grid" not in sink.statuses[-1][0].state_text


def assert_the_whole_room(snap) -> None:
    """Walls occupied all round and closed, the inside free, the outside unknown (within a cell)."""
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
    # rebuilt from the history's thinned points: still the whole room (every k-th point instead of a
    # random draw aliased with the image's columns, and rays grazing the empty cells opened the walls)
    assert_the_whole_room(grid.snapshot())


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


def test_two_cameras_back_to_back_fill_one_grid_once_the_second_joins_the_first_ones_map():
    """Two cameras back to back on one base turn together through half a turn (6 frames of 30 degrees,
    90 degree fields of view): the front camera alone leaves the wall behind the start unseen; the back
    camera's own map frame is its first pose, turned 180 degrees from the front one's. Its frames
    wait in its history (its status says why) until its map joins the first camera's (the rotation
    MapAligner would give); then the grid is rebuilt with them and is the whole room, as one
    camera's full turn gives it. The back camera's new sequence keeps the cells; the front
    camera's (a new map) clears them."""
    grid = GridMap(grid_config(resolve_settings({"grid": True, "grid_resolution": RESOLUTION})))
    joined = {"yes": False}
    T_front_back = np.eye(4)
    T_front_back[:3, :3] = np.diag([-1.0, -1.0, 1.0])  # 180 degrees about the map's z (REP 103 up)

    def place(transform):
        return (T_front_back, "") if joined["yes"] else (None, "waiting for TF base_link -> back_optical")

    front, _ = room_engine(session=RoomSession(6, 0.0, math.pi), grid=grid, camera="front")
    back, back_sink = room_engine(session=RoomSession(6, math.pi, math.pi), grid=grid, camera="back", place=place)
    run(front, 6)
    snap = grid.snapshot()
    wall, inside, outside = classes(snap)
    assert grid.state.on and grid.state.frames == 6
    assert np.mean(snap.cells()[wall] == OCCUPIED) < 0.8  # part of the room is not seen yet
    run(back, 5)
    assert grid.snapshot() is snap and back.seq.grid.history() == [0, 1, 2, 3, 4]  # waiting, not in the grid
    reason = back.seq.grid.state.reason
    assert "camera back's frames wait to join the map (waiting for TF base_link -> back_optical)" in reason
    assert reason in back_sink.statuses[-1][0].state_text and front.seq.grid.state.reason == ""
    joined["yes"] = True
    rebuilds = grid.state.rebuilds
    run(back, 1)
    assert grid.state.on and grid.state.rebuilds == rebuilds + 1 and grid.state.frames == 12, grid.state
    assert back.seq.grid.state.reason == ""
    assert_the_whole_room(grid.snapshot())
    back.commands.reset()  # the back camera's new sequence: its history goes, the map and its cells stay
    assert back.outputs.flush(5.0)
    assert back.seq.grid.history() == [] and grid.snapshot().cells().tolist() == \
        front.seq.grid.snapshot().cells().tolist() and grid.state.on
    assert_the_whole_room(grid.snapshot())
    front.commands.reset()  # the first camera's new sequence is a new map
    assert front.outputs.flush(5.0)
    assert not grid.state.on and grid.snapshot().width == 0 and "new sequence" in grid.state.reason


class HeldRebuild:
    """A grid builder's ``rebuild`` that waits at its first call until ``gate`` is set."""

    def __init__(self, builder) -> None:
        self.entered, self.gate, self.real = threading.Event(), threading.Event(), builder.rebuild

    def __call__(self, frames):
        frames = list(frames)
        if not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(30.0)
        return self.real(frames)


def two_cameras_with_corrections(hold: bool):
    """Front and back cameras (back joined) with 3 and 1 frames; then the front camera's loop correction,
    2 more back frames and the back camera's correction; ``hold``: the front camera's rebuild is held in
    its builder while the back camera goes on (each back step must not wait for it)."""
    grid = GridMap(grid_config(resolve_settings({"grid": True, "grid_resolution": RESOLUTION})))
    T_front_back = np.eye(4)
    T_front_back[:3, :3] = np.diag([-1.0, -1.0, 1.0])
    front, _ = room_engine(session=RoomSession(6, 0.0, math.pi), grid=grid, camera="front")
    back, _ = room_engine(session=RoomSession(6, math.pi, math.pi), grid=grid, camera="back",
                          place=lambda transform: (T_front_back, ""))
    run(front, 3)
    run(back, 1)
    rebuilds = grid.state.rebuilds
    held = HeldRebuild(grid.builder) if hold else None
    if held is not None:
        grid.builder.rebuild = held
    front.seq.correct(Corrections({0: Sim3(np.eye(3), np.array([0.1, 0.0, 0.0]), 1.0)}))
    if held is not None:
        assert held.entered.wait(30.0), "the front camera's rebuild never started"
    for _ in range(2):  # the back camera's next frames
        stamp = back.seq.counter_values().frames_received + 1
        back.submit_frame(InputFrame(rgb=np.zeros((28, 42, 3), np.uint8), stamp=stamp, stamp_s=float(stamp),
                                     camera_frame="cam_optical"))
        assert back.run_once(0.0)
        assert back.outputs.flush(5.0), "the back camera's output thread waited for the other's rebuild"
    back.seq.correct(Corrections({0: Sim3(np.eye(3), np.array([0.0, 0.2, 0.0]), 1.0)}))
    assert back.outputs.flush(5.0), "the back camera's correction waited for the other's rebuild"
    if held is not None:
        assert grid.rebuilding and len(grid.late) == 2 and grid.again
        held.gate.set()
    assert front.outputs.flush(30.0) and back.outputs.flush(30.0)
    assert not grid.rebuilding and grid.late == [] and grid.state.frames == 6
    return grid, rebuilds


def test_a_rebuild_on_one_cameras_thread_holds_up_no_other_camera():
    """The long part of a rebuild runs with the grid's lock free: while the front camera's output
    thread rebuilds (a loop correction; held here inside the builder), the back camera's frames are
    taken at once and its own correction only asks for another pass; when the rebuild ends the grid
    is cell for cell what the same changes one after the other give."""
    expected, _ = two_cameras_with_corrections(hold=False)
    grid, rebuilds = two_cameras_with_corrections(hold=True)
    assert grid.state.rebuilds == rebuilds + 2  # the held one, then the pass the back camera asked for
    assert grid.snapshot().cells().tolist() == expected.snapshot().cells().tolist()
