"""What one processed frame gives, assembled for the engine to publish: ``FrameAssembler``.

For a frame with a finite pose and depth: the pose in the map frame (``T_map_cam``, model units,
the path's entry), the tracking health's judgement, the metric scale and map anchor
(``anchor.MapAnchor``: the ``OutputTransform`` every output goes through), the ``FrameOutput``
the sink publishes (scaled and offset) and, when someone reads ~/frame, the ``FrameSummary`` a
keyframe client reads. It changes nothing of the sequence's path, map, counters or state: the
engine applies what it returns (``runtime.engine``). Inference thread only; no ROS.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..geometry import optical_pose_to_map, rotation_angle_deg
from ..robot.health import TrackingState
from ..robot.map_offset import OutputTransform
from ..stream import FrameResult
from .clouds import ConfidenceSample
from .frames import FrameOutput, FrameSummary, InputFrame
from .mapping import PoseEntry
from .params import NodeSettings
from .sequence import Sequence


@dataclass
class Assembled:
    """One frame's outputs before they are published."""

    entry: PoseEntry  # the path's entry: T_map_cam in model units, the sequence's map frame
    pose: FrameOutput  # as it leaves: through ``transform`` (scale, map offset)
    transform: OutputTransform
    confidence: ConfidenceSample
    seconds: float  # perf_counter time the assembly took (the frame's postprocess)


def finite_maps(r: FrameResult) -> bool:
    """The frame's depth and confidence maps are finite (a frame without depth counts as finite)."""
    return r.depth is None or bool(np.isfinite(r.depth).all() and np.isfinite(r.confidence).all())


class FrameAssembler:
    """See the module docstring. ``last_intrinsics``: (K, width, height) of the last frame's
    model input, replaced as a whole (the node's diagnostics compare it with CameraInfo's)."""

    def __init__(self, session, seq: Sequence) -> None:
        self.session, self.seq = session, seq
        self.last_intrinsics: tuple[np.ndarray, int, int] | None = None

    def assemble(self, r: FrameResult, frame: InputFrame, settings: NodeSettings) -> Assembled:
        """The outputs of frame ``r`` (its input ``frame``; finite, ``finite_maps``): the health is
        judged and the scale estimated with it (their own state), nothing else changes."""
        t0 = time.perf_counter()
        seq = self.seq
        T_map_cam = optical_pose_to_map(r.c2w)  # the stream's (front end); the path keeps it
        h, w = r.size
        self.last_intrinsics = (r.intrinsics, w, h)
        seq.focal.add(r.intrinsics, (w, h), (frame.rgb.shape[1], frame.rgb.shape[0]))
        confidence = ConfidenceSample(r.confidence, settings.conf_threshold)
        seq.tracking.judge(confidence.valid, r.c2w)
        scale, ready = seq.anchor.update_scale(T_map_cam, frame, r, self.session.window_index)
        transform = seq.anchor.output  # scale and map offset of this frame's outputs
        corrections = seq.corrections  # loop closure's (identity without)
        T_out = transform.pose(corrections.pose(r.frame_index, T_map_cam))
        T_front = None if corrections.identity else transform.pose(T_map_cam)
        index = r.frame_index + 1
        if seq.tracking.state == TrackingState.TRACKING:
            seq.anchor.good(index, frame, T_out, ready)
        pose = FrameOutput(index, frame.stamp, frame.stamp_s, frame.camera_frame, r.is_keyframe, T_out,
                           r.intrinsics, None, None, None, None,
                           covariance=seq.tracking.health.covariance(scale).ravel(), scale=scale, scale_ready=ready,
                           transform=transform, T_front=T_front)
        entry = PoseEntry(r.frame_index, frame.stamp, frame.stamp_s, T_map_cam)
        return Assembled(entry, pose, transform, confidence, time.perf_counter() - t0)

    def summary(self, r: FrameResult, out: Assembled, hold: bool, now: float) -> FrameSummary:
        """~/frame: what a keyframe client needs about this frame (msg/FrameInfo.msg): its motion
        since the last stored frame (read before this frame is noted as stored; the stream's own
        poses, so that a loop correction is no motion), its confidence."""
        ref = self.seq.decisions.reference()
        pose = out.pose
        T = stream_pose(pose)
        translation = rotation = 0.0
        if ref is not None:
            translation = float(np.linalg.norm(T[:3, 3] - ref[:3, 3]))
            rotation = float(rotation_angle_deg(ref[:3, :3], T[:3, :3]))
        mean, median, valid = out.confidence.summary()
        stats = self.session.stats()
        return FrameSummary(
            frame_index=pose.frame_index, window_index=self.session.window_index, stored=r.is_keyframe,
            is_keyframe=r.is_keyframe, decision_pending=hold,
            pending_eviction_pages=stats.pending_evictions if stats is not None else 0,
            confidence_mean=mean, confidence_median=median, valid_fraction=valid,
            translation_since_keyframe=translation, rotation_since_keyframe_deg=rotation,
            latency_ms=max(0.0, (now - pose.stamp_s) * 1e3))


def stream_pose(pose: FrameOutput) -> np.ndarray:
    """The frame's pose as the stream gave it (scaled and offset, without loop closure's correction)."""
    return pose.T_map_cam if pose.T_front is None else pose.T_front


__all__ = ["FrameAssembler", "Assembled", "finite_maps", "stream_pose"]
