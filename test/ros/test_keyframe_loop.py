"""Keyframe logic over the services (issue 16), against the real node in a ROS 2 graph.

A node process (tiny fixture weights, CPU, decision hold on) and, in this process, an
independent client that sees each frame's ``~/frame`` and keeps every third frame, drops
the rest. The node's poses and cache statistics must equal an in-process replay of the same
frames with the same keep/drop pattern. Then the faults: decisions about the wrong frame,
twice, too late, a reset during a hold, and the shipped ``keyframe_selector`` killed
mid-run (the timeout's default decision applies and tracking goes on).
"""
from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402

from graph_helpers import (GraphClient, generated_frames, image_msg, private_domain_id, replay_session,  # noqa: E402
                           start_node, start_ros_process, stop_processes, write_node_params)
from lingbot_map_ros.msg import FrameInfo, Status  # noqa: E402
from lingbot_map_ros.srv import CommitEviction, RollbackFrame  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 201, 30, 13, 3)  # 201..230
NODE = "/kf_node"
TIMEOUT = 30.0
WIDTH = 98
PARAMS = {"image_width": WIDTH, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", "backend": "sdpa",
          "keyframe_decision_timeout": 20.0, "deferred_eviction": True, "max_pending_evictions": 2,
          "deferred_eviction_timeout": 0.0, "service_timeout": 20.0, "publish_points": False,
          "publish_depth": False, "accumulate_map": False}


class Client(GraphClient):
    """Test node: publishes images on the node's ~/image, records ~/frame, ~/pose and ~/status,
    answers the keyframe decisions."""

    def __init__(self) -> None:
        super().__init__("kf_test_client", DOMAIN_ID, TIMEOUT)
        for msg_type, key in ((FrameInfo, "frame"), (PoseStamped, "pose"), (Status, "status")):
            self.record(msg_type, f"{NODE}/{key}", key, depth=500)
        self.pub = self.node.create_publisher(Image, f"{NODE}/image", QoSProfile(depth=10))

    def find_status(self, sec: int, after: int) -> Status | None:
        """The first status of the frame stamped ``sec`` among those after the first ``after`` ones."""
        return next((s for s in self.msgs["status"][after:] if s.header.stamp.sec == sec), None)

    def status_for(self, sec: int, after: int) -> Status:
        return self.wait(lambda: self.find_status(sec, after), what=f"the status of frame stamped {sec}")

    def keep(self, index: int):
        return self.call(CommitEviction, f"{NODE}/commit_eviction", CommitEviction.Request(expected_frame_index=index))

    def drop(self, index: int):
        return self.call(RollbackFrame, f"{NODE}/rollback_last_frame",
                         RollbackFrame.Request(expected_frame_index=index))

    def set_param(self, name: str, value: float):
        result = self.set_parameter(NODE, name, float(value))
        assert result.successful, result.reason


