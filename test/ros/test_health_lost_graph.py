"""Tracking health over real DDS (loopback, a private ROS_DOMAIN_ID): lost on injected non-finite
poses, recovery, and on_lost=reset continuing the map through odometry (issue 17).

The node runs in this process (tiny fixture weights, CPU), spun as ``main.main`` spins it, with its
session wrapped so that chosen frames come back with NaN poses. A client node of its own context
publishes the images, a static ``base_link -> cam_optical`` transform and an ``odom -> base_link``
trajectory (one transform per image stamp, in the node's TF buffer before the image goes out), and
records ~/status and ~/pose. The fixture model turns by more than 30 degrees between frames, so the
test loosens ``health_max_rotation_deg`` and ``health_jump_factor`` (node parameters).
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
pytest.importorskip("tf2_ros", reason="tf2_ros not importable: install ../shared/ros_extras")

from builtin_interfaces.msg import Time  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from graph_helpers import (GraphClient, InProcessNode, fixture_params, generated_frames, image_msg,  # noqa: E402
                           pose_matrix, private_domain_id)
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.ros.conversions import transform_stamped  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 201, 30, 13, 17)  # 201..230, not test_keyframe_loop's (+3) in the same process
NODE = "lm_lost"
CAMERA = "cam_optical"
TIMEOUT = 30.0
ALIGN_TOL = 1e-6  # metres and rotation-matrix entries: exact maths through float64 messages and TF stamps
PARAMS = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", "conf_threshold": 0.0,
          "publish_points": False, "publish_depth": False, "publish_map": False, "accumulate_map": False,
          "publish_path": False, "publish_tf": True, "odom_frame": "odom", "on_lost": "continue",
          "health_max_rotation_deg": 180.0, "health_jump_factor": 1e6, "service_timeout": 20.0}
T_BASE_CAM = np.array([[0.0, 0.0, 1.0, 0.2], [-1.0, 0.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.5], [0.0, 0.0, 0.0, 1.0]])


def odom_base(k: int) -> np.ndarray:
    """The robot's odometry at frame k: a curve, 5 degrees of yaw per frame (metres)."""
    a = math.radians(5.0 * k)
    T = np.eye(4)
    T[:3, :3] = [[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0], [0.0, 0.0, 1.0]]
    T[:3, 3] = (0.1 * k, 0.02 * k * k, 0.0)
    return T


def stamp_of(k: int) -> Time:
    return Time(sec=100 + k, nanosec=0)


class Poison:
    """The node's session, with the next ``count`` results that are not empty given non-finite poses
    (c2w and pose_enc NaN), as a diverging model would."""

    def __init__(self, session) -> None:
        self._s = session
        self._lock = threading.Lock()
        self.count = 0

    def __getattr__(self, name):
        return getattr(self._s, name)

    def arm(self, count: int = 1) -> None:
        with self._lock:
            self.count = count

    def results(self, pending):
        results = self._s.results(pending)
        with self._lock:
            poison = bool(results) and self.count > 0
            self.count -= int(poison)
        for r in results if poison else ():
            r.c2w = np.full((4, 4), np.nan)
            r.pose_enc = np.full_like(r.pose_enc, np.nan)
        return results


class Robot(GraphClient):
    """Client node (own context): images, TF (static extrinsic + odometry), records ~/status and ~/pose."""

    def __init__(self) -> None:
        import tf2_ros

        super().__init__("lost_graph_robot", DOMAIN_ID, TIMEOUT)
        self.record(Status, f"/{NODE}/status", "status", depth=500)
        self.record(PoseStamped, f"/{NODE}/pose", "pose", depth=500)
        self.images = self.node.create_publisher(Image, "image", QoSProfile(depth=10))
        self.tf = tf2_ros.TransformBroadcaster(self.node)
        self.static = tf2_ros.StaticTransformBroadcaster(self.node)

    def statuses(self, k: int) -> list[Status]:
        s = stamp_of(k)
        return [m for m in self.msgs["status"] if (m.header.stamp.sec, m.header.stamp.nanosec) == (s.sec, s.nanosec)]

    def pose(self, k: int) -> np.ndarray:
        s = stamp_of(k)
        msg = self.wait(lambda: next((m for m in self.msgs["pose"] if m.header.stamp.sec == s.sec), None),
                        f"the pose of frame {k}")
        return pose_matrix(msg)

    def send(self, node: InProcessNode, k: int, rgb: np.ndarray) -> None:
        """Odometry for frame k into the node's TF buffer, then the image; waits for its status."""
        self.tf.sendTransform(transform_stamped(odom_base(k), Header(stamp=stamp_of(k), frame_id="odom"), "base_link"))
        deadline = time.monotonic() + TIMEOUT
        while node.node.channels[""].outputs.tf.camera_pose(stamp_of(k), CAMERA) is None:
            assert time.monotonic() < deadline, f"odometry of frame {k} never reached the node's TF buffer"
            time.sleep(0.02)
        msg = image_msg(rgb, stamp_of(k), CAMERA)
        if k == 0:  # the first image until it arrived (a copy is a repeated stamp: dropped, one more status)
            self.publish_until(self.images, msg, lambda: self.statuses(k), f"a status of frame {k}")
        else:
            self.images.publish(msg)
            self.wait(lambda: self.statuses(k), f"a status of frame {k}")


