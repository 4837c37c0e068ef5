"""KeyframeDecisions (runtime/decisions.py) alone: holds and their deadline, refusals (counted),
the motion reference of ~/frame and the deferral deadline."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.runtime.decisions import KEYFRAME_POSES, KeyframeDecisions
from lingbot_map_ros.runtime.worker import Counters
from lingbot_map_ros.stream import SessionError


def pose(x: float) -> np.ndarray:
    T = np.eye(4)
    T[0, 3] = x
    return T


def test_a_hold_expires_at_its_deadline_and_a_decision_clears_it():
    d = KeyframeDecisions(Counters())
    d.start_hold(7, now=4.0, timeout=6.0)
    assert d.expired(9.99, 6.0) is None and d.expired(10.0, 6.0).index == 7
    assert d.check(0, commit=True, hold_mode=True) == 7 and d.check(7, commit=False, hold_mode=True) == 7
    d.decide(7, "kept")
    assert d.hold is None and d.decided == (7, "kept") and d.counters.snapshot().decisions_kept == 1


def test_a_timeout_lowered_at_run_time_counts_from_now_and_a_longer_one_waits_for_the_next_hold():
    d = KeyframeDecisions(Counters())
    d.start_hold(3, now=0.0, timeout=20.0)
    assert d.expired(5.0, 30.0) is None and d.hold.deadline == 20.0  # longer: this hold keeps its deadline
    assert d.expired(5.0, 2.0) is None and d.hold.deadline == 7.0  # shorter: now + 2 s
    assert d.expired(6.9, 2.0) is None and d.expired(7.0, 2.0).index == 3
    d.start_hold(4, now=10.0, timeout=20.0)
    assert d.expired(10.5, 0.0).index == 4  # 0 releases the held frame at once


def test_a_decision_about_another_frame_or_a_decided_one_is_refused_and_counted():
    counters = Counters()
    d = KeyframeDecisions(counters)
    d.start_hold(7, now=4.0, timeout=6.0)
    with pytest.raises(SessionError, match=r"frame 6 is not the frame waiting for a decision \(7\)"):
        d.check(6, commit=True, hold_mode=True)
    d.decide(7, "dropped")
    with pytest.raises(SessionError, match=r"frame 7 was already decided \(dropped\)"):
        d.check(7, commit=False, hold_mode=True)
    c = counters.snapshot()
    assert (c.decisions_refused, c.decisions_dropped) == (2, 1)


def test_a_commit_naming_another_frame_than_the_last_stored_is_refused():
    counters = Counters()
    d = KeyframeDecisions(counters)
    with pytest.raises(SessionError, match="the last stored frame is none"):
        d.check(3, commit=True, hold_mode=False)
    d.stored(4, pose(1.0))
    assert d.check(4, commit=True, hold_mode=False) is None and d.check(0, commit=True, hold_mode=False) is None
    with pytest.raises(SessionError, match="the last stored frame is 4, not 3"):
        d.check(3, commit=True, hold_mode=True)
    assert counters.snapshot().decisions_refused == 1  # only in hold mode is a refused commit a decision


def test_timeouts_count_as_timed_out():
    d = KeyframeDecisions(Counters())
    d.start_hold(2, 0.0, 1.0)
    d.decide(2, "drop by timeout")
    assert d.counters.snapshot().decisions_timed_out == 1


def test_the_reference_is_the_newest_stored_pose_and_forgets_rolled_back_frames():
    d = KeyframeDecisions(Counters())
    assert d.reference() is None
    for i in range(1, 12):
        d.stored(i, pose(float(i)))
    assert len(d.poses) == KEYFRAME_POSES and d.reference()[0, 3] == 11.0 and d.last_stored == 11
    d.forget_from(10)
    assert d.reference()[0, 3] == 9.0 and d.last_stored == 0
    d.clear()
    assert d.reference() is None and d.hold is None and d.pending_since is None


def test_the_deferral_deadline_runs_from_the_first_pending_eviction():
    d = KeyframeDecisions(Counters())
    assert not d.deferral_due(5.0, now=100.0)  # nothing pending
    d.note_pending(True, now=10.0)
    d.note_pending(True, now=12.0)  # the clock keeps its start
    assert not d.deferral_due(5.0, now=14.9) and d.deferral_due(5.0, now=15.0)
    assert not d.deferral_due(0.0, now=1e9)  # 0 = never
    d.auto_committed()
    assert d.pending_since is None and d.client_gone
    d.note_pending(True, now=20.0)
    assert d.deferral_due(5.0, now=20.0)  # the client is gone: at once
    d.client_back()
    assert not d.deferral_due(5.0, now=20.0)
    d.note_pending(False, now=21.0)
    assert d.pending_since is None