@pytest.fixture(scope="module")
def loop(fixtures, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kf")
    log = tmp / "node.log"
    proc = start_node(NODE.lstrip("/"), write_node_params(tmp / "kf.yaml", fixtures, PARAMS), log, DOMAIN_ID,
                      {"image": f"{NODE}/image"})
    client = Client()
    try:
        client.wait(lambda: client.msgs["status"], timeout=90.0, what="the node's first status")
        # the first status ("loading the model") comes before the image subscription exists
        client.wait(lambda: client.pub.get_subscription_count() >= 1, timeout=90.0, what="the node's image subscription")
        yield client, proc, log, fixtures
    finally:
        client.close()
        stop_processes(proc)


def test_hold_with_a_client_keeping_every_third_frame_equals_a_replay(loop):
    client, proc, log, fixtures = loop
    imgs = generated_frames(14)
    decisions, refused = [], []
    for k, rgb in enumerate(imgs):
        sec = 100 + k
        seen, after = client.count("frame"), client.count("status")
        if k == 0:  # the first image until it arrived (a copy is a repeated stamp: dropped)
            status = client.publish_until(client.pub, image_msg(rgb, sec), lambda: client.find_status(sec, after),
                                          f"the status of frame stamped {sec}")
        else:
            client.pub.publish(image_msg(rgb, sec))
            status = client.status_for(sec, after)
        if status.state != Status.STATE_TRACKING:  # collecting the scale frames: no outputs yet
            decisions.append(None)
            continue
        info = client.wait(lambda: next((m for m in client.msgs["frame"][seen:] if m.header.stamp.sec == sec), None),
                           what=f"~/frame of frame {k}")
        if not info.decision_pending:
            decisions.append(None)  # a scale frame
            continue
        keep = k % 3 == 0
        answer = client.keep(info.frame_index) if keep else client.drop(info.frame_index)
        if not answer.success:
            refused.append((k, answer.message))
        decisions.append(keep)
    assert not refused, refused
    after = client.count("status")
    client.pub.publish(image_msg(imgs[0], 1000))  # one more frame: its status carries the cache statistics
    final = client.status_for(1000, after)
    assert final.decisions_refused == 0 and final.decisions_timed_out == 0
    assert final.decisions_kept == sum(d is True for d in decisions)
    assert final.decisions_dropped == sum(d is False for d in decisions)

    # in-process replay with the same pattern
    from lingbot_map_ros.ros.conversions import optical_pose_to_map
    from lingbot_map_ros.io.preprocess import model_input

    session = replay_session(fixtures, PARAMS)
    expected = {}
    pending = []
    for k, rgb in enumerate(imgs + [imgs[0]]):
        results = session.push(model_input(rgb, WIDTH))
        pending.append(100 + k if k < len(imgs) else 1000)
        for r in results:
            expected[pending.pop(0)] = optical_pose_to_map(r.c2w)
        if k < len(imgs) and decisions[k] is not None:
            if decisions[k]:
                session.commit_eviction()
            else:
                session.rollback_last_frame()
    poses = {m.header.stamp.sec: m.pose for m in client.msgs["pose"]}
    assert set(expected) <= set(poses)
    for sec, T in expected.items():
        p = poses[sec].position
        got = np.array([p.x, p.y, p.z])
        np.testing.assert_allclose(got, T[:3, 3], rtol=1e-4, atol=1e-6, err_msg=f"frame stamped {sec}")
    stats = session.stats()
    assert (final.stored_frames, final.temporal_index, final.scale_pages, final.window_pages, final.free_pages,
            final.special_tokens, final.pending_evictions) == (
        stats.resident_frames, stats.temporal_index, stats.scale_pages, stats.window_pages, stats.free_pages,
        stats.special_tokens, stats.pending_evictions)
    # the frame sent last is held now; keep it so the next test starts from a decided state
    assert client.keep(0).success


def test_bad_decisions_are_refused_and_change_nothing(loop):
    client, *_ = loop
    seen = client.count("frame")
    client.pub.publish(image_msg(generated_frames(3, seed=5)[0], 2000))
    info = client.wait(lambda: next((m for m in client.msgs["frame"][seen:] if m.header.stamp.sec == 2000), None),
                       what="~/frame of the held frame")
    assert info.decision_pending
    n = info.frame_index
    wrong = client.keep(n + 5)
    assert not wrong.success and "not the frame waiting" in wrong.message
    wrong = client.drop(n - 1)
    assert not wrong.success
    assert client.keep(n).success
    twice = client.drop(n)
    assert not twice.success and "already decided" in twice.message
    # a client that never answers: the default (keep) applies after the timeout
    client.set_param("keyframe_decision_timeout", 0.5)
    after = client.count("status")
    # counted from here: frame 1000 of the test before may have timed out while it replayed (a slow machine)
    timed_out = client.msgs["status"][-1].decisions_timed_out
    client.pub.publish(image_msg(generated_frames(3, seed=5)[1], 2001))
    client.wait(lambda: any(s.decisions_timed_out > timed_out for s in client.msgs["status"][after:]),
                what="the timeout's default decision")
    late = client.keep(n + 1)
    assert not late.success and "already decided" in late.message and "timeout" in late.message
    # a reset during a hold
    seen = client.count("frame")
    client.set_param("keyframe_decision_timeout", 20.0)
    for sec in (2002, 2003, 2004):  # two scale frames of the new sequence, then a held frame
        client.pub.publish(image_msg(generated_frames(5, seed=6)[sec - 2002], sec))
        time.sleep(0.3)
    client.wait(lambda: any(m.decision_pending for m in client.msgs["frame"][seen:]), what="a held frame")
    reset = client.call(Trigger, f"{NODE}/reset", Trigger.Request())
    assert reset.success, reset.message
    after = client.count("status")
    client.pub.publish(image_msg(generated_frames(3, seed=7)[0], 3000))
    status = client.status_for(3000, after)
    assert not status.decision_pending and status.frames_received == 1


def test_the_shipped_selector_decides_and_its_death_leaves_the_node_tracking(loop, tmp_path):
    client, proc, log, _ = loop
    client.set_param("keyframe_decision_timeout", 1.0)
    client.call(Trigger, f"{NODE}/reset", Trigger.Request())
    sel_log = tmp_path / "selector.log"
    selector = start_ros_process("lingbot_map_ros.ros.keyframe_selector",
                                 ["-p", f"target_node:={NODE}", "--log-level", "debug"], sel_log, DOMAIN_ID)
    try:
        imgs = generated_frames(30, seed=8)
        deadline = time.monotonic() + 60.0
        decided = None
        k = 0
        while decided is None:  # until the selector has decided a few frames
            assert time.monotonic() < deadline, sel_log.read_text()[-3000:]
            client.pub.publish(image_msg(imgs[k % 30], 4000 + k))
            k += 1
            time.sleep(0.3)
            last = client.msgs["status"][-1] if client.msgs["status"] else None
            if last is not None and last.decisions_kept + last.decisions_dropped >= 3:
                decided = last
        assert decided.decisions_refused == 0
        selector.send_signal(signal.SIGKILL)  # the client dies mid-stream
        selector.wait(10)
        after = client.count("status")
        for j in range(6):
            client.pub.publish(image_msg(imgs[(k + j) % 30], 5000 + j))
            time.sleep(0.5)
        client.wait(lambda: any(s.decisions_timed_out > decided.decisions_timed_out
                                for s in client.msgs["status"][after:]), what="a timed-out decision")
        client.wait(lambda: any(p.header.stamp.sec >= 5003 for p in client.msgs["pose"]),
                    what="poses after the selector died")
        assert proc.poll() is None
    finally:
        stop_processes(selector)


FLOOD_CALLS, FLOOD_BURST = 200, 20  # 200 calls in about 2 s, 20 at once (more than the default queue of 10)
FLOOD_QUIET = 20.0  # seconds without a new answer that end the wait for the rest
KEEP_ALL = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)


