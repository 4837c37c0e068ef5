"""Loop closure in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID): a node process
with the tiny fixture weights on the CPU, loop_closure on, its state in a state_directory.

This is the *plumbing* test (random tiny weights give no meaningful relative pose: the geometry of
closures and relocalisation is checked against a known scene in test/core/test_loop_engine.py). It
drives what a robot sees over ROS: a stream that comes back to its first places makes candidates
that the model's side session verifies (~/status counters, ~/loop_closures markers, /diagnostics);
REP 105 TF (map -> odom -> camera); ~/set_pose refused with its reason for each bad input and
taken for a good one (map -> odom moves by it); ~/pose_prior refused on ~/status; ~/save_map writes
the corrected and the raw trajectories; kill -9 and a restart on the same state_directory give
back the same pose graph and the same map -> odom.
"""
from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
tf2_ros = pytest.importorskip("tf2_ros", reason="tf2_ros not installed (scripts/bootstrap.sh installs ros_extras)")

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from geometry_msgs.msg import PoseWithCovarianceStamped  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from visualization_msgs.msg import MarkerArray  # noqa: E402

from graph_helpers import (GraphClient, image_msg, private_domain_id, start_node, stop_processes,  # noqa: E402
                           write_node_params)
from lingbot_map_ros.io.export import read_tum  # noqa: E402
from lingbot_map_ros.msg import FrameInfo, Status  # noqa: E402
from lingbot_map_ros.ros.tf_tools import transform_to_matrix  # noqa: E402
from lingbot_map_ros.runtime.loop_journal import read_loop_journal  # noqa: E402
from lingbot_map_ros.srv import SaveMap, SetPose  # noqa: E402
from loop_scene import place_image, tagged  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 61)  # not the other graph modules' offsets
NAME, TOPIC = "lm_loop", "/loop_cam/image"
PLACES, REVISITS = 10, 4  # ten places, then the first four again (more than a window later)
PARAMS = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "keyframe_interval": 1,
          "window_frames": 5, "device": "cpu", "conf_threshold": 0.0, "publish_points": False,
          "publish_depth": False, "publish_map": True, "publish_path": True, "publish_tf": True,
          "tf_mode": "map_to_camera", "loop_closure": True, "loop_min_separation": 6,
          "loop_min_similarity": 0.9}
START_TIMEOUT, STEP_TIMEOUT = 90.0, 60.0


def frames() -> list[np.ndarray]:
    return [tagged(place_image(k % PLACES, 56, 98), k) for k in range(PLACES + REVISITS)]


class Robot:
    """The robot's side: images out; ~/frame, ~/status, markers, /diagnostics and TF in."""

    def __init__(self) -> None:
        self.client = GraphClient("lm_loop_robot", DOMAIN_ID, STEP_TIMEOUT)
        c = self.client
        self.frames: dict[int, FrameInfo] = {}
        c.subscribe(FrameInfo, f"/{NAME}/frame", lambda m: self.frames.__setitem__(m.frame_index, m), depth=50)
        self.statuses = c.record(Status, f"/{NAME}/status", "status", depth=200)
        self.markers = c.record(MarkerArray, f"/{NAME}/loop_closures", "markers", depth=5)
        self.diagnostics = c.record(DiagnosticArray, "/diagnostics", "diagnostics", depth=20)
        self.images = c.node.create_publisher(Image, TOPIC, QoSProfile(depth=10))
        self.priors = c.node.create_publisher(PoseWithCovarianceStamped, f"/{NAME}/pose_prior", QoSProfile(depth=10))
        self.buffer = tf2_ros.Buffer()
        self.listener = tf2_ros.TransformListener(self.buffer, c.node)

    def ready(self, log: Path) -> None:
        c = self.client
        c.wait(lambda: "ready: listening" in log.read_text(errors="replace"), "the node", START_TIMEOUT)
        c.wait(lambda: self.images.get_subscription_count() >= 1, "the node to subscribe", START_TIMEOUT)
        self.statuses.clear()
        c.wait(lambda: c.node.count_publishers(f"/{NAME}/frame") >= 1 and self.statuses, "a ~/status", START_TIMEOUT)

    def send(self, k: int, rgb: np.ndarray, stamp: float) -> FrameInfo | Status:
        """Frame ``k`` at ``stamp`` s, until its ~/status comes (posed, collected or looked for)."""
        msg = image_msg(rgb, int(stamp), "cam")
        sec = int(stamp)
        got = lambda: next((s for s in self.statuses if s.header.stamp.sec == sec  # noqa: E731
                            and not s.state_text.startswith("ready")), None)
        return self.client.publish_until(self.images, msg, got, f"the status of frame {k}")

    def status(self) -> Status:
        with self.client.cond:
            return self.statuses[-1]

    def map_to_odom(self) -> np.ndarray:
        t = self.buffer.lookup_transform("map", "odom", rclpy.time.Time())
        return transform_to_matrix(t)

    def set_pose(self, request) -> SetPose.Response:
        return self.client.call(SetPose, f"/{NAME}/set_pose", request, timeout=30.0)


