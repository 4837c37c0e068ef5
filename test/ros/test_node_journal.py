"""The node's map outlives its process (state_directory, ~/save_session, ~/load_session), in a
real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID), tiny fixture weights on the CPU.

The uninterrupted run is a replay session with the node's settings fed the same frames (the
node equals it: test_node_graph, test_keyframe_loop). Each test interrupts the node's run —
kill -9 of the process, or a fresh node that loads a saved session — and checks that every
frame after it comes out with the uninterrupted run's pose and ~/frame index.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from graph_helpers import (GraphClient, InProcessNode, fixture_params, generated_frames, image_msg,  # noqa: E402
                           pose_matrix, private_domain_id, replay_session, start_node, stop_processes,
                           write_node_params)
from lingbot_map_ros.journal import JOURNAL_NAME  # noqa: E402
from lingbot_map_ros.journal.format import JournalError, iter_records, scan  # noqa: E402
from lingbot_map_ros.io.export import read_ply, read_tum  # noqa: E402
from lingbot_map_ros.msg import FrameInfo, Status  # noqa: E402
from lingbot_map_ros.ros.diagnostics import node_diagnostics  # noqa: E402
from lingbot_map_ros.runtime.map_journal import MAP_JOURNAL_NAME  # noqa: E402
from lingbot_map_ros.srv import LoadSession, SaveMap, SaveSession  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 77)
WIDTH = 98
FRAMES = 14
# 2 scale frames, every 2nd frame stored, a window of 5 stored frames: the window restarts at
# frame 9 (0-based); the sequence covers the scale phase, a window and a restart
PARAMS = {"image_width": WIDTH, "num_scale_frames": 2, "sliding_window": 3, "keyframe_interval": 2,
          "window_frames": 5, "device": "cpu", "conf_threshold": 0.0, "publish_points": False,
          "publish_depth": False, "publish_map": False, "publish_path": False, "publish_tf": False}
START_TIMEOUT = 90.0
STEP_TIMEOUT = 40.0


@pytest.fixture(scope="module")
def frames():
    return generated_frames(FRAMES, seed=3)


@pytest.fixture(scope="module")
def straight(fixtures, frames):
    """{0-based frame index: (T_map_cam [4, 4], window index)} of the uninterrupted run."""
    out = _straight_of(fixtures, frames)
    assert len(out) == FRAMES and max(w for _, w in out.values()) >= 1  # the script reaches a restart
    return out


def assert_like_straight(got: dict[int, FrameInfo], straight, indices) -> None:
    for i in indices:
        assert i + 1 in got, f"no ~/frame for frame {i + 1} (got {sorted(got)})"
        msg = got[i + 1]
        np.testing.assert_allclose(pose_matrix_of(msg), straight[i][0], atol=1e-4, err_msg=f"frame {i + 1}")
        assert msg.window_index == straight[i][1], f"frame {i + 1}"


def pose_matrix_of(msg: FrameInfo) -> np.ndarray:
    from geometry_msgs.msg import PoseStamped

    return pose_matrix(PoseStamped(header=msg.header, pose=msg.pose))


def last_index(path: Path, kinds=("frame", "seen")) -> int:
    """The highest frame index a journal file holds a record of (-1: none yet): by default the
    keyframe journal's frames; ``kinds=("chunk", "snapshot")``: the frames whose points the map
    journal holds."""
    last = -1
    try:  # the node writes (and compacts: replaces) the file while this reads it: not there yet
        for r in iter_records(scan(path)):
            if r.kind in kinds:
                last = max(last, int(r.meta.get("i", -1)), *r.meta.get("chunks", []))
    except JournalError:
        return -1
    return last


MAP_KINDS = ("chunk", "snapshot")


def saved_map(client: GraphClient, name: str, directory: Path) -> tuple:
    """~/save_map into ``directory``: (points, colours, stamps, poses) read back from the files."""
    answer = client.call(SaveMap, f"/{name}/save_map", SaveMap.Request(directory=str(directory)), timeout=60.0)
    assert answer.success, answer.message
    points, colors = read_ply(answer.ply_path)
    stamps, poses = read_tum(answer.trajectory_path)
    return points, colors, stamps, poses


def assert_same_saved_map(got, want, what: str) -> None:
    (p, c, s, T), (wp, wc, ws, wT) = got, want
    assert p.shape == wp.shape and s.shape == ws.shape, f"{what}: {p.shape} vs {wp.shape}, {s.shape} vs {ws.shape}"
    np.testing.assert_allclose(p, wp, atol=1e-4, err_msg=f"{what}: map.ply points")
    assert np.array_equal(c, wc), f"{what}: map.ply colours"
    np.testing.assert_allclose(s, ws, atol=1e-6, err_msg=f"{what}: trajectory.tum stamps")
    np.testing.assert_allclose(T, wT, atol=1e-4, err_msg=f"{what}: trajectory.tum poses")


class Robot:
    """Publishes the frames on the node's image topic and records its ~/frame by index."""

    def __init__(self, name: str, topic: str, camera: str = "") -> None:
        self.client = GraphClient(f"{name}_{camera}_robot", DOMAIN_ID, STEP_TIMEOUT)
        self.frames: dict[int, FrameInfo] = {}
        self.frame_topic = f"/{name}/{camera}/frame" if camera else f"/{name}/frame"
        self.client.subscribe(FrameInfo, self.frame_topic, self._on_frame, depth=50)
        self.statuses = self.client.record(Status, self.frame_topic[:-len("frame")] + "status", "status", depth=50)
        self.pub = self.client.node.create_publisher(Image, topic, QoSProfile(depth=10))

    def ready(self, node: InProcessNode | None = None, camera: str = "") -> None:
        """Wait until the node takes images and its ~/frame reaches us (a process: until it
        publishes ~/frame; the node publishes it only to matched subscribers)."""
        self.client.wait(lambda: self.pub.get_subscription_count() >= 1, "the node to subscribe", START_TIMEOUT)
        if node is not None:
            frame_info = node.node.channels[camera].outputs.frame_info
            self.client.wait(lambda: frame_info.get_subscription_count() >= 1, "~/frame to match", START_TIMEOUT)
        else:  # a status heartbeat (1 Hz) from the node: its publishers have matched ours
            self.statuses.clear()
            self.client.wait(lambda: self.client.node.count_publishers(self.frame_topic) >= 1 and self.statuses,
                             "~/frame and a ~/status from the node", START_TIMEOUT)

    def _on_frame(self, msg: FrameInfo) -> None:
        self.frames[msg.frame_index] = msg

    def send(self, k: int, rgb: np.ndarray, until) -> None:
        """Publish frame ``k`` (stamp 1000 + k s) until ``until()`` holds (a first sample may go
        out before the node's reader matched the writer: it is sent again, same stamp)."""
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            self.pub.publish(image_msg(rgb, 1000 + k, "cam"))
            try:
                return self.client.wait(until, f"frame {k}", timeout=min(2.0, deadline - time.monotonic()))
            except AssertionError:
                if time.monotonic() > deadline:
                    raise


