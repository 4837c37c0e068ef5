"""TfOutput.camera_pose: ``T_odom_cam`` at an image stamp from a real tf2 buffer (no graph):
odometry chain times the URDF's static extrinsic, hand-computed; None when TF lacks it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lingbot_map_ros.ros.conversions import transform_stamped
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.ros.tf_tools import TfOutput

pytestmark = pytest.mark.ros
R_OPT = np.array([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])  # optical axes in a REP-103 body
R_Z90 = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])


def rigid_rt(R, t) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    return T


class FakeNode:
    """Enough of an rclpy node for tf2_ros' broadcaster and listener."""

    def create_publisher(self, *args, **kwargs):
        return None

    def create_subscription(self, *args, **kwargs):
        return None

    def destroy_subscription(self, sub) -> None:
        pass

    def get_logger(self):
        return self

    def info(self, text: str) -> None:
        pass


def stamp(sec: int, nanosec: int = 0):
    from builtin_interfaces.msg import Time

    return Time(sec=sec, nanosec=nanosec)


def put(out: TfOutput, T: np.ndarray, parent: str, child: str, sec: int | None = None) -> None:
    from std_msgs.msg import Header

    msg = transform_stamped(T, Header(stamp=stamp(sec or 0), frame_id=parent), child)
    if sec is None:
        out._buffer.set_transform_static(msg, "test")
    else:
        out._buffer.set_transform(msg, "test")


def test_camera_pose_is_odometry_times_extrinsic_at_the_stamp():
    pytest.importorskip("tf2_ros", reason="tf2_ros not importable: install ../shared/ros_extras")
    settings = replace(resolve_settings({}, cuda_available=lambda: False), odom_frame="odom")
    out = TfOutput(FakeNode(), settings, lambda _m: None)
    assert out.camera_pose(stamp(4), "cam_optical") is None  # nothing in TF yet
    T_base_cam = rigid_rt(R_OPT, [0.2, 0.0, 0.5])
    put(out, T_base_cam, "base_link", "cam_optical")
    put(out, rigid_rt(np.eye(3), [0.0, 0.0, 0.0]), "odom", "base_link", sec=4)
    put(out, rigid_rt(np.eye(3), [2.0, 0.0, 0.0]), "odom", "base_link", sec=6)
    put(out, rigid_rt(R_Z90, [3.0, 1.0, 0.0]), "odom", "base_link", sec=8)
    np.testing.assert_allclose(out.camera_pose(stamp(8), "cam_optical"), rigid_rt(R_Z90, [3.0, 1.0, 0.0]) @ T_base_cam,
                               atol=1e-9)
    # between two odometry stamps tf2 interpolates: 1 m forward at t = 5
    np.testing.assert_allclose(out.camera_pose(stamp(5), "cam_optical"), rigid_rt(np.eye(3), [1.0, 0, 0]) @ T_base_cam,
                               atol=1e-9)
    np.testing.assert_allclose(out.camera_position(stamp(5), "cam_optical"), [1.2, 0.0, 0.5], atol=1e-9)
    assert out.camera_pose(stamp(9), "cam_optical") is None  # after the newest odometry: no extrapolation
    assert out.camera_pose(stamp(5), "other_camera") is None


def test_camera_pose_without_a_buffer_is_none():
    settings = replace(resolve_settings({}, cuda_available=lambda: False), publish_tf=False)
    out = TfOutput(FakeNode(), settings, lambda _m: None)  # not started: no tf2 buffer
    assert out.camera_pose(stamp(1), "cam") is None and out.camera_position(stamp(1), "cam") is None
