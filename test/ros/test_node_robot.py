"""The node as a robot deployment uses it (issue 15), in a real ROS 2 graph on loopback.

One node runs in this process (tiny fixture weights, CPU) so that a test can make its file
writing block; its executors are spun exactly as ``main.main`` spins them. Its settings:
deferred eviction on with no client committing, ``use_sim_time`` with no /clock. A test
client (own context) publishes frames and calls the parameter and node services. Two
more node processes check that SIGINT and SIGTERM mid-stream end the node with exit
status 0 and no ERROR line.
"""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from builtin_interfaces.msg import Time  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from rcl_interfaces.srv import DescribeParameters, GetParameters, ListParameters  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402

from graph_helpers import (GraphClient, InProcessNode, fixture_params, generated_frames, image_msg,  # noqa: E402
                           private_domain_id, start_node, stop_processes, write_node_params)
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.srv import CommitEviction, SaveMap  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 101, 100, 11, 5)  # 101..200: apart from the other graph modules
NODE = "/robot_node"
TIMEOUT = 30.0
PARAMS = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu",
          "deferred_eviction": True, "max_pending_evictions": 1, "deferred_eviction_timeout": 1.0,
          "service_timeout": 20.0, "map_voxel_size": 0.0, "conf_threshold": 0.0, "point_stride": 1,
          "input_timeout": 1.5, "path_publish_rate": 10.0, "map_publish_rate": 5.0}


class Client(GraphClient):
    """Test node: publishes images, records ~/status, ~/pose and /diagnostics, calls services."""

    def __init__(self) -> None:
        super().__init__("robot_test_client", DOMAIN_ID, TIMEOUT)
        self.record(Status, f"{NODE}/status", "status")
        self.record(PoseStamped, f"{NODE}/pose", "pose")
        self.record(DiagnosticArray, "/diagnostics", "diagnostics")
        self.pub = self.node.create_publisher(Image, "image", QoSProfile(depth=10))

    def send(self, rgb: np.ndarray, sec: int, nanosec: int = 0) -> Status:
        """Publish a frame and wait for the node's status about it."""
        seen = self.count("status")
        self.pub.publish(image_msg(rgb, Time(sec=sec, nanosec=nanosec)))
        return self.status_after(seen, sec, nanosec)

    def status_after(self, seen: int, sec: int, nanosec: int = 0, after: Status | None = None) -> Status:
        """The first status stamped ``sec``.``nanosec`` among those after the first ``seen``; with
        ``after`` (the status of an earlier frame with this same stamp) the first that reports one
        more frame handled than it: a heartbeat repeats the last frame's stamp with the same counters
        (when no status went out for a second) and may come first."""
        handled = lambda s: (s.frames_processed + s.frames_dropped_stamp + s.frames_dropped_invalid  # noqa: E731
                             + s.frames_dropped_error + s.frames_dropped_stale)
        return self.wait(lambda: next((s for s in self.msgs["status"][seen:] if s.header.stamp.sec == sec
                                       and s.header.stamp.nanosec == nanosec
                                       and (after is None or handled(s) > handled(after))), None),
                         what=f"status of {sec}")


@pytest.fixture(scope="module")
def robot(fixtures, tmp_path_factory):
    out = tmp_path_factory.mktemp("robot_out")
    params = {**fixture_params(fixtures, PARAMS), "output_directory": str(out), "use_sim_time": True}
    node = InProcessNode(NODE.lstrip("/"), params, DOMAIN_ID).start()  # up once constructed (weights loaded)
    client = Client()
    try:
        yield node, client, out
    finally:
        client.close()
        node.close()


# ------------------------------------------------------------------ parameters
def test_parameter_services_list_get_describe_and_validate_sets(robot):
    """The parameter services exist (they were dropped before), describe shows ranges and
    read-only flags, run-time parameters take effect and bad values are refused with a reason."""
    from lingbot_map_ros.runtime.params import DYNAMIC_PARAMETERS, PARAMETERS

    node, client, _ = robot
    names = client.call(ListParameters, f"{NODE}/list_parameters", ListParameters.Request()).result.names
    assert {p.name for p in PARAMETERS} <= set(names)
    got = client.call(GetParameters, f"{NODE}/get_parameters", GetParameters.Request(names=["image_width", "device"]))
    assert got.values[0].integer_value == 98 and got.values[1].string_value == "cpu"
    desc = client.call(DescribeParameters, f"{NODE}/describe_parameters",
                       DescribeParameters.Request(names=["conf_threshold", "device", "point_stride"])).descriptors
    assert desc[0].description and not desc[0].read_only and desc[0].floating_point_range
    assert desc[1].read_only and desc[2].integer_range[0].from_value == 1
    assert {"conf_threshold", "point_stride", "deferred_eviction_timeout", "keyframe_decision_timeout",
            "publish_tf", "map_publish_rate"} <= DYNAMIC_PARAMETERS

    ok = client.set_parameter(NODE, "conf_threshold", 2.0)
    assert ok.successful, ok.reason
    assert node.node.settings.conf_threshold == 2.0 and node.node.channels[""].engine.settings.conf_threshold == 2.0
    refused = client.set_parameter(NODE, "device", "cuda")
    assert not refused.successful and "read-only" in refused.reason
    refused = client.set_parameter(NODE, "point_stride", 0)
    assert not refused.successful and refused.reason
    refused = client.set_parameter(NODE, "keyframe_decision_default", "maybe")
    assert not refused.successful and "keep" in refused.reason and "drop" in refused.reason
    assert node.node.settings.keyframe_decision_default == "keep"  # unchanged
    ok = client.set_parameter(NODE, "map_publish_rate", 0.0)
    assert ok.successful and "map" not in node.node._rate_timers
    ok = client.set_parameter(NODE, "map_publish_rate", 2.0)
    assert ok.successful and "map" in node.node._rate_timers
    assert client.set_parameter(NODE, "conf_threshold", 0.0).successful


