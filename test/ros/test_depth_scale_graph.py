"""Metric scale from a depth sensor in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID).

The test plays a robot whose registered depth camera sees exactly the node's own model depth
times a known scale: an in-process replay of the same frames (tiny fixture weights, CPU) gives
each frame's model depth [H, W] (model units) and ``T_map_cam``; before each colour image
(rgb8, 294 x 518) a 32FC1 depth image (metres) with the SAME stamp, ``SCALE * model depth``
at the model's depth resolution (56 x 98: the colour image resized to width 98, no crop, so
``resample_nearest`` maps model pixel (v, u) onto sensor pixel (v, u)), is sent on ``depth``.
The node (scale_source depth) must report scale_source "depth", converge to SCALE within 2 %
and publish ~/pose translations equal to the replay's times the status scale once converged.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from builtin_interfaces.msg import Time as TimeMsg  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from graph_helpers import (GraphClient, generated_frames, image_msg, private_domain_id, replay_session,  # noqa: E402
                           start_node, stop_processes, write_node_params)
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.ros.conversions import depth_to_image_msg  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

# 1..100 with the multiplier of test_node_graph (+13), test_tf_graph (+46), test_keyframe_selector (+63),
# test_health_graph (+64), test_launch (+79) and test_scale_graph (+98): never theirs in the same process
DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 29)
NAME = "lm_dscale"
IMAGE_TOPIC = "/dscale_test/image"
DEPTH_TOPIC = "/dscale_test/depth"
START_TIMEOUT = 90.0
STEP_TIMEOUT = 40.0
SCALE = 4.0  # fixture model depths ~0.6-2.1 units -> 2.4-8.4 m, inside the estimator's [0.1, 10] m
TOLERANCE = 0.02
FRAMES = 8
WIDTH = 98
PARAMS = {"image_width": WIDTH, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", "backend": "sdpa",
          "publish_points": False, "publish_depth": False, "publish_map": False, "accumulate_map": False,
          "publish_path": False, "tf_mode": "map_to_camera", "map_frame": "map_d", "camera_frame": "cam_d",
          "scale_source": "depth"}


def replay(fixtures: Path, images: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(``T_map_cam`` [4, 4] model units, model depth [H, W] model units) of each image, as the node
    computes them."""
    from lingbot_map_ros.geometry import optical_pose_to_map
    from lingbot_map_ros.io.preprocess import model_input

    session = replay_session(fixtures, PARAMS)
    poses, depths = [], []
    for rgb in images:
        for r in session.push(model_input(rgb, WIDTH)):
            poses.append(optical_pose_to_map(r.c2w))
            depths.append(np.asarray(r.depth, dtype=np.float32).copy())
    return poses, depths


def stamp_of(k: int) -> TimeMsg:
    return TimeMsg(sec=7000 + k, nanosec=250_000_000)


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    tmp = tmp_path_factory.mktemp("depth_scale_graph")
    images = generated_frames(FRAMES)
    model_poses, model_depths = replay(fixtures, images)
    assert len(model_poses) == len(model_depths) == FRAMES
    params = write_node_params(tmp / "p.yaml", fixtures, {**PARAMS, "output_directory": str(tmp / "out")})
    log = tmp / "node.log"
    proc = start_node(NAME, params, log, DOMAIN_ID, {"image": IMAGE_TOPIC, "depth": DEPTH_TOPIC})
    client = GraphClient("depth_scale_graph_robot", DOMAIN_ID, STEP_TIMEOUT)
    client.watch(proc, log)
    got = client.msgs
    client.record_by_sec(PoseStamped, f"/{NAME}/pose", "pose", depth=50)
    client.record(Status, f"/{NAME}/status", "status", depth=200)
    images_pub = client.node.create_publisher(Image, IMAGE_TOPIC, QoSProfile(depth=10))
    depth_pub = client.node.create_publisher(Image, DEPTH_TOPIC, QoSProfile(depth=10))
    try:
        client.wait(lambda: images_pub.get_subscription_count() >= 1, "the node to subscribe to images",
                    START_TIMEOUT)
        client.wait(lambda: depth_pub.get_subscription_count() >= 1, "the node to subscribe to depth")
        time.sleep(0.3)
        for k, rgb in enumerate(images):
            # the depth a frame ahead of the colour (frame 0: its own and frame 1's): a frame's depth
            # went out with the frame before, so it is cached when its colour image is posed (two
            # topics: nothing orders their delivery; the node cache keeps the last 8)
            for j in ((0, 1) if k == 0 else (k + 1,)):
                if j >= FRAMES:
                    continue
                sensor = depth_to_image_msg(SCALE * model_depths[j], Header(stamp=stamp_of(j), frame_id="cam_d"))
                for _ in range(2):  # the node's depth subscription is best effort: send it twice
                    depth_pub.publish(sensor)
                    time.sleep(0.05)
            time.sleep(0.05)
            if k == 0:  # the first image until it arrived (a copy is a repeated stamp: dropped)
                client.publish_until(images_pub, image_msg(rgb, stamp_of(k), "cam_d"),
                                     lambda: any(s.header.stamp == stamp_of(0) for s in got["status"]),
                                     "the first image's status")
            else:  # the two scale frames come out together with the second image
                images_pub.publish(image_msg(rgb, stamp_of(k), "cam_d"))
                client.wait(lambda: stamp_of(k).sec in got["pose"], f"the pose of frame {k}")
        client.wait(lambda: any(s.header.stamp.sec == stamp_of(FRAMES - 1).sec for s in got["status"]),
                    "the last frame's status")
        yield got, model_poses, log
    finally:
        client.close()
        stop_processes(proc)


def _frame_statuses(got) -> dict[int, Status]:
    """Frame index -> the status published for that frame."""
    return {s.header.stamp.sec - 7000: s for s in got["status"] if s.frames_processed > 0}


def _converged_from(got) -> int:
    """The first frame index (0-based) whose status reports a converged scale."""
    ready = [k for k, s in _frame_statuses(got).items() if s.scale_converged]
    assert ready, "the scale never converged: " + str([(s.scale, s.scale_spread) for s in got["status"]][-5:])
    return min(ready)


def test_the_scale_converges_to_the_depth_ratio(graph):
    got, _, log = graph
    last = got["status"][-1]
    assert last.scale_source == "depth", last.scale_source
    assert last.scale_converged
    assert abs(last.scale / SCALE - 1.0) <= TOLERANCE, last.scale
    assert _converged_from(got) < FRAMES - 2  # converged with frames to spare
    assert "[ERROR]" not in log.read_text()


def test_poses_are_the_replay_times_the_scale_once_converged(graph):
    got, model_poses, _ = graph
    first = _converged_from(got)
    statuses = _frame_statuses(got)
    for k in range(FRAMES):
        p = got["pose"][stamp_of(k).sec].pose.position
        position = np.array([p.x, p.y, p.z])
        s = statuses[k].scale
        if k < first:
            assert s == 1.0 and not statuses[k].scale_converged, (k, s)
            np.testing.assert_allclose(position, model_poses[k][:3, 3], rtol=1e-3, atol=1e-5, err_msg=f"frame {k}")
        else:
            assert s == pytest.approx(SCALE, rel=TOLERANCE), (k, s)
            np.testing.assert_allclose(position, s * model_poses[k][:3, 3], rtol=1e-3, atol=1e-5,
                                       err_msg=f"frame {k}")
    assert first < FRAMES - 2
    # not vacuous: the camera moved, so scaled and unscaled positions differ
    assert np.linalg.norm(model_poses[-1][:3, 3]) > 1e-3, model_poses[-1][:3, 3]
