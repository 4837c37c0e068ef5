"""The parts of LongStreamSession alone, without a model: the Window's index mapping, the
store policy's decisions and the keyframe ledger's bookkeeping (stream.window, stream.keyframes)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from lingbot_map_ros.config import LongStreamConfig
from lingbot_map_ros.stream.alignment import Sim3
from lingbot_map_ros.stream.keyframes import KeyframeLedger, StorePolicy
from lingbot_map_ros.stream.results import FrameResult
from lingbot_map_ros.stream.window import KeptKeyframe, Window, fit_window, refeed


def pose(x: float = 0.0, yaw_deg: float = 0.0) -> np.ndarray:
    c, s = np.cos(np.radians(yaw_deg)), np.sin(np.radians(yaw_deg))
    c2w = np.eye(4)
    c2w[:2, :2] = [[c, -s], [s, c]]
    c2w[0, 3] = x
    return c2w


def result(i: int, stored: bool, x: float = 0.0, depth: float | None = 1.0) -> FrameResult:
    c2w = pose(x).astype(np.float32)
    return FrameResult(i, i, stored, np.zeros(9, np.float32), c2w, np.eye(3, dtype=np.float32),
                       None if depth is None else np.full((2, 3), depth, np.float32),
                       None if depth is None else np.full((2, 3), 2.0, np.float32),
                       np.full((3, 2, 3), i / 10, np.float32))


# ------------------------------------------------------------------ Window
def test_window_maps_global_and_inner_indices_both_ways():
    first = Window()
    assert first.to_inner(5) == 5 and first.to_global(5) == 5 and first.alignment.is_identity
    w = Window(index=2, start=10, overlap_indices=(7, 9), alignment=Sim3(2.0))
    assert w.to_inner(10) == 2 and w.to_inner(13) == 5 and w.to_inner(9) == 1
    assert [w.to_global(w.to_inner(g)) for g in range(7, 20)] == list(range(7, 20))
    assert w.to_global(0) == 8  # the offset a pending result of this window is shifted by
    with pytest.raises(AttributeError):
        w.start = 0  # a value: a restart replaces it


class Recorder:
    """An inner session that records what it is fed."""

    class cfg:
        num_scale_frames = 2

    def __init__(self):
        self.fed = []

    def push(self, frame, keyframe=None):
        self.fed.append((float(frame.flat[0]), keyframe))
        return [result(len(self.fed) - 1, True, x=float(frame.flat[0]))]


def test_refeed_sends_the_oldest_as_scale_frames_and_the_rest_as_keyframes():
    kept = [KeptKeyframe(i, np.full((3, 2, 3), i, np.float32), pose(i), None, None) for i in (4, 6, 8, 9)]
    inner = Recorder()
    fed = refeed(inner, tuple(kept))
    assert inner.fed == [(4.0, None), (6.0, None), (8.0, True), (9.0, True)]
    assert [r.frame_index for r in fed] == [0, 1, 2, 3]


def test_fit_window_uses_depth_ratio_when_every_frame_has_depth_else_the_centres():
    kept = [KeptKeyframe(i, np.zeros((3, 2, 3), np.float32), pose(2.0 * i), np.full((2, 3), 3.0), None)
            for i in range(3)]
    fed = [result(i, True, x=float(i), depth=1.5) for i in range(3)]  # half the scale: depth 1.5 for 3.0
    fit = fit_window(kept, fed)
    assert fit.scale_source == "depth" and fit.sim3.scale == pytest.approx(2.0)
    fed[1] = result(1, True, x=1.0, depth=None)
    assert fit_window(kept, fed).scale_source != "depth"


# ------------------------------------------------------------------ StorePolicy
def test_a_forced_decision_wins_over_either_policy():
    for policy in ("interval", "motion"):
        p = StorePolicy(LongStreamConfig(keyframe_policy=policy), lambda i: True)
        assert p.decide(False, 4, pose(), pose(9.0)) is False
        assert p.decide(True, 5, pose(), pose()) is True
        assert p.decide(1, 5, pose(), pose()) is True  # bool() of the caller's value


def test_interval_asks_the_inner_session_with_the_global_index():
    asked = []
    p = StorePolicy(LongStreamConfig(), lambda i: asked.append(i) or i % 3 == 0)
    assert [p.decide(None, i, None, None) for i in (6, 7)] == [True, False] and asked == [6, 7]
    assert not p.reads_poses


@pytest.mark.parametrize("latest, store", [
    (pose(0.049), False),             # below both thresholds
    (pose(0.05), True),               # the translation threshold itself
    (pose(0.0, yaw_deg=4.9), False),
    (pose(0.0, yaw_deg=5.1), True),   # just over the rotation threshold
])
def test_motion_stores_at_either_threshold(latest, store):
    p = StorePolicy(LongStreamConfig(keyframe_policy="motion", motion_min_translation=0.05,
                                     motion_min_rotation_deg=5.0), lambda i: pytest.fail("interval asked"))
    assert p.reads_poses and p.decide(None, 9, pose(), latest) is store


def test_motion_with_a_criterion_off_and_without_poses():
    turn_only = StorePolicy(LongStreamConfig(keyframe_policy="motion", motion_min_translation=0.0,
                                             motion_min_rotation_deg=5.0), lambda i: False)
    assert turn_only.decide(None, 3, pose(), pose(100.0)) is False
    assert turn_only.decide(None, 3, None, pose()) is True and turn_only.decide(None, 3, pose(), None) is True


def test_a_full_window_is_refused_and_warned_about_once_per_window(caplog):
    p = StorePolicy(LongStreamConfig(window_frames=6, auto_restart=False), lambda i: True)
    with caplog.at_level(logging.WARNING):
        assert [p.window_full(), p.window_full()] == [False, False]
        p.new_window()
        assert p.window_full() is False
    assert sum("auto_restart is off" in m for m in caplog.messages) == 2


# ------------------------------------------------------------------ KeyframeLedger
def test_ledger_keeps_the_last_overlap_keyframes_and_the_motion_poses():
    ledger = KeyframeLedger(2)
    outs = [[result(i, i != 1, x=float(i))] for i in range(4)]
    for out in outs[:2]:
        ledger.record(out)
    assert [k.index for k in ledger.kept()] == [0]
    assert ledger.last_stored == 0 and ledger.latest_c2w[0, 3] == 1.0 and ledger.last_keyframe_c2w[0, 3] == 0.0
    for out in outs[2:]:
        ledger.record(out)
    assert [k.index for k in ledger.kept()] == [2, 3]  # the last overlap_frames
    kept = ledger.kept()[-1]
    assert kept.c2w.dtype == np.float64 and kept.depth is not outs[3][0].depth  # private copies


def test_ledger_undo_restores_the_state_before_the_last_stored_frame_once():
    ledger = KeyframeLedger(2)
    for i, stored in enumerate([True, True, False, True, False]):
        ledger.record([result(i, stored, x=float(i))])
    assert ledger.last_stored == 3 and [k.index for k in ledger.kept()] == [1, 3]
    ledger.undo()
    assert ledger.last_stored is None and [k.index for k in ledger.kept()] == [0, 1]
    assert ledger.last_keyframe_c2w[0, 3] == 1.0 and ledger.latest_c2w[0, 3] == 2.0
    ledger.record([result(5, True)])
    ledger.forget_undo()  # a restart: nothing before it rolls back
    assert ledger.last_stored is None and [k.index for k in ledger.kept()] == [1, 5]


def test_ledger_clear_forgets_everything():
    ledger = KeyframeLedger(2)
    ledger.record([result(0, True)])
    ledger.clear()
    assert ledger.kept() == () and ledger.last_stored is None
    assert ledger.last_keyframe_c2w is None and ledger.latest_c2w is None
