"""The keyframe selector serving one camera of a two-camera node, in a real ROS 2 graph (DDS on
loopback, a private ROS_DOMAIN_ID).

One node process (tiny fixture weights, CPU) serves ``cameras: [front, rear]``; only ``front``
holds its stored frames for a decision (``camera.front.keyframe_decision_timeout``). A
``keyframe_selector`` process with ``target_node:=/lingbot_map/front`` reads
``/lingbot_map/front/frame`` and calls ``/lingbot_map/front/commit_eviction`` /
``rollback_last_frame``. Its policy is steered through the node's ``conf_threshold`` (the
frames' valid fraction): 0 makes every pixel confident (valid fraction 1: the selector keeps),
1000 none (valid fraction 0: the selector drops, ``min_valid_fraction`` 0.5). Checked: front's
decisions are the selector's (exact kept/dropped counts in ~/front/status, none timed out or
refused, a drop's frame index comes again), rear streams without a hold or a decision, and the
selector never calls rear's services.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from builtin_interfaces.msg import Time as TimeMsg  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from graph_helpers import (GraphClient, image_msg, private_domain_id, start_node, start_ros_process,  # noqa: E402
                           stop_processes, write_node_params)
from lingbot_map_ros.msg import FrameInfo, Status  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
DOMAIN_ID = private_domain_id(__name__, 231, 2, 1, 0)  # 231..232: no other graph module's range (Fast DDS max)
SELECTOR_MODULE = "lingbot_map_ros.ros.keyframe_selector"
NODE = "/lingbot_map"
CAMERAS = ("front", "rear")
START_TIMEOUT = 90.0
MATCH_SETTLE_S = 0.5  # s after the selector matched the node's writer, for the node's side of the match
STEP_TIMEOUT = 30.0
DECISION_TIMEOUT = 10.0  # front's hold: far longer than the selector needs (a timeout would fail the test)
KEPT, DROPPED = 3, 2  # front's held frames the selector keeps, then drops
NODE_PARAMS = {"num_scale_frames": 2, "sliding_window": 3, "keyframe_interval": 1, "camera_iterations": 4,
               # reliable input: a best-effort reader may miss a frame sent right after discovery
               "input_qos": "reliable",
               "device": "cpu", "image_width": 98, "input_timeout": 30.0, "conf_threshold": 0.0,
               "service_timeout": 20.0, "publish_depth": False, "publish_points": False, "publish_map": False,
               "publish_tf": False, "cameras": list(CAMERAS), "camera.rear.camera_frame": "rear_optical",
               "camera.front.keyframe_decision_timeout": DECISION_TIMEOUT}
SELECTOR_PARAMS = {"target_node": f"{NODE}/front", "min_translation": 0.0, "min_valid_fraction": 0.5,
                   "confidence_drop": 0.0, "service_timeout": DECISION_TIMEOUT, "summary_period": 0.0}


def real_frames(first: int, n: int) -> list[np.ndarray]:
    from PIL import Image as PILImage

    folder = SHARED / "data" / "loop"
    if not folder.is_dir():
        pytest.skip(f"real frames not found at {folder}")
    return [np.asarray(PILImage.open(p).convert("RGB")) for p in sorted(folder.glob("*.jpg"))[first:first + n]]


class Client(GraphClient):
    """The test's side: image publishers, recorders of each camera's status and frame info
    (``msgs`` keyed by topic)."""

    def __init__(self) -> None:
        super().__init__("multi_camera_selector_test", DOMAIN_ID, STEP_TIMEOUT)
        for c in CAMERAS:
            self.record(Status, f"{NODE}/{c}/status", f"{NODE}/{c}/status")
            self.record(FrameInfo, f"{NODE}/{c}/frame", f"{NODE}/{c}/frame")
        self.images = {c: self.node.create_publisher(Image, f"/{c}/image", QoSProfile(depth=10)) for c in CAMERAS}

    def status(self, camera: str) -> Status:
        with self.cond:
            return self.msgs[f"{NODE}/{camera}/status"][-1]

    def send(self, camera: str, rgb: np.ndarray, stamp: TimeMsg, first: bool = False) -> Status:
        """Publish a frame to ``camera`` and wait for the node's status about it (a frame behind a
        held one waits for that one's decision); ``first``: the camera's first frame, published
        again every 1.5 s until that status came (a copy is a repeated stamp: the node drops it)."""
        msg = image_msg(rgb, stamp, f"{camera}_optical")
        return self.send_for_status(self.images[camera], msg, f"{NODE}/{camera}/status", first)


def stamp_of(k: int) -> TimeMsg:
    return TimeMsg(sec=8000 + k, nanosec=250_000_000)


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    tmp = tmp_path_factory.mktemp("multi_camera_selector")
    frames = {"front": real_frames(0, 2 + KEPT + DROPPED), "rear": real_frames(60, 2 + KEPT + DROPPED)}
    params = write_node_params(tmp / "multi.yaml", fixtures, {**NODE_PARAMS, "output_directory": str(tmp / "out")})
    node = start_node("lingbot_map", params, tmp / "node.log", DOMAIN_ID)
    selector_args = [a for name, value in SELECTOR_PARAMS.items() for a in ("-p", f"{name}:={value}")]
    selector = start_ros_process(SELECTOR_MODULE, [*selector_args, "--log-level", "keyframe_selector:=debug"],
                                 tmp / "selector.log", DOMAIN_ID)
    client = Client()
    try:
        client.watch(node, tmp / "node.log")
        client.watch(selector, tmp / "selector.log")
        client.wait(lambda: all(p.get_subscription_count() >= 1 for p in client.images.values()),
                    timeout=START_TIMEOUT, what="the node to subscribe to both cameras")
        # the selector in the graph: subscribed to front's frame info, a client of front's services
        client.wait(lambda: client.node.count_subscribers(f"{NODE}/front/frame") >= 2
                    and client.node.count_clients(f"{NODE}/front/commit_eviction") >= 1
                    and client.node.count_clients(f"{NODE}/front/rollback_last_frame") >= 1,
                    timeout=START_TIMEOUT, what="the selector on front's frame topic and services")
        # and the selector's side matched to the node's frame publisher (the test client seeing the
        # selector's subscription does not mean the node's writer has matched it yet: front's first
        # frame infos were lost that way in CI)
        client.wait(lambda: "receiving /lingbot_map/front/frame" in (tmp / "selector.log").read_text(),
                    timeout=START_TIMEOUT, what="the selector receiving front's frame topic")
        time.sleep(MATCH_SETTLE_S)
        yield client, node, selector, frames, tmp
    finally:
        client.close()
        stop_processes(selector)  # first: it calls front's services until it ends
        stop_processes(node)


# ------------------------------------------------------------------ tests
def test_the_selector_decides_for_front_and_rear_streams_without_holds(graph):
    client, node, selector, frames, tmp = graph
    assert client.node.count_clients(f"{NODE}/rear/commit_eviction") == 0
    assert client.node.count_clients(f"{NODE}/rear/rollback_last_frame") == 0
    k = 0
    for i in range(2 + KEPT):  # conf_threshold 0: valid fraction 1, every held frame kept
        client.send("front", frames["front"][i], stamp_of(k), first=i == 0)
        client.send("rear", frames["rear"][i], stamp_of(k), first=i == 0)
        k += 1
    client.wait(lambda: client.status("front").decisions_kept == KEPT, what=f"front: {KEPT} decisions kept")
    result = client.set_parameter(NODE, "conf_threshold", 1000.0)  # valid fraction 0: every held frame dropped
    assert result.successful, f"cannot set conf_threshold: {result.reason}"
    for i in range(2 + KEPT, 2 + KEPT + DROPPED):
        client.send("front", frames["front"][i], stamp_of(k))
        client.send("rear", frames["rear"][i], stamp_of(k))
        k += 1
    client.wait(lambda: client.status("front").decisions_dropped == DROPPED,
                what=f"front: {DROPPED} decisions dropped")

    front = client.status("front")
    assert (front.decisions_kept, front.decisions_dropped) == (KEPT, DROPPED)
    assert (front.decisions_timed_out, front.decisions_refused) == (0, 0)
    assert not front.decision_pending
    infos = client.msgs[f"{NODE}/front/frame"]
    held = [m for m in infos if m.decision_pending]
    # frames 1 and 2 (the scale frames) are stored without a hold; 3, 4, 5 kept; 6 dropped twice
    assert [int(m.frame_index) for m in held] == [3, 4, 5, 6, 6], [int(m.frame_index) for m in infos]
    assert all(m.valid_fraction > 0.5 for m in held[:KEPT]) and all(m.valid_fraction < 0.5 for m in held[KEPT:])
    assert front.frame_index == 5 and front.frames_processed == 2 + KEPT + DROPPED  # both drops rolled back

    rear_statuses = [s for s in client.msgs[f"{NODE}/rear/status"] if s.frames_processed > 0]
    assert rear_statuses and not any(s.decision_pending for s in rear_statuses)
    rear = client.status("rear")
    assert (rear.decisions_kept, rear.decisions_dropped, rear.decisions_timed_out, rear.decisions_refused) == (0,) * 4
    assert rear.frame_index == rear.frames_processed == 2 + KEPT + DROPPED
    assert client.msgs[f"{NODE}/rear/frame"] and not any(m.decision_pending for m in client.msgs[f"{NODE}/rear/frame"])

    # the node counted the second drop; the selector logs its answer a moment later: wait for it (bounded)
    client.wait(lambda: (tmp / "selector.log").read_text().count("frame 6: drop done") >= DROPPED,
                what="the selector's log of the second drop's answer")
    stop_processes(selector)
    assert selector.returncode == 0
    log = (tmp / "selector.log").read_text()
    assert f"deciding keyframes of {NODE}/front (the frames it holds)" in log
    for index in (3, 4, 5):
        assert f"frame {index}: keep done" in log, log[-3000:]
    assert log.count("frame 6: drop done") == DROPPED, log[-3000:]
    assert f"final summary: kept {KEPT}, dropped {DROPPED}, refused 0, unanswered 0, unavailable 0" in log
    assert "ERROR" not in log and "Traceback" not in log
    assert node.poll() is None