# ------------------------------------------------------------------ clock
def test_without_clock_diagnostics_and_heartbeat_go_on_and_say_no_clock(robot):
    """use_sim_time with no /clock: the timers run on the steady clock and say why time stands still."""
    _, client, _ = robot
    start = client.count("diagnostics")

    def clock_warning():
        for arr in client.msgs["diagnostics"][start:]:
            for st in arr.status:
                if st.name.endswith(": clock") and st.level == DiagnosticStatus.WARN and "no clock" in st.message:
                    return st
        return None

    client.wait(clock_warning, what="a /diagnostics 'no clock' warning")
    client.wait(lambda: len(client.msgs["diagnostics"]) >= start + 2, what="two more /diagnostics")
    client.wait(lambda: any("no clock" in s.state_text for s in client.msgs["status"]),
                what="a status heartbeat saying 'no clock'")


# ------------------------------------------------------------------ deferral without a client
def test_deferred_eviction_without_a_commit_never_stops_tracking(robot):
    """Deferral on, a window of 3 + 1 pending eviction, nobody commits: before, every frame after
    the cache filled was dropped as an error for good; now the pending eviction is committed
    after deferred_eviction_timeout (1 s) and tracking goes on."""
    _, client, _ = robot
    imgs = generated_frames(14)
    last = None
    for i, rgb in enumerate(imgs):
        last = client.send(rgb, 2000 + i)
        time.sleep(0.2)
    client.wait(lambda: client.msgs["pose"] and client.msgs["pose"][-1].header.stamp.sec == 2000 + len(imgs) - 1,
                what="the last frame's pose")
    assert last.evictions_auto_committed >= 1, last
    assert last.frames_processed >= len(imgs) - 5, last  # a few dropped while the first eviction waited
    assert last.state == Status.STATE_TRACKING


# ------------------------------------------------------------------ stamps
def test_repeated_backwards_and_jumping_stamps(robot):
    node, client, _ = robot
    imgs = generated_frames(6, seed=1)
    first = client.send(imgs[0], 3000)
    first_seen = time.monotonic()  # frame 3000's status went out before this
    # A heartbeat (stamp 3000, the sequence's own text) goes out before the repeat's status when
    # that comes more than a second after frame 3000's (a slow machine). Provoked: the inference
    # thread is held until a heartbeat waits behind the hold, the repeat has arrived and a second
    # has passed; the repeat's status is told from the heartbeat by its counters.
    channel = node.node.channels[""]
    engine = channel.engine
    holding, release = threading.Event(), threading.Event()
    engine.submit("test hold", lambda: holding.set() or release.wait(TIMEOUT))
    try:
        assert holding.wait(TIMEOUT), "the inference thread never took the hold"
        client.wait(lambda: channel._heartbeat is not None and not channel._heartbeat.wait(0),
                    what="a heartbeat queued behind the hold")
        received = engine.seq.counter_values().frames_received
        seen = client.count("status")
        client.pub.publish(image_msg(imgs[1], Time(sec=3000)))
        client.wait(lambda: engine.seq.counter_values().frames_received > received, what="the repeat to arrive")
        time.sleep(max(0.0, first_seen + 1.1 - time.monotonic()))  # the heartbeat is due when it runs
    finally:
        release.set()
    repeated = client.status_after(seen, 3000, after=first)
    later = client.msgs["status"][seen:]
    before = [s.state_text for s in later[:next(i for i, s in enumerate(later) if s is repeated)]
              if s.header.stamp.sec == 3000]
    assert before and not any("same stamp" in t for t in before), before  # the heartbeat came first
    assert "same stamp" in repeated.state_text
    assert repeated.frames_dropped_stamp == first.frames_dropped_stamp + 1
    older = client.send(imgs[2], 2999, 600_000_000)  # 0.4 s back: out of order
    assert "older than the previous frame" in older.state_text
    jump = client.send(imgs[3], 100)  # a bag played again from the start: a new sequence
    assert jump.time_jumps == first.time_jumps + 1 and jump.state == Status.STATE_INITIALIZING
    after = client.send(imgs[4], 101)
    assert after.frame_index <= 2 and after.frames_dropped_stamp == first.frames_dropped_stamp + 2