def pose_request(x=0.0, q=(0.0, 0.0, 0.0, 1.0), cov=None, frame="map", stamp=0) -> SetPose.Request:
    req = SetPose.Request()
    p = req.pose
    p.header.frame_id, p.header.stamp.sec = frame, int(stamp)
    p.pose.pose.position.x = float(x)
    p.pose.pose.orientation.x, p.pose.pose.orientation.y, p.pose.pose.orientation.z, p.pose.pose.orientation.w = q
    p.pose.covariance = list(np.diag([0.01] * 6).reshape(-1) if cov is None else np.asarray(cov, float).reshape(-1))
    return req


def test_loop_closure_plumbing_in_a_ros_graph(fixtures, tmp_path):
    state, out = tmp_path / "state", tmp_path / "out"
    params = write_node_params(tmp_path / "p.yaml", fixtures, {**PARAMS, "state_directory": str(state),
                                                              "output_directory": str(out)})
    images = frames()
    robot = Robot()
    procs = []
    try:
        log1 = tmp_path / "first.log"
        first = start_node(NAME, params, log1, DOMAIN_ID, {"image": TOPIC})
        procs.append(first)
        robot.client.watch(first, log1)
        robot.ready(log1)
        for k, rgb in enumerate(images):
            robot.send(k, rgb, 1000 + k)
        c = robot.client
        # every candidate goes through the model's side session and is decided (tiny weights: the
        # verdict itself is not the point here)
        st = c.wait(lambda: (s := self_status(robot)) and s.loop_candidates >= 1
                    and s.loop_accepted + s.loop_rejected == s.loop_candidates and s, "a decided loop candidate",
                    repeat=lambda: None)
        assert st.loop_closure and st.loop_keyframes >= PLACES, st
        c.wait(lambda: any(sum(len(m.points) for m in a.markers) >= 2 for a in robot.markers), "~/loop_closures")
        c.wait(lambda: any("loop closure" in s.name for a in robot.diagnostics for s in a.status),
               "a loop closure entry on /diagnostics")
        # REP 105: map -> odom (the correction) and odom -> the camera (the stream's own pose)
        (before,) = c.wait(lambda: _lookup(robot), "map -> odom on /tf")
        c.wait(lambda: robot.buffer.can_transform("odom", "cam_lingbot", rclpy.time.Time()), "odom -> cam_lingbot")

        # ~/set_pose: each bad input is refused with its reason and changes nothing
        bad = {"NaN": pose_request(x=math.nan),
               "unit quaternion": pose_request(q=(0.0, 0.0, 0.0, 0.5)),
               "positive definite": pose_request(cov=np.diag([0.01, 0.01, -0.01, 0.01, 0.01, 0.01])),
               "not the map frame": pose_request(frame="odom"),
               "from the nearest frame": pose_request(stamp=5000)}
        for reason, request in bad.items():
            answer = robot.set_pose(request)
            assert not answer.success and reason in answer.message, (reason, answer.message)
        time.sleep(0.3)
        np.testing.assert_allclose(robot.map_to_odom(), before, atol=1e-9)

        # a good one: the latest frame is 1 unit further along x in the map; map -> odom moves by it
        last = robot.frames[max(robot.frames)]
        p = last.pose.position
        q = last.pose.orientation
        request = pose_request(x=p.x + 1.0, q=(q.x, q.y, q.z, q.w))
        request.pose.pose.pose.position.y, request.pose.pose.pose.position.z = p.y, p.z
        answer = robot.set_pose(request)
        assert answer.success, answer.message
        robot.send(PLACES + REVISITS, images[5], 1000 + PLACES + REVISITS)  # a frame publishes TF again
        (moved,) = c.wait(lambda: (T := _lookup(robot)) is not None
                          and np.linalg.norm(T[0][:3, 3] - before[:3, 3]) > 0.5 and T, "map -> odom to move by the set pose")
        assert abs(np.linalg.norm(moved[:3, 3] - before[:3, 3]) - 1.0) < 0.05

        # ~/pose_prior: a refusal is said on ~/status (and in the log)
        prior = pose_request(q=(0.0, 0.0, 0.0, 2.0)).pose
        robot.priors.publish(prior)
        c.wait(lambda: any("pose prior refused" in s.state_text and "unit quaternion" in s.state_text
                           for s in robot.statuses), "the pose prior's refusal on ~/status",
               repeat=lambda: robot.priors.publish(prior))

        # ~/save_map: the corrected trajectory and the front end's, one set pose apart
        saved = c.call(SaveMap, f"/{NAME}/save_map", SaveMap.Request(directory=str(out / "map")), timeout=60.0)
        assert saved.success, saved.message
        stamps, corrected = read_tum(saved.trajectory_path)
        raw_stamps, raw = read_tum(Path(saved.trajectory_path).with_name("trajectory_raw.tum"))
        assert np.array_equal(stamps, raw_stamps) and len(stamps) >= PLACES
        shift = np.linalg.norm(corrected[-1][:3, 3] - raw[-1][:3, 3])
        assert shift > 0.5, shift

        # kill -9 once the loop journal holds the set pose; a restart gives back the same graph
        c.wait(lambda: "lframe" in [r.kind for r in read_loop_journal(state / "loop.lbj").records],
               "the loop journal to hold the set pose")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        keyframes = [r.kind for r in read_loop_journal(state / "loop.lbj").records].count("lkf")  # as the kill left it
        c._watched.clear()
        log2 = tmp_path / "second.log"
        second = start_node(NAME, params, log2, DOMAIN_ID, {"image": TOPIC})
        procs.append(second)
        c.watch(second, log2)
        robot.ready(log2)
        after = robot.status()
        assert after.loop_keyframes == keyframes and after.localization == "", after
        robot.send(99, images[6], 2000)
        (again,) = c.wait(lambda: _lookup(robot, newer_than=2000), "map -> odom after the restart")
        np.testing.assert_allclose(again[:3, 3], moved[:3, 3], atol=0.05)
    finally:
        robot.client.close()
        stop_processes(*procs)


def self_status(robot: Robot) -> Status | None:
    return robot.statuses[-1] if robot.statuses else None


def _lookup(robot: Robot, newer_than: float = 0.0) -> tuple[np.ndarray] | None:
    """(map -> odom [4, 4],) as the robot's TF buffer has it now (stamped ``newer_than`` s or later)."""
    try:
        t = robot.buffer.lookup_transform("map", "odom", rclpy.time.Time())
    except (tf2_ros.LookupException, tf2_ros.ConnectivityException, tf2_ros.ExtrapolationException):
        return None
    if t.header.stamp.sec + 1e-9 * t.header.stamp.nanosec < newer_than:
        return None
    return (transform_to_matrix(t),)
