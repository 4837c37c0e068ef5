"""``keyframe_selector``: a reference keyframe client of the mapping node, over its services.

    ros2 run lingbot_map_ros keyframe_selector --ros-args -p target_node:=/lingbot_map
    # the mapping node with the decision hold:  -p keyframe_decision_timeout:=0.5
    # one camera of a multi-camera node (cameras [front, rear]; its hold:
    # -p camera.front.keyframe_decision_timeout:=0.5):
    ros2 run lingbot_map_ros keyframe_selector --ros-args -p target_node:=/lingbot_map/front

For each frame that the node holds for a decision (``decision_pending``) announced on
``<target_node>/frame`` (lingbot_map_ros/FrameInfo) it decides keep or drop and calls
``<target_node>/commit_eviction`` (keep) or ``<target_node>/rollback_last_frame`` (drop) with
``expected_frame_index`` = the frame's index. ``target_node`` is the mapping node's fully
qualified name, or ``<node>/<camera>`` for one camera of a multi-camera node (its names
``~/<camera>/frame``, ``~/<camera>/commit_eviction``, ``~/<camera>/rollback_last_frame``;
one selector per camera). Frames the node stores without a hold (the scale
frames at the start, a new window's re-fed frames) only become the reference of the next
decisions; ``decide_unheld`` decides them too, for a node without the hold. Rules, in order
(``KeyframePolicy``; translation in map units, rotation in degrees, both measured by the node
from the last stored keyframe):

1. kept if no keyframe was seen since start or a reset (there is nothing to compare with);
2. a frame whose ``valid_fraction`` (share of confident pixels) is below
   ``min_valid_fraction`` is dropped: blur, a blank wall or an occluded lens would put
   poor tokens into the context of every later frame;
3. kept if ``translation_since_keyframe >= min_translation`` or
   ``rotation_since_keyframe_deg >= min_rotation_deg``;
4. kept if ``valid_fraction`` fell by more than ``confidence_drop`` (relative) below the
   last kept keyframe's: the model sees much it did not see from the cached views;
5. dropped otherwise (too close to the last keyframe).

One call is in flight at a time, sent with ``call_async``; a newer frame replaces one still
waiting to be sent. Nothing is sent while the services are not available (the frame waits up
to ``service_timeout``, then the node's ``keyframe_decision_default`` applies); a call without
an answer within ``service_timeout`` is given up, and its late answer is only logged at
debug. A frame index below the last one (the node restarted or was reset; after a drop of frame
N the next frame is N again, which is no restart) starts the policy again.
Exit status 0 on Ctrl-C, 1 with one error line for a bad parameter.
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import rclpy
from rcl_interfaces.msg import FloatingPointRange, ParameterDescriptor
from rclpy.exceptions import InvalidTopicNameException, ParameterException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.validate_full_topic_name import validate_full_topic_name

from lingbot_map_ros.msg import FrameInfo
from lingbot_map_ros.srv import CommitEviction, RollbackFrame

NODE_NAME = "keyframe_selector"
TIMER_PERIOD = 0.1  # s: checks for calls without an answer and services that came back


# ------------------------------------------------------------------ decision logic (no ROS)
@dataclass(frozen=True)
class Thresholds:
    """Keyframe thresholds: translation in map units, rotation in degrees, fractions in 0..1."""
    min_translation: float = 0.10
    min_rotation_deg: float = 10.0
    min_valid_fraction: float = 0.3
    confidence_drop: float = 0.25  # 0 = rule 4 off

    def __post_init__(self) -> None:
        for name in ("min_translation", "min_rotation_deg", "min_valid_fraction", "confidence_drop"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("min_valid_fraction", "confidence_drop"):
            if getattr(self, name) > 1.0:
                raise ValueError(f"{name} must be within 0..1, got {getattr(self, name)}")


class Decision(NamedTuple):
    keep: bool
    reason: str


class KeyframePolicy:
    """Keep/drop rules 1-5 of the module docstring. ``decide`` changes nothing; the caller reports
    each frame that became a keyframe (a keep the node confirmed, a frame it stored by itself)
    with ``note_keyframe``: its valid fraction is the reference of rule 4."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self.reference_valid_fraction: float | None = None  # the last kept frame's; None = none yet

    def reset(self) -> None:
        self.reference_valid_fraction = None

    def note_keyframe(self, valid_fraction: float) -> None:
        """The node stored this frame as a keyframe: it is the reference from now on."""
        self.reference_valid_fraction = valid_fraction if math.isfinite(valid_fraction) else 0.0

    def decide(self, translation: float, rotation_deg: float, valid_fraction: float) -> Decision:
        """Decide about one stored frame (the state is unchanged)."""
        t, ref = self.thresholds, self.reference_valid_fraction
        if ref is None:
            return Decision(True, "first frame")
        if not math.isfinite(valid_fraction) or valid_fraction < t.min_valid_fraction:
            return Decision(False, f"unreliable: valid fraction {valid_fraction:.2f} < {t.min_valid_fraction:.2f}")
        if translation >= t.min_translation:
            return Decision(True, f"moved {translation:.3f} >= {t.min_translation:.3f}")
        if rotation_deg >= t.min_rotation_deg:
            return Decision(True, f"turned {rotation_deg:.1f} >= {t.min_rotation_deg:.1f} deg")
        if t.confidence_drop > 0.0 and valid_fraction < (1.0 - t.confidence_drop) * ref:
            return Decision(True, f"confidence dropped: valid fraction {valid_fraction:.2f} "
                                  f"< {1.0 - t.confidence_drop:.2f} x {ref:.2f}")
        return Decision(False, "too close to the last keyframe")


