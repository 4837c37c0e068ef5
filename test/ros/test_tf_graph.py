"""The node's TF in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID).

Four node processes (tiny fixture weights, CPU) take the same image topic, one per
``tf_mode``, each with frames of its own so that their transforms do not meet in the
one TF tree: ``map_to_odom`` (map_o, odom_o, base_o, cam_o), ``map_to_base`` (map_b,
base_b, cam_b), ``map_to_camera`` (map_c, cam_c) and ``auto`` (map_a, odom_a, base_a,
cam_a). This process plays the robot: a StaticTransformBroadcaster sends the URDF's
camera extrinsics ``base_* -> cam_*`` (known, non-trivial), a TransformBroadcaster the
odometry ``odom_* -> base_*`` at each image stamp; the extrinsic of the map_to_base node
is sent only after two frames, so that node first waits (no TF, a warning naming the
transform). A tf2_ros Buffer + TransformListener here receives everything, and each
node's transform is checked against its ~/pose (``T_map_cam``) composed with the known
extrinsic and odometry.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
tf2_ros = pytest.importorskip("tf2_ros", reason="tf2_ros not importable: install ../shared/ros_extras "
                                                "(bash ../shared/ros_extras/install.sh .venv)")

from builtin_interfaces.msg import Time as TimeMsg  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from rclpy.time import Time  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from graph_helpers import (GraphClient, generated_frames, image_msg, pose_matrix, private_domain_id,  # noqa: E402
                           start_node, stop_processes, write_node_params)
from lingbot_map_ros.geometry import quaternion_to_matrix  # noqa: E402
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.ros.conversions import transform_stamped  # noqa: E402
from lingbot_map_ros.ros.tf_tools import invert_rigid, parents_from_yaml, transform_to_matrix  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 33)  # not test_node_graph's (+0) nor test_launch's (+66)
IMAGE_TOPIC = "/tf_test/image"
START_TIMEOUT = 90.0
STEP_TIMEOUT = 40.0
ATOL = 1e-5
NODES = {  # node name -> (parameters, frames as map, odom, base, camera)
    "lm_odom": {"tf_mode": "map_to_odom", "map_frame": "map_o", "odom_frame": "odom_o", "base_frame": "base_o",
                "camera_frame": "cam_o"},
    "lm_base": {"tf_mode": "map_to_base", "map_frame": "map_b", "odom_frame": "odom_b", "base_frame": "base_b",
                "camera_frame": "cam_b"},
    "lm_cam": {"tf_mode": "map_to_camera", "map_frame": "map_c", "base_frame": "", "camera_frame": "cam_c"},
    "lm_auto": {"tf_mode": "auto", "map_frame": "map_a", "odom_frame": "odom_a", "base_frame": "base_a",
                "camera_frame": "cam_a"},
}
EARLY_FRAMES = 2  # before lm_base's extrinsic is sent
LATE_FRAMES = 3


def rigid(rotation: np.ndarray, translation) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = rotation, translation
    return T


def rotation(axis, degrees: float) -> np.ndarray:
    axis = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    half = np.radians(degrees) / 2
    return quaternion_to_matrix(np.array([*(np.sin(half) * axis), np.cos(half)]))


# camera optical axes (z forward, x right, y down) in a REP-103 base (x forward, y left, z up)
R_OPTICAL_IN_BASE = np.array([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])


def extrinsic(tilt_deg: float, offset) -> np.ndarray:
    """``T_base_cam``: a camera pitched down by ``tilt_deg`` and yawed a little, at ``offset``."""
    return rigid(rotation([0, 0, 1], 7.0) @ rotation([0, 1, 0], tilt_deg) @ R_OPTICAL_IN_BASE, offset)


EXTRINSICS = {"o": extrinsic(15.0, [0.25, 0.05, 0.6]), "b": extrinsic(-10.0, [0.1, -0.2, 0.4]),
              "c": extrinsic(30.0, [0.0, 0.1, 1.2]), "a": extrinsic(5.0, [0.3, 0.0, 0.5])}


def odometry(k: int, key: str) -> np.ndarray:
    """``T_odom_base`` of the robot at frame ``k`` (different for each node's robot)."""
    phase = {"o": 0.0, "a": 1.0}[key]
    return rigid(rotation([0, 0, 1], 20.0 * k + 30.0 * phase), [0.4 * k + phase, 0.1 * k - phase, 0.0])


def stamp_of(k: int) -> TimeMsg:
    return TimeMsg(sec=5000 + k, nanosec=250_000_000)


class Robot(GraphClient):
    """The test's side of the graph: image publisher, TF broadcasters, a TF listener, pose recorders."""

    def __init__(self) -> None:
        super().__init__("tf_graph_robot", DOMAIN_ID, STEP_TIMEOUT)
        self.poses: dict[str, dict[int, PoseStamped]] = {
            name: self.record_by_sec(PoseStamped, f"/{name}/pose", name, depth=50) for name in NODES}
        for name in NODES:
            self.record(Status, f"/{name}/status", f"{name} status")
        self.images = self.node.create_publisher(Image, IMAGE_TOPIC, QoSProfile(depth=10))
        self.buffer = tf2_ros.Buffer()
        self.listener = tf2_ros.TransformListener(self.buffer, self.node)
        self.dynamic = tf2_ros.TransformBroadcaster(self.node)
        self.urdf = tf2_ros.StaticTransformBroadcaster(self.node)
        self.urdf_late: tf2_ros.StaticTransformBroadcaster | None = None

    def send_extrinsics(self, keys: str, late: bool = False) -> None:
        msgs = [transform_stamped(EXTRINSICS[k], Header(frame_id=f"base_{k}"), f"cam_{k}") for k in keys]
        if late:  # a second latched publisher: the first one's message stays as it is
            self.urdf_late = tf2_ros.StaticTransformBroadcaster(self.node)
            self.wait_matched(self.urdf_late.pub_tf, "the late /tf_static publisher")
            self.urdf_late.sendTransform(msgs)
        else:
            self.urdf.sendTransform(msgs)
        self.wait(lambda: all(self.buffer.can_transform(f"base_{k}", f"cam_{k}", Time()) for k in keys),
                  what=f"the extrinsics of {keys} in this process's buffer")

    def wait_matched(self, publisher, what: str) -> None:
        """Until every node (and this process's listener) has discovered ``publisher``."""
        self.wait(lambda: publisher.get_subscription_count() >= len(NODES) + 1, what=f"{what} to be discovered")

    def send_frame(self, k: int, rgb: np.ndarray) -> None:
        """Odometry a frame ahead of the camera (as a robot's runs ahead of it), then the image: the
        odometry at the image stamp went out with the frame before (frame 0: with its own, and frame
        1's), so it is in the nodes' TF buffers when the image is posed (TF on /tf and the image on
        its topic: nothing orders their delivery; a node publishes no map -> odom without it)."""
        stamp = stamp_of(k)
        ahead = (0, 1) if k == 0 else (k + 1,)
        self.dynamic.sendTransform([transform_stamped(odometry(j, key), Header(stamp=stamp_of(j),
                                                                                frame_id=f"odom_{key}"), f"base_{key}")
                                    for j in ahead for key in ("o", "a")])
        time.sleep(0.05)
        self.images.publish(image_msg(rgb, stamp, "header_frame_unused"))

    def wait_poses(self, ks: range) -> None:
        self.wait(lambda: all(stamp_of(k).sec in self.poses[name] for name in NODES for k in ks),
                  what=f"poses of frames {list(ks)} from every node")

    def lookup(self, target: str, source: str, k: int, timeout: float = 10.0) -> np.ndarray:
        when = Time.from_msg(stamp_of(k))
        self.wait(lambda: self.buffer.can_transform(target, source, when), timeout=timeout,
                  what=f"TF {target} -> {source} at frame {k}")
        return transform_to_matrix(self.buffer.lookup_transform(target, source, when))

    def T_map_cam(self, name: str, k: int) -> np.ndarray:
        return pose_matrix(self.poses[name][stamp_of(k).sec])


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    root = fixtures  # skips with a message when the tiny fixture set is absent
    tmp = tmp_path_factory.mktemp("tf_graph")
    common = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu",
              "publish_points": False, "publish_depth": False, "publish_map": False, "accumulate_map": False,
              "publish_path": False, "output_directory": str(tmp / "out")}
    logs = {name: tmp / f"{name}.log" for name in NODES}
    procs = {name: start_node(name, write_node_params(tmp / f"{name}.yaml", root, {**common, **params}), logs[name],
                              DOMAIN_ID, {"image": IMAGE_TOPIC})
             for name, params in NODES.items()}
    robot = Robot()
    for name, proc in procs.items():
        robot.watch(proc, logs[name])
    try:
        robot.send_extrinsics("oca")  # lm_base's comes later
        robot.wait(lambda: robot.images.get_subscription_count() >= len(NODES), "the nodes all to subscribe",
                   START_TIMEOUT)
        robot.wait_matched(robot.dynamic.pub_tf, "the odometry publisher")
        robot.wait_matched(robot.urdf.pub_tf, "the /tf_static publisher")
        frames = generated_frames(EARLY_FRAMES + LATE_FRAMES)
        # the first frame (odometry and image) again every 1.5 s until every node has received it: a
        # node's reader can miss a writer's first sample after the writer matched it (a copy is a
        # repeated stamp: the node drops it; the odometry's copy is the same transform at the same stamp)
        robot.wait(lambda: all(any(st.frames_received >= 1 for st in robot.msgs[f"{name} status"]) for name in NODES),
                   "every node's status of the first frame", repeat=lambda: robot.send_frame(0, frames[0]))
        for k in range(1, EARLY_FRAMES):
            robot.send_frame(k, frames[k])
            time.sleep(0.2)
        robot.wait_poses(range(EARLY_FRAMES))
        robot.send_extrinsics("b", late=True)
        for k in range(EARLY_FRAMES, EARLY_FRAMES + LATE_FRAMES):
            robot.send_frame(k, frames[k])
            robot.wait_poses(range(k, k + 1))  # one frame at a time: each node has a pose for every stamp
        yield robot, logs
    finally:
        stop_processes(*procs.values())  # all at once: they stop in parallel
        robot.close()


