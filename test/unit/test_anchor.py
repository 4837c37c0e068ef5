"""MapAnchor (runtime/anchor.py) alone: the applied scale, the output transform, and the lost-reset
alignment through odometry (hand-computed placements), with fake look-ups and a fake result."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from lingbot_map_ros.geometry import OPTICAL_TO_REP103
from lingbot_map_ros.runtime.anchor import NEW_ORIGIN, DepthCache, MapAnchor
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.worker import Throttle

from engine_fakes import Log  # test/ is on sys.path (conftest.py)


def frame(stamp_s: float) -> InputFrame:
    return InputFrame(rgb=np.zeros((4, 4, 3), np.uint8), stamp=stamp_s, stamp_s=stamp_s, camera_frame="cam")


def translation(x: float, y: float = 0.0, z: float = 0.0) -> np.ndarray:
    T = np.eye(4)
    T[:3, 3] = (x, y, z)
    return T


def result(c2w: np.ndarray):
    return SimpleNamespace(c2w=c2w, depth=None, confidence=None)


def anchor(source: str = "none", camera_pose=None, odom_position=None, metric_scale: float = 1.0) -> MapAnchor:
    log = Log()
    return MapAnchor(source, metric_scale, 1.0, "odom", log, Throttle(5.0), odom_position=odom_position,
                     camera_pose=camera_pose)


def test_without_a_scale_source_outputs_are_in_model_units():
    a = anchor()
    assert a.update_scale(np.eye(4), frame(1.0), result(np.eye(4)), 0) == (1.0, True)
    assert a.output.identity and a.status() == (0.0, False)


def test_a_fixed_scale_is_applied_at_once_and_the_output_is_replaced_not_mutated():
    a = anchor("fixed", metric_scale=2.5)
    before = a.output
    scale, ready = a.update_scale(np.eye(4), frame(1.0), result(np.eye(4)), 0)
    assert (scale, ready) == (2.5, True) and a.applied_scale == 2.5
    assert a.output is not before and before.identity and a.output.scale == 2.5
    same = a.output
    a.update_scale(np.eye(4), frame(2.0), result(np.eye(4)), 0)
    assert a.output is same  # no change: the same object
    a.clear()
    assert a.applied_scale == 1.0 and a.output.identity


def test_odometry_scale_samples_the_camera_centre_at_the_image_stamp():
    odom = {float(t): np.array([2.0 * t, 0.0, 0.0]) for t in range(12)}
    a = anchor("odometry", odom_position=lambda stamp, frame_id: odom.get(stamp))
    for t in range(12):
        a.update_scale(translation(float(t)), frame(float(t)), result(np.eye(4)), 0)
    assert a.scale_source.converged and abs(a.applied_scale - 2.0) < 1e-6


def test_a_lost_reset_without_a_good_pose_or_odometry_says_why():
    assert anchor().lost() == (None, "no pose was tracked since the map frame started")
    a = anchor()
    a.good(3, frame(1.0), np.eye(4), ready=True)
    pending, why = a.lost()
    assert pending is None and "no odometry look-up" in why
    b = anchor(camera_pose=lambda stamp, frame_id: None)
    b.good(3, frame(1.0), np.eye(4), ready=True)
    pending, why = b.lost()
    assert pending is None and "no TF odom -> cam at the last good pose's stamp 1.000 s" in why


def test_the_next_sequence_continues_from_the_last_good_pose_through_odometry():
    """Good pose at x=5 (published), odometry moved the camera 1 m forward in between: the new
    sequence's first frame is placed at 6, and its later frames follow by its own motion."""
    odom = {1.0: translation(10.0), 2.0: translation(11.0)}
    a = anchor(camera_pose=lambda stamp, frame_id: odom.get(stamp))
    a.good(4, frame(1.0), translation(5.0), ready=True)
    pending, why = a.lost()
    assert pending is not None and why == "" and pending.good.index == 4
    a.clear(keep_map_frame=True)
    a.continue_from(pending)
    assert a.aligning
    c2w_first = np.eye(4)  # the new sequence's first camera: its own origin
    a.align([result(c2w_first)], [frame(2.0)])
    assert not a.aligning and "continued from frame 4" in a.map_alignment and "moved 1.000 m" in a.map_alignment
    np.testing.assert_allclose(a.output.pose(OPTICAL_TO_REP103 @ c2w_first), translation(6.0), atol=1e-9)
    assert a.take_note().startswith("map continued") and a.take_note() == ""
    assert any("moved 1.000 m" in m for level, m in a.log.lines if level == "warning")  # model units, not metric


def test_without_odometry_at_the_new_frames_the_map_starts_a_new_origin():
    odom = {1.0: translation(10.0)}
    a = anchor(camera_pose=lambda stamp, frame_id: odom.get(stamp))
    a.good(4, frame(1.0), translation(5.0), ready=True)
    pending, _ = a.lost()
    a.clear(keep_map_frame=True)
    a.continue_from(pending)
    a.align([result(np.eye(4))], [frame(3.0)])
    assert a.map_alignment == NEW_ORIGIN and a.output.identity and "new map origin" in a.take_note()
    assert a.lost()[0] is None  # the good pose went with the old origin


def test_depth_cache_gives_the_nearest_image_within_the_tolerance():
    cache = DepthCache(size=2)
    cache.put(1.0, np.full((2, 2), 1.0))
    cache.put(2.0, np.full((2, 2), 2.0))
    cache.put(3.0, np.full((2, 2), 3.0))  # the oldest goes
    assert cache.nearest(1.0) is None and cache.nearest(2.04)[0, 0] == 2.0 and cache.nearest(2.6) is None
    assert cache.nearest(2.6, tolerance=0.5)[0, 0] == 3.0
