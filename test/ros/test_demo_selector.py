"""lingbot-map-demo --keyframe-selector: decision timing from ~/status (demo_selector), the
options and the demo's decision line. The measured run with the selector in the loop, the
provenance and the comparison tool: test/ros/test_node_latency_bench.py."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from lingbot_map_ros.cli import demo, demo_selector
from lingbot_map_ros.cli.demo_selector import StatusEvent

pytestmark = pytest.mark.ros


def ev(t: float, index: int, per_frame: bool, kept: int = 0, dropped: int = 0, timed_out: int = 0,
       refused: int = 0, stamp: float | None = None) -> StatusEvent:
    """A status received at t s about frame ``index`` stamped at ``stamp`` (default t - 0.03 s)."""
    return StatusEvent(t, t - 0.03 if stamp is None else stamp, index, per_frame, False, kept, dropped, timed_out,
                       refused)


# ------------------------------------------------------------------ pairing statuses
def test_each_held_frame_is_paired_with_the_status_that_announces_its_decision():
    events = [
        ev(10.000, 1, True), ev(10.001, 2, True),  # scale frames: never held, no decision follows
        ev(10.100, 3, True), ev(10.103, 3, False, kept=1),  # kept after 3 ms
        ev(10.150, 3, False, kept=1),  # a periodic status: nothing new
        ev(10.200, 4, True, kept=1), ev(10.205, 4, False, kept=1, dropped=1),  # dropped after 5 ms
        ev(10.300, 4, True, kept=1, dropped=1),  # the next frame reuses the rolled back index
        ev(10.800, 4, False, kept=1, dropped=1, timed_out=1, refused=1),  # the default after the timeout
        ev(10.900, 5, True, kept=1, dropped=1, timed_out=1, refused=1),
        ev(11.000, 6, True, kept=2, dropped=1, timed_out=1, refused=1),  # 5's own decision status was lost
    ]
    timings, unobserved = demo_selector.decision_timings(events)
    assert [(t.frame_index, t.how) for t in timings] == [(3, "kept"), (4, "dropped"), (4, "timed_out")]
    assert [round(t.round_trip_ms, 6) for t in timings] == [3.0, 5.0, 500.0]
    assert timings[0].stamp_s == pytest.approx(10.07) and timings[1].decided_s == 10.205
    assert unobserved == 1


def test_a_reset_that_zeroes_the_counters_opens_no_false_decision():
    events = [ev(1.0, 3, True, kept=5), ev(1.01, 0, False),  # reset: the counters start again
              ev(2.0, 1, True), ev(2.002, 1, False, kept=1)]
    timings, unobserved = demo_selector.decision_timings(events)
    assert [(t.frame_index, round(t.round_trip_ms, 6)) for t in timings] == [(1, 2.0)] and unobserved == 0


def test_hold_waits_count_only_frames_stamped_before_the_previous_decision():
    events = [ev(1.000, 3, True), ev(1.040, 3, False, kept=1),
              ev(1.100, 4, True, kept=1, stamp=1.020), ev(1.104, 4, False, kept=2),  # stamped 20 ms before 3's
              ev(1.200, 5, True, kept=2, stamp=1.150)]  # stamped after 4's decision: no wait
    timings, _ = demo_selector.decision_timings(events)
    assert [round(w, 6) for w in demo_selector.hold_waits_ms(events, timings)] == [20.0]


def test_decision_measurement_keeps_to_the_timed_part_and_subtracts_the_baseline(tmp_path):
    log = tmp_path / "selector.log"
    log.write_text("[INFO] [1.0] [keyframe_selector]: final summary: kept 7, dropped 2, refused 0, unanswered 1, "
                   "unavailable 0, superseded 3, restarts 0\n")
    events = [ev(1.0, 3, True), ev(1.01, 3, False, kept=1),  # warm-up (stamped before since_s = 5)
              ev(6.0, 4, True, kept=1), ev(6.002, 4, False, kept=2),
              ev(7.0, 5, True, kept=2), ev(7.004, 5, False, kept=2, dropped=1),
              ev(8.0, 6, True, kept=2, dropped=1), ev(8.5, 6, False, kept=2, dropped=1, timed_out=1)]
    final = SimpleNamespace(decisions_kept=2, decisions_dropped=1, decisions_timed_out=1, decisions_refused=4)
    m = demo_selector.decision_measurement(events, 5.0, {"kept": 1, "dropped": 0, "timed_out": 0, "refused": 3},
                                           final, 0.5, demo_selector.selector_summary(log))
    assert m["node"] == {"kept": 1, "dropped": 1, "timed_out": 1, "refused": 1}
    assert m["node_totals"] == {"kept": 2, "dropped": 1, "timed_out": 1, "refused": 4}
    rt = m["round_trip_ms"]  # the timed-out frame waited for the timeout, not for an answer: left out
    assert rt["n"] == 2 and rt["min"] == pytest.approx(2.0) and rt["max"] == pytest.approx(4.0)
    assert m["round_trip_ms_kept"]["n"] == 1 and m["round_trip_ms_dropped"]["median"] == pytest.approx(4.0)
    assert m["timed_out_observed"] == 1 and m["hold_waits"]["frames"] == 0
    assert m["selector"] == {"kept": 7, "dropped": 2, "refused": 0, "unanswered": 1, "unavailable": 0,
                             "superseded": 3, "restarts": 0}
    assert demo_selector.selector_summary(tmp_path / "missing.log") is None
    json.dumps(m)


# ------------------------------------------------------------------ options
def test_selector_options_set_the_decision_hold_and_the_selector_command(tmp_path):
    parser = demo.build_parser()
    args = parser.parse_args(["--keyframe-selector", "--selector-param", "min_translation=0.05"])
    demo.check_selector_options(args)
    values = demo.node_parameters(args, {"checkpoint": ""}, tmp_path)
    assert values["keyframe_decision_timeout"] == demo_selector.DEFAULT_DECISION_TIMEOUT
    args = parser.parse_args(["--keyframe-selector", "--decision-timeout", "2",
                              "--node-param", "keyframe_decision_default=drop"])
    values = demo.node_parameters(args, {"checkpoint": ""}, tmp_path)
    assert (values["keyframe_decision_timeout"], values["keyframe_decision_default"]) == (2.0, "drop")
    assert "keyframe_decision_timeout" not in demo.node_parameters(parser.parse_args([]), {}, tmp_path)
    cmd = demo_selector.selector_cmd(["min_translation=0.05", "service_timeout=2.0"])
    assert cmd[:3] == [sys.executable, "-m", "lingbot_map_ros.ros.keyframe_selector"]
    assert cmd[3:] == ["--ros-args", "-p", "target_node:=/lingbot_map", "-p", "min_translation:=0.05",
                       "-p", "service_timeout:=2.0"]


@pytest.mark.parametrize("argv, message", [
    (["--decision-timeout", "1"], "need --keyframe-selector"),
    (["--selector-param", "a=1"], "need --keyframe-selector"),
    (["--keyframe-selector", "--decision-timeout", "0"], "--decision-timeout"),
    (["--keyframe-selector", "--decision-timeout", "61"], "--decision-timeout"),
    (["--keyframe-selector", "--selector-param", "novalue"], "NAME=VALUE")])
def test_bad_selector_options_are_one_line_errors(argv, message, tmp_path, capsys):
    assert demo.main(argv + ["--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_demo_prints_the_node_decision_counters():
    status = SimpleNamespace(decisions_kept=7, decisions_dropped=2, decisions_timed_out=1, decisions_refused=0)
    line = demo.decisions_line(status)
    assert line.startswith("decisions        : kept 7, dropped 2, timed out 1, refused 0"), line
    assert "kept 0, dropped 0, timed out 0, refused 0" in demo.decisions_line(None)
