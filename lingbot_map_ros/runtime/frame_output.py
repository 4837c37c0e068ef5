"""What one processed frame gives, assembled and handed to the sink: ``FramePublisher``.

For a frame with a finite pose: the path entry, the focal lengths (diagnostics), the tracking
health, the metric scale and map anchor (``anchor.MapAnchor``: the ``OutputTransform`` of
everything that leaves), the pose (``Sink.publish_frame``), the ~/frame summary a keyframe
client reads, the clouds and depth (queued to the output thread), the counters and one
~/status with the frame's latency. A non-finite depth or confidence map drops the outputs
(counted as invalid; the frame stays in the cache). Inference thread only; no ROS.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ..geometry import optical_pose_to_map, rotation_angle_deg
from ..robot.health import TrackingState
from ..robot.intrinsics import FocalTracker
from ..stream import FrameResult
from .anchor import MapAnchor
from .clouds import CloudOutput, ConfidenceSample
from .decisions import KeyframeDecisions
from .frames import FrameOutput, FrameSummary, InputFrame, Logger, Sink, State
from .mapping import MapAccumulator, PoseEntry, Trajectory
from .params import NodeSettings
from .status import Latency, StatusReporter
from .tracking import TrackingJudge
from .worker import Counters, RateMeter, Throttle


class FramePublisher:
    """See the module docstring. ``last_intrinsics``: (K, width, height) of the last frame's
    model input, replaced as a whole (the node's diagnostics compare it with CameraInfo's)."""

    def __init__(self, session: Any, sink: Sink, reporter: StatusReporter, tracking: TrackingJudge, anchor: MapAnchor,
                 decisions: KeyframeDecisions, trajectory: Trajectory, map_: MapAccumulator | None,
                 clouds: CloudOutput, focal: FocalTracker, counters: Counters, output_rate: RateMeter, log: Logger,
                 throttle: Throttle, now: Callable[[], float]) -> None:
        self.session, self.sink, self.reporter, self.tracking, self.anchor = session, sink, reporter, tracking, anchor
        self.decisions, self.trajectory, self.map, self.clouds, self.focal = decisions, trajectory, map_, clouds, focal
        self.counters, self.output_rate, self.log, self.throttle, self.now = counters, output_rate, log, throttle, now
        self.last_intrinsics: tuple[np.ndarray, int, int] | None = None

    def publish(self, r: FrameResult, frame: InputFrame, settings: NodeSettings, hold: bool = False,
                before_clouds: Callable[[], None] | None = None) -> bool:
        """Publish frame ``r`` (its input ``frame``); False when its outputs were dropped.
        ``hold``: its keyframe decision will be held (said in its ~/frame). ``before_clouds``: called
        once the pose is out and before the clouds are queued, or at once when the outputs are dropped
        (the engine's map bookkeeping for a stored frame, which the frame's clouds must follow)."""
        t0 = time.perf_counter()
        if r.depth is not None and not (np.isfinite(r.depth).all() and np.isfinite(r.confidence).all()):
            if before_clouds is not None:
                before_clouds()
            self.counters.add("frames_dropped_invalid")
            self.throttle.emit(self.log.warning, f"non-finite depth from the model for frame {r.frame_index + 1}: "
                               "outputs dropped (the frame stays in the cache)", kind="non-finite depth")
            self.tracking.judge(None, None, finite=False)
            self.reporter.publish("dropped: non-finite depth", frame.stamp, frame_index=r.frame_index + 1)
            return False
        T_map_cam = optical_pose_to_map(r.c2w)
        need_points = r.depth is not None and (self.map is not None or self.sink.wants("points"))
        need_depth = r.depth is not None and self.sink.wants("depth")
        h, w = r.size
        self.last_intrinsics = (r.intrinsics, w, h)
        index = r.frame_index + 1
        self.trajectory.append(PoseEntry(r.frame_index, frame.stamp, frame.stamp_s, T_map_cam))
        self.focal.add(r.intrinsics, (w, h), (frame.rgb.shape[1], frame.rgb.shape[0]))
        conf_stats = ConfidenceSample(r.confidence, settings.conf_threshold)
        self.tracking.judge(conf_stats.valid, r.c2w)
        scale, ready = self.anchor.update_scale(T_map_cam, frame, r, self.session.window_index)
        transform = self.anchor.output  # scale and map offset of this frame's outputs
        T_out = transform.pose(T_map_cam)
        if self.tracking.state == TrackingState.TRACKING:
            self.anchor.good(index, frame, T_out, ready)
        t1 = time.perf_counter()
        pose = FrameOutput(index, frame.stamp, frame.stamp_s, frame.camera_frame, r.is_keyframe, T_out,
                           r.intrinsics, None, None, None, None,
                           covariance=self.tracking.health.covariance(scale).ravel(), scale=scale, scale_ready=ready)
        self.sink.publish_frame(pose)
        if before_clouds is not None:
            before_clouds()
        self._summary(r, pose, hold, conf_stats)
        t2 = time.perf_counter()
        if need_points or need_depth:
            self.clouds.submit(r, pose, need_points, need_depth, settings.conf_threshold, settings.point_stride,
                               transform)
        self.counters.add("frames_processed")
        self.output_rate.tick()
        self.reporter.last_index = index
        self.reporter.set(State.TRACKING, "tracking")
        latency = Latency(preprocess=frame.preprocess_ms, model=r.timings.get("model_ms", 0.0),
                          postprocess=r.timings.get("postprocess_ms", 0.0) + (t1 - t0) * 1e3,
                          publish=(t2 - t1) * 1e3)
        note = self.anchor.take_note()
        self.reporter.publish(self.reporter.text + (f"; {note}" if note else ""), frame.stamp, frame_index=index,
                              is_keyframe=r.is_keyframe, latency=latency, stamp_s=frame.stamp_s)
        self.log.debug(f"frame {index}{' (keyframe)' if r.is_keyframe else ''}: preprocess {latency.preprocess:.1f} "
                       f"ms, model {latency.model:.1f} ms, postprocess {latency.postprocess:.1f} ms, publish "
                       f"{latency.publish:.1f} ms")
        return True

    def _summary(self, r: FrameResult, pose: FrameOutput, hold: bool, conf_stats: ConfidenceSample) -> None:
        """~/frame: what a keyframe client needs about this frame (see msg/FrameInfo.msg); also notes
        a stored frame's pose as the reference of the next frames' motion."""
        index = r.frame_index + 1
        ref = self.decisions.reference()
        if r.is_keyframe:
            self.decisions.stored(index, pose.T_map_cam)
        if not self.sink.wants("frame"):
            return
        translation = rotation = 0.0
        if ref is not None:
            translation = float(np.linalg.norm(pose.T_map_cam[:3, 3] - ref[:3, 3]))
            rotation = float(rotation_angle_deg(ref[:3, :3], pose.T_map_cam[:3, :3]))
        mean, median, valid = conf_stats.summary()
        stats = self.session.stats()
        self.sink.publish_frame_info(FrameSummary(
            frame_index=index, window_index=self.session.window_index, stored=r.is_keyframe,
            is_keyframe=r.is_keyframe, decision_pending=hold,
            pending_eviction_pages=stats.pending_evictions if stats is not None else 0,
            confidence_mean=mean, confidence_median=median, valid_fraction=valid,
            translation_since_keyframe=translation, rotation_since_keyframe_deg=rotation,
            latency_ms=max(0.0, (self.now() - pose.stamp_s) * 1e3)), pose)


__all__ = ["FramePublisher"]
