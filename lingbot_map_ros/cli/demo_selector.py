"""The keyframe selector in the demo's loop (``lingbot-map-demo --keyframe-selector``).

With ``--keyframe-selector`` the demo runs ``lingbot_map_ros.ros.keyframe_selector`` as a
third process against the node and turns the node's decision hold on (node parameter
``keyframe_decision_timeout``): every stored frame after the scale frames then waits for the
selector's keep (``~/commit_eviction``) or drop (``~/rollback_last_frame``) before the next
frame is stored; the next frame waits in the node's latest-frame slot meanwhile.

What is measured here, all in the demo's recorder process (one clock, ``time.time()``):

* **decision round trip** of a held frame N: from the node's per-frame ``~/status`` of frame N
  received to the node's next ``~/status`` whose decision counters went up, received.
  The node publishes frame N's ``~/frame`` (what the selector reads) just before that
  per-frame status, sets the hold right after it, and publishes the counter change right
  after applying the decision on its inference thread; both ends travel on the same topic to
  the same subscriber, so their transport cancels. The figure is the time the node held
  frame N: ``~/frame`` to the selector, its decision, the service call, the node's service
  thread handing the decision to the inference thread, and the status back.
* **hold waits**: a processed frame whose image stamp is earlier than the previous frame's
  decision arrived while the node was holding; ``decision received - stamp`` bounds from
  above how long the hold kept it waiting (its own transport to the node is inside).
"""
from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_DECISION_TIMEOUT = 0.5  # s, the node's keyframe_decision_timeout with --keyframe-selector
DECISION_COUNTERS = ("decisions_kept", "decisions_dropped", "decisions_timed_out", "decisions_refused")
ROUND_TRIP = ("node's per-frame ~/status of a held frame -> the node's next ~/status whose decision counters "
              "went up, both received by the demo's recorder (same process, same topic): how long the node held "
              "the frame for the selector's keep/drop")
HOLD_WAIT = ("processed frames stamped before the previous frame's decision arrived (they waited in the latest-frame "
             "slot); wait = decision received - image stamp, an upper bound")
_SUMMARY = re.compile(r"final summary: kept (\d+), dropped (\d+), refused (\d+), unanswered (\d+), "
                      r"unavailable (\d+), superseded (\d+), restarts (\d+)")


@dataclass(frozen=True)
class StatusEvent:
    """One ``~/status`` message as the recorder received it."""

    received_s: float  # wall time of arrival, seconds since the epoch
    stamp_s: float  # header stamp: the image this status is about, seconds
    frame_index: int
    per_frame: bool  # the status of a processed frame (it carries the model time)
    decision_pending: bool
    kept: int
    dropped: int
    timed_out: int
    refused: int

    @property
    def decided(self) -> int:
        """Decisions applied so far (kept + dropped + timed out)."""
        return self.kept + self.dropped + self.timed_out


@dataclass(frozen=True)
class DecisionTiming:
    """The decision about one held frame, as seen from the recorder."""

    frame_index: int
    stamp_s: float  # the held frame's image stamp, seconds
    how: str  # "kept", "dropped" or "timed_out" ("unknown" when counters fell and rose meanwhile)
    round_trip_ms: float  # see the module docstring
    decided_s: float  # wall time the decision's status arrived


class StatusLog:
    """Every ``<prefix>/status`` message with its arrival time, on a subscription of ``node``
    (the demo's recorder; spun elsewhere)."""

    def __init__(self, node, prefix: str = "/lingbot_map") -> None:
        from rclpy.qos import QoSProfile

        from lingbot_map_ros.msg import Status

        self._lock = threading.Lock()
        self._events: list[StatusEvent] = []
        node.create_subscription(Status, f"{prefix.rstrip('/')}/status", self._on_status, QoSProfile(depth=200))

    def _on_status(self, msg) -> None:
        now = time.time()
        event = StatusEvent(now, msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9, int(msg.frame_index),
                            msg.latency_model_ms > 0, bool(msg.decision_pending), int(msg.decisions_kept),
                            int(msg.decisions_dropped), int(msg.decisions_timed_out), int(msg.decisions_refused))
        with self._lock:
            self._events.append(event)

    def events(self) -> list[StatusEvent]:
        with self._lock:
            return list(self._events)


def decision_timings(events: list[StatusEvent]) -> tuple[list[DecisionTiming], int]:
    """Pair each per-frame status with the next status whose decision counters went up.

    ``events`` in arrival order (one topic, one publisher: the node's publication order).
    Returns (the timings, the count of decisions seen only in a later per-frame status,
    whose round trip is unknown)."""
    timings: list[DecisionTiming] = []
    unobserved = 0
    open_: StatusEvent | None = None  # the latest per-frame status not decided yet
    last: StatusEvent | None = None
    for e in events:
        if last is not None and e.decided < last.decided:  # the node was reset: counters start again
            open_ = None
        if open_ is not None and e.decided > open_.decided:
            if e.per_frame:
                unobserved += 1  # the decision's own status never arrived; only its effect did
            else:
                changes = (("kept", e.kept - open_.kept), ("dropped", e.dropped - open_.dropped),
                           ("timed_out", e.timed_out - open_.timed_out))
                # "unknown" only when another counter fell meanwhile
                how = next((name for name, change in changes if change > 0), "unknown")
                timings.append(DecisionTiming(open_.frame_index, open_.stamp_s, how,
                                              (e.received_s - open_.received_s) * 1e3, e.received_s))
            open_ = None
        if e.per_frame:
            open_ = e
        last = e
    return timings, unobserved


