"""StampGate (runtime/stamps.py) alone: verdicts on ages, zero, repeated, older and jumping stamps."""
from __future__ import annotations

import pytest

from lingbot_map_ros.runtime.stamps import StampGate

LIMITS = dict(max_frame_age=0.0, time_jump_threshold=1.0, on_time_jump="reset")


def taken(gate: StampGate, stamp_s: float, now: float = 100.0, **kw):
    verdict = gate.check(stamp_s, now, **{**LIMITS, **kw})
    if verdict.accept:
        gate.taken(stamp_s, stamp_s)
    return verdict


def test_newer_stamps_pass_and_the_first_has_no_predecessor():
    gate = StampGate()
    assert taken(gate, 10.0).accept and taken(gate, 10.5).accept
    assert gate.last_stamp_s == 10.5 and not gate.behind


def test_a_frame_older_than_max_frame_age_is_stale_before_any_stamp_rule():
    gate = StampGate()
    v = taken(gate, 10.0, now=12.5, max_frame_age=2.0)
    assert not v.accept and v.counter == "frames_dropped_stale" and v.kind == "too old" and not v.status
    assert "age 2.50 s" in v.reason and gate.last_stamp_s is None
    assert taken(gate, 10.0, now=11.0, max_frame_age=2.0).accept  # within the age: taken


def test_repeated_and_slightly_older_stamps_are_dropped_and_reported():
    gate = StampGate()
    taken(gate, 10.0)
    same = taken(gate, 10.0)
    assert not same.accept and same.counter == "frames_dropped_stamp" and same.status and "duplicate" in same.reason
    older = taken(gate, 9.5)
    assert not older.accept and older.kind == "older stamp" and "500.0 ms older" in older.reason
    assert gate.last_stamp_s == 10.0  # nothing dropped moves the gate


def test_a_zero_stamp_passes_once_with_a_warning_and_a_repeat_is_dropped():
    gate = StampGate()
    first = taken(gate, 0.0)
    assert first.accept and first.zero_stamp
    again = taken(gate, 0.0)
    assert not again.accept and again.zero_stamp and again.counter == "frames_dropped_stamp"


def test_a_time_jump_with_reset_starts_a_new_sequence_and_counts_once():
    gate = StampGate()
    taken(gate, 100.0)
    v = taken(gate, 5.0)
    assert v.accept and v.new_sequence and v.time_jump and "on_time_jump=reset" in v.reason
    assert gate.last_stamp_s == 5.0 and not gate.behind


def test_a_time_jump_with_drop_drops_until_the_stamps_pass_and_counts_the_jump_once():
    gate = StampGate()
    taken(gate, 100.0)
    first = taken(gate, 5.0, on_time_jump="drop")
    assert not first.accept and first.time_jump and first.status and "until the stamps pass 100.000 s" in first.reason
    second = taken(gate, 6.0, on_time_jump="drop")
    assert not second.accept and not second.time_jump and gate.behind  # the same jump: counted once
    assert taken(gate, 100.5, on_time_jump="drop").accept and not gate.behind


def test_clear_forgets_the_last_stamp_and_the_jump():
    gate = StampGate()
    taken(gate, 100.0)
    taken(gate, 5.0, on_time_jump="drop")
    gate.clear()
    assert gate.last_stamp is None and gate.last_stamp_s is None and not gate.behind
    assert taken(gate, 5.0).accept


@pytest.mark.parametrize("back, jump", [(0.999, False), (1.001, True)])
def test_the_threshold_separates_out_of_order_from_a_jump(back, jump):
    gate = StampGate()
    taken(gate, 50.0)
    v = taken(gate, 50.0 - back)
    assert v.accept == jump and v.time_jump == jump