# ------------------------------------------------------------------ node
def _desc(text: str, lo: float | None = None, hi: float | None = None) -> ParameterDescriptor:
    d = ParameterDescriptor(description=text, read_only=True)
    if lo is not None:
        d.floating_point_range = [FloatingPointRange(from_value=lo, to_value=hi, step=0.0)]
    return d


PARAMS = {
    "target_node": ("/lingbot_map", _desc("Fully qualified name of the mapping node, or <node>/<camera> for one "
                                          "camera of a multi-camera node (e.g. /lingbot_map/front)")),
    "min_translation": (0.10, _desc("Keep a frame this far from the last keyframe (map units)", 0.0, 1e6)),
    "min_rotation_deg": (10.0, _desc("Keep a frame turned this much from the last keyframe (degrees)", 0.0, 180.0)),
    "min_valid_fraction": (0.3, _desc("Drop a frame with fewer confident pixels than this (0..1; 0 = off)",
                                      0.0, 1.0)),
    "confidence_drop": (0.25, _desc("Keep a frame whose valid fraction fell by more than this share below the "
                                    "last keyframe's (0..1; 0 = off)", 0.0, 1.0)),
    "decide_unheld": (False, _desc("Also decide stored frames the node does not hold (a node with "
                                   "keyframe_decision_timeout 0; a drop may then come after the next frame and be "
                                   "refused); false: they are only references, as the node's scale frames should be")),
    "service_timeout": (1.0, _desc("Seconds a frame waits for the services, and a call for its answer", 0.01, 60.0)),
    "summary_period": (30.0, _desc("Seconds between the info summaries of the counters (0 = only at exit)",
                                   0.0, 86400.0)),
}


class InFlight(NamedTuple):
    frame_index: int
    keep: bool
    valid_fraction: float
    future: Any  # rclpy Future of the service response
    sent: float  # time.monotonic() at the call


