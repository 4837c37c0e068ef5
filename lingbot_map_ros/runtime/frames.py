"""What goes in and out of a camera's engine: ``InputFrame`` in, ``FrameOutput``,
``FrameSummary`` and ``StatusFields`` out to a ``Sink`` (the ROS outputs, or a test's fake).

Frames: everything leaving the engine is in the REP-103 map frame (x forward, y left, z up,
origin at the first camera of the sequence; see ``ros/conversions``); poses are
``T_map_cam`` of the camera's optical frame. Units are the model's unless ``scale`` says
otherwise (metres per model unit).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..robot.map_offset import OutputTransform
from ..robot.undistort import CameraModel
from .mapping import PoseEntry


class State(enum.IntEnum):
    """Mirrors the STATE_* constants of lingbot_map_ros/msg/Status."""

    INITIALIZING = 0
    TRACKING = 1
    WAITING_FOR_IMAGES = 2
    RESETTING = 3
    ERROR = 4


class Logger(Protocol):
    def debug(self, message: str) -> Any: ...
    def info(self, message: str) -> Any: ...
    def warning(self, message: str) -> Any: ...
    def error(self, message: str) -> Any: ...


@dataclass
class InputFrame:
    """A converted image waiting for inference."""

    rgb: np.ndarray  # [H, W, 3] uint8 RGB, as received
    stamp: Any  # the image's builtin_interfaces/Time
    stamp_s: float  # the same, in seconds
    camera_frame: str  # optical frame id of the image
    convert_ms: float = 0.0  # message -> array time
    preprocess_ms: float = 0.0  # set by the engine
    camera: CameraModel | None = None  # the latest camera_info when the frame arrived (undistortion)


@dataclass
class FrameOutput:
    """What the sink publishes for one processed frame (map frame, image stamp)."""

    frame_index: int  # 1-based since start/reset
    stamp: Any
    stamp_s: float
    camera_frame: str
    is_keyframe: bool
    T_map_cam: np.ndarray  # [4, 4] camera optical frame -> map
    intrinsics: np.ndarray  # [3, 3] at the depth resolution, pixels
    depth: np.ndarray | None  # [H, W] float32 z-depth, NaN where not > 0; None when nobody wants it
    points: np.ndarray | None  # [N, 3] float32 in the map frame; None when not computed
    colors: np.ndarray | None  # [N, 3] uint8 RGB
    confidence: np.ndarray | None  # [N] float32
    covariance: np.ndarray | None = None  # [36] float64 row-major 6x6 pose covariance (x y z roll pitch yaw)
    scale: float = 1.0  # metres per model unit applied to T_map_cam, points and depth (1 = model units)
    scale_ready: bool = True  # False while an estimated scale has not converged (TF may wait, see node)
    transform: OutputTransform = field(default_factory=OutputTransform)  # scale + map offset it went through
    # the stream's own pose, through ``transform`` but without loop closure's correction (REP 105's
    # odom -> camera); None: no correction applies (it equals T_map_cam)
    T_front: np.ndarray | None = None


@dataclass
class StatusFields:
    """Fields of lingbot_map_ros/msg/Status except the header (same names)."""

    state: int = 0
    state_text: str = ""
    frame_index: int = 0
    window_index: int = 0
    is_keyframe: bool = False
    deferred_eviction: bool = False
    pending_evictions: int = 0
    stored_frames: int = 0
    temporal_index: int = 0
    scale_pages: int = 0
    window_pages: int = 0
    free_pages: int = 0
    special_tokens: int = 0
    latency_preprocess_ms: float = 0.0
    latency_model_ms: float = 0.0
    latency_postprocess_ms: float = 0.0
    latency_publish_ms: float = 0.0
    latency_total_ms: float = 0.0
    gpu_memory_allocated_mb: float = 0.0
    gpu_memory_reserved_mb: float = 0.0
    frames_received: int = 0
    frames_processed: int = 0
    frames_dropped_stale: int = 0
    frames_dropped_invalid: int = 0
    frames_dropped_error: int = 0
    frames_dropped_stamp: int = 0
    time_jumps: int = 0
    evictions_auto_committed: int = 0
    decision_pending: bool = False
    decisions_kept: int = 0
    decisions_dropped: int = 0
    decisions_timed_out: int = 0
    decisions_refused: int = 0
    tracking_state: str = "initializing"
    tracking_reasons: str = ""
    lost_resets: int = 0
    scale: float = 1.0
    scale_source: str = "none"
    scale_spread: float = 0.0
    scale_converged: bool = False
    loop_closure: bool = False
    localization: str = ""
    frames_not_localized: int = 0
    loop_keyframes: int = 0
    loop_candidates: int = 0
    loop_accepted: int = 0
    loop_rejected: int = 0
    loop_optimisation_ms: float = 0.0


@dataclass
class FrameSummary:
    """Fields of lingbot_map_ros/msg/FrameInfo except header and pose (same names), plus the pose."""

    frame_index: int
    window_index: int
    stored: bool
    is_keyframe: bool
    decision_pending: bool
    pending_eviction_pages: int
    confidence_mean: float
    confidence_median: float
    valid_fraction: float
    translation_since_keyframe: float
    rotation_since_keyframe_deg: float
    latency_ms: float


class Sink(Protocol):
    def wants(self, output: str) -> bool:
        """Whether anyone consumes ``output`` ("points" or "depth") right now."""

    def publish_frame(self, out: FrameOutput) -> None: ...
    def publish_clouds(self, out: FrameOutput) -> None: ...  # points and depth of an already published frame
    def publish_path(self, entries: list[PoseEntry], transform: OutputTransform | None = None,
                     corrections: Any = None) -> None: ...  # corrections: runtime.corrections.Corrections
    def publish_status(self, status: StatusFields, stamp: Any) -> None: ...
    def publish_frame_info(self, info: FrameSummary, out: FrameOutput) -> None: ...
    def configure(self, settings: Any) -> None: ...  # new settings (a parameter set), on the inference thread


__all__ = ["State", "Logger", "InputFrame", "FrameOutput", "StatusFields", "FrameSummary", "Sink"]
