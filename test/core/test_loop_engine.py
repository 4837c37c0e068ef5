"""Loop closure through the node's frame loop, without ROS: runtime/engine.py with loop_link.py,
loop_closure.py, loop_graph.py and loop_journal.py, driven by a real scheduler thread (its idle
turns run the verifications), the tiny fixture model on CPU.

Which test is which (random tiny weights give no meaningful relative pose):

- *geometry* tests run the model but replace each result's pose and depth by a known scene's
  (``loop_scene.SceneInner``: a drifting front end in a box room) and verify with
  ``loop_scene.TrueSideRunner``; the windows, restarts, the relocalisation's alignment, the pose
  graph, the corrections and the journals are the real ones. They check that a closure lands the
  revisit where the verification measured it, and that a relocalisation gives the saved poses;
- *plumbing* tests use the tiny weights as they are (``ModelSideRunner``: a real side session):
  candidates are found and verified by the model, and the journal brings the same graph back.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.geometry import optical_pose_to_map
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.journaling import open_camera_journal, save_sessions
from lingbot_map_ros.runtime.params import ConfigError, resolve_settings
from lingbot_map_ros.runtime.scheduler import CameraScheduler
from lingbot_map_ros.stream.long_stream import LongStreamSession
from lingbot_map_ros.stream.session import StreamingSession

from engine_fakes import Log, Sink
from loop_scene import SceneInner, TrueSideRunner, circuit, drifted, place_image, tagged

pytest.importorskip("gtsam", reason="gtsam is not installed (scripts/bootstrap.sh installs it)")

BASE = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "keyframe_interval": 1, "window_frames": 8,
        "device": "cpu", "conf_threshold": 0.0, "backend": "sdpa", "map_voxel_size": 0.0, "loop_closure": True,
        "loop_min_separation": 12, "loop_min_similarity": 0.9}
N, REVISIT = 30, 5  # a circuit of N places, then the first REVISIT places again


def settings_of(tmp_path: Path, **kw):
    return resolve_settings({**BASE, "output_directory": str(tmp_path / "out"), **kw})


class Run:
    """An engine on the scene (``reported``/``true``: {identity: c2w}) with a scheduler thread."""

    def __init__(self, model, settings, reported, true, side, state_dir: bool = False) -> None:
        self.inner = SceneInner(StreamingSession(model, settings.stream), reported, true)
        self.session = LongStreamSession(self.inner, settings.long_stream)
        self.journal = None
        resumed = None
        if settings.state_directory or settings.load_session:
            self.journal, resumed = open_camera_journal(self.session, settings, "")
        self.sink = Sink(wants=())
        self.engine = InferenceEngine(self.session, settings, self.sink, Log(), now=lambda: 1000.0,
                                      journal=self.journal, side=side)
        if resumed is not None:
            self.engine.commands.resumed_from(resumed)
        self.scheduler = CameraScheduler({"": self.engine})
        self.scheduler.start()

    def show(self, image: np.ndarray, stamp: float) -> None:
        """One frame, then wait until it is handled (posed, collected or looked for in the map)."""
        e = self.engine
        before = self.handled()
        e.submit_frame(InputFrame(rgb=image, stamp=stamp, stamp_s=stamp, camera_frame="cam"))
        deadline = time.monotonic() + 60
        while self.handled() <= before and not e.recovery.collected:
            assert time.monotonic() < deadline, "the frame was not handled"
            time.sleep(0.002)
        self.settle()

    def handled(self) -> int:
        c = self.engine.seq.counter_values()
        return c.frames_processed + c.frames_dropped_invalid + c.frames_dropped_error + c.frames_not_localized

    def settle(self) -> None:
        """Until the loop thread and the verifications it asked for are done, what they decided was
        applied on the inference thread, and the keyframes' map is rendered as the corrections are
        (the node renders it when it is shown): repeated until nothing moved in one more round
        (the scheduler's idle turns run candidates when they like)."""
        loop = self.engine.loop
        deadline = time.monotonic() + 120
        while True:
            version = (loop.corrections.version, loop.stats)
            assert loop.flush(60)
            with loop._idle:
                waiting = bool(loop._jobs) or loop._busy
            if not waiting:
                assert self.engine.submit("sync", lambda: None).wait(30)
                assert loop.flush(60)  # what the inference thread told it then (a relocalisation done)
                assert self.engine.submit("sync", lambda: None).wait(30)
                loop.render_map()
                assert loop.flush(60)
                time.sleep(0.02)  # an idle turn of the scheduler, if it has a candidate to run
                with loop._idle:
                    waiting = bool(loop._jobs) or loop._busy or loop._pending
                if not waiting and version == (loop.corrections.version, loop.stats):
                    return
            assert time.monotonic() < deadline, "the loop closer did not settle"
            time.sleep(0.005)

    def stop(self) -> None:
        self.scheduler.stop()
        if self.journal is not None and self.journal.writer is not None:
            self.journal.writer.close()


def show_until_relocalized(run: Run, again: dict, t0: float) -> list[int]:
    """Show the revisits ``again`` ({tag: place}) from stamp ``t0`` on, one a second, until the camera's
    loop closer has relocalized; the places shown, in order."""
    shown = []
    for n, (k, j) in enumerate(again.items()):
        run.show(tagged(place_image(j % N), k), t0 + n)
        shown.append(j)
        if not run.engine.loop.relocalizing:
            break
    return shown


def map_pose(run: Run, index: int) -> np.ndarray:
    """Frame ``index``'s pose in the map as the path hands it over (the sequence's path, its
    corrections applied)."""
    entry = next(e for e in run.engine.seq.path.entries() if e.frame_index == index)
    return run.engine.seq.corrections.pose(index, entry.T_map_cam)


@pytest.fixture(scope="module")
def scene():
    true = circuit(N)
    true = true + true[:REVISIT]
    reported = drifted(true)
    images = [tagged(place_image(i % N), i) for i in range(len(true))]
    side = TrueSideRunner(list(zip(images[:N], true[:N])))
    return dict(enumerate(reported)), dict(enumerate(true)), images, side


def test_closure_geometry_through_the_engine_lands_the_revisit_on_the_first_pass(tiny_model, tmp_path, scene):
    """Geometry (stand-in): the stream comes back to its first places after more than a window;
    the closure is found against the right keyframe, verified, added; map -> odom moves, the path's
    revisit lands where the first pass saw the place, and the loop-closure map moves with it."""
    reported, true, images, side = scene
    run = Run(tiny_model, settings_of(tmp_path, publish_path=True), reported, true, side)
    try:
        for i, image in enumerate(images[:N]):
            run.show(image, 1000.0 + i)
        loop = run.engine.loop
        assert loop.stats.accepted == 0 and run.session.window_index >= 2  # more than a window, no loop yet
        map_before = loop.map[0].copy()
        for i in range(N, N + REVISIT):
            run.show(images[i], 1000.0 + i)
        stats = loop.stats
        assert stats.accepted >= 1 and side.calls >= 2, stats
        accepted = [m for m in loop.markers if m.accepted]
        assert accepted and all(m.kept == m.current - N for m in accepted)  # the same place, the first pass
        # map -> odom: the newest frame's published pose is its corrected one, not the front end's
        last = run.sink.frames[-1]
        assert last.T_front is not None
        assert np.linalg.norm(last.T_map_cam[:3, 3] - last.T_front[:3, 3]) > 0.02
        for j in range(accepted[0].current, N + REVISIT):
            raw_gap = np.linalg.norm(optical_pose_to_map(reported[j])[:3, 3] - optical_pose_to_map(reported[j - N])[:3, 3])
            gap = np.linalg.norm(map_pose(run, j)[:3, 3] - map_pose(run, j - N)[:3, 3])
            assert gap < 0.25 * raw_gap and gap < 0.05, (j, raw_gap, gap)
        map_after = loop.map[0]
        assert len(map_after) and len(map_before)
        assert not np.allclose(map_after[: len(map_before)].mean(0), map_before.mean(0), atol=1e-3)
    finally:
        run.stop()


def test_no_revisit_gives_no_closure_through_the_engine(tiny_model, tmp_path, scene):
    """Geometry (stand-in): a stream that never comes back accepts no closure."""
    reported, true, images, side = scene
    run = Run(tiny_model, settings_of(tmp_path), reported, true, side)
    try:
        for i, image in enumerate(images[:N]):
            run.show(image, 1000.0 + i)
        assert run.engine.loop.stats.accepted == 0 and run.engine.loop.stats.keyframes >= N - 2
        assert run.engine.seq.corrections.identity or all(
            np.allclose(s.matrix(), np.eye(4), atol=1e-6) for _, s in run.engine.seq.corrections.items())
    finally:
        run.stop()


def test_relocalizes_a_saved_session_onto_its_keyframes(tiny_model, tmp_path, scene):
    """Geometry (stand-in): a session of several windows is saved; a fresh engine started from it
    relocalizes on frames of its *first* window and poses them where the saved map has them;
    frames of places not in the map leave it not localized and unposed."""
    reported, true, images, side = scene
    saving = settings_of(tmp_path, state_directory=str(tmp_path / "state"), publish_path=True)
    first = Run(tiny_model, saving, reported, true, side)
    try:
        for i, image in enumerate(images[:20]):
            first.show(image, 1000.0 + i)
        assert first.session.window_index >= 2
        saved_poses = {j: map_pose(first, j) for j in range(20)}
        save_sessions({"": first.journal}, tmp_path / "out" / "kept", {"": first.engine.seq.map_journal},
                      {"": first.engine.loop})
    finally:
        first.stop()
    assert (tmp_path / "out" / "kept" / "loop.lbj").is_file()

    # new places (identities after the map's), then places of the first window seen again
    new_ids = range(40, 44)
    reported2, true2 = dict(reported), dict(true)
    strangers = {}
    for k in new_ids:
        reported2[k], true2[k] = reported[0] @ np.diag([1, 1, 1, 1.0]), true[0]
        strangers[k] = tagged(place_image(500 + k), k)
    again = {50 + j: j for j in (3, 4, 5)}  # identity -> the saved frame whose place it shows
    for k, j in again.items():
        reported2[k], true2[k] = reported[j], true[j]
    loading = settings_of(tmp_path, load_session="kept", publish_path=True)
    second = Run(tiny_model, loading, reported2, true2, side)
    try:
        loop = second.engine.loop
        assert loop.relocalizing and len(loop.store) >= 18
        for n, k in enumerate(new_ids):
            second.show(strangers[k], 2000.0 + n)
        assert loop.relocalizing and not second.sink.frames
        assert second.engine.seq.counter_values().frames_not_localized == len(new_ids)
        assert any("relocalizing" in st.state_text for st, _ in second.sink.statuses)
        shown = show_until_relocalized(second, again, 3000.0)
        assert loop.localization == "localized", (loop.stats, [r for r in second.engine.log.lines if "reloc" in r[1]])
        assert second.sink.statuses[-1][0].localization == "localized"
        # the frames after the relocalisation are posed where the saved map has their places
        rest = [(k, j) for k, j in again.items() if j not in shown]
        assert rest, "relocalized only at the last frame"
        for n, (k, j) in enumerate(rest):
            second.show(tagged(place_image(j % N), k), 4000.0 + n)
            posed = second.sink.frames[-1].T_map_cam
            assert np.allclose(posed[:3, 3], saved_poses[j][:3, 3], atol=2e-3), (j, posed[:3, 3], saved_poses[j][:3, 3])
            assert np.allclose(posed[:3, :3], saved_poses[j][:3, :3], atol=2e-3)
    finally:
        second.stop()


def lost_scene(reported, true, first: int):
    """The scene's first ``first`` frames, then three frames whose confidence collapses (identities
    40-42: the camera still at place ``first - 1``; a lost track with health_lost_after 2), four of
    places not in the map (43-46) and places 3, 4, 5 of the first window seen again (50-52)."""
    reported2, true2 = dict(reported), dict(true)
    blind = {40: first - 1, 41: first - 1, 42: first - 1}
    for k, j in blind.items():
        reported2[k], true2[k] = reported[j], true[j]
    strangers = {}
    for k in range(43, 47):
        reported2[k], true2[k] = reported[first - 1], true[0]
        strangers[k] = tagged(place_image(500 + k), k)
    again = {50 + j: j for j in (3, 4, 5)}  # identity -> the frame of the first pass whose place it shows
    for k, j in again.items():
        reported2[k], true2[k] = reported[j], true[j]
    return reported2, true2, blind, strangers, again


def test_a_lost_track_relocalizes_in_its_own_map_and_goes_on(tiny_model, tmp_path, scene):
    """Geometry (stand-in), on_lost=relocalize: after more than a window, the confidence collapses
    and tracking is lost; the sequence stays (path, keyframes, numbering), frames of places not in
    the map are neither posed nor stepped, and frames of the first window's places relocalize the
    camera: the frames after it are posed where the first pass saw their places."""
    reported, true, images, side = scene
    first = 20
    reported2, true2, blind, strangers, again = lost_scene(reported, true, first)
    settings = settings_of(tmp_path, publish_path=True, on_lost="relocalize", health_lost_after=2)
    run = Run(tiny_model, settings, reported2, true2, side)
    run.inner.blind = set(blind)
    try:
        for i, image in enumerate(images[:first]):
            run.show(image, 1000.0 + i)
        assert run.session.window_index >= 2
        first_pass = {j: map_pose(run, j) for j in range(first)}
        loop, seq = run.engine.loop, run.engine.seq
        for n, (k, j) in enumerate(blind.items()):
            run.show(tagged(place_image(j % N), k), 1100.0 + n)
            if loop.relocalizing:
                break
        assert loop.relocalizing, [st.state_text for st, _ in run.sink.statuses[-3:]]
        assert seq.tracking.lost_resets == 1 and len(loop.store) >= first
        assert "relocalizing in the map" in run.sink.statuses[-1][0].state_text
        pushed = run.session.frames_pushed
        posed = len(run.sink.frames)
        for n, (k, image) in enumerate(strangers.items()):
            run.show(image, 1200.0 + n)
        assert loop.relocalizing and len(run.sink.frames) == posed and run.session.frames_pushed == pushed
        assert seq.counter_values().frames_not_localized == len(strangers)
        assert run.sink.statuses[-1][0].localization == "relocalizing"
        shown = show_until_relocalized(run, again, 1300.0)
        assert loop.localization == "localized", (loop.stats, [r for r in run.engine.log.lines if "reloc" in r[1]])
        assert {e.frame_index for e in seq.path.entries()} >= set(range(first))  # the sequence went on
        assert seq.tracking.lost_resets == 1 and len(loop.store) >= first
        rest = [(k, j) for k, j in again.items() if j not in shown]
        assert rest, "relocalized only at the last frame"
        for n, (k, j) in enumerate(rest):
            run.show(tagged(place_image(j % N), k), 1400.0 + n)
            T = run.sink.frames[-1].T_map_cam
            assert run.sink.frames[-1].frame_index >= pushed  # numbered on after the lost frames
            np.testing.assert_allclose(T[:3, 3], first_pass[j][:3, 3], atol=2e-3, err_msg=f"place {j}")
            np.testing.assert_allclose(T[:3, :3], first_pass[j][:3, :3], atol=2e-3, err_msg=f"place {j}")
    finally:
        run.stop()


def test_a_lost_track_not_relocalized_within_the_timeout_starts_a_new_sequence(tiny_model, tmp_path, scene):
    """on_lost=relocalize with relocalize_timeout 2 s: places not in the map for longer than that
    (image stamps) give up the search: a new sequence starts (the keyframe map with it), frames are
    stepped again and ~/status says why; on_lost=relocalize without loop closure is refused."""
    reported, true, images, side = scene
    first = 6
    reported2, true2, blind, strangers, _ = lost_scene(reported, true, first)
    settings = settings_of(tmp_path, on_lost="relocalize", health_lost_after=2, relocalize_timeout=2.0)
    run = Run(tiny_model, settings, reported2, true2, side)
    run.inner.blind = set(blind)
    try:
        for i, image in enumerate(images[:first]):
            run.show(image, 1000.0 + i)
        loop, seq = run.engine.loop, run.engine.seq
        for n, (k, j) in enumerate(blind.items()):
            run.show(tagged(place_image(j % N), k), 1100.0 + n)
            if loop.relocalizing:
                break
        assert loop.relocalizing
        lost_at = run.engine.loop_link.lost_at
        stamps = [lost_at + 1.0, lost_at + 1.9, lost_at + 2.5]  # the third is past the timeout
        for stamp, (k, image) in zip(stamps, strangers.items()):
            run.show(image, stamp)
        assert not loop.relocalizing and loop.localization == "" and len(loop.store) == 0
        text = run.sink.statuses[-1][0].state_text
        assert "not found in the map within relocalize_timeout 2 s" in text and "new sequence" in text, text
        assert seq.counter_values().frames_not_localized == 3 and seq.tracking.lost_resets == 1
        pushed = run.session.frames_pushed
        run.show(list(strangers.values())[-1], lost_at + 3.0)
        assert run.session.frames_pushed > pushed or run.engine.recovery.collected  # stepped again
    finally:
        run.stop()
    with pytest.raises(ConfigError, match="on_lost 'relocalize' looks for the camera .* set loop_closure true"):
        resolve_settings({**BASE, "loop_closure": False, "on_lost": "relocalize"})


def test_closure_and_pose_graph_survive_a_kill_with_the_same_graph_path_and_map(tiny_model, tmp_path, scene):
    """Geometry (stand-in) and persistence: after a closure, the state directory as a kill -9 leaves
    it (the files as written so far) starts an engine with the same pose graph, the same corrected
    path and the same loop-closure map."""
    reported, true, images, side = scene
    settings = settings_of(tmp_path, state_directory=str(tmp_path / "state"), publish_path=True)
    run = Run(tiny_model, settings, reported, true, side)
    try:
        for i, image in enumerate(images):
            run.show(image, 1000.0 + i)
        loop = run.engine.loop
        assert loop.stats.accepted >= 1
        assert run.journal.writer.flush(30) and run.engine.seq.map_journal.writer.flush(30)
        assert loop.graph.journal.writer.flush(30)
        killed = tmp_path / "killed"
        killed.mkdir()
        for f in (tmp_path / "state").iterdir():
            (killed / f.name).write_bytes(f.read_bytes())  # what a kill leaves
        edges = loop.graph.graph.edge_counts()
        corrections = dict(loop.corrections.items())
        path = {e.frame_index: map_pose(run, e.frame_index) for e in run.engine.seq.path.entries()}
        points = loop.map[0].copy()
    finally:
        run.stop()
    assert edges.get("loop", 0) >= 1 and (killed / "loop.lbj").is_file()

    again = Run(tiny_model, settings_of(tmp_path, state_directory=str(killed), publish_path=True), reported, true, side)
    try:
        again.settle()
        loop2 = again.engine.loop
        assert not loop2.relocalizing  # a restart continues where it was; only a loaded session relocalizes
        assert loop2.graph.graph.edge_counts() == edges
        assert sorted(dict(loop2.corrections.items())) == sorted(corrections)
        for index, c in loop2.corrections.items():
            np.testing.assert_allclose(c.matrix(), corrections[index].matrix(), atol=1e-6, err_msg=f"keyframe {index}")
        assert sorted(e.frame_index for e in again.engine.seq.path.entries()) == sorted(path)
        assert again.sink.corrections is again.engine.seq.corrections  # what was handed over to publish
        for index, pose in path.items():
            np.testing.assert_allclose(map_pose(again, index), pose, atol=1e-6, err_msg=f"frame {index}")
        np.testing.assert_allclose(loop2.map[0], points, atol=1e-5)
    finally:
        again.stop()


def test_closure_plumbing_with_the_tiny_weights_verifies_candidates_with_the_model(tiny_model, tmp_path):
    """Plumbing (tiny weights as they are, a real side session): a stream that shows its first
    places again makes candidates; each one is run through the model's side session and decided
    (accepted or refused with its reason); the keyframes and the decisions are journaled."""
    settings = settings_of(tmp_path, state_directory=str(tmp_path / "state"))
    images = [tagged(place_image(i % 16), i) for i in range(22)]
    inner = StreamingSession(tiny_model, settings.stream)
    session = LongStreamSession(inner, settings.long_stream)
    journal, _ = open_camera_journal(session, settings, "")
    sink = Sink(wants=())
    engine = InferenceEngine(session, settings, sink, Log(), now=lambda: 1000.0, journal=journal)
    scheduler = CameraScheduler({"": engine})
    scheduler.start()
    run = Run.__new__(Run)
    run.engine, run.journal, run.scheduler, run.sink, run.session = engine, journal, scheduler, sink, session
    try:
        for i, image in enumerate(images):
            run.show(image, 1000.0 + i)
        stats = engine.loop.stats
        assert stats.keyframes >= 18 and stats.candidates >= 1, stats
        assert stats.accepted + stats.rejected == stats.candidates, stats  # each was verified and decided
        assert all(m.reason for m in engine.loop.markers) and len(engine.loop.markers) == stats.candidates
        assert engine.loop.graph.journal.writer.flush(30)
    finally:
        run.stop()
    from lingbot_map_ros.runtime.loop_journal import read_loop_journal

    kinds = [r.kind for r in read_loop_journal(tmp_path / "state" / "loop.lbj").records]
    assert kinds.count("lkf") == stats.keyframes and kinds.count("loop") == stats.accepted


def _pose_input(x, y, z, q=(0.0, 0.0, 0.0, 1.0), cov=None, frame="map", stamp=0.0):
    from lingbot_map_ros.runtime.pose_inputs import PoseInput

    cov = np.diag([0.01] * 6) if cov is None else np.asarray(cov, float)
    return PoseInput(frame, stamp, (x, y, z), tuple(q), tuple(cov.reshape(-1)))


def test_set_pose_moves_the_map_and_bad_poses_are_refused_with_their_reason(tiny_model, tmp_path, scene):
    """~/set_pose and ~/pose_prior through the engine (geometry stand-in): each bad input is refused
    with its reason and changes nothing; a good set_pose puts the frame where it was said to be
    (the path and map -> odom move with it); a prior lands on the keyframe at or before its frame."""
    from lingbot_map_ros.geometry import matrix_to_quaternion
    from lingbot_map_ros.runtime.pose_inputs import PoseRefused

    reported, true, images, side = scene
    run = Run(tiny_model, settings_of(tmp_path, publish_path=True), reported, true, side)
    link = run.engine.loop_link
    try:
        for i, image in enumerate(images[:8]):
            run.show(image, 1000.0 + i)
        last = run.engine.seq.path.entries()[-1]
        T = map_pose(run, last.frame_index)
        q = matrix_to_quaternion(T[:3, :3])
        bad = {"NaN": _pose_input(np.nan, 0, 0),
               "unit quaternion": _pose_input(0, 0, 0, q=(0, 0, 0, 0.5)),
               "positive definite": _pose_input(0, 0, 0, cov=np.diag([0.01, 0.01, 0.0, 0.01, 0.01, 0.01])),
               "symmetric": _pose_input(0, 0, 0, cov=np.diag([0.01] * 6) + np.eye(6, k=1) * 0.001),
               "not the map frame": _pose_input(0, 0, 0, frame="odom"),
               "no frame_id": _pose_input(0, 0, 0, frame=""),
               "from the nearest frame": _pose_input(0, 0, 0, stamp=5000.0)}
        for kind in ("set_pose", "prior"):
            for reason, p in bad.items():
                with pytest.raises(PoseRefused, match=reason):
                    cmd = run.engine.submit(kind, lambda p=p, kind=kind: link.pose_input(kind, p))
                    assert cmd.wait(30)
                    raise cmd.error
        run.settle()
        assert run.engine.seq.corrections.identity and run.engine.loop.graph.graph.edge_counts().get("prior", 0) == 0
        # a good one: the latest frame is 1 unit further along x
        target = (T[0, 3] + 1.0, T[1, 3], T[2, 3])
        cmd = run.engine.submit("set_pose", lambda: link.pose_input("set_pose", _pose_input(*target, q=tuple(q))))
        assert cmd.wait(30) and cmd.error is None, cmd.error
        run.settle()
        moved = map_pose(run, last.frame_index)
        np.testing.assert_allclose(moved[:3, 3], target, atol=1e-3)
        np.testing.assert_allclose(moved[:3, :3], T[:3, :3], atol=1e-3)
        first = map_pose(run, 0)  # the whole map moved with it (a frame, not a bend)
        np.testing.assert_allclose(first[:3, 3] - moved[:3, 3], map_pose_raw(run, 0)[:3, 3] - T[:3, 3], atol=1e-3)
        assert run.engine.loop.graph.graph.edge_counts().get("prior", 0) == 1
        # a prior on the stamp of frame 5: on keyframe 5, in the graph
        entry = next(e for e in run.engine.seq.path.entries() if e.frame_index == 5)
        P = map_pose(run, 5)
        cmd = run.engine.submit("prior", lambda: link.pose_input("prior", _pose_input(
            *P[:3, 3], q=tuple(matrix_to_quaternion(P[:3, :3])), stamp=entry.stamp_s)))
        assert cmd.wait(30) and cmd.error is None and "keyframe 6" in cmd.result, (cmd.error, cmd.result)
        run.settle()
        assert run.engine.loop.graph.graph.edge_counts().get("prior", 0) == 2
        # the next frame is published where the moved map has it
        run.show(images[8], 1008.0)
        out = run.sink.frames[-1]
        np.testing.assert_allclose(out.T_map_cam, map_pose(run, out.frame_index - 1), atol=1e-9)  # 1-based
        assert np.linalg.norm(out.T_map_cam[:3, 3] - out.T_front[:3, 3]) > 0.5
    finally:
        run.stop()


def map_pose_raw(run: Run, index: int) -> np.ndarray:
    return next(e for e in run.engine.seq.path.entries() if e.frame_index == index).T_map_cam
