"""A box room seen from its centre, rendered for a stand-in session (not a test module; test/ is on
sys.path, see conftest.py): the scene of the occupancy-grid tests that go through the engine
(test/unit/test_grid_sequence.py) and through the ROS node (test/ros/test_grid_graph.py).

The ground frame has z up and the floor at z = 0; a level camera 1 m up near the room's centre turns
in place (``RoomSession``: one stored frame per step, its depth rendered in model units of
``SCALE`` m). The camera's first pose defines the map frame, so the map frame is the ground frame
moved up to the camera."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from lingbot_map_ros.geometry import OPTICAL_TO_REP103
from lingbot_map_ros.robot.map_offset import invert_rigid

ROOM_X, ROOM_Y, CEILING = 2.0, 1.5, 2.5  # ground frame (z up, floor z = 0): the room's half sizes, its height
CAMERA = np.array([0.012, 0.012, 1.0])  # the camera's centre in the ground frame (off the cell borders)
WIDTH, HEIGHT, FOCAL = 168, 126, 84.0  # 90 deg horizontal field of view (sizes: multiples of 14)
SCALE = 2.0  # metres per model unit (scale_source fixed)
RESOLUTION = 0.1
# body (x forward, y left, z up) <- optical (x right, y down, z forward)
BODY_FROM_OPTICAL = np.array([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])


def yaw(angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def render_depth(angle: float) -> np.ndarray:
    """Metric z-depth [H, W] of the room for the level camera at CAMERA looking along ``angle``."""
    v, u = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float64)
    rays = np.stack([(u - WIDTH / 2) / FOCAL, (v - HEIGHT / 2) / FOCAL, np.ones_like(u)], -1)  # optical, z = 1
    d = rays @ (yaw(angle) @ BODY_FROM_OPTICAL).T  # ground frame
    t = np.full(u.shape, np.inf)
    for axis, bounds in ((0, (-ROOM_X, ROOM_X)), (1, (-ROOM_Y, ROOM_Y)), (2, (0.0, CEILING))):
        for bound in bounds:
            with np.errstate(divide="ignore", invalid="ignore"):
                hit = (bound - CAMERA[axis]) / d[..., axis]
            t = np.where((hit > 0) & (hit < t), hit, t)
    return t  # the ray's z component is 1: its parameter is the z-depth


def frame_result(index: int, angle: float, origin: float = 0.0):
    """The stand-in session's result for frame ``index``: the camera at the map origin turned by
    ``angle``, its depth in model units; ``origin``: the angle of the sequence's first camera (its
    map frame's heading: the pose is turned by ``angle - origin`` in it)."""
    T_map_cam = np.eye(4)
    T_map_cam[:3, :3] = yaw(angle - origin) @ BODY_FROM_OPTICAL
    c2w = OPTICAL_TO_REP103.T @ T_map_cam  # the model's world: the first camera's optical axes
    depth = (render_depth(angle) / SCALE).astype(np.float32)
    K = np.array([[FOCAL, 0, WIDTH / 2], [0, FOCAL, HEIGHT / 2], [0, 0, 1]])
    return SimpleNamespace(frame_index=index, c2w=c2w, depth=depth, confidence=np.full(depth.shape, 5.0, np.float32),
                           intrinsics=K, size=(HEIGHT, WIDTH), is_keyframe=True, timings={}, pose_enc=np.zeros(9),
                           frame=None, colors=lambda idx: np.zeros((len(idx), 3), np.uint8))


class RoomSession:
    """Each step gives the next frame of a turn in place (``frames`` steps of ``sweep`` / frames radians
    from ``start``: a full turn from the room's x axis by default); its map frame is its first pose's
    (turned by ``start`` in the room)."""

    def __init__(self, frames: int = 12, start: float = 0.0, sweep: float = 2 * math.pi) -> None:
        self.pushed, self.frames = 0, frames
        self.start, self.sweep = start, sweep
        self.window_index, self.deferred_eviction, self.device = 0, False, None
        self.cfg = SimpleNamespace(num_scale_frames=1)

    @property
    def frames_pushed(self) -> int:
        return self.pushed

    def stats(self):
        return None

    def submit(self, image, keyframe=None, stamp=None, tag=None):
        self.pushed += 1
        index = self.pushed - 1
        return [frame_result(index, self.start + self.sweep * index / self.frames, self.start)]

    def results(self, pending):
        return pending

    def reset(self) -> None:
        self.pushed = 0

    def rollback_last_frame(self, expected=None) -> int:
        self.pushed -= 1
        return self.pushed

    def set_deferred_eviction(self, enabled: bool) -> None:
        self.deferred_eviction = enabled

    def commit_eviction(self) -> int:
        return 0


def T_cam_base() -> np.ndarray:
    """The camera extrinsic: base_link on the floor under the camera, its x along the camera's view."""
    T_base_cam = np.eye(4)
    T_base_cam[:3, :3] = BODY_FROM_OPTICAL
    T_base_cam[2, 3] = CAMERA[2]
    return invert_rigid(T_base_cam)


def stand_in_sessions(frames: int = 12, cameras: dict[str, RoomSession] | None = None) -> SimpleNamespace:
    """What ``ros.startup.load_sessions`` gives: for the node's one camera a ``RoomSession`` of
    ``frames``; with ``cameras`` (name -> session) those, as a node with the parameter ``cameras``
    gets them (no shared pool to report)."""
    sessions = cameras if cameras is not None else {"": RoomSession(frames)}
    for session in sessions.values():
        session.inner = SimpleNamespace(backend=SimpleNamespace(name="box room (stand-in)"))
    first = next(iter(sessions.values()))
    return SimpleNamespace(sessions=dict(sessions), storage=None, model=first, submit_many=None,
                           pool_status=lambda: None)


def classes(snap):
    """(occupied, free, unknown) boolean [H, W] of the cells whose centre is near a wall (within one
    cell), inside the room by more than a cell, outside by more than a cell; map frame = the first
    camera's, so the room is offset by the camera's position."""
    res = snap.resolution
    x = snap.origin_xy[0] + (np.arange(snap.width) + 0.5) * res + CAMERA[0]
    y = snap.origin_xy[1] + (np.arange(snap.height) + 0.5) * res + CAMERA[1]
    dx, dy = np.abs(x)[None, :] - ROOM_X, np.abs(y)[:, None] - ROOM_Y
    wall = ((np.abs(dx) <= res) & (dy <= res)) | ((np.abs(dy) <= res) & (dx <= res))
    return wall, (dx < -res) & (dy < -res), (dx > res) | (dy > res)