# name -> (the frame after which the node is killed, extra parameters); run side by side with one
# uninterrupted node ("straight": not killed) whose saved map the others' must equal
KILLS = {"scale-phase": (0, {}), "mid-window": (4, {}), "after-restart": (9, {}),
         "held-decision": (6, {"keyframe_decision_timeout": 1.0})}
STRAIGHT = "straight"


def _kill_and_resume(case: str, fixtures, frames, tmp: Path) -> dict:
    """One node process fed frames 0..k, killed with SIGKILL once frame k is in its journal (with a
    decision timeout: while the next frame is held for frame k's decision), then a new process on
    the same state_directory fed frames k+1..; what each run published and the second one's log."""
    kill_at, extra = KILLS.get(case, (FRAMES - 1, {}))
    name, topic = f"lm_kill_{case.replace('-', '_')}", f"/kill_{case.replace('-', '_')}/image"
    state = tmp / "state"
    params = write_node_params(tmp / "p.yaml", fixtures, {**PARAMS, **extra, "state_directory": str(state),
                                                         "output_directory": str(tmp / "out")})
    robot = Robot(name, topic)
    procs = []
    try:
        first = start_node(name, params, tmp / "first.log", DOMAIN_ID, {"image": topic})
        procs.append(first)
        robot.client.watch(first, tmp / "first.log")
        robot.ready()
        journal, map_journal = state / JOURNAL_NAME, state / MAP_JOURNAL_NAME
        for k in range(kill_at + 1):  # frame k's points reach the map journal after its pose
            robot.send(k, frames[k], lambda k=k: last_index(journal) >= k and (
                k == 0 or (k + 1 in robot.frames and last_index(map_journal, MAP_KINDS) >= k)))
        if case == STRAIGHT:
            return {"before": dict(robot.frames), "map": saved_map(robot.client, name, tmp / "saved")}
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        robot.client._watched.clear()
        before = dict(robot.frames)
        robot.frames.clear()
        second = start_node(name, params, tmp / "second.log", DOMAIN_ID, {"image": topic})
        procs.append(second)
        robot.client.watch(second, tmp / "second.log")
        # the killed process's endpoints linger in discovery until their lease ends: wait for the new one
        robot.client.wait(lambda: "ready: listening" in (tmp / "second.log").read_text(errors="replace"), "the new node",
                          START_TIMEOUT)
        robot.ready()
        for k in range(kill_at + 1, FRAMES):
            robot.send(k, frames[k], lambda k=k: k + 1 in robot.frames)
        return {"before": before, "after": dict(robot.frames), "log": (tmp / "second.log").read_text(errors="replace"),
                "map": saved_map(robot.client, name, tmp / "saved")}
    finally:
        robot.client.close()
        stop_processes(*procs)


