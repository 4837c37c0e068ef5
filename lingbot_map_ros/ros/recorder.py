"""A small in-process listener for demos and tools: records what the node outputs.

``Recorder`` subscribes to the node's ``pose`` and ``status`` topics and keeps, per
pose, the image stamp and the wall time it arrived, so the end-to-end latency
(image stamp -> pose received) and the output rate can be summarised. The image
publisher stamps with the same system clock, so the difference is meaningful on one
machine. ``call`` runs a service on the node and waits with a deadline.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
from geometry_msgs.msg import PoseStamped
from rclpy.node import Node
from rclpy.qos import QoSProfile

from lingbot_map_ros.msg import Status

from ..geometry import quaternion_to_matrix


@dataclass
class PoseRecord:
    stamp_s: float  # image stamp, seconds
    received_s: float  # wall time the pose arrived, seconds since the epoch
    T_map_cam: np.ndarray  # [4, 4]

    @property
    def latency_ms(self) -> float:
        return (self.received_s - self.stamp_s) * 1e3


@dataclass
class Summary:
    frames: int
    fps: float
    latency_median_ms: float
    latency_p95_ms: float
    model_mean_ms: float  # the node's per-frame model time (Status.latency_model_ms), mean


class Recorder(Node):
    """Records poses and the latest status of a LingBot-Map node (``prefix`` = its private
    namespace, e.g. ``/lingbot_map``)."""

    def __init__(self, prefix: str = "/lingbot_map", name: str = "lingbot_map_recorder") -> None:
        super().__init__(name)
        self.prefix = prefix.rstrip("/")
        self._lock = threading.Lock()
        self.poses: list[PoseRecord] = []
        self.status: Status | None = None
        self.model_ms: list[float] = []
        self.create_subscription(PoseStamped, f"{self.prefix}/pose", self._on_pose, QoSProfile(depth=100))
        self.create_subscription(Status, f"{self.prefix}/status", self._on_status, QoSProfile(depth=100))

    def _on_pose(self, msg: PoseStamped) -> None:
        now = time.time()
        p, q = msg.pose.position, msg.pose.orientation
        T = np.eye(4)
        T[:3, :3] = quaternion_to_matrix(np.array([q.x, q.y, q.z, q.w]))
        T[:3, 3] = (p.x, p.y, p.z)
        with self._lock:
            self.poses.append(PoseRecord(msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9, now, T))

    def _on_status(self, msg: Status) -> None:
        with self._lock:
            self.status = msg
            if msg.latency_model_ms > 0:
                self.model_ms.append(msg.latency_model_ms)

    def snapshot(self) -> tuple[list[PoseRecord], Status | None]:
        with self._lock:
            return list(self.poses), self.status

    def summary(self) -> Summary:
        poses, _ = self.snapshot()
        with self._lock:
            model_ms = float(np.mean(self.model_ms)) if self.model_ms else float("nan")
        if not poses:
            return Summary(0, 0.0, float("nan"), float("nan"), model_ms)
        latencies = np.array([p.latency_ms for p in poses])
        span = poses[-1].received_s - poses[0].received_s
        # The scale frames arrive together; the rate counts the intervals after the first pose.
        fps = (len(poses) - 1) / span if len(poses) > 1 and span > 0 else 0.0
        return Summary(len(poses), fps, float(np.median(latencies)), float(np.percentile(latencies, 95)), model_ms)

    def call(self, srv_type, name: str, request, timeout: float = 30.0):
        """Call service ``name`` and wait (the node must be spun elsewhere); None on timeout."""
        client = self.create_client(srv_type, name)
        try:
            if not client.wait_for_service(timeout_sec=timeout):
                return None
            future = client.call_async(request)
            done = threading.Event()
            future.add_done_callback(lambda _f: done.set())
            if not done.wait(timeout):
                return None
            return future.result()
        finally:
            self.destroy_client(client)


__all__ = ["Recorder", "PoseRecord", "Summary"]