ALL = range(EARLY_FRAMES + LATE_FRAMES)
LATE = range(EARLY_FRAMES, EARLY_FRAMES + LATE_FRAMES)


@pytest.mark.parametrize("name, key", [("lm_odom", "o"), ("lm_auto", "a")])
def test_map_to_odom_puts_the_base_where_the_model_sees_it(graph, name, key):
    robot, logs = graph
    T_cam_base = invert_rigid(EXTRINSICS[key])
    for k in ALL:
        T_map_base = robot.T_map_cam(name, k) @ T_cam_base  # the model's estimate of the base
        np.testing.assert_allclose(robot.lookup(f"map_{key}", f"odom_{key}", k),
                                   T_map_base @ invert_rigid(odometry(k, key)), atol=ATOL)
        # the whole chain map -> odom -> base -> camera lands on the node's camera pose
        np.testing.assert_allclose(robot.lookup(f"map_{key}", f"base_{key}", k), T_map_base, atol=ATOL)
        np.testing.assert_allclose(robot.lookup(f"map_{key}", f"cam_{key}", k), robot.T_map_cam(name, k), atol=ATOL)
    if name == "lm_auto":
        assert "TF: publishing map_a -> odom_a, tf_mode map_to_odom (auto:" in logs[name].read_text()


def test_map_to_base_waits_for_the_extrinsic_then_publishes(graph):
    robot, logs = graph
    T_cam_base = invert_rigid(EXTRINSICS["b"])
    # the late extrinsic reaches the node's TF buffer some time after this process's: the first frame
    # after it may still go without TF (as it should); every later one has it, composed correctly
    first = LATE[0]
    if robot.buffer.can_transform("map_b", "base_b", Time.from_msg(stamp_of(first))):
        np.testing.assert_allclose(robot.lookup("map_b", "base_b", first),
                                   robot.T_map_cam("lm_base", first) @ T_cam_base, atol=ATOL)
    for k in LATE[1:]:
        np.testing.assert_allclose(robot.lookup("map_b", "base_b", k), robot.T_map_cam("lm_base", k) @ T_cam_base,
                                   atol=ATOL)
    # before the extrinsic: no TF at those stamps (the first map_b -> base_b is later than them)
    for k in range(EARLY_FRAMES):
        assert not robot.buffer.can_transform("map_b", "base_b", Time.from_msg(stamp_of(k)))
    log = logs["lm_base"].read_text()
    assert "waiting for TF cam_b -> base_b (the camera extrinsic" in log, log[-3000:]


def test_map_to_camera_publishes_its_own_child_and_keeps_the_urdf_parent(graph):
    robot, _ = graph
    for k in ALL:
        np.testing.assert_allclose(robot.lookup("map_c", "cam_c_lingbot", k), robot.T_map_cam("lm_cam", k),
                                   atol=ATOL)
    parents = parents_from_yaml(robot.buffer.all_frames_as_yaml())
    assert parents["cam_c"] == "base_c" and parents["cam_c_lingbot"] == "map_c"
    # and the robots' frames kept their parents too: nobody gave a frame a second one
    assert (parents["base_o"], parents["base_a"], parents["odom_o"], parents["odom_a"], parents["base_b"]) == (
        "odom_o", "odom_a", "map_o", "map_a", "map_b")


def test_no_node_logged_an_error(graph):
    _, logs = graph
    for name, log in logs.items():
        bad = [line for line in log.read_text().splitlines() if "ERROR" in line or "Traceback" in line]
        assert not bad, f"{name}:\n" + "\n".join(bad[:10])