@pytest.fixture(scope="module")
def kills(fixtures, frames, tmp_path_factory):
    """Every case of KILLS, run in parallel threads (each its own processes, topic and folder)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(KILLS) + 1) as pool:
        futures = {case: pool.submit(_kill_and_resume, case, fixtures, frames, tmp_path_factory.mktemp(case))
                   for case in [*KILLS, STRAIGHT]}
        return {case: f.result() for case, f in futures.items()}


@pytest.mark.parametrize("case", list(KILLS))
def test_kill_9_then_restart_resumes_the_map(kills, straight, case):
    """The node is killed with SIGKILL once frame k is in its journal; a new process with the same
    state_directory resumes, and frames k+1.. come out as in one uninterrupted run."""
    kill_at, extra = KILLS[case]
    run = kills[case]
    assert "resumed the journal" in run["log"], run["log"][-3000:]
    assert "[ERROR]" not in run["log"]
    # frame 0 alone has no results; frames 1..k came out before the kill
    assert_like_straight(run["before"], straight, [i for i in range(kill_at + 1) if i >= 1])
    assert_like_straight(run["after"], straight, range(max(kill_at + 1, 1), FRAMES))
    if kill_at == 0:
        assert_like_straight(run["after"], straight, [0])  # the scale frames come out together
    if extra.get("keyframe_decision_timeout"):
        held = run["before"][kill_at + 1]
        assert held.stored and held.decision_pending  # killed while the next frame waited for the decision


@pytest.mark.parametrize("case", list(KILLS))
def test_kill_9_then_restart_saves_the_map_of_an_uninterrupted_run(kills, case):
    """~/save_map of the resumed node (map.ply, trajectory.tum) equals the uninterrupted node's:
    the accumulated cloud and the path came back from the map journal, then grew alike."""
    straight_run = kills[STRAIGHT]
    assert sorted(straight_run["before"]) == list(range(1, FRAMES + 1)), sorted(straight_run["before"])
    assert straight_run["map"][0].shape[0] > 0 and straight_run["map"][2].shape[0] == FRAMES
    assert_same_saved_map(kills[case]["map"], straight_run["map"], case)


def call(client: GraphClient, srv, name: str, request):
    return client.call(srv, name, request, timeout=60.0)


def received(node: InProcessNode) -> int:
    return node.node.channels[""].engine.seq.counter_values().frames_received


def test_save_session_then_a_fresh_node_loads_it_and_continues_the_map(fixtures, frames, straight, kills, tmp_path):
    """~/save_session at frame 6 (mid-window); a fresh node (no state directory) started with
    load_session, and another that calls ~/load_session, each continue with frames 7.. exactly
    as the uninterrupted run, and save its map and path; refusals answer with the reason and
    change nothing."""
    out = tmp_path / "out"
    common = {**PARAMS, "output_directory": str(out)}
    save_at = 6
    a = InProcessNode("lm_save", fixture_params(fixtures, {**common, "state_directory": str(tmp_path / "sa")}),
                      DOMAIN_ID).start()
    robot = Robot("lm_save", "/image")
    try:
        robot.ready(a)
        for k in range(save_at + 1):
            robot.send(k, frames[k], lambda k=k: received(a) > k if k == 0 else k + 1 in robot.frames)
        saved = call(robot.client, SaveSession, "/lm_save/save_session", SaveSession.Request(directory="kept"))
        assert saved.success, saved.message
        assert Path(saved.path) == (out / "kept").resolve() and (out / "kept" / JOURNAL_NAME).is_file()
        assert (out / "kept" / MAP_JOURNAL_NAME).is_file()
        assert saved.bytes > 0
        # a relative folder that leaves output_directory is refused
        bad = call(robot.client, SaveSession, "/lm_save/save_session", SaveSession.Request(directory="../x"))
        assert not bad.success and "outside output_directory" in bad.message
        # saving again into the same folder replaces it atomically
        again = call(robot.client, SaveSession, "/lm_save/save_session", SaveSession.Request(directory="kept"))
        assert again.success, again.message
    finally:
        robot.client.close()
        a.close()

    # a node started from the saved session (the launch argument's parameter)
    b = InProcessNode("lm_load", fixture_params(fixtures, {**common, "load_session": "kept"}), DOMAIN_ID).start()
    robot = Robot("lm_load", "/image")
    try:
        assert b.node.channels[""].engine.commands.resumed is not None and b.node.channels[""].engine.commands.resumed.frames > 0
        robot.ready(b)
        for k in range(save_at + 1, FRAMES):
            robot.send(k, frames[k], lambda k=k: k + 1 in robot.frames)
        assert_like_straight(robot.frames, straight, range(save_at + 1, FRAMES))
        assert_same_saved_map(saved_map(robot.client, "lm_load", tmp_path / "b_map"), kills[STRAIGHT]["map"],
                              "load_session at start")
        # ~/save_session without a state directory: refused with the reason
        off = call(robot.client, SaveSession, "/lm_load/save_session", SaveSession.Request())
        assert not off.success and "state_directory" in off.message
    finally:
        robot.client.close()
        b.close()

    # a running node told to load it: its own frames are replaced by the saved map
    c = InProcessNode("lm_svc", fixture_params(fixtures, {**common, "state_directory": str(tmp_path / "sc")}),
                      DOMAIN_ID).start()
    robot = Robot("lm_svc", "/image")
    try:
        robot.ready(c)
        for k in (11, 12, 13):  # another scene start: these frames make a map of their own
            robot.send(k, frames[k], lambda k=k: received(c) > k - 11)
        robot.client.wait(lambda: c.node.channels[""].engine.seq.counter_values().frames_processed == 3, "3 frames processed")
        pushed = c.node.channels[""].engine.session.frames_pushed
        missing = call(robot.client, LoadSession, "/lm_svc/load_session", LoadSession.Request(directory="nope"))
        assert not missing.success and "no saved session" in missing.message
        assert c.node.channels[""].engine.session.frames_pushed == pushed and pushed > 0  # state unchanged by the refusal
        loaded = call(robot.client, LoadSession, "/lm_svc/load_session", LoadSession.Request(directory="kept"))
        assert loaded.success, loaded.message
        assert loaded.next_frame == save_at + 2 and loaded.frames_replayed > 0
        robot.frames.clear()
        for k in range(save_at + 1, FRAMES):
            robot.send(k, frames[k], lambda k=k: k + 1 in robot.frames)
        assert_like_straight(robot.frames, straight, range(save_at + 1, FRAMES))
        # its own frames' points and poses are gone: the map and path are the saved session's, continued
        assert_same_saved_map(saved_map(robot.client, "lm_svc", tmp_path / "c_map"), kills[STRAIGHT]["map"],
                              "~/load_session")
    finally:
        robot.client.close()
        c.close()


def test_two_cameras_save_and_load_one_session(fixtures, frames, straight, tmp_path):
    """Named cameras: ~/save_session writes one folder per camera in one call; a fresh node started
    with load_session continues both cameras' maps (each camera as its own uninterrupted run)."""
    out = tmp_path / "out"
    other = generated_frames(FRAMES, seed=4)
    rear_straight = _straight_of(fixtures, other)
    common = {**PARAMS, "output_directory": str(out), "cameras": ["front", "rear"]}
    save_at = 5
    views = {"front": frames, "rear": other}

    def run(node: InProcessNode, name: str, ks) -> dict[str, dict[int, FrameInfo]]:
        robots = {c: Robot(name, f"/{c}/image", c) for c in views}
        try:
            for c, robot in robots.items():
                robot.ready(node, c)
            for k in ks:
                for c, robot in robots.items():
                    engine = node.node.channels[c].engine
                    robot.send(k, views[c][k], lambda k=k, e=engine, r=robot:
                               (e.seq.counter_values().frames_received > 0 and not r.frames and k == ks[0]
                                and e.session.frames_pushed == 0) or k + 1 in r.frames)
            return {c: dict(r.frames) for c, r in robots.items()}
        finally:
            for robot in robots.values():
                robot.client.close()

    a = InProcessNode("lm_two", fixture_params(fixtures, {**common, "state_directory": str(tmp_path / "s")}),
                      DOMAIN_ID).start()
    try:
        run(a, "lm_two", list(range(save_at + 1)))
        client = GraphClient("lm_two_saver", DOMAIN_ID, STEP_TIMEOUT)
        try:
            saved = call(client, SaveSession, "/lm_two/save_session", SaveSession.Request(directory="both"))
        finally:
            client.close()
        assert saved.success, saved.message
        assert all((out / "both" / c / JOURNAL_NAME).is_file() and (out / "both" / c / MAP_JOURNAL_NAME).is_file()
                   for c in views)
    finally:
        a.close()
    b = InProcessNode("lm_two_b", fixture_params(fixtures, {**common, "load_session": "both"}), DOMAIN_ID).start()
    try:
        got = run(b, "lm_two_b", list(range(save_at + 1, FRAMES)))
    finally:
        b.close()
    assert_like_straight(got["front"], straight, range(save_at + 1, FRAMES))
    assert_like_straight(got["rear"], rear_straight, range(save_at + 1, FRAMES))


