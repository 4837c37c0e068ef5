"""Metric scale from odometry in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID).

The test plays a robot whose odometry is the node's own model trajectory times a known
scale: an in-process replay of the same frames (tiny fixture weights, CPU) gives
``T_map_cam`` in model units; a static TF sends the camera extrinsic ``base_s -> cam_s``;
before each image, ``odom_s -> base_s`` at the image stamp is sent so that
``T_odom_cam = apply_scale(T_map_cam_model, SCALE)``. The node (tf_mode map_to_odom,
scale_source odometry) must converge to SCALE within 2 %, publish ~/pose translations SCALE
times the replay's once converged, and send no map -> odom TF before that (then ~identity,
since the odometry is the scaled map itself).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
tf2_ros = pytest.importorskip("tf2_ros", reason="tf2_ros not importable: install ../shared/ros_extras")

from builtin_interfaces.msg import Time as TimeMsg  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402
from tf2_msgs.msg import TFMessage  # noqa: E402

from graph_helpers import (GraphClient, generated_frames, image_msg, pose_matrix, private_domain_id,  # noqa: E402
                           replay_session, start_node, stop_processes, write_node_params)
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.robot.scale import apply_scale  # noqa: E402
from lingbot_map_ros.ros.conversions import transform_stamped  # noqa: E402
from lingbot_map_ros.ros.tf_tools import invert_rigid, transform_to_matrix  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 85)  # not the other graph modules' offsets
NAME = "lm_scale"
IMAGE_TOPIC = "/scale_test/image"
START_TIMEOUT = 90.0
STEP_TIMEOUT = 40.0
SCALE = 10.0  # the fixture model moves ~0.03-0.06 units a frame: odometry steps above min_motion (0.1 m)
TOLERANCE = 0.02
FRAMES = 14
WIDTH = 98
PARAMS = {"image_width": WIDTH, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", "backend": "sdpa",
          "publish_points": False, "publish_depth": False, "publish_map": False, "accumulate_map": False,
          "publish_path": False, "tf_mode": "map_to_odom", "map_frame": "map_s", "odom_frame": "odom_s",
          "base_frame": "base_s", "camera_frame": "cam_s", "scale_source": "odometry"}
R_OPTICAL_IN_BASE = np.array([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
T_BASE_CAM = np.eye(4)
T_BASE_CAM[:3, :3], T_BASE_CAM[:3, 3] = R_OPTICAL_IN_BASE, [0.2, 0.05, 0.5]


def replay_poses(fixtures: Path, images: list[np.ndarray]) -> list[np.ndarray]:
    """``T_map_cam`` [4, 4] (model units) of each image, as the node computes them."""
    from lingbot_map_ros.geometry import optical_pose_to_map
    from lingbot_map_ros.io.preprocess import model_input

    session = replay_session(fixtures, PARAMS)
    out = []
    for rgb in images:
        out += [optical_pose_to_map(r.c2w) for r in session.push(model_input(rgb, WIDTH))]
    return out


def stamp_of(k: int) -> TimeMsg:
    return TimeMsg(sec=9000 + k, nanosec=500_000_000)


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    tmp = tmp_path_factory.mktemp("scale_graph")
    images = generated_frames(FRAMES)
    model_poses = replay_poses(fixtures, images)
    assert len(model_poses) == FRAMES
    params = write_node_params(tmp / "p.yaml", fixtures, {**PARAMS, "output_directory": str(tmp / "out")})
    log = tmp / "node.log"
    proc = start_node(NAME, params, log, DOMAIN_ID, {"image": IMAGE_TOPIC})
    client = GraphClient("scale_graph_robot", DOMAIN_ID, STEP_TIMEOUT)
    client.watch(proc, log)
    got = client.msgs
    client.record_by_sec(PoseStamped, f"/{NAME}/pose", "pose", depth=50)
    client.record(Status, f"/{NAME}/status", "status", depth=200)
    tf = got["tf"] = []
    client.subscribe(TFMessage, "/tf", lambda msg: tf.extend(t for t in msg.transforms if t.header.frame_id == "map_s"),
                     depth=100)
    images_pub = client.node.create_publisher(Image, IMAGE_TOPIC, QoSProfile(depth=10))
    # the robot's own view of the tree: map -> base_s through the node's map -> odom and the odometry
    got["tf_buffer"] = tf2_ros.Buffer()
    listener = tf2_ros.TransformListener(got["tf_buffer"], client.node)  # noqa: F841 (kept alive by the fixture)
    dynamic = tf2_ros.TransformBroadcaster(client.node)
    static = tf2_ros.StaticTransformBroadcaster(client.node)
    try:
        static.sendTransform(transform_stamped(T_BASE_CAM, Header(frame_id="base_s"), "cam_s"))
        client.wait(lambda: images_pub.get_subscription_count() >= 1, "the node to subscribe", START_TIMEOUT)
        client.wait(lambda: dynamic.pub_tf.get_subscription_count() >= 1, "the node's TF listener")
        time.sleep(0.5)  # the latched extrinsic reaches the node's listener
        for k, rgb in enumerate(images):
            T_odom_cam = apply_scale(model_poses[k], SCALE)
            T_odom_base = T_odom_cam @ invert_rigid(T_BASE_CAM)
            dynamic.sendTransform(transform_stamped(T_odom_base, Header(stamp=stamp_of(k), frame_id="odom_s"),
                                                    "base_s"))
            time.sleep(0.1)  # odometry runs ahead of the camera
            if k == 0:  # the first image until it arrived (a copy is a repeated stamp: dropped)
                client.publish_until(images_pub, image_msg(rgb, stamp_of(k), "unused"),
                                     lambda: any(s.header.stamp == stamp_of(0) for s in got["status"]),
                                     "the first image's status")
            else:  # the two scale frames come out together with the second image
                images_pub.publish(image_msg(rgb, stamp_of(k), "unused"))
                client.wait(lambda: stamp_of(k).sec in got["pose"], f"the pose of frame {k}")
        # the tests read every frame's status: the last one leaves after its pose, on its own topic
        client.wait(lambda: any(s.header.stamp == stamp_of(FRAMES - 1) and s.frames_processed > 0
                                for s in got["status"]), "the last frame's status")
        yield got, model_poses, log
    finally:
        client.close()
        stop_processes(proc)


def _converged_from(got) -> int:
    """The first frame index (0-based) whose status reports a converged scale."""
    ready = [s.header.stamp.sec - 9000 for s in got["status"] if s.scale_converged and s.frames_processed > 0]
    assert ready, "the scale never converged: " + str([(s.scale, s.scale_spread) for s in got["status"]][-5:])
    return min(ready)


def test_the_scale_converges_to_the_odometry_ratio(graph):
    got, _, _ = graph
    last = got["status"][-1]
    assert last.scale_source == "odometry" and last.scale_converged
    assert abs(last.scale / SCALE - 1.0) <= TOLERANCE, last.scale
    assert _converged_from(got) < FRAMES - 2  # converged with frames to spare


def test_poses_are_the_replay_times_the_scale_once_converged(graph):
    got, model_poses, _ = graph
    first = _converged_from(got)
    scales = {s.header.stamp.sec: s.scale for s in got["status"] if s.frames_processed > 0}
    for k in range(FRAMES):
        p = got["pose"][stamp_of(k).sec].pose.position
        position = np.array([p.x, p.y, p.z])
        s = scales[stamp_of(k).sec]
        if k < first:
            assert s == 1.0
        np.testing.assert_allclose(position, s * model_poses[k][:3, 3], rtol=1e-4, atol=1e-5, err_msg=f"frame {k}")
    assert scales[stamp_of(FRAMES - 1).sec] == pytest.approx(SCALE, rel=TOLERANCE)


def test_map_to_odom_waits_for_the_scale_then_is_about_identity(graph):
    got, _, log = graph
    first = _converged_from(got)
    sent = {t.header.stamp.sec - 9000: transform_to_matrix(t.transform) for t in got["tf"]
            if t.child_frame_id == "odom_s"}
    assert sent and min(sent) >= first, (sorted(sent), first)
    for k, T in sent.items():
        # the odometry is the map scaled by SCALE: map -> odom is identity up to the estimate's error
        np.testing.assert_allclose(T[:3, :3], np.eye(3), atol=1e-4)
        assert np.linalg.norm(T[:3, 3]) < 0.05 * SCALE, (k, T[:3, 3])
    assert "waits for the metric scale" in log.read_text()
    assert "[ERROR]" not in log.read_text()


def test_map_to_base_looked_up_through_tf2_is_the_scaled_pose_and_the_extrinsic(graph):
    """A robot's tf2_ros lookup of map -> base at a converged frame's stamp (the node's map -> odom
    composed with the odometry) puts the base where the published pose and the URDF extrinsic say:
    T_map_base = T_map_cam · inv(T_base_cam), metric, and (odometry being the scaled map) close to
    the odometry itself."""
    from rclpy.time import Time

    got, model_poses, _ = graph
    buffer = got["tf_buffer"]
    checked = 0
    for k in range(_converged_from(got), FRAMES):
        stamp = Time(seconds=stamp_of(k).sec, nanoseconds=stamp_of(k).nanosec)
        if not buffer.can_transform("map_s", "base_s", stamp):
            continue
        T_map_base = transform_to_matrix(buffer.lookup_transform("map_s", "base_s", stamp))
        T_map_cam = pose_matrix(got["pose"][stamp_of(k).sec])
        np.testing.assert_allclose(T_map_base, T_map_cam @ invert_rigid(T_BASE_CAM), atol=1e-4, err_msg=f"frame {k}")
        T_odom_base = apply_scale(model_poses[k], SCALE) @ invert_rigid(T_BASE_CAM)
        assert np.linalg.norm(T_map_base[:3, 3] - T_odom_base[:3, 3]) < 0.05 * SCALE, k
        checked += 1
    assert checked >= 3, f"map -> base_s was looked up at only {checked} converged frame(s)"
