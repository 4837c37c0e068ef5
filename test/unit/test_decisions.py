"""KeyframeDecisions (runtime/decisions.py) alone: holds and their deadline, refusals (and whether
they count), the counter each decision counts in, the motion reference of ~/frame and the
deferral deadline."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.runtime.decisions import KEYFRAME_POSES, DecisionRefused, KeyframeDecisions
from lingbot_map_ros.stream import SessionError


def pose(x: float) -> np.ndarray:
    T = np.eye(4)
    T[0, 3] = x
    return T


def test_a_hold_expires_at_its_deadline_and_a_decision_clears_it():
    d = KeyframeDecisions()
    d.start_hold(7, now=4.0, timeout=6.0)
    assert d.expired(9.99, 6.0) is None and d.expired(10.0, 6.0).index == 7
    assert d.check(0, commit=True, hold_mode=True) == 7 and d.check(7, commit=False, hold_mode=True) == 7
    assert d.decide(7, "kept") == "decisions_kept"
    assert d.hold is None and d.decided == (7, "kept")


def test_a_timeout_lowered_at_run_time_counts_from_now_and_a_longer_one_waits_for_the_next_hold():
    d = KeyframeDecisions()
    d.start_hold(3, now=0.0, timeout=20.0)
    assert d.expired(5.0, 30.0) is None and d.hold.deadline == 20.0  # longer: this hold keeps its deadline
    assert d.expired(5.0, 2.0) is None and d.hold.deadline == 7.0  # shorter: now + 2 s
    assert d.expired(6.9, 2.0) is None and d.expired(7.0, 2.0).index == 3
    d.start_hold(4, now=10.0, timeout=20.0)
    assert d.expired(10.5, 0.0).index == 4  # 0 releases the held frame at once


def test_a_decision_about_another_frame_or_a_decided_one_is_refused_and_counts():
    d = KeyframeDecisions()
    d.start_hold(7, now=4.0, timeout=6.0)
    with pytest.raises(DecisionRefused, match=r"frame 6 is not the frame waiting for a decision \(7\)") as refused:
        d.check(6, commit=True, hold_mode=True)
    assert refused.value.counted and isinstance(refused.value, SessionError)
    assert d.hold is not None  # nothing changed
    assert d.decide(7, "dropped") == "decisions_dropped"
    with pytest.raises(DecisionRefused, match=r"frame 7 was already decided \(dropped\)") as refused:
        d.check(7, commit=False, hold_mode=True)
    assert refused.value.counted


def test_a_commit_naming_another_frame_than_the_last_stored_is_refused():
    d = KeyframeDecisions()
    with pytest.raises(DecisionRefused, match="the last stored frame is none") as refused:
        d.check(3, commit=True, hold_mode=False)
    assert not refused.value.counted  # only in hold mode is a refused commit a decision
    d.stored(4, pose(1.0))
    assert d.check(4, commit=True, hold_mode=False) is None and d.check(0, commit=True, hold_mode=False) is None
    with pytest.raises(DecisionRefused, match="the last stored frame is 4, not 3") as refused:
        d.check(3, commit=True, hold_mode=True)
    assert refused.value.counted


def test_timeouts_count_as_timed_out():
    d = KeyframeDecisions()
    d.start_hold(2, 0.0, 1.0)
    assert d.decide(2, "drop by timeout") == "decisions_timed_out"


def test_the_reference_is_the_newest_stored_pose_and_forgets_rolled_back_frames():
    d = KeyframeDecisions()
    assert d.reference() is None
    for i in range(1, 12):
        d.stored(i, pose(float(i)))
    assert len(d.poses) == KEYFRAME_POSES and d.reference()[0, 3] == 11.0 and d.last_stored == 11
    d.forget_from(10)
    assert d.reference()[0, 3] == 9.0 and d.last_stored == 0
    d.clear()
    assert d.reference() is None and d.hold is None and d.pending_since is None


def test_the_deferral_deadline_runs_from_the_first_pending_eviction():
    d = KeyframeDecisions()
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