def _straight_of(fixtures, images) -> dict:
    """{0-based frame index: (T_map_cam, window index)} of a replay session fed ``images``."""
    from lingbot_map_ros.geometry import optical_pose_to_map
    from lingbot_map_ros.io.preprocess import model_input

    session = replay_session(fixtures, PARAMS)
    out = {}
    for rgb in images:
        for r in session.push(model_input(rgb, WIDTH)):
            out[r.frame_index] = (optical_pose_to_map(r.c2w), session.window_index)
    return out


def test_the_journal_diagnostics_warn_while_paused_and_after_a_set_aside():
    """/diagnostics "journal": OK while writing, WARN (with the reason) while journaling is paused
    or when a journal found at start was set aside; absent without sessions."""
    from types import SimpleNamespace

    from diagnostic_msgs.msg import DiagnosticStatus

    from lingbot_map_ros.journal import JournalStatus
    from lingbot_map_ros.ros.sessions import journal_diag
    from lingbot_map_ros.runtime.journaling import Resumed

    def engine(state: str, reason: str = "", resumed=None):
        status = JournalStatus(state, reason, "/s/journal.lbj", 5, 100, 2 << 20, 1 << 20, 0, int(bool(reason)), 1)
        writer = SimpleNamespace(status=lambda: status)
        return SimpleNamespace(journal=SimpleNamespace(writer=writer), commands=SimpleNamespace(resumed=resumed),
                               seq=SimpleNamespace(map_journal=None, restored=None))

    assert journal_diag("n", SimpleNamespace(journal=None, commands=SimpleNamespace(resumed=None))) is None
    ok = journal_diag("n", engine("ok"))
    assert ok.level == DiagnosticStatus.OK and ok.name == "n: journal" and ok.message.startswith("ok: 5 records")
    paused = journal_diag("n", engine("paused", "[Errno 28] No space left on device"))
    assert paused.level == DiagnosticStatus.WARN and "No space left" in paused.message
    aside = Resumed("journal", "/s/journal.lbj", 0, 0, 0.0, refused="written at 112x64", set_aside="/s/j.lbj")
    warned = journal_diag("n", engine("ok", resumed=aside))
    assert warned.level == DiagnosticStatus.WARN and "set aside" in warned.message
    assert any("112x64" in kv.value for kv in warned.values)


