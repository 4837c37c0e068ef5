"""The keyframe selector's decision rules (KeyframePolicy, Thresholds), no ROS graph."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from lingbot_map_ros.ros.keyframe_selector import Decision, KeyframePolicy, Thresholds  # noqa: E402

T = Thresholds(min_translation=0.10, min_rotation_deg=10.0, min_valid_fraction=0.3, confidence_drop=0.25)


def step(policy: KeyframePolicy, translation: float, rotation: float, valid: float) -> Decision:
    """Decide, and note a keep as the selector does once the node confirms it."""
    decision = policy.decide(translation, rotation, valid)
    if decision.keep:
        policy.note_keyframe(valid)
    return decision


def started(thresholds: Thresholds = T, valid_fraction: float = 0.8) -> KeyframePolicy:
    """A policy that has kept its first frame (valid fraction ``valid_fraction``)."""
    policy = KeyframePolicy(thresholds)
    assert step(policy, 0.0, 0.0, valid_fraction).keep
    return policy


def test_first_frame_is_kept_whatever_it_shows():
    policy = KeyframePolicy(T)
    decision = policy.decide(0.0, 0.0, 0.05)  # even below the floor: there is nothing to compare with
    assert decision.keep and decision.reason == "first frame"


def test_decide_changes_nothing():
    policy = KeyframePolicy(T)
    assert policy.decide(0.0, 0.0, 0.9).keep and policy.reference_valid_fraction is None
    policy.note_keyframe(0.8)
    # keeps (moved, confidence dropped) and drops alike: only a keep the node confirms is noted
    for args, keep in [((0.5, 0.0, 0.9), True), ((0.0, 0.0, 0.1), False), ((0.0, 0.0, 0.59), True),
                       ((0.0, 0.0, 0.79), False)]:
        assert policy.decide(*args).keep is keep
        assert policy.reference_valid_fraction == pytest.approx(0.8)


@pytest.mark.parametrize("translation, rotation, keep, word", [
    (0.0, 0.0, False, "too close"),
    (0.0999, 9.99, False, "too close"),
    (0.10, 0.0, True, "moved"),        # the thresholds are inclusive
    (0.0, 10.0, True, "turned"),
    (0.5, 45.0, True, "moved"),        # translation is checked first
])
def test_motion_thresholds(translation, rotation, keep, word):
    decision = started().decide(translation, rotation, 0.8)
    assert decision.keep is keep and word in decision.reason


def test_unreliable_frame_is_dropped_even_when_it_moved():
    policy = started()
    decision = policy.decide(1.0, 90.0, 0.29)
    assert not decision.keep and decision.reason.startswith("unreliable")
    assert policy.decide(1.0, 90.0, 0.30).keep  # at the floor: usable
    for bad in (math.nan, math.inf, -math.inf):
        assert not started().decide(1.0, 90.0, bad).keep


def test_confidence_drop_is_relative_to_the_last_kept_frame():
    policy = started(valid_fraction=0.8)
    assert not step(policy, 0.0, 0.0, 0.61).keep   # 0.61 >= 0.75 * 0.8 = 0.6
    assert not step(policy, 0.0, 0.0, 0.9).keep    # a rise never keeps
    decision = step(policy, 0.0, 0.0, 0.59)
    assert decision.keep and decision.reason.startswith("confidence dropped")
    assert policy.reference_valid_fraction == pytest.approx(0.59)
    assert not step(policy, 0.0, 0.0, 0.45).keep   # 0.45 >= 0.75 * 0.59 = 0.4425
    assert step(policy, 0.0, 0.0, 0.44).keep


def test_motion_keep_moves_the_confidence_reference():
    policy = started(valid_fraction=0.8)
    assert step(policy, 0.2, 0.0, 0.5).keep        # kept for motion: reference 0.5 now
    assert not step(policy, 0.0, 0.0, 0.4).keep    # 0.4 >= 0.375: no drop relative to 0.5
    assert step(policy, 0.0, 0.0, 0.37).keep


def test_drops_do_not_move_the_reference():
    policy = started(valid_fraction=0.8)
    for vf in (0.7, 0.65, 0.62):
        assert not step(policy, 0.0, 0.0, vf).keep
    assert policy.reference_valid_fraction == pytest.approx(0.8)


def test_zero_turns_the_confidence_rules_off():
    policy = started(Thresholds(min_valid_fraction=0.0, confidence_drop=0.0), valid_fraction=0.9)
    assert not step(policy, 0.0, 0.0, 0.01).keep   # no drop rule, no floor
    assert step(policy, 0.2, 0.0, 0.0).keep        # no floor: a moved frame is kept at any confidence


def test_a_frame_stored_by_the_node_is_the_reference():
    policy = KeyframePolicy(T)
    policy.note_keyframe(0.8)  # e.g. a scale frame: the first decision is no "first frame" any more
    decision = policy.decide(0.01, 0.0, 0.7)
    assert not decision.keep and decision.reason.startswith("too close")
    assert step(policy, 0.0, 0.0, 0.59).keep     # 0.59 < 0.75 x 0.8
    policy.note_keyframe(0.2)
    assert policy.reference_valid_fraction == pytest.approx(0.2)
    policy.note_keyframe(math.nan)
    assert policy.reference_valid_fraction == 0.0  # never NaN: later comparisons stay defined


def test_reset_makes_the_next_frame_a_first_frame():
    policy = started()
    assert not policy.decide(0.0, 0.0, 0.8).keep
    policy.reset()
    assert policy.reference_valid_fraction is None
    assert policy.decide(0.0, 0.0, 0.8).reason == "first frame"


@pytest.mark.parametrize("kwargs, word", [
    ({"min_translation": -0.1}, "min_translation"),
    ({"min_rotation_deg": math.nan}, "min_rotation_deg"),
    ({"min_valid_fraction": 1.5}, "min_valid_fraction"),
    ({"confidence_drop": 2.0}, "confidence_drop"),
])
def test_bad_thresholds_name_the_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Thresholds(**kwargs)