# ------------------------------------------------------------------ a blocked save
def test_a_save_that_blocks_holds_up_neither_frames_nor_diagnostics_nor_other_services(robot, monkeypatch):
    """~/save_map writes its files on a service thread: while the disk hangs, frames are
    processed, /diagnostics goes on and ~/commit_eviction is answered."""
    import lingbot_map_ros.ros.map_outputs as map_outputs

    node, client, out = robot
    gate, entered = threading.Event(), threading.Event()
    real = map_outputs.write_map_files

    def stalled_disk(*args, **kwargs):
        entered.set()
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(map_outputs, "write_map_files", stalled_disk)
    imgs = generated_frames(8, seed=2)
    for i in range(3):
        client.send(imgs[i], 4000 + i)
    save = client.call_async(SaveMap, f"{NODE}/save_map", SaveMap.Request(directory=str(out / "stalled")))
    assert entered.wait(TIMEOUT), "the save never reached its file writing"
    try:
        diag_before = client.count("diagnostics")
        for i in range(3, 7):
            status = client.send(imgs[i], 4000 + i)
            assert status.state == Status.STATE_TRACKING, status.state_text
        commit = client.call(CommitEviction, f"{NODE}/commit_eviction", CommitEviction.Request())
        assert commit.success, commit.message
        client.wait(lambda: len(client.msgs["diagnostics"]) >= diag_before + 2,
                    what="/diagnostics during the stalled save")
        assert not save.done()
    finally:
        gate.set()
    client.wait(lambda: save.done(), what="the save to finish")
    result = save.result()
    assert result.success, result.message
    assert Path(result.ply_path).is_file() and Path(result.trajectory_path).is_file()


def test_reset_then_trigger_services_still_answer(robot):
    _, client, _ = robot
    response = client.call(Trigger, f"{NODE}/reset", Trigger.Request())
    assert response.success, response.message


# ------------------------------------------------------------------ shutdown
def _node_process(fixtures: Path, tmp: Path, name: str):
    """A node process ``name`` (deferral off) reading ``/<name>/image``; (process, its log)."""
    params = write_node_params(tmp / f"{name}.yaml", fixtures, {**PARAMS, "deferred_eviction": False,
                                                                 "output_directory": str(tmp)})
    log = tmp / f"{name}.log"
    return start_node(name, params, log, DOMAIN_ID, {"image": f"/{name}/image"}), log


def test_sigint_and_sigterm_mid_stream_exit_cleanly(robot, fixtures, tmp_path):
    """Before, SIGINT mid-stream sometimes logged "publisher's context is invalid" as an ERROR."""
    _, client, _ = robot
    procs = {sig: _node_process(fixtures, tmp_path, f"stop_{sig.name.lower()}") for sig in (signal.SIGINT,
                                                                                           signal.SIGTERM)}
    pubs = {sig: client.node.create_publisher(Image, f"/stop_{sig.name.lower()}/image", QoSProfile(depth=5))
            for sig in procs}
    poses = {sig: [] for sig in procs}
    for sig in procs:
        client.node.create_subscription(PoseStamped, f"/stop_{sig.name.lower()}/pose",
                                        lambda m, sig=sig: poses[sig].append(m), QoSProfile(depth=50))
    try:
        imgs = generated_frames(40, seed=3)
        deadline = time.monotonic() + 90.0
        i = 0
        while not all(len(p) >= 3 for p in poses.values()):  # streaming: poses come out of both
            assert time.monotonic() < deadline, f"no poses: {[p.read_text()[-2000:] for _, p in procs.values()]}"
            for sig, pub in pubs.items():
                pub.publish(image_msg(imgs[i % len(imgs)], 5000 + i))
            i += 1
            time.sleep(0.1)
        for _ in range(5):  # frames in flight when the signal comes
            for pub in pubs.values():
                pub.publish(image_msg(imgs[i % len(imgs)], 5000 + i))
            i += 1
        for sig, (proc, _) in procs.items():
            proc.send_signal(sig)
        for sig, (proc, log) in procs.items():
            code = proc.wait(30)
            text = log.read_text()
            assert code == 0, f"{sig.name}: exit {code}\n{text[-3000:]}"
            assert "[ERROR]" not in text and "Traceback" not in text, f"{sig.name}:\n{text[-3000:]}"
    finally:
        stop_processes(*(proc for proc, _ in procs.values()))
