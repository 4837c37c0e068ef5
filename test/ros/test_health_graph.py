"""Tracking health in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID): one node
process (tiny fixture weights, CPU) takes a few images; ~/odometry carries the health
covariance (x100 while initializing, x1 once tracking), ~/status the tracking state, and
/diagnostics a "tracking" entry."""
from __future__ import annotations

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from nav_msgs.msg import Odometry  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from graph_helpers import (GraphClient, generated_frames, image_msg, private_domain_id, start_node,  # noqa: E402
                           stop_processes, write_node_params)
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.robot.health import HealthConfig  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 51)  # not the other graph modules' offsets
IMAGE_TOPIC = "/health_test/image"
NAME = "lm_health"
START_TIMEOUT = 90.0
STEP_TIMEOUT = 40.0
FRAMES = 6


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    tmp = tmp_path_factory.mktemp("health_graph")
    params = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu",
              "conf_threshold": 0.0, "publish_points": False, "publish_depth": False, "publish_map": False,
              "accumulate_map": False, "publish_path": False, "publish_tf": False,
              "output_directory": str(tmp / "out")}
    log = tmp / "node.log"
    proc = start_node(NAME, write_node_params(tmp / "p.yaml", fixtures, params), log, DOMAIN_ID,
                      {"image": IMAGE_TOPIC})
    client = GraphClient("health_graph_robot", DOMAIN_ID, STEP_TIMEOUT)
    client.watch(proc, log)
    got = client.msgs
    client.record(Odometry, f"/{NAME}/odometry", "odometry", depth=50)
    client.record(Status, f"/{NAME}/status", "status", depth=200)
    client.record(DiagnosticArray, "/diagnostics", "diagnostics", depth=50)
    images = client.node.create_publisher(Image, IMAGE_TOPIC, QoSProfile(depth=10))
    try:
        client.wait(lambda: images.get_subscription_count() >= 1, "the node to subscribe", START_TIMEOUT)
        frames = generated_frames(FRAMES)
        # the first image until it arrived (a copy of it is a repeated stamp: dropped, no odometry)
        client.publish_until(images, image_msg(frames[0], 7000, "cam"),
                             lambda: any(st.frames_received >= 1 for st in got["status"]), "the first image's status")
        for k, rgb in enumerate(frames[1:], start=1):
            images.publish(image_msg(rgb, 7000 + k, "cam"))
            # the two scale frames come out together with the second image
            client.wait(lambda: len(got["odometry"]) >= k + 1, f"odometry of frame {k}")
        client.wait(lambda: len(got["odometry"]) >= FRAMES, f"{FRAMES} odometry messages")
        # each frame's status travels on its own topic, after its odometry: wait for the last one's too
        last = image_msg(frames[-1], 7000 + FRAMES - 1, "cam").header.stamp
        client.wait(lambda: any(_key(s.header.stamp) == _key(last) and s.frames_processed > 0 for s in got["status"]),
                    "the last frame's status")
        client.wait(lambda: any(s.name.endswith(": tracking") for a in got["diagnostics"] for s in a.status),
                    "a tracking diagnostics entry")
        yield got, log
    finally:
        client.close()
        stop_processes(proc)


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
