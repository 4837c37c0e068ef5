"""A small in-process listener for demos and tools: records what the node outputs.

``Recorder`` subscribes to the node's ``pose`` and ``status`` topics and keeps, per
pose, the image stamp and the wall time it arrived, so the end-to-end latency
(image stamp -> pose received) and the output rate can be summarised. The image
publisher stamps with the same system clock, so the difference is meaningful on one
machine. ``call`` runs a service on the node and waits with a deadline. Per processed frame
it also keeps the node's own timings from ``status`` (``frame_status``), and
``summary(since_s)`` restricts everything to images stamped at or after ``since_s``
(to leave a warm-up out).
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
class FrameStatus:
    """The node's Status for one processed frame (the one with its timings)."""

    stamp_s: float  # image stamp, seconds
    frame_index: int
    window_index: int
    model_ms: float  # Status.latency_model_ms
    total_ms: float  # Status.latency_total_ms: image stamp -> end of publishing, node side
    preprocess_ms: float
    postprocess_ms: float
    publish_ms: float
    gpu_allocated_mb: float
    gpu_reserved_mb: float


@dataclass
class Summary:
    frames: int
    fps: float
    latency_median_ms: float
    latency_p95_ms: float
    model_mean_ms: float  # the node's per-frame model time (Status.latency_model_ms), mean
    latency_max_ms: float = float("nan")
    latency_mean_ms: float = float("nan")


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
        self.frame_status: list[FrameStatus] = []
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
                self.frame_status.append(FrameStatus(
                    msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9, int(msg.frame_index),
                    int(msg.window_index), msg.latency_model_ms, msg.latency_total_ms, msg.latency_preprocess_ms,
                    msg.latency_postprocess_ms, msg.latency_publish_ms, msg.gpu_memory_allocated_mb,
                    msg.gpu_memory_reserved_mb))

    def snapshot(self) -> tuple[list[PoseRecord], Status | None]:
        with self._lock:
            return list(self.poses), self.status

    def frame_statuses(self, since_s: float | None = None) -> list[FrameStatus]:
        """Per-frame statuses of images stamped at or after ``since_s`` (all when None)."""
        with self._lock:
            return [f for f in self.frame_status if since_s is None or f.stamp_s >= since_s]

    def summary(self, since_s: float | None = None) -> Summary:
        """Poses of images stamped at or after ``since_s`` (all when None)."""
        poses, _ = self.snapshot()
        if since_s is None:
            with self._lock:
                model = list(self.model_ms)
        else:
            poses = [p for p in poses if p.stamp_s >= since_s]
            model = [f.model_ms for f in self.frame_statuses(since_s)]
        model_ms = float(np.mean(model)) if model else float("nan")
        if not poses:
            return Summary(0, 0.0, float("nan"), float("nan"), model_ms)
        latencies = np.array([p.latency_ms for p in poses])
        span = poses[-1].received_s - poses[0].received_s
        # The scale frames arrive together; the rate counts the intervals after the first pose.
        fps = (len(poses) - 1) / span if len(poses) > 1 and span > 0 else 0.0
        return Summary(len(poses), fps, float(np.median(latencies)), float(np.percentile(latencies, 95)), model_ms,
                       float(latencies.max()), float(latencies.mean()))

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


__all__ = ["Recorder", "PoseRecord", "FrameStatus", "Summary"]
