"""``SharedTf``: one TF broadcaster, buffer and listener for several ``TfOutput`` (the cameras of a
multi-camera node) and the alignment's look-ups (no graph: a fake node records what tf2_ros
creates on it, tf2's buffer is filled by hand)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lingbot_map_ros.ros.conversions import OPTICAL_TO_REP103, transform_stamped
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.ros.tf_tools import SharedTf, TfOutput, transform_to_matrix
from test_ros_tf_and_files import FakeNode  # a fake rclpy node recording what tf2_ros creates on it

pytestmark = pytest.mark.ros
pytest.importorskip("tf2_ros", reason="tf2_ros not importable: install ../shared/ros_extras "
                                      "(bash ../shared/ros_extras/install.sh .venv)")

SETTINGS = replace(resolve_settings({}, cuda_available=lambda: False), map_frame="map", odom_frame="odom",
                   base_frame="", camera_tf_frame="", tf_mode="map_to_camera")
R_OPT = np.asarray(OPTICAL_TO_REP103)[:3, :3]  # optical axes in a REP-103 body: a camera looking forward


def rigid(R: np.ndarray, t) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    return T


T_BASE_FRONT = rigid(R_OPT, (0.2, 0.0, 0.5))
T_BASE_REAR = rigid(np.diag([-1.0, -1.0, 1.0]) @ R_OPT, (-0.3, 0.05, 0.5))
T_ODOM_BASE = rigid(np.eye(3), (3.0, 1.0, 0.0))


def stamp(sec: int):
    from builtin_interfaces.msg import Time

    return Time(sec=sec, nanosec=0)


def put(shared: SharedTf, T: np.ndarray, parent: str, child: str, sec: int | None = None) -> None:
    """A transform as the listener would store it (static when ``sec`` is None)."""
    from std_msgs.msg import Header

    msg = transform_stamped(T, Header(stamp=stamp(sec or 0), frame_id=parent), child)
    if sec is None:
        shared.buffer.set_transform_static(msg, "test")
    else:
        shared.buffer.set_transform(msg, "test")


def two_cameras(node: FakeNode, shared: SharedTf | None, **frames) -> tuple[TfOutput, TfOutput, list[str]]:
    warnings: list[str] = []
    settings = replace(SETTINGS, **frames)
    return (TfOutput(node, settings, warnings.append, shared=shared),
            TfOutput(node, settings, warnings.append, shared=shared), warnings)


def test_shared_outputs_start_one_listener_and_one_broadcaster_when_first_needed():
    node = FakeNode()
    shared = SharedTf(node)
    front, rear, _ = two_cameras(node, shared, publish_tf=False)
    assert node.subscriptions == [] and node.publishers == [] and not shared.started  # lazy, as one camera
    assert front.backend == "none" and front.camera_pose(stamp(1), "front_optical") is None
    front.settings = replace(front.settings, publish_tf=True)  # `ros2 param set` on one camera
    assert front.publish(np.eye(4), stamp(2), "front_optical")
    assert sorted(node.subscriptions) == ["/tf", "/tf_static"] and node.publishers == ["/tf"]
    assert rear.backend == front.backend == "tf2_ros" and rear._buffer is front._buffer is shared.buffer
    rear.settings = replace(rear.settings, publish_tf=True)
    assert rear.publish(np.eye(4), stamp(2), "rear_optical")
    rear.start()
    shared.start()
    assert sorted(node.subscriptions) == ["/tf", "/tf_static"] and node.publishers == ["/tf"]  # still one of each
    assert [t.child_frame_id for t in node.sent] == ["front_optical_lingbot", "rear_optical_lingbot"]


def test_outputs_without_a_shared_one_keep_their_own_listener():
    node = FakeNode()
    front, rear, _ = two_cameras(node, None)
    assert sorted(node.subscriptions) == ["/tf", "/tf", "/tf_static", "/tf_static"]
    assert front._buffer is not rear._buffer


def test_every_user_reads_the_one_buffer():
    node = FakeNode()
    shared = SharedTf(node)
    front, rear, _ = two_cameras(node, shared, odom_frame="odom")
    put(shared, T_BASE_FRONT, "base_link", "front_optical")
    put(shared, T_BASE_REAR, "base_link", "rear_optical")
    put(shared, T_ODOM_BASE, "odom", "base_link", sec=4)
    put(shared, T_ODOM_BASE, "odom", "base_link", sec=6)
    np.testing.assert_allclose(front.camera_pose(stamp(5), "front_optical"), T_ODOM_BASE @ T_BASE_FRONT, atol=1e-9)
    np.testing.assert_allclose(rear.camera_pose(stamp(5), "rear_optical"), T_ODOM_BASE @ T_BASE_REAR, atol=1e-9)
    # the alignment's look-ups (ros.named_cameras.make_aligner): latest and at a stamp in seconds
    np.testing.assert_allclose(shared.matrix("base_link", "rear_optical"), T_BASE_REAR, atol=1e-9)
    np.testing.assert_allclose(shared.matrix("odom", "base_link", 5.0), T_ODOM_BASE, atol=1e-9)
    assert shared.matrix("odom", "base_link", 9.0) is None  # after the newest odometry: no extrapolation
    assert shared.matrix("base_link", "side_optical") is None
    assert SharedTf(FakeNode()).matrix("base_link", "front_optical") is None  # not started: no buffer


def test_a_time_jump_clears_the_shared_buffer_once_for_all_cameras():
    """A bag played in a loop: the first camera whose stamps go back clears the buffer; the other
    camera, whose stamps go back a frame later, must not clear the new pass's odometry again."""
    node = FakeNode()
    shared = SharedTf(node)
    front, rear, warnings = two_cameras(node, shared, tf_mode="map_to_odom", base_frame="base_link")
    put(shared, T_BASE_FRONT, "base_link", "front_optical")
    put(shared, T_BASE_REAR, "base_link", "rear_optical")
    put(shared, T_ODOM_BASE, "odom", "base_link", sec=500)
    assert front.publish(np.eye(4), stamp(500), "front_optical")
    assert rear.publish(np.eye(4), stamp(500), "rear_optical")
    assert not front.publish(np.eye(4), stamp(480), "front_optical")  # the loop starts again: front clears
    assert shared.clears == 1 and sum("went back 20.0 s" in line for line in node.infos) == 1
    put(shared, T_ODOM_BASE, "odom", "base_link", sec=480)  # the new pass's odometry
    put(shared, T_ODOM_BASE, "odom", "base_link", sec=481)
    assert rear.publish(np.eye(4), stamp(480), "rear_optical"), warnings  # rear's jump: already cleared
    assert shared.clears == 1 and sum("went back" in line for line in node.infos) == 1
    assert front.publish(np.eye(4), stamp(481), "front_optical"), warnings
    assert [t.header.stamp.sec for t in node.sent] == [500, 500, 480, 481]
    np.testing.assert_allclose(transform_to_matrix(node.sent[-1]),
                               np.linalg.inv(T_BASE_FRONT) @ np.linalg.inv(T_ODOM_BASE), atol=1e-9)  # T_map_cam = I
    # a later loop: each camera's stamps go back once more, the buffer is cleared once more
    assert not rear.publish(np.eye(4), stamp(400), "rear_optical")
    assert not front.publish(np.eye(4), stamp(400), "front_optical")
    assert shared.clears == 2
