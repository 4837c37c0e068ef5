"""The engine's parts alone, with stand-ins for the session and the sink (no model, no ROS):
``KeyframeControl`` (keep, drop, the hold's and the deferral's deadlines), ``StatusReporter``,
``TrackingJudge``, ``JournalNotes`` and ``FramePublisher``."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lingbot_map_ros.robot.health import TrackingState
from lingbot_map_ros.robot.map_offset import OutputTransform
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame, State
from lingbot_map_ros.runtime.journaling import ANCHOR_STATE, COUNTERS_STATE, JournalNotes, Resumed
from lingbot_map_ros.runtime.keyframe_control import KeyframeControl
from lingbot_map_ros.runtime.mapping import PoseEntry
from lingbot_map_ros.runtime.output_worker import OutputWorker
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.runtime.sequence import Sequence
from lingbot_map_ros.runtime.stamps import StampGate
from lingbot_map_ros.runtime.status import HEARTBEAT_PERIOD, StatusReporter
from lingbot_map_ros.runtime.tracking import TrackingJudge
from lingbot_map_ros.runtime.worker import CounterValues, Throttle, WorkQueue
from lingbot_map_ros.stream import FrameMismatchError, SessionError

from engine_fakes import Log, Sink


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeSession:
    """Frames 0..pushed-1 pushed, every one stored; ``pending`` deferred eviction pages."""

    def __init__(self, pushed: int = 5, pending: int = 0) -> None:
        self.pushed, self.pending, self.commits = pushed, pending, 0
        self.window_index = 0
        self.deferred_eviction = True
        self.device = None

    @property
    def frames_pushed(self) -> int:
        return self.pushed

    def stats(self):
        return SimpleNamespace(pending_evictions=self.pending, resident_frames=self.pushed, temporal_index=self.pushed,
                               scale_pages=1, window_pages=self.pushed, free_pages=10, special_tokens=6 * self.pushed)

    def commit_eviction(self) -> int:
        freed, self.pending = self.pending, 0
        self.commits += 1
        return freed

    def rollback_last_frame(self, expected=None) -> int:
        last = self.pushed - 1
        if expected is not None and expected != last:
            raise FrameMismatchError(last, expected)
        self.pushed -= 1
        return last


def settings_of(**kw):
    return resolve_settings({"image_width": 98, "device": "cpu", "publish_path": True, **kw})


class FakeAnchor:
    """Model units out (scale 1, no offset), never ready."""

    source_name = "none"

    def __init__(self) -> None:
        self.output = OutputTransform()
        self.good_frames, self.note = [], ""
        self.restored = None
        self.aligning = False

    def update_scale(self, T, frame, r, window):
        return 1.0, False

    def good(self, index, frame, T_out, ready):
        self.good_frames.append(index)

    def take_note(self):
        return ""

    def status(self):
        return 0.0, False

    applied_scale = 1.0

    def clear(self, keep_map_frame=False):
        pass

    def snapshot(self):
        return {"at": id(self.output)}

    def restore(self, state):
        self.restored = state
        self.output = OutputTransform(2.0)


def sequence_of(settings, sink=None, log=None, anchor=None):
    """A ``Sequence`` on a sink, a work queue and a running output thread."""
    return Sequence(settings, sink or Sink(wants=()), WorkQueue(), OutputWorker(max_pending=2), anchor or FakeAnchor(),
                    log or Log())


def control_of(session, settings, clock=None):
    clock = clock or Clock()
    sink, log = Sink(wants=()), Log()
    seq = sequence_of(settings, sink, log)
    holder = {"settings": settings}
    reporter = StatusReporter(sink, session, seq, clock, clock)
    for i in range(session.pushed):
        seq.add_pose(PoseEntry(i, i, float(i), np.eye(4)))
        seq.stored(i + 1, np.eye(4))
        seq.add_points(i, np.full((2, 3), float(i), np.float32), np.zeros((2, 3), np.uint8))
    control = KeyframeControl(session, seq, lambda: holder["settings"], reporter, StampGate(), log,
                              Throttle(0.0, clock), clock)
    return SimpleNamespace(control=control, decisions=seq.decisions, seq=seq, sink=sink, log=log, reporter=reporter,
                           trajectory=seq.path, map=seq.map, clock=clock, holder=holder)


def counts(p):
    return p.seq.counter_values()


def test_rollback_forgets_the_frame_from_path_and_map_and_answers_one_based():
    session = FakeSession(pushed=5)
    p = control_of(session, settings_of())
    assert p.control.rollback(5) == 5
    assert [e.frame_index for e in p.trajectory.entries()] == [0, 1, 2, 3]
    assert p.seq.outputs.flush(5.0)  # the map's removal runs on the output thread, in order
    assert p.map.frames() == [0, 1, 2, 3]
    assert p.sink.paths[-1] == [0, 1, 2, 3]
    assert p.decisions.reference() is not None and p.decisions.last_stored == 0  # frame 5 is no reference
    assert p.sink.statuses[-1][0].state_text == "rolled back frame 5"


def test_a_rollback_naming_another_frame_is_refused_and_changes_nothing():
    session = FakeSession(pushed=5)
    p = control_of(session, settings_of())
    with pytest.raises(SessionError, match="the last stored frame is 5, not 3"):
        p.control.rollback(3)
    assert session.pushed == 5 and len(p.trajectory) == 5 and not p.sink.statuses


def test_commit_keeps_the_held_frame_and_counts_the_decision():
    session = FakeSession(pushed=5, pending=2)
    p = control_of(session, settings_of(keyframe_decision_timeout=1.0))
    p.decisions.start_hold(5, p.clock(), 1.0)
    with pytest.raises(SessionError, match="not the frame waiting"):
        p.control.commit_eviction(4)
    assert session.commits == 0 and counts(p).decisions_refused == 1
    assert p.control.commit_eviction(5) == 2
    assert p.decisions.hold is None and counts(p).decisions_kept == 1
    assert p.reporter.last_stats.pending_evictions == 0


@pytest.mark.parametrize("default", ["keep", "drop"])
def test_a_hold_past_its_deadline_gets_the_default(default):
    session = FakeSession(pushed=5, pending=1)
    p = control_of(session, settings_of(keyframe_decision_timeout=0.5, keyframe_decision_default=default))
    p.decisions.start_hold(5, p.clock(), 0.5)
    p.control.check_hold_deadline()
    assert p.decisions.hold is not None  # not yet
    p.clock.t += 0.6
    p.control.check_hold_deadline()
    assert p.decisions.hold is None and counts(p).decisions_timed_out == 1
    assert session.pushed == (4 if default == "drop" else 5)
    assert session.commits == (0 if default == "drop" else 1)
    assert any(f"keyframe_decision_default={default}" in m for lvl, m in p.log.lines if lvl == "warning")
    assert p.sink.statuses[-1][0].state_text == f"frame 5: {default} by timeout"


def test_a_lowered_decision_timeout_releases_the_held_frame_now():
    session = FakeSession(pushed=5)
    p = control_of(session, settings_of(keyframe_decision_timeout=30.0))
    p.decisions.start_hold(5, p.clock(), 30.0)
    p.holder["settings"] = settings_of(keyframe_decision_timeout=0.0)
    p.control.check_hold_deadline()
    assert p.decisions.hold is None


def test_the_deferral_deadline_commits_once_then_at_once_until_a_client_is_back():
    session = FakeSession(pushed=5, pending=3)
    p = control_of(session, settings_of(deferred_eviction_timeout=2.0))
    p.control.note_pending()
    p.clock.t += 1.0
    p.control.check_deferral_deadline()
    assert session.commits == 0
    p.clock.t += 1.5
    p.control.check_deferral_deadline()
    assert session.commits == 1 and counts(p).evictions_auto_committed == 1
    session.pending = 1  # the next deferral: committed at once (the client is gone)
    p.control.note_pending()
    p.control.check_deferral_deadline()
    assert session.commits == 2
    p.control.deferral_changed()  # a client sets the deferral again: the timeout counts again
    session.pending = 1
    p.control.note_pending()
    p.control.check_deferral_deadline()
    assert session.commits == 2


def test_status_reporter_numbers_the_last_frame_and_knows_when_a_heartbeat_is_due():
    clock, sink = Clock(), Sink(wants=())
    session = FakeSession(pushed=3)
    seq = sequence_of(settings_of(), sink)
    reporter = StatusReporter(sink, session, seq, clock, clock)
    assert seq.state == State.WAITING_FOR_IMAGES and reporter.due()
    seq.last_index = 7
    seq.set_state(State.TRACKING, "tracking")
    seq.decisions.start_hold(7, clock(), 1.0)
    reporter.publish("hello", "stamp")
    st, stamp = sink.statuses[-1]
    assert (st.state_text, st.frame_index, st.state, stamp) == ("hello", 7, int(State.TRACKING), "stamp")
    assert st.decision_pending and st.tracking_state == "initializing" and st.stored_frames == 3
    assert not reporter.due()
    clock.t += HEARTBEAT_PERIOD
    assert reporter.due()
    reporter.publish("other", None, frame_index=2)
    assert sink.statuses[-1][0].frame_index == 2
    session.pushed = 9
    assert reporter.last_stats.resident_frames == 3 and reporter.refresh_stats().resident_frames == 9


def test_the_sequence_counts_the_work_queue_intake_with_its_own_counters():
    seq = sequence_of(settings_of())
    queue = seq._queue
    queue.put_frame("a")
    queue.put_frame("b")  # replaces a: stale
    queue.reject()
    seq.count("frames_processed")
    seq.count("frames_dropped_stale", 2)
    c = seq.counter_values()
    assert (c.frames_received, c.frames_dropped_stale, c.frames_dropped_invalid, c.frames_processed) == (3, 3, 1, 1)
    seq.restore_counters({"frames_received": 10, "frames_processed": 4})  # a resume: the totals as journaled
    c = seq.counter_values()
    assert (c.frames_received, c.frames_dropped_stale, c.frames_processed) == (10, 0, 4)
    queue.put_frame("c")
    seq.reset_counters()
    assert seq.counter_values() == CounterValues()


def test_tracking_judge_logs_changes_and_counts_lost_resets_only_when_asked():
    log = Log()
    judge = TrackingJudge(settings_of(), log)
    judge.judge(None, None, finite=False)
    assert judge.state == TrackingState.LOST and judge.reasons == ("non_finite",)
    assert [lvl for lvl, m in log.lines if m.startswith("tracking")] == ["warning"]
    assert judge.lost_reason("continue") is None and judge.lost_resets == 0
    assert judge.lost_reason("reset") == "non_finite" and judge.lost_resets == 1
    judge.clear()
    assert judge.state == TrackingState.INITIALIZING and judge.reasons == () and judge.lost_resets == 1
    assert judge.lost_reason("reset") is None


class FakeJournal:
    def __init__(self, writer=True) -> None:
        self.writer = object() if writer else None
        self.notes = []

    def note_state(self, name, data):
        self.notes.append((name, data))


def test_journal_notes_write_only_what_changed():
    journal, anchor = FakeJournal(), FakeAnchor()
    notes = JournalNotes(journal)
    notes.counters(CounterValues())
    notes.counters(CounterValues())
    notes.counters(CounterValues(frames_received=1))
    notes.anchor(anchor)
    notes.anchor(anchor)
    anchor.output = OutputTransform(3.0)
    notes.anchor(anchor)
    assert [n for n, _ in journal.notes] == [COUNTERS_STATE, COUNTERS_STATE, ANCHOR_STATE, ANCHOR_STATE]
    assert journal.notes[1][1]["frames_received"] == 1
    silent = FakeJournal(writer=False)
    JournalNotes(silent).counters(CounterValues())
    JournalNotes(None).anchor(anchor)
    assert silent.notes == []


def test_journal_notes_restore_counters_and_anchor_from_a_rebuilt_session():
    journal, anchor = FakeJournal(), FakeAnchor()
    seq = sequence_of(settings_of(), anchor=anchor)
    notes = JournalNotes(journal)
    journaled = dict(vars(CounterValues(frames_processed=3)))  # as JournalNotes.counters wrote them
    resumed = Resumed("journal", "p", 3, 3, 0.1, states={COUNTERS_STATE: journaled, ANCHOR_STATE: {"anchor": None}})
    notes.restore(resumed, seq)
    assert seq.counter_values().frames_processed == 3 and anchor.restored == {"anchor": None}
    assert [n for n, _ in journal.notes] == [ANCHOR_STATE]  # the restored anchor is noted; counters unchanged
    notes.counters(seq.counter_values())
    assert [n for n, _ in journal.notes] == [ANCHOR_STATE]
    seq.count("frames_processed")
    notes.counters(seq.counter_values())
    assert [n for n, _ in journal.notes] == [ANCHOR_STATE, COUNTERS_STATE]


def frame_result(index, depth_value=1.0, keyframe=True):
    c2w = np.eye(4)
    c2w[0, 3] = 0.1 * index
    depth = np.full((28, 42), depth_value, np.float32)
    return SimpleNamespace(frame_index=index, c2w=c2w, depth=depth, confidence=np.full((28, 42), 5.0, np.float32),
                           intrinsics=np.array([[40.0, 0, 21], [0, 40.0, 14], [0, 0, 1]]), size=(28, 42),
                           is_keyframe=keyframe, timings={"model_ms": 3.0}, pose_enc=np.zeros(9),
                           frame=np.zeros((28, 42, 3), np.uint8), colors=lambda index: np.zeros((len(index), 3),
                                                                                               np.uint8))


class ScriptedSession(FakeSession):
    """A session whose every step gives the next scripted results (one stored frame each)."""

    def __init__(self, script) -> None:
        super().__init__(pushed=0)
        self.script, self.cfg = list(script), SimpleNamespace(num_scale_frames=1)

    def submit(self, image, keyframe=None, stamp=None, tag=None):
        self.pushed += 1
        return self.script.pop(0)

    def results(self, pending):
        return pending


def engine_of(script, wants=("frame",), **settings):
    clock, sink, log = Clock(), Sink(wants=wants), Log()
    engine = InferenceEngine(ScriptedSession(script), settings_of(**settings), sink, log, now=clock, monotonic=clock)
    return engine, sink


def input_frame(i):
    return InputFrame(rgb=np.zeros((28, 42, 3), np.uint8), stamp=i, stamp_s=float(i), camera_frame="cam")


def run_frames(engine, n):
    """``n`` frames through ``engine``, stamped after the ones before."""
    for _ in range(n):
        engine.submit_frame(input_frame(engine.seq.counter_values().frames_received + 1))
        assert engine.run_once(0.0)
    assert engine.outputs.flush(5.0)


def test_a_frame_goes_out_as_pose_path_status_and_motion_reference():
    engine, sink = engine_of([[frame_result(0)], [frame_result(1, keyframe=False)]], image_width=42)
    run_frames(engine, 2)
    seq = engine.seq
    assert [o.frame_index for o in sink.frames] == [1, 2]
    assert [e.frame_index for e in seq.path.entries()] == [0, 1] and sink.paths[-1] == [0, 1]
    assert seq.counter_values().frames_processed == 2 and seq.last_index == 2
    assert seq.state == State.TRACKING and sink.statuses[-1][0].frame_index == 2
    assert seq.decisions.last_stored == 1  # only the keyframe is a motion reference
    assert engine.assembler.last_intrinsics[1:] == (42, 28)


def test_a_non_finite_depth_drops_the_outputs():
    engine, sink = engine_of([[frame_result(0, depth_value=np.nan)]], image_width=42)
    run_frames(engine, 1)
    seq = engine.seq
    assert sink.frames == [] and len(seq.path) == 0
    assert seq.counter_values().frames_dropped_invalid == 1 and seq.counter_values().frames_processed == 0
    assert seq.tracking.state == TrackingState.LOST
    assert sink.statuses[-1][0].state_text == "dropped: non-finite depth"


def test_the_map_keeps_a_stored_frame_apart_once_its_pose_is_out_and_before_its_clouds():
    """The map's bookkeeping of a stored frame (``Sequence.protect_from``) is queued once the pose is
    out (not during the pose's own work) and before the frame's clouds; at once when the outputs
    are dropped, so a non-finite frame still gets it."""
    engine, sink = engine_of([[frame_result(0)], [frame_result(1, depth_value=np.inf)]], wants=("frame", "points"),
                             image_width=42)
    order = []
    publish_frame, protect = sink.publish_frame, engine.seq.protect_from
    sink.publish_frame = lambda out: (order.append("pose"), publish_frame(out))
    engine.seq.protect_from = lambda i: (order.append("protect"), protect(i))
    engine.clouds.submit = lambda *args, **kwargs: order.append("clouds")  # queued to the output thread
    run_frames(engine, 1)
    assert order == ["pose", "protect", "clouds"]
    order.clear()
    run_frames(engine, 1)
    assert order == ["protect"]