def hold_waits_ms(events: list[StatusEvent], timings: list[DecisionTiming]) -> list[float]:
    """For each decision, the next processed frame's wait if it was stamped before the
    decision arrived (see the module docstring), in ms."""
    per_frame = [e for e in events if e.per_frame]
    waits = []
    for t in timings:
        nxt = next((e for e in per_frame if e.frame_index > t.frame_index and e.received_s > t.decided_s), None)
        if nxt is not None and nxt.stamp_s < t.decided_s:
            waits.append((t.decided_s - nxt.stamp_s) * 1e3)
    return waits


def stats(values, digits: int = 2) -> dict:
    """n, median, p95, p99, max, mean, min of ``values`` ({"n": 0} when empty)."""
    if not len(values):
        return {"n": 0}
    a = np.asarray(values, dtype=float)
    return {"n": int(a.size), "median": round(float(np.median(a)), digits),
            "p95": round(float(np.percentile(a, 95)), digits), "p99": round(float(np.percentile(a, 99)), digits),
            "max": round(float(a.max()), digits), "mean": round(float(a.mean()), digits),
            "min": round(float(a.min()), digits)}


def decision_counts(status) -> dict[str, int]:
    """The node's cumulative decision counters from a Status message (zeros when None)."""
    return {name.removeprefix("decisions_"): int(getattr(status, name)) if status is not None else 0
            for name in DECISION_COUNTERS}


def selector_summary(log_path: Path) -> dict | None:
    """The selector's own counters from its 'final summary' log line (None when absent)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = _SUMMARY.findall(text)
    if not found:
        return None
    names = ("kept", "dropped", "refused", "unanswered", "unavailable", "superseded", "restarts")
    return dict(zip(names, (int(v) for v in found[-1])))


def decision_measurement(events: list[StatusEvent], since_s: float | None, baseline: dict[str, int],
                         final_status, timeout_s: float, selector: dict | None) -> dict:
    """The ``decisions`` part of the demo's JSON: the node's counters over the timed part
    (``final_status`` minus ``baseline``), the round trips and hold waits of frames stamped at
    or after ``since_s`` (all when None), and the selector's own counters (whole run)."""
    final = decision_counts(final_status)
    timings, unobserved = decision_timings(events)
    if since_s is not None:
        timings = [t for t in timings if t.stamp_s >= since_s]
    answered = [t.round_trip_ms for t in timings if t.how != "timed_out"]
    waits = hold_waits_ms(events, timings)
    return {
        "keyframe_decision_timeout_s": timeout_s,
        "node": {name: final[name] - baseline.get(name, 0) for name in final},  # timed part
        "node_totals": final,  # since the node started, warm-up included
        "round_trip_ms": stats(answered), "round_trip_definition": ROUND_TRIP,
        "round_trip_ms_kept": stats([t.round_trip_ms for t in timings if t.how == "kept"]),
        "round_trip_ms_dropped": stats([t.round_trip_ms for t in timings if t.how == "dropped"]),
        "timed_out_observed": sum(t.how == "timed_out" for t in timings),
        "decisions_without_their_status": unobserved,
        "hold_waits": {"frames": len(waits), "ms": stats(waits), "definition": HOLD_WAIT},
        "selector": selector,  # its final summary line, whole run (warm-up included)
    }


def decision_timeout(args: argparse.Namespace) -> float:
    """The node's keyframe_decision_timeout (s) with --keyframe-selector."""
    return args.decision_timeout if args.decision_timeout is not None else DEFAULT_DECISION_TIMEOUT


def selector_cmd(params: list[str], target: str = "/lingbot_map") -> list[str]:
    """The selector's command line; ``params`` are ``NAME=VALUE`` strings (ROS parameter syntax)."""
    cmd = [sys.executable, "-m", "lingbot_map_ros.ros.keyframe_selector", "--ros-args", "-p", f"target_node:={target}"]
    for item in params:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--selector-param needs NAME=VALUE, got {item!r}")
        cmd += ["-p", f"{name}:={value}"]
    return cmd


__all__ = ["StatusLog", "StatusEvent", "DecisionTiming", "decision_timings", "hold_waits_ms",
           "decision_measurement", "decision_counts", "selector_summary", "selector_cmd", "stats",
           "DEFAULT_DECISION_TIMEOUT"]