class KeyframeSelector(Node):
    """Decides keep/drop for each stored frame of ``target_node`` and calls its services."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(NODE_NAME, **kwargs)
        p = {name: self.declare_parameter(name, default, desc).value for name, (default, desc) in PARAMS.items()}
        target = p["target_node"].rstrip("/")
        try:
            validate_full_topic_name(f"{target}/frame")
        except InvalidTopicNameException as exc:
            raise ValueError(f"target_node must be a fully qualified node name such as /lingbot_map (or "
                             f"/lingbot_map/front for camera front of a multi-camera node), got "
                             f"{p['target_node']!r} ({str(exc).splitlines()[0].rstrip(':')})") from None
        self.policy = KeyframePolicy(Thresholds(p["min_translation"], p["min_rotation_deg"],
                                                p["min_valid_fraction"], p["confidence_drop"]))
        self.timeout, self.decide_unheld = p["service_timeout"], p["decide_unheld"]
        self.counts: Counter[str] = Counter()
        self._logged: Counter[str] = Counter()
        self._waiting: tuple[FrameInfo, float] | None = None  # the frame to decide next, its arrival time
        self._in_flight: InFlight | None = None
        self._last_index = 0
        self._available = True
        self.keep_client = self.create_client(CommitEviction, f"{target}/commit_eviction")
        self.drop_client = self.create_client(RollbackFrame, f"{target}/rollback_last_frame")
        self._frames = self.create_subscription(FrameInfo, f"{target}/frame", self._on_frame,
                                                QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self._publishers_seen = 0  # publishers of the frame topic matched at the last timer tick
        self.create_timer(TIMER_PERIOD, self._on_timer)
        if p["summary_period"] > 0:
            self.create_timer(p["summary_period"], self.log_summary)
        which = "every stored frame" if self.decide_unheld else "the frames it holds"
        self.get_logger().info(f"deciding keyframes of {target} ({which}): {self.policy.thresholds}")

    def _on_frame(self, msg: FrameInfo) -> None:
        index = int(msg.frame_index)
        if index < self._last_index:  # after a drop of frame N the next frame is N again: no restart
            self.get_logger().info(f"frame index went back from {self._last_index} to {index}: the mapping node "
                                   "restarted or was reset; starting again")
            self.counts["restarts"] += 1
            self.policy.reset()
            self._waiting = self._in_flight = None  # an answer still to come is late
        self._last_index = index
        if not msg.stored:
            return  # not in the cache: nothing to keep or roll back
        if not (msg.decision_pending or self.decide_unheld):
            self.get_logger().debug(f"frame {index}: stored without a hold; the reference of the next decisions")
            self.policy.note_keyframe(msg.valid_fraction)
            return
        if self._waiting is not None:
            self.get_logger().debug(f"frame {self._waiting[0].frame_index}: not sent, replaced by frame {index}")
            self.counts["superseded"] += 1
        self._waiting = (msg, time.monotonic())
        self._dispatch()

    def _on_timer(self) -> None:
        self._note_publishers()
        if self._in_flight is not None and time.monotonic() - self._in_flight.sent > self.timeout:
            self.get_logger().warning(f"no answer about frame {self._in_flight.frame_index} within "
                                      f"{self.timeout} s; giving it up")
            self.counts["unanswered"] += 1
            self._in_flight = None
        self._dispatch()

    def _note_publishers(self) -> None:
        """Log when the frame topic gains its first matched publisher (the node: from then on its
        frames reach this selector) and when it loses the last one."""
        n = self._frames.get_publisher_count()
        if n and not self._publishers_seen:
            self.get_logger().info(f"receiving {self._frames.topic_name} ({n} publisher{'s' if n > 1 else ''})")
        elif not n and self._publishers_seen:
            self.get_logger().warning(f"no publisher on {self._frames.topic_name} any more")
        self._publishers_seen = n

    def _dispatch(self) -> None:
        """Decide about the waiting frame and send the call, if none is in flight and the services are up."""
        if self._in_flight is not None or self._waiting is None:
            return
        msg, arrived = self._waiting
        if not (self.keep_client.service_is_ready() and self.drop_client.service_is_ready()):
            if self._available:
                self.get_logger().warning(f"services {self.keep_client.service_name} and "
                                          f"{self.drop_client.service_name} not available; waiting")
                self._available = False
            if time.monotonic() - arrived > self.timeout:
                self.get_logger().debug(f"frame {msg.frame_index}: not sent (services unavailable for "
                                        f"{self.timeout} s); the node's default decision applies")
                self.counts["unavailable"] += 1
                self._waiting = None
            return
        if not self._available:
            self.get_logger().info("services available again")
            self._available = True
        self._waiting = None
        decision = self.policy.decide(msg.translation_since_keyframe, msg.rotation_since_keyframe_deg,
                                      msg.valid_fraction)
        index = int(msg.frame_index)
        self.get_logger().debug(f"frame {index}: {'keep' if decision.keep else 'drop'} ({decision.reason})")
        if decision.keep:
            future = self.keep_client.call_async(CommitEviction.Request(expected_frame_index=index))
        else:
            future = self.drop_client.call_async(RollbackFrame.Request(expected_frame_index=index))
        call = InFlight(index, decision.keep, msg.valid_fraction, future, time.monotonic())
        self._in_flight = call
        future.add_done_callback(lambda _: self._on_answer(call))

    def _on_answer(self, call: InFlight) -> None:
        """Count the answer to ``call``; one to a call given up or from before a restart is only logged."""
        word = "keep" if call.keep else "drop"
        try:
            response = call.future.result()
            success, text = bool(response.success), response.message
        except Exception as exc:  # noqa: BLE001 - a failed call is counted, never raised into the executor
            success, text = False, f"call failed: {exc}"
        if self._in_flight is not call:
            self.get_logger().debug(f"frame {call.frame_index}: late answer to {word} (success={success}: {text})")
            return
        self._in_flight = None
        self.counts[word if success else "refused"] += 1
        if success and call.keep:
            self.policy.note_keyframe(call.valid_fraction)
        self.get_logger().debug(f"frame {call.frame_index}: {word} {'done' if success else 'refused'}: {text}")
        self._dispatch()

    def summary(self) -> str:
        c = self.counts
        return (f"kept {c['keep']}, dropped {c['drop']}, refused {c['refused']}, unanswered {c['unanswered']}, "
                f"unavailable {c['unavailable']}, superseded {c['superseded']}, restarts {c['restarts']}")

    def log_summary(self) -> None:
        """Log the counters at info when they changed since the last summary."""
        if self.counts != self._logged:
            self._logged = Counter(self.counts)
            self.get_logger().info(f"summary: {self.summary()}")


def usage() -> str:
    """``--help``: how to run it and its parameters (name, default, description)."""
    lines = ["usage: ros2 run lingbot_map_ros keyframe_selector [--ros-args -p <name>:=<value> ...]", "",
             "Decides keep/drop for each frame the mapping node holds (see ~/frame) and calls its",
             "~/commit_eviction (keep) or ~/rollback_last_frame (drop). Parameters (read at start):"]
    for name, (default, desc) in PARAMS.items():
        lines.append(f"  {name} (default {default!r}): {desc.description}")
    return "\n".join(lines)


def main(args: list[str] | None = None) -> int:
    """Console entry point ``keyframe_selector``: 0 on shutdown, 1 with one error line for a bad parameter;
    ``-h``/``--help`` (before ``--ros-args``) prints the usage and exits 0."""
    argv = list(args if args is not None else sys.argv)
    own = argv[1:argv.index("--ros-args")] if "--ros-args" in argv else argv[1:]
    if "-h" in own or "--help" in own:
        print(usage())
        return 0
    rclpy.init(args=argv)
    try:
        node = KeyframeSelector()
    except (ParameterException, ValueError) as exc:
        rclpy.logging.get_logger(NODE_NAME).error(f"cannot start: {exc}")
        rclpy.try_shutdown()
        return 1
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        summary = node.summary()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()  # first: the node's logger would publish to /rosout of a shut-down context
        rclpy.logging.get_logger(NODE_NAME).info(f"final summary: {summary}")
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
