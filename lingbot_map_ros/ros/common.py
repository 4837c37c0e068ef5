"""What every part of the ROS shell shares: the node's name, QoS profiles, stamps and the
/diagnostics entry builder."""
from __future__ import annotations

from builtin_interfaces.msg import Time as TimeMsg
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

NODE_NAME = "lingbot_map"

# The services' request queue keeps every request (reliable, keep-all) instead of rclpy's default
# keep-last 10: a call waits for the inference thread on one of main.SERVICE_THREADS threads, and
# while they all wait, a burst of calls (a keyframe client's flood) waits in this queue. With the
# default the 11th queued request overwrote the oldest, which then never got an answer.
SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)


def qos_profile(reliable: bool = True, latched: bool = False, depth: int = 10) -> QoSProfile:
    return QoSProfile(depth=depth,
                      reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


def stamp_seconds(stamp: TimeMsg) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def stamp_of_ns(ns: int) -> TimeMsg:
    """A Time message of ``ns`` nanoseconds (>= 0)."""
    return TimeMsg(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def diag(name: str, level: bytes, message: str, values: dict) -> DiagnosticStatus:
    """One /diagnostics entry of this node."""
    return DiagnosticStatus(level=level, name=name, message=message, hardware_id=NODE_NAME,
                            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])


__all__ = ["NODE_NAME", "SERVICE_QOS", "qos_profile", "stamp_seconds", "stamp_of_ns", "diag"]