def test_a_flood_of_decisions_while_streaming_gets_an_answer_for_every_call(loop):
    """200 ~/commit_eviction calls in about 2 s, in bursts of 20, from one client while frames
    stream: every call is answered (kept, nothing pending, or refused with a reason).

    The node's request queue keeps every request (before: keep-last 10, so a burst that came
    while the service threads waited for the inference thread lost requests without an answer).
    The client uses a keep-all QoS too (as ``camera_channel.SERVICE_QOS``): with rclpy's default a
    client loses answers in its own keep-last-10 response queue when it sends bursts."""
    client, proc, log, _ = loop
    client.set_param("keyframe_decision_timeout", 20.0)
    assert client.call(Trigger, f"{NODE}/reset", Trigger.Request()).success
    keep = client.node.create_client(CommitEviction, f"{NODE}/commit_eviction", qos_profile=KEEP_ALL)
    assert keep.wait_for_service(timeout_sec=TIMEOUT)
    imgs = generated_frames(12, seed=9)
    stop = threading.Event()

    def stream() -> None:  # 10 Hz, bounded
        for k in range(600):
            if stop.wait(0.1):
                return
            client.pub.publish(image_msg(imgs[k % len(imgs)], 6000 + k))

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    futures = []
    try:
        client.wait(lambda: any(m.decision_pending for m in client.msgs["frame"]
                                if m.header.stamp.sec >= 6000), what="a held frame while streaming")
        for _ in range(FLOOD_CALLS // FLOOD_BURST):  # bursts of FLOOD_BURST calls, 5 a second
            for _ in range(FLOOD_BURST):
                futures.append(keep.call_async(CommitEviction.Request(expected_frame_index=0)))
            time.sleep(0.2)
        done, last_change = 0, time.monotonic()
        while done < FLOOD_CALLS and time.monotonic() - last_change < FLOOD_QUIET:  # bounded: answers must flow
            time.sleep(0.05)
            now_done = sum(f.done() for f in futures)
            if now_done != done:
                done, last_change = now_done, time.monotonic()
    finally:
        stop.set()
        streamer.join(5.0)
        client.node.destroy_client(keep)
    answered = [f.result() for f in futures if f.done()]
    assert len(answered) == FLOOD_CALLS, (f"{FLOOD_CALLS - len(answered)} of {FLOOD_CALLS} calls got no answer "
                                          f"(none came for {FLOOD_QUIET} s)\n{log.read_text()[-2000:]}")
    for r in answered:
        assert r.success or r.message, "a refusal without a reason"
    assert proc.poll() is None
    status = client.msgs["status"][-1]
    assert status.decisions_kept >= 1  # frames were held while the flood came, and kept by it
    print(f"\n[flood] {FLOOD_CALLS} calls answered: "
          + ", ".join(f"{n} x {m!r}" for m, n in Counter(("ok: " if r.success else "refused: ") + r.message
                                                          for r in answered).most_common(5)))


def test_a_decision_timeout_set_to_zero_releases_the_held_frame_now(loop):
    """A frame held under a 20 s timeout is released (default decision) as soon as
    keyframe_decision_timeout:=0 is set, not 20 s later; later frames are not held."""
    client, proc, log, _ = loop
    client.set_param("keyframe_decision_timeout", 20.0)
    time.sleep(0.5)  # an image an earlier test published last is delivered (and then cleared by the reset)
    assert client.call(Trigger, f"{NODE}/reset", Trigger.Request()).success
    imgs = generated_frames(5, seed=10)
    seen = client.count("frame")
    for k in range(3):  # two scale frames, then a held frame
        after = client.count("status")
        client.pub.publish(image_msg(imgs[k], 7000 + k))
        client.status_for(7000 + k, after)
    held = client.wait(lambda: next((m for m in client.msgs["frame"][seen:] if m.header.stamp.sec == 7002), None),
                       what="~/frame of the third frame")
    assert held.decision_pending and held.frame_index == 3
    after = client.count("status")
    client.set_param("keyframe_decision_timeout", 0.0)
    released = client.wait(lambda: next((s for s in client.msgs["status"][after:]
                                         if s.state_text == f"frame {held.frame_index}: keep by timeout"), None),
                           timeout=10.0, what="the release of the held frame (within 10 s, not at its 20 s deadline)")
    assert not released.decision_pending
    seen = client.count("frame")
    client.pub.publish(image_msg(imgs[3], 7003))
    info = client.wait(lambda: next((m for m in client.msgs["frame"][seen:] if m.header.stamp.sec == 7003), None),
                       what="~/frame of the next frame")
    assert not info.decision_pending
    client.set_param("keyframe_decision_timeout", 20.0)