def test_a_full_disk_pauses_the_journal_and_inference_goes_on(fixtures, frames, tmp_path):
    """state_directory on a 64 KiB file system: the journal pauses with the reason (/diagnostics
    WARN) while poses keep coming; given room again it resumes with every frame on disk."""
    from diagnostic_msgs.msg import DiagnosticStatus

    from disk_helpers import mount, tmpfs

    state = tmp_path / "state"
    with tmpfs(state, "64k"):
        node = InProcessNode("lm_full", fixture_params(fixtures, {**PARAMS, "state_directory": str(state),
                                                                 "output_directory": str(tmp_path / "out")}),
                             DOMAIN_ID).start()
        robot = Robot("lm_full", "/image")
        journal = node.node.channels[""].engine.journal

        def entry():
            return next(s for s in node_diagnostics(node.node, "").status if s.name.endswith(": journal"))
        try:
            robot.ready(node)
            for k in range(10):
                robot.send(k, frames[k], lambda k=k: received(node) > k if k == 0 else k + 1 in robot.frames)
            robot.client.wait(lambda: journal.writer.status().state == "paused", "the journal to pause")
            full = entry()
            assert full.level == DiagnosticStatus.WARN and "paused" in full.message, full.message
            assert sorted(robot.frames) == list(range(1, 11))  # every pose came out (frame 0 with frame 1)
            mount("-o", "remount,size=8m", str(state))
            robot.client.wait(lambda: journal.writer.status().state == "ok", "the journal to resume", 30.0)
            assert journal.writer.flush(10)
            assert last_index(state / JOURNAL_NAME) == 9
            # the map journal paused on the same full disk and is whole again too
            map_journal = node.node.channels[""].engine.seq.map_journal
            assert map_journal.status().pauses >= 1
            robot.client.wait(lambda: map_journal.status().state == "ok", "the map journal to resume", 30.0)
            assert map_journal.writer.flush(10) and last_index(state / MAP_JOURNAL_NAME, MAP_KINDS) == 9
            assert entry().level == DiagnosticStatus.OK
        finally:
            robot.client.close()
            node.close()
