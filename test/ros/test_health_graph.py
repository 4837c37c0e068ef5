"""Tracking health in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID): one node
process (tiny fixture weights, CPU) takes a few images; ~/odometry carries the health
covariance (x100 while initializing, x1 once tracking), ~/status the tracking state, and
/diagnostics a "tracking" entry."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from builtin_interfaces.msg import Time as TimeMsg  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from nav_msgs.msg import Odometry  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.robot.health import HealthConfig  # noqa: E402
from lingbot_map_ros.ros.conversions import rgb_to_image_msg  # noqa: E402
from lingbot_map_ros.ros.params import write_params_file  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = 1 + (os.getpid() * 7 + 13 + 51) % 100  # not the other graph modules' offsets
IMAGE_TOPIC = "/health_test/image"
NAME = "lm_health"
START_TIMEOUT = 90.0
STEP_TIMEOUT = 40.0
FRAMES = 6


def generated_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """n RGB frames [294, 518, 3] uint8 of a sliding blocky texture."""
    rng = np.random.default_rng(seed)
    big = np.kron(rng.integers(0, 256, (40, 120, 3)).astype(np.float32), np.ones((8, 8, 1)))
    return [big[10 + i: 304 + i, 20 + 7 * i: 538 + 7 * i].astype(np.uint8) for i in range(n)]


def start_node(params: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(DOMAIN_ID),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "lingbot_map_ros.ros.node", "--ros-args", "--params-file", str(params),
           "-r", f"__node:={NAME}", "-r", f"image:={IMAGE_TOPIC}"]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    tmp = tmp_path_factory.mktemp("health_graph")
    params = {"checkpoint": str(fixtures / "weights.safetensors"), "model_config": str(fixtures / "config.json"),
              "image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu",
              "conf_threshold": 0.0, "publish_points": False, "publish_depth": False, "publish_map": False,
              "accumulate_map": False, "publish_path": False, "publish_tf": False,
              "output_directory": str(tmp / "out")}
    log = tmp / "node.log"
    proc = start_node(write_params_file(tmp / "p.yaml", params), log)
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=DOMAIN_ID)
    node = rclpy.create_node("health_graph_robot", context=context)
    got = {"odometry": [], "status": [], "diagnostics": []}
    cond = threading.Condition()

    def keep(kind):
        def store(msg):
            with cond:
                got[kind].append(msg)
                cond.notify_all()
        return store

    node.create_subscription(Odometry, f"/{NAME}/odometry", keep("odometry"), QoSProfile(depth=50))
    node.create_subscription(Status, f"/{NAME}/status", keep("status"), QoSProfile(depth=200))
    node.create_subscription(DiagnosticArray, "/diagnostics", keep("diagnostics"), QoSProfile(depth=50))
    images = node.create_publisher(Image, IMAGE_TOPIC, QoSProfile(depth=10))
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    thread = threading.Thread(target=executor.spin, daemon=True)
    thread.start()

    def wait(predicate, what, timeout=STEP_TIMEOUT):
        deadline = time.monotonic() + timeout
        with cond:
            while not predicate():
                assert proc.poll() is None, f"the node ended early:\n{log.read_text()[-3000:]}"
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"timed out after {timeout} s waiting for {what}:\n{log.read_text()[-2000:]}"
                cond.wait(min(remaining, 0.1))

    try:
        wait(lambda: images.get_subscription_count() >= 1, "the node to subscribe", START_TIMEOUT)
        for k, rgb in enumerate(generated_frames(FRAMES)):
            images.publish(rgb_to_image_msg(rgb, Header(stamp=TimeMsg(sec=7000 + k), frame_id="cam"), "rgb8"))
            if k >= 1:  # the two scale frames come out together with the second image
                wait(lambda: len(got["odometry"]) >= k + 1, f"odometry of frame {k}")
            else:
                wait(lambda: any(st.frames_received >= 1 for st in got["status"]), "the first image's status")
        wait(lambda: len(got["odometry"]) >= FRAMES, f"{FRAMES} odometry messages")
        wait(lambda: any(s.name.endswith(": tracking") for a in got["diagnostics"] for s in a.status),
             "a tracking diagnostics entry")
        yield got, log
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.shutdown(context=context)
        stop_process(proc)


def _key(stamp) -> tuple[int, int]:
    return stamp.sec, stamp.nanosec


def test_odometry_covariance_follows_the_tracking_state(graph):
    """Each ~/odometry covariance is the diagonal of the state the same frame's ~/status reports
    (the random fixture weights turn by more than 30 degrees a frame: rotation_jump keeps the
    track initializing, which the engine tests cover the other way)."""
    got, _ = graph
    cfg = HealthConfig()
    states = {_key(s.header.stamp): s.tracking_state for s in got["status"] if s.frames_processed > 0}
    factors = {"tracking": cfg.factor_tracking, "degraded": cfg.factor_degraded,
               "initializing": cfg.factor_initializing, "lost": cfg.factor_lost}
    for msg in got["odometry"]:
        cov = np.asarray(msg.pose.covariance).reshape(6, 6)
        factor = factors[states[_key(msg.header.stamp)]]
        expected = np.diag([cfg.base_translation_std ** 2 * factor] * 3
                           + [np.radians(cfg.base_rotation_std_deg) ** 2 * factor] * 3)
        np.testing.assert_allclose(cov, expected, rtol=1e-9)
    assert np.asarray(got["odometry"][0].pose.covariance)[0] == pytest.approx(
        cfg.base_translation_std ** 2 * cfg.factor_initializing)


def test_status_and_diagnostics_report_tracking(graph):
    got, _ = graph
    processed = [s for s in got["status"] if s.frames_processed > 0]
    assert processed[0].tracking_state == "initializing"
    assert all(s.tracking_state in ("initializing", "tracking", "degraded", "lost") for s in processed)
    bad = [s for s in processed if s.tracking_reasons]
    assert all(set(s.tracking_reasons.split(",")) <= {"rotation_jump", "translation_jump", "low_confidence",
                                                      "confidence_collapse"} for s in bad)
    entries = [s for a in got["diagnostics"] for s in a.status if s.name.endswith(": tracking")]
    values = {kv.key: kv.value for kv in entries[-1].values}
    assert values["on_lost"] == "continue" and values["lost resets"] == "0"
    expected_level = {"degraded": DiagnosticStatus.WARN, "lost": DiagnosticStatus.ERROR}.get(
        values["state"], DiagnosticStatus.OK)
    assert entries[-1].level == expected_level and entries[-1].message.startswith(values["state"])


def test_the_node_logged_no_error(graph):
    _, log = graph
    assert "[ERROR]" not in log.read_text()
