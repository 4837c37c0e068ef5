"""The keyframe journal as the node uses it, without ROS (runtime/journaling.py and the
engine's side of it): what start-up does with a state directory, saved session folders,
the engine's ~/load_session command and its refusals (tiny fixture weights, CPU)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.config import ConfigError
from lingbot_map_ros.geometry import optical_pose_to_map
from lingbot_map_ros.journal import JOURNAL_NAME, JournalRecorder
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.journaling import (COUNTERS_STATE, SessionError, open_camera_journal, save_sessions,
                                                session_folder)
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.runtime.scheduler import CameraScheduler
from lingbot_map_ros.stream.long_stream import LongStreamSession
from lingbot_map_ros.stream.session import StreamingSession

from engine_fakes import Log, Sink

WIDTH = 98
BASE = {"image_width": WIDTH, "num_scale_frames": 2, "sliding_window": 3, "keyframe_interval": 2,
        "window_frames": 5, "device": "cpu", "conf_threshold": 0.0, "accumulate_map": False}


def rgb_frames(n: int, seed: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    big = np.kron(rng.integers(0, 256, (40, 120, 3)).astype(np.float32), np.ones((8, 8, 1)))
    return [big[10 + i: 304 + i, 20 + 7 * i: 538 + 7 * i].astype(np.uint8) for i in range(n)]


FRAMES = rgb_frames(12)


def settings_of(tmp_path: Path, **kw):
    return resolve_settings({**BASE, "output_directory": str(tmp_path / "out"), **kw})


def session_of(model, settings):
    return LongStreamSession(StreamingSession(model, settings.stream), settings.long_stream)


def engine_of(model, settings, session=None, journal=None):
    """An engine (``journal``: the session's recorder) driven by a real scheduler thread, recording
    what it publishes."""
    session = session if session is not None else session_of(model, settings)
    sink, log = Sink(wants=()), Log()
    engine = InferenceEngine(session, settings, sink, log, now=lambda: 1000.0, journal=journal)
    scheduler = CameraScheduler({"": engine})
    scheduler.start()
    return engine, scheduler, sink


def feed(engine: InferenceEngine, sink: Sink, ks) -> None:
    """Each frame, then wait until it and every frame before it are handled (the first frame
    of a sequence: until it is collected). Counting from the start matters: a scale step's
    results are counted one by one, so "one more than before" can be met by the previous frame."""
    start = handled(engine)
    for n, k in enumerate(ks, 1):
        first = engine.session.frames_pushed == 0 and not engine.recovery.collected
        engine.submit_frame(InputFrame(rgb=FRAMES[k], stamp=1000 + k, stamp_s=1000.0 + k, camera_frame="cam"))
        deadline = time.monotonic() + 60
        while not (engine.recovery.collected if first else handled(engine) >= start + n):
            assert time.monotonic() < deadline, f"frame {k} was not taken"
            time.sleep(0.005)


def journaled_run(model, settings, ks, then=None) -> None:
    """A journaled engine over frames ``ks`` (``then(journal)`` afterwards), then stopped and closed."""
    session = session_of(model, settings)
    journal, _ = open_camera_journal(session, settings, "")
    engine, scheduler, sink = engine_of(model, settings, session, journal)
    try:
        feed(engine, sink, ks)
        if then is not None:
            then(journal)
    finally:
        scheduler.stop()
        journal.writer.close()


def handled(engine: InferenceEngine) -> int:
    c = engine.seq.counter_values()
    return c.frames_processed + c.frames_dropped_invalid + c.frames_dropped_error


def poses(sink: Sink) -> dict[int, np.ndarray]:
    return {o.frame_index: o.T_map_cam for o in sink.frames}


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory):
    """{1-based index: T_map_cam} of one uninterrupted engine run over FRAMES."""
    settings = settings_of(tmp_path_factory.mktemp("straight"))
    session = session_of(tiny_model, settings)
    out = {}
    from lingbot_map_ros.io.preprocess import model_input

    for rgb in FRAMES:
        for r in session.push(model_input(rgb, WIDTH)):
            out[r.frame_index + 1] = optical_pose_to_map(r.c2w)
    assert session.window_index >= 1  # the frames reach a window restart
    return out


def test_state_directory_and_camera_batching_are_refused_together():
    with pytest.raises(ConfigError, match="camera_batching"):
        resolve_settings({**BASE, "cameras": ["a", "b"], "camera_batching": True, "state_directory": "/tmp/x"})
    resolve_settings({**BASE, "cameras": ["a", "b"], "camera_batching": True})  # each alone is fine
    resolve_settings({**BASE, "cameras": ["a", "b"], "state_directory": "/tmp/x"})


def test_without_state_directory_the_session_has_no_journal(tiny_model, tmp_path):
    settings = settings_of(tmp_path)
    session = session_of(tiny_model, settings)
    journal, resumed = open_camera_journal(session, settings, "")
    assert journal is None and resumed is None and session.events is None


def test_engine_journals_resumes_with_progress_and_restores_counters(tiny_model, tmp_path, straight):
    """A journaled engine run stopped at frame 7 (no clean close: what the writer wrote is what
    there is); a new engine on the same state directory resumes, says "resuming k of n" while it
    replays, takes the journaled counters, and continues exactly as the uninterrupted run."""
    settings = settings_of(tmp_path, state_directory=str(tmp_path / "state"))
    session = session_of(tiny_model, settings)
    journal, resumed = open_camera_journal(session, settings, "")
    assert isinstance(journal, JournalRecorder) and resumed is None and session.events is journal
    engine, scheduler, sink = engine_of(tiny_model, settings, session, journal)
    try:
        feed(engine, sink, range(7))
        engine.heartbeat().wait(10)  # the counters are journaled with the heartbeat
        assert journal.writer.flush(10)
    finally:
        scheduler.stop()
    first = poses(sink)
    for i in range(1, 8):
        np.testing.assert_allclose(first[i], straight[i], atol=1e-5)

    progress = []
    session2 = session_of(tiny_model, settings)
    journal2, resumed2 = open_camera_journal(session2, settings, "", progress=lambda k, n: progress.append((k, n)))
    assert resumed2 is not None and resumed2.source == "journal" and resumed2.next_frame == 7
    assert progress and progress[-1][0] == progress[-1][1] == resumed2.frames
    assert resumed2.states[COUNTERS_STATE]["frames_processed"] == 7
    engine2, scheduler2, sink2 = engine_of(tiny_model, settings, session2, journal2)
    try:
        engine2.commands.resumed_from(resumed2)
        assert "resumed the journal" in engine2.seq.text and "next frame is 8" in engine2.seq.text
        assert engine2.seq.counter_values().frames_processed == 7
        feed(engine2, sink2, range(7, 12))
        # ~/load_session while running: back to the journal's state (the run's own frames are replaced)
        saved = tmp_path / "out" / "s1"
        save_sessions({"": journal2}, saved)
        loaded = engine2.submit("load", lambda: engine2.commands.load_session(saved))
        assert loaded.wait(30) and loaded.error is None, loaded.error
        texts = [st.state_text for st, _ in sink2.statuses]
        assert any("loading the session: resuming" in t for t in texts)
        assert engine2.commands.resumed.next_frame == 12
    finally:
        scheduler2.stop()
        journal2.writer.close()
    got = poses(sink2)
    for i in range(8, 13):
        np.testing.assert_allclose(got[i], straight[i], atol=1e-4, err_msg=f"frame {i}")


def test_a_journal_of_another_width_is_set_aside_and_a_new_one_starts(tiny_model, tmp_path):
    state = tmp_path / "state"
    journaled_run(tiny_model, settings_of(tmp_path, state_directory=str(state)), range(3))
    other = settings_of(tmp_path, state_directory=str(state), image_width=112)
    session2 = session_of(tiny_model, other)
    journal2, resumed = open_camera_journal(session2, other, "")
    try:
        assert resumed is not None and resumed.frames == 0 and "image_width" in resumed.refused
        aside = Path(resumed.set_aside)
        assert aside.exists() and aside.name.startswith("journal.refused-")
        assert session2.frames_pushed == 0
    finally:
        journal2.writer.close()


def test_load_session_at_start_sets_the_state_directory_journal_aside(tiny_model, tmp_path):
    state = tmp_path / "state"
    journaled_run(tiny_model, settings_of(tmp_path, state_directory=str(state)), range(4),
                  then=lambda journal: save_sessions({"": journal}, tmp_path / "out" / "kept"))
    with_load = settings_of(tmp_path, state_directory=str(state), load_session="kept")
    journal2, resumed = open_camera_journal(session_of(tiny_model, with_load), with_load, "")
    try:
        assert resumed.source == "session" and resumed.next_frame == 4
        assert [p.name for p in state.glob("journal.replaced-*.lbj")]  # the old journal kept, not resumed
    finally:
        journal2.writer.close()
    # a load_session that is not there: the node must not start in another map than asked
    missing = settings_of(tmp_path, load_session="nowhere")
    with pytest.raises(SessionError, match="no saved session"):
        open_camera_journal(session_of(tiny_model, missing), missing, "")


def test_load_session_refusals_leave_the_state_alone(tiny_model, tmp_path):
    settings = settings_of(tmp_path)
    engine, scheduler, sink = engine_of(tiny_model, settings)  # no journal: sessions are off
    try:
        feed(engine, sink, range(3))
        refused = engine.submit("load", lambda: engine.commands.load_session(tmp_path))
        assert refused.wait(10) and isinstance(refused.error, SessionError)
        assert "state_directory" in str(refused.error)
        assert engine.session.frames_pushed == 3
    finally:
        scheduler.stop()
    with_dir = settings_of(tmp_path, state_directory=str(tmp_path / "s"))
    session = session_of(tiny_model, with_dir)
    journal, _ = open_camera_journal(session, with_dir, "")
    engine, scheduler, sink = engine_of(tiny_model, with_dir, session, journal)
    try:
        feed(engine, sink, range(3))
        (tmp_path / "empty").mkdir()
        refused = engine.submit("load", lambda: engine.commands.load_session(tmp_path / "empty"))
        assert refused.wait(10) and isinstance(refused.error, SessionError)
        junk = tmp_path / "junk"
        junk.mkdir()
        (junk / JOURNAL_NAME).write_bytes(b"not a journal at all")
        refused = engine.submit("load", lambda: engine.commands.load_session(junk))
        assert refused.wait(10) and isinstance(refused.error, SessionError)
        assert engine.session.frames_pushed == 3 and engine.commands.resumed is None
    finally:
        scheduler.stop()
        journal.writer.close()


def test_saved_session_folders_are_replaced_whole_and_refuse_what_is_not_theirs(tiny_model, tmp_path):
    settings = settings_of(tmp_path, state_directory=str(tmp_path / "s"))
    session = session_of(tiny_model, settings)
    journal, _ = open_camera_journal(session, settings, "")
    off = JournalRecorder(None, journal.identity, begin=False)
    try:
        with pytest.raises(SessionError, match="journaling is off"):
            save_sessions({"": off}, tmp_path / "x")
        dest = tmp_path / "out" / "a"
        first = save_sessions({"": journal}, dest)
        assert first > 0 and (dest / JOURNAL_NAME).is_file()
        assert save_sessions({"": journal}, dest) == first  # replaced, same content
        assert sorted(p.name for p in dest.parent.iterdir()) == ["a"]  # no temporary left
        other = tmp_path / "out" / "other"
        other.mkdir()
        (other / "notes.txt").write_text("mine")
        with pytest.raises(SessionError, match="other files"):
            save_sessions({"": journal}, other)
        assert (other / "notes.txt").read_text() == "mine"
        # several cameras: one folder each inside the session
        both = save_sessions({"front": journal, "rear": journal}, tmp_path / "out" / "two")
        assert both == 2 * first and (tmp_path / "out" / "two" / "rear" / JOURNAL_NAME).is_file()
        if os.geteuid() != 0:  # root writes anywhere: the read-only case needs another user
            ro = tmp_path / "ro"
            ro.mkdir()
            ro.chmod(0o500)
            with pytest.raises(OSError):
                save_sessions({"": journal}, ro / "s")
        with pytest.raises(SessionError, match="outside output_directory"):
            session_folder("../../elsewhere", str(tmp_path / "out"))
        assert session_folder("", str(tmp_path / "out")).name.startswith("session-")
    finally:
        journal.writer.close()


class PoisonOnce:
    """Wraps a session: ``arm()`` makes the next step's poses non-finite (the node's lost case)."""

    def __init__(self, session) -> None:
        self._s, self._armed, self._poisoned = session, False, []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def arm(self) -> None:
        self._armed = True

    def submit(self, image, keyframe=None, stamp=None, tag=None):
        pending, armed, self._armed = self._s.submit(image, keyframe, stamp, tag), self._armed, False
        if armed:
            self._poisoned.append(pending)
        return pending

    def results(self, pending):
        results = self._s.results(pending)
        if any(p is pending for p in self._poisoned):
            for r in results:
                r.c2w = np.full((4, 4), np.nan)
        return results


def test_a_resume_after_a_lost_reset_keeps_the_map_offset(tmp_path):
    """on_lost=reset with odometry: the new sequence is placed in the old map (an offset). The
    journal keeps that offset: a node resumed from the journal as it was on disk after frame 9
    publishes frames 10 and 11 exactly where the uninterrupted engine does."""
    from lingbot_map_ros.config import ModelConfig
    from lingbot_map_ros.io.checkpoint import load_model
    from test_engine import odometry_pose

    tiny_model = load_model(ModelConfig.preset("tiny"), None, seed=3)  # its track reaches "tracking"
    def camera_pose(stamp, camera_frame):
        return odometry_pose(float(stamp) - 1000.0)

    settings = settings_of(tmp_path, state_directory=str(tmp_path / "a"), on_lost="reset", keyframe_interval=1,
                           window_frames=320)
    session = session_of(tiny_model, settings)
    journal, _ = open_camera_journal(session, settings, "")
    poison = PoisonOnce(session)
    sink, log = Sink(wants=()), Log()
    engine = InferenceEngine(poison, settings, sink, log, now=lambda: 1000.0, camera_pose=camera_pose, journal=journal)
    scheduler = CameraScheduler({"": engine})
    scheduler.start()
    try:
        feed(engine, sink, range(5))
        poison.arm()
        feed(engine, sink, [5])
        assert engine.seq.tracking.lost_resets == 1
        feed(engine, sink, range(6, 10))
        assert engine.seq.anchor.output.offset is not None  # the new sequence sits in the old map
        assert journal.writer.flush(10)
        killed = tmp_path / "b"
        killed.mkdir()
        (killed / JOURNAL_NAME).write_bytes((tmp_path / "a" / JOURNAL_NAME).read_bytes())  # what a kill leaves
        feed(engine, sink, [10, 11])
    finally:
        scheduler.stop()
        journal.writer.close()
    straight = {o.frame_index: o.T_map_cam for o in sink.frames[-2:]}

    again = settings_of(tmp_path, state_directory=str(killed), on_lost="reset", keyframe_interval=1,
                        window_frames=320)
    session2 = session_of(tiny_model, again)
    journal2, resumed = open_camera_journal(session2, again, "")
    sink2 = Sink(wants=())
    engine2 = InferenceEngine(session2, again, sink2, Log(), now=lambda: 1000.0, camera_pose=camera_pose,
                              journal=journal2)
    engine2.commands.resumed_from(resumed)
    np.testing.assert_allclose(engine2.seq.anchor.output.offset, engine.seq.anchor.output.offset, atol=1e-9)
    assert "continued from frame" in engine2.seq.anchor.map_alignment
    scheduler2 = CameraScheduler({"": engine2})
    scheduler2.start()
    try:
        feed(engine2, sink2, [10, 11])
    finally:
        scheduler2.stop()
        journal2.writer.close()
    got = {o.frame_index: o.T_map_cam for o in sink2.frames}
    assert sorted(got) == sorted(straight)
    for i in straight:
        np.testing.assert_allclose(got[i], straight[i], atol=1e-6, err_msg=f"frame {i}")


def test_a_save_that_fails_halfway_keeps_the_old_session_and_leaves_no_temporary(tiny_model, tmp_path):
    """Several cameras: the second camera's journal cannot be written (disk full): the saved
    session already there is kept whole, nothing half-written is left beside it."""
    settings = settings_of(tmp_path, state_directory=str(tmp_path / "s"))
    front, _ = open_camera_journal(session_of(tiny_model, settings), settings, "front")
    rear, _ = open_camera_journal(session_of(tiny_model, settings), settings, "rear")
    try:
        dest = tmp_path / "out" / "both"
        save_sessions({"front": front, "rear": rear}, dest)
        before = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}

        def full(_dest):
            raise OSError(28, "No space left on device")
        rear.writer.save_copy = full
        with pytest.raises(OSError, match="No space"):
            save_sessions({"front": front, "rear": rear}, dest)
        after = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
        assert after == before
        assert sorted(p.name for p in dest.parent.iterdir()) == ["both"]
    finally:
        front.writer.close()
        rear.writer.close()


def map_of(engine: InferenceEngine):
    """(points, colours, stamps, poses) as ~/save_map would write them (taken on the inference thread)."""
    taken = engine.submit("save", engine.commands.save_snapshot)
    assert taken.wait(30) and taken.error is None, taken.error
    snapshot = taken.result
    points, colors, poses = snapshot.output(30)
    return points, colors, snapshot.stamps, poses


def assert_same_map(got, want, what: str) -> None:
    (p, c, s, T), (wp, wc, ws, wT) = got, want
    assert p.shape == wp.shape and s.shape == ws.shape, f"{what}: {p.shape} {wp.shape}, {s.shape} {ws.shape}"
    np.testing.assert_allclose(p, wp, atol=1e-4, err_msg=what)
    assert np.array_equal(c, wc), what
    np.testing.assert_array_equal(s, ws, err_msg=what)
    np.testing.assert_allclose(T, wT, atol=1e-4, err_msg=what)


@pytest.fixture(scope="module")
def straight_map(tiny_model, tmp_path_factory):
    """The map and path an uninterrupted engine run over FRAMES saves."""
    settings = settings_of(tmp_path_factory.mktemp("straight_map"), accumulate_map=True)
    engine, scheduler, sink = engine_of(tiny_model, settings)
    try:
        feed(engine, sink, range(len(FRAMES)))
        out = map_of(engine)
    finally:
        scheduler.stop()
    assert out[0].shape[0] > 0 and out[2].shape[0] == len(FRAMES)
    return out


def test_the_saved_map_and_path_survive_a_resume_and_a_saved_session(tiny_model, tmp_path, straight_map):
    """Stopped without a clean close at frame 7 (what the writers wrote is what there is): the
    resumed engine, fed frames 8.., saves the map and path of the uninterrupted run; so does a
    fresh engine started from a session saved at frame 7 (load_session, no state directory)."""
    settings = settings_of(tmp_path, accumulate_map=True, state_directory=str(tmp_path / "state"))
    session = session_of(tiny_model, settings)
    journal, _ = open_camera_journal(session, settings, "")
    engine, scheduler, sink = engine_of(tiny_model, settings, session, journal)
    engine.commands.resumed_from(None)  # as the node does at start
    try:
        feed(engine, sink, range(7))
        assert engine.outputs.flush(10) and journal.writer.flush(10) and engine.seq.map_journal.writer.flush(10)
        saved = save_sessions({"": journal}, tmp_path / "out" / "kept", {"": engine.seq.map_journal})
        assert saved > 0 and (tmp_path / "out" / "kept" / "map.lbj").is_file()
    finally:
        scheduler.stop()
    assert (tmp_path / "state" / "map.lbj").is_file()

    session2 = session_of(tiny_model, settings)
    journal2, resumed2 = open_camera_journal(session2, settings, "")
    engine2, scheduler2, sink2 = engine_of(tiny_model, settings, session2, journal2)
    try:
        engine2.commands.resumed_from(resumed2)
        restored = engine2.seq.restored
        assert restored.note == "" and restored.poses == 7 and restored.points > 0
        assert f"path {restored.poses} poses" in engine2.seq.text
        feed(engine2, sink2, range(7, len(FRAMES)))
        assert_same_map(map_of(engine2), straight_map, "resumed")
    finally:
        scheduler2.stop()
        journal2.writer.close()
        engine2.seq.map_journal.close()

    loader = settings_of(tmp_path, accumulate_map=True, load_session="kept")
    session3 = session_of(tiny_model, loader)
    journal3, resumed3 = open_camera_journal(session3, loader, "")
    engine3, scheduler3, sink3 = engine_of(tiny_model, loader, session3, journal3)
    try:
        assert engine3.seq.map_journal is None  # no state directory: loaded, not journaled
        engine3.commands.resumed_from(resumed3)
        feed(engine3, sink3, range(7, len(FRAMES)))
        assert_same_map(map_of(engine3), straight_map, "loaded session")
    finally:
        scheduler3.stop()


def test_journal_map_false_keeps_the_model_state_but_not_the_map(tiny_model, tmp_path):
    settings = settings_of(tmp_path, accumulate_map=True, journal_map=False, state_directory=str(tmp_path / "s"))
    session = session_of(tiny_model, settings)
    journal, _ = open_camera_journal(session, settings, "")
    engine, scheduler, sink = engine_of(tiny_model, settings, session, journal)
    try:
        assert engine.seq.map_journal is None
        feed(engine, sink, range(4))
        assert journal.writer.flush(10)
    finally:
        scheduler.stop()
        journal.writer.close()
    assert not (tmp_path / "s" / "map.lbj").exists()
    session2 = session_of(tiny_model, settings)
    journal2, resumed2 = open_camera_journal(session2, settings, "")
    engine2, scheduler2, _ = engine_of(tiny_model, settings, session2, journal2)
    try:
        engine2.commands.resumed_from(resumed2)
        assert resumed2.next_frame == 4 and len(engine2.seq.path) == 0
        assert "map and path not restored: no map.lbj" in engine2.seq.text
    finally:
        scheduler2.stop()
        journal2.writer.close()


def test_journal_compression_reaches_both_journals_and_lz4_falls_back_when_missing(tiny_model, tmp_path,
                                                                                   monkeypatch, caplog):
    from lingbot_map_ros.journal import writer as writer_mod
    from lingbot_map_ros.journal.format import COMPRESSIONS
    from lingbot_map_ros.runtime.params import JOURNAL_COMPRESSIONS

    assert JOURNAL_COMPRESSIONS == COMPRESSIONS  # the parameter offers what the writer takes

    for asked, have_lz4, want in (("zlib", True, "zlib"), ("lz4", True, "lz4"), ("lz4", False, "none")):
        monkeypatch.setattr(writer_mod, "lz4_available", lambda have=have_lz4: have)
        folder = tmp_path / f"{asked}_{have_lz4}"
        settings = settings_of(tmp_path, accumulate_map=True, state_directory=str(folder), journal_compression=asked)
        caplog.clear()
        session = session_of(tiny_model, settings)
        journal, _ = open_camera_journal(session, settings, "")
        engine, scheduler, _ = engine_of(tiny_model, settings, session, journal)
        try:
            assert journal.writer.compression == want and engine.seq.map_journal.writer.compression == want
            assert ("the lz4 module is not installed" in caplog.text) == (not have_lz4), caplog.text
        finally:
            scheduler.stop()
            journal.writer.close()
            engine.seq.map_journal.close()