def last_state(robot: Robot, k: int) -> str:
    """The tracking state after frame k (its last status; later frames' statuses prove it arrived)."""
    return robot.statuses(k)[-1].tracking_state


@pytest.fixture(scope="module")
def run(fixtures):
    """Frames 0-9 with on_lost continue (NaN at 6), then on_lost reset, frames 10-15 (NaN at 12)."""
    node = InProcessNode(NODE, fixture_params(fixtures, PARAMS), DOMAIN_ID)
    session = node.node.channels[""].engine.session = Poison(node.node.channels[""].engine.session)  # before any image
    node.start()
    robot = Robot()
    try:
        robot.static.sendTransform(transform_stamped(T_BASE_CAM, Header(stamp=stamp_of(0), frame_id="base_link"),
                                                     CAMERA))
        robot.wait(lambda: robot.images.get_subscription_count() >= 1, "the node to subscribe")
        imgs = generated_frames(16)
        for k in range(10):
            if k == 6:
                session.arm(1)
            robot.send(node, k, imgs[k])
            if k == 6:  # a heartbeat (same stamp, the sequence's own text) follows the drop's status, as on slow CI
                robot.wait(lambda: len(robot.statuses(6)) >= 2, "a heartbeat after the dropped frame")
        node.node.set_parameters([Parameter("on_lost", value="reset")])
        for k in range(10, 16):
            if k == 12:
                session.arm(1)
            robot.send(node, k, imgs[k])
        robot.wait(lambda: robot.statuses(15) and len(robot.msgs["pose"]) >= 14, "the last frame's pose")
        yield node, robot
    finally:
        robot.close()
        node.close()


def test_status_goes_tracking_lost_and_back_to_tracking(run):
    """on_lost continue: tracking before the NaN pose, lost on it (reason non_finite), lost for the
    next good frames until health_recover_after (3) of them, then tracking again; no reset."""
    _, robot = run
    states = [last_state(robot, k) for k in range(2, 10)]
    assert states == ["tracking"] * 4 + ["lost", "lost", "lost", "tracking"], states
    # the drop's own status (a heartbeat may follow it with the same stamp and the sequence's text)
    dropped = [s for s in robot.statuses(6) if "non-finite pose" in s.state_text]
    assert dropped, [s.state_text for s in robot.statuses(6)]
    assert (dropped[-1].tracking_state, dropped[-1].tracking_reasons, dropped[-1].lost_resets) == \
        ("lost", "non_finite", 0)


def test_on_lost_reset_counts_and_continues_from_the_last_good_pose(run):
    """on_lost reset: the NaN pose at frame 12 starts a new sequence (lost_resets 1); its first frame
    (13) is published at the last good pose (frame 11) moved by the odometry between the two stamps,
    within ALIGN_TOL."""
    node, robot = run
    lost = robot.statuses(12)
    assert [s.lost_resets for s in lost][-1] == 1 and lost[-1].tracking_state == "initializing"
    assert "aligned to the last good pose through odometry" in lost[-1].state_text
    assert last_state(robot, 11) == "tracking"
    T_odom_cam = {k: odom_base(k) @ T_BASE_CAM for k in (11, 13)}
    expected = robot.pose(11) @ np.linalg.inv(T_odom_cam[11]) @ T_odom_cam[13]
    np.testing.assert_allclose(robot.pose(13), expected, atol=ALIGN_TOL)
    # without the alignment the new sequence would start at its own origin: the check could fail
    assert np.linalg.norm(expected[:3, 3]) > 0.5
    assert any("map continued from the last good pose" in s.state_text for s in robot.statuses(13))
    assert robot.statuses(15)[-1].lost_resets == 1 and "continued from frame" in node.node.channels[""].engine.seq.anchor.map_alignment
