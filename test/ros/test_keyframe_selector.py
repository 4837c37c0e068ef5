"""The reference keyframe selector in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID).

The selector runs as a process (``scripts/keyframe_selector`` or ``python -m``) against a
fake mapping node in this process: ``FakeMapper`` publishes FrameInfo on ``/fake/frame``
for a synthetic trajectory, measures translation and rotation from the last frame it kept
(as the node does) and serves ``/fake/commit_eviction`` and ``/fake/rollback_last_frame``,
accepting a decision only when ``expected_frame_index`` names the frame it holds. Checked:
the exact keep/drop list of a trajectory, frames not stored get no call, a refused
decision, a stalled service (the call is given up, its late answer is not counted, a
frame waiting behind it is replaced by a newer one),
services not there yet (no call, counted), a restart of the fake with indices from 1,
and a Ctrl-C exit with status 0, no error line and exact final counters.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from geometry_msgs.msg import Pose  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402

from lingbot_map_ros.msg import FrameInfo  # noqa: E402
from lingbot_map_ros.srv import CommitEviction, RollbackFrame  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DOMAIN_ID = 1 + (os.getpid() * 7 + 63) % 100  # 1..100, never test_node_graph's (+13) in the same process
FAKE = "/fake"
SERVICE_TIMEOUT = 4.0  # the selector's (the stall below must outlast publishing frames 5 and 6 on a loaded machine)
WAIT = 20.0            # bound of every wait for the graph
FIRST_PERIOD = 3.0     # s between the copies of a fake's first frame (FakeMapper.publish_first)
FORBIDDEN = ("ERROR", "Traceback", "Failed to publish")


@pytest.fixture(scope="module", autouse=True)
def private_domain():
    saved = {k: os.environ.get(k) for k in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE")}
    os.environ.update(ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def wait_for(predicate, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class FakeMapper:
    """Stand-in for the mapping node with the decision hold (frame poses: x in map units, yaw in degrees).

    ``requests`` records every call as (frame index, "keep"|"drop", accepted). While ``gate``
    is cleared the service callbacks block, as a stalled node would.
    """

    def __init__(self) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(FAKE[1:], context=self.context)
        self.pub = self.node.create_publisher(FrameInfo, f"{FAKE}/frame",
                                              QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self.cond = threading.Condition()
        self.gate = threading.Event()
        self.gate.set()
        self.requests: list[tuple[int, str, bool]] = []
        self.held: tuple[int, float, float] | None = None  # (index, x, yaw) of the frame a decision may name
        self.keyframe: tuple[float, float] | None = None   # (x, yaw) of the last stored keyframe
        self.unheld_previous: tuple[float, float] | None = None  # the keyframe before an unheld stored frame
        self.unheld = False                                # held names a frame stored without a hold
        self.next_index = 1  # as the node numbers frames: +1 per frame, a dropped frame's index is reused
        self.mark = 0        # requests before the last publish
        self.last_msg: FrameInfo | None = None  # the message publish() sent last
        self.services: list = []
        self.open_services()
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def open_services(self) -> None:
        self.services = [self.node.create_service(CommitEviction, f"{FAKE}/commit_eviction", self._serve("keep")),
                         self.node.create_service(RollbackFrame, f"{FAKE}/rollback_last_frame", self._serve("drop"))]

    def close_services(self) -> None:
        for service in self.services:
            self.node.destroy_service(service)
        self.services = []
        wait_for(lambda: self.node.count_services(f"{FAKE}/commit_eviction") == 0, "the services gone")

    def close(self) -> None:
        if not self.context.ok():
            return
        self.gate.set()
        self.executor.shutdown(timeout_sec=2.0)
        self.thread.join(timeout=5.0)  # not left in rclpy's C++ wait when the interpreter finalizes
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)

    def wait_for_selector(self) -> None:
        wait_for(lambda: self.pub.get_subscription_count() >= 1
                 and self.node.count_clients(f"{FAKE}/commit_eviction") >= 1
                 and self.node.count_clients(f"{FAKE}/rollback_last_frame") >= 1, "the selector in the graph")

    def _serve(self, kind: str):
        def serve(request, response):
            self.gate.wait(WAIT)
            with self.cond:
                expected = int(request.expected_frame_index)
                ok = self.held is not None and expected == self.held[0]
                response.success = ok
                response.message = "ok" if ok else f"frame {expected} is not the frame awaiting a decision"
                if ok and kind == "keep" and not self.unheld:
                    self.keyframe = self.held[1:]
                if ok and kind == "drop" and self.unheld:  # rolled back: the keyframe before it again
                    self.keyframe = self.unheld_previous
                if ok and kind == "drop":
                    self.next_index = expected
                if ok:
                    self.held = None
                self.requests.append((expected, kind, ok))
                self.cond.notify_all()
            return response
        return serve

    def publish(self, index: int, x: float, yaw: float, valid: float, stored: bool = True, pending: bool = True,
                accept: bool = True) -> None:
        """Publish frame ``index``: stored and held (``pending``), stored without a hold (a keyframe at once,
        as the node's scale frames), or not stored. ``accept`` = False: refuse any decision about it
        (as after the node's own hold timed out)."""
        with self.cond:
            assert index == self.next_index, f"the node would number this frame {self.next_index}, not {index}"
            self.next_index, self.mark = index + 1, len(self.requests)
            kx, kyaw = self.keyframe if self.keyframe is not None else (x, yaw)
            # float(): an int given to a float32 field arrives as 0.0 (seen with these rclpy wheels)
            msg = FrameInfo(frame_index=index, stored=stored, decision_pending=pending and stored,
                            valid_fraction=float(valid), translation_since_keyframe=float(abs(x - kx)),
                            rotation_since_keyframe_deg=float(abs(yaw - kyaw)), pose=Pose())
            msg.pose.position.x = x
            half = math.radians(yaw) / 2  # the pose: for show, the selector reads the distances
            msg.pose.orientation.z, msg.pose.orientation.w = math.sin(half), math.cos(half)
            if stored and not pending:
                self.unheld_previous, self.keyframe = self.keyframe, (x, yaw)
            if stored:
                self.held, self.unheld = ((index, x, yaw) if accept else None), not pending
        self.pub.publish(msg)
        self.last_msg = msg

    def publish_first(self, selector: "Selector", needle: str, *args, **kwargs) -> None:
        """``publish(*args, **kwargs)`` of the selector's first frame from this fake, and the same
        message again every ``FIRST_PERIOD`` s until ``needle`` is in the selector's log (its
        reader can miss a writer's first sample after the writer matched it). ``needle``: a line
        the selector logs as that frame arrives, so that a copy goes out only when the frame was
        lost (a copy that arrived too would be a second message about the frame)."""
        self.publish(*args, **kwargs)
        deadline = time.monotonic() + WAIT
        while True:
            try:
                wait_for(lambda: needle in selector.text(), repr(needle), FIRST_PERIOD)
                return
            except AssertionError:
                assert time.monotonic() < deadline, f"{needle!r} not in the selector's log within {WAIT} s:\n" \
                                                    f"{selector.text()[-3000:]}"
                self.pub.publish(self.last_msg)

    def apply_default_keep(self) -> None:
        """The hold timed out: the held frame is kept (keyframe_decision_default keep)."""
        with self.cond:
            self.keyframe, self.held = self.held[1:], None

    def wait_request(self, index: int) -> tuple[int, str, bool]:
        """The first call naming ``index`` since the last publish."""
        with self.cond:
            ok = self.cond.wait_for(lambda: any(r[0] == index for r in self.requests[self.mark:]), WAIT)
            assert ok, f"no decision about frame {index} within {WAIT} s"
            return next(r for r in self.requests[self.mark:] if r[0] == index)


class Selector:
    """The selector process; its stdout and stderr go to a log file."""

    def __init__(self, log: Path, cmd: list[str], *params: str) -> None:
        self.log = log
        args = [a for p in (f"target_node:={FAKE}", f"service_timeout:={SERVICE_TIMEOUT}", "summary_period:=0.5",
                            *params) for a in ("-p", p)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *cmd, "--ros-args", *args, "--log-level", "keyframe_selector:=debug"],
                env=dict(os.environ), cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text()

    def wait_log(self, needle: str, timeout: float = WAIT, count: int = 1) -> None:
        wait_for(lambda: self.text().count(needle) >= count, f"{needle!r} {count}x in the selector's log", timeout)

    def stop(self) -> tuple[int, str]:
        """SIGINT, as Ctrl-C; returns (exit status, log). Killed (status -9) if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode, self.text()


@pytest.fixture
def fake():
    mapper = FakeMapper()
    yield mapper
    mapper.close()


def assert_clean_exit(selector: Selector, summary: str) -> str:
    rc, log = selector.stop()
    bad = [line for line in log.splitlines() if any(word in line for word in FORBIDDEN)]
    assert rc == 0 and not bad, f"exit status {rc}, error lines {bad}\n{log}"
    assert f"final summary: {summary}" in log, log
    return log


# (index, x, yaw_deg, valid_fraction, stored, pending, expected); thresholds: defaults 0.10, 10 deg,
# floor 0.3, confidence drop 0.25; distances are from the last stored keyframe. As in the node, a
# dropped (rolled back) frame's index is the next frame's.
TRAJECTORY = [
    (1, 0.00, 0.0, 0.90, True, False, None),    # scale frames: stored without a hold, not decided,
    (2, 0.02, 0.0, 0.85, True, False, None),    # the reference of the first decision
    (3, 0.06, 0.0, 0.90, True, True, "drop"),   # 0.04 from frame 2: no "first frame" keep
    (3, 0.08, 0.0, 0.90, False, False, None),   # not stored: no call
    (4, 0.10, 0.0, 0.88, True, True, "drop"),   # 0.08
    (4, 0.14, 0.0, 0.85, True, True, "keep"),   # moved 0.12; index 4 again: no restart
    (5, 0.17, 4.0, 0.85, True, True, "drop"),   # 0.03, 4 deg
    (5, 0.18, 11.0, 0.85, True, True, "keep"),  # turned 11 deg
    (6, 0.60, 12.0, 0.20, True, True, "drop"),  # moved 0.42 but unreliable (0.20 < 0.3)
    (6, 0.20, 13.0, 0.60, True, True, "keep"),  # confidence dropped: 0.60 < 0.75 x 0.85
    (7, 0.21, 13.0, 0.55, True, True, "drop"),  # 0.55 >= 0.75 x 0.60
    (7, 0.21, 13.0, 0.44, True, True, "keep"),  # 0.44 < 0.45
    (8, 0.27, 13.0, 0.50, True, True, "drop"),  # 0.06
    (8, 0.32, 13.0, 0.50, True, True, "keep"),  # moved 0.11
]


def test_decisions_follow_the_thresholds(fake: FakeMapper, tmp_path: Path):
    selector = Selector(tmp_path / "selector.log", ["scripts/keyframe_selector"])
    try:
        fake.wait_for_selector()
        for n, (index, x, yaw, valid, stored, pending, want) in enumerate(TRAJECTORY):
            if n == 0:  # a scale frame: a copy only notes the same reference again
                fake.publish_first(selector, f"frame {index}: stored without a hold", index, x, yaw, valid, stored,
                                   pending)
            else:
                fake.publish(index, x, yaw, valid, stored, pending)
            if want is not None:
                fake.wait_request(index)
            elif stored:
                selector.wait_log(f"frame {index}: stored without a hold")
        selector.wait_log("frame 8: keep done")  # the last answer is in: the counters are final
        selector.wait_log("]: summary: kept 5, dropped 6, refused 0")  # the periodic summary (0.5 s)
    finally:
        log = assert_clean_exit(selector, "kept 5, dropped 6, refused 0, unanswered 0, unavailable 0, "
                                          "superseded 0, restarts 0")
    expected = [(i, want, True) for i, *_, want in TRAJECTORY if want is not None]
    assert fake.requests == expected
    assert "frame 6: keep (confidence dropped" in log and "frame 6: drop (unreliable" in log
    assert "first frame" not in log  # the scale frames were the reference


def test_outage_refusal_stall_and_restart(fake: FakeMapper, tmp_path: Path):
    fake.close_services()  # a node still starting: its services do not exist yet
    selector = Selector(tmp_path / "selector.log", ["-m", "lingbot_map_ros.ros.keyframe_selector"],
                        "decide_unheld:=true")
    restarted = None
    try:
        wait_for(lambda: fake.pub.get_subscription_count() >= 1, "the selector's subscription")
        # services unavailable: frame 1 waits service_timeout, is never sent, and is counted (logged as it
        # arrives: a copy goes out only if it was lost, since one that arrived too would replace it)
        fake.publish_first(selector, "not available; waiting", 1, 0.0, 0.0, 0.9)
        selector.wait_log("frame 1: not sent", timeout=SERVICE_TIMEOUT + WAIT)
        assert fake.requests == []
        fake.apply_default_keep()
        fake.open_services()
        fake.publish(2, 0.01, 0.0, 0.9)  # the selector's first decision: kept whatever it shows
        assert fake.wait_request(2) == (2, "keep", True)
        # refused: the fake holds no frame (as after its own hold timed out)
        fake.publish(3, 0.5, 0.0, 0.9, accept=False)
        assert fake.wait_request(3) == (3, "keep", False)
        selector.wait_log("frame 3: keep refused")
        # stalled: the call about frame 4 gets no answer in time and is given up; meanwhile frame 5
        # waits and frame 6 replaces it (the fake's holds time out: its default keeps them)
        fake.gate.clear()
        fake.publish(4, 1.0, 0.0, 0.9)
        selector.wait_log("frame 4: keep (")
        fake.apply_default_keep()
        fake.publish(5, 1.2, 0.0, 0.9)
        fake.apply_default_keep()
        fake.publish(6, 1.22, 0.0, 0.9)  # close to frame 5: drop, sent once the call about 4 is given up
        selector.wait_log("no answer about frame 4")
        selector.wait_log("frame 6: drop (")
        fake.gate.set()  # the stalled call answers late (refused: frame 6 is held now), then 6 is served
        assert fake.wait_request(6) == (6, "drop", True)
        assert fake.wait_request(4) == (4, "keep", False)
        selector.wait_log("frame 4: late answer to keep (success=False")
        assert not any(r[0] == 5 for r in fake.requests) and "frame 5: not sent, replaced by frame 6" in selector.text()
        # restart: a new node of the same name, indices from 1; with decide_unheld, a frame stored
        # without a hold is decided too (here: the first after the restart, kept)
        fake.close()
        selector.wait_log(f"no publisher on {FAKE}/frame any more")  # the node gone: said once
        restarted = FakeMapper()
        restarted.wait_for_selector()
        selector.wait_log(f"receiving {FAKE}/frame (1 publisher)", count=2)  # and back
        for index, x, pending, want in [(1, 5.0, False, "keep"), (2, 5.05, True, "drop"), (2, 5.2, True, "keep")]:
            if index == 1:  # the new fake's first frame (the selector logs the restart as it arrives)
                restarted.publish_first(selector, "frame index went back from 6 to 1", index, x, 0.0, 0.9,
                                        pending=pending)
            else:
                restarted.publish(index, x, 0.0, 0.9, pending=pending)
            assert restarted.wait_request(index) == (index, want, True)
        selector.wait_log("frame 2: keep done", count=2)  # frame 2 before the restart, and this one
    finally:
        log = assert_clean_exit(selector, "kept 3, dropped 2, refused 1, unanswered 1, unavailable 1, "
                                          "superseded 1, restarts 1")
        if restarted is not None:
            restarted.close()
    assert "frame index went back from 6 to 1" in log
    assert "not available; waiting" in log and "services available again" in log
    assert "frame 1: keep (" not in log.split("frame index went back")[0]  # frame 1 was never decided


def test_help_prints_the_usage_and_every_parameter_without_starting_a_node(capsys):
    from lingbot_map_ros.ros.keyframe_selector import PARAMS, main

    assert main(["keyframe_selector", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ros2 run lingbot_map_ros keyframe_selector")
    for name, (default, _) in PARAMS.items():
        assert f"  {name} (default {default!r}): " in out, name
    assert not rclpy.ok()  # no context was initialised
