"""A frame's outputs beyond its pose: the point cloud and depth image (``frame_clouds``) and the
confidence statistics of ~/frame and the health (``ConfidenceSample``).

Points: the pixels with confidence above ``conf_threshold``, every ``point_stride``-th of
them, unprojected with the frame's depth, intrinsics and pose (OpenCV world), then in the
REP-103 map frame; the map keeps them in model units, the published cloud goes through the
frame's ``OutputTransform`` (scale, map offset). Depth: z-depth [H, W] float32, NaN where
not > 0, times the frame's scale. ``CloudOutput`` runs them on the camera's output thread; no ROS.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..geometry import optical_pose_to_map, points_to_map, unproject_pixels
from ..robot.map_offset import OutputTransform
from ..robot.scale import scale_depth
from ..stream import FrameResult
from .frames import FrameOutput, Logger, Sink
from .output_worker import OutputWorker
from .worker import Throttle

CONFIDENCE_SAMPLE = 4  # ~/frame's confidence statistics read every 4th pixel (0.2 ms instead of 1 ms at 518x378)


def frame_clouds(r: FrameResult, pose: FrameOutput, need_points: bool, need_depth: bool, conf_threshold: float,
                 point_stride: int, transform: OutputTransform | None = None, correction=None
                 ) -> tuple[FrameOutput, tuple[np.ndarray, np.ndarray] | None]:
    """(``pose`` with its clouds, (points [N, 3] float32 in the sequence's map frame and model units,
    colours [N, 3] uint8) for the map, or None without points). ``transform``: the frame's scale
    and map offset (default: the frame's scale alone); ``correction``: loop closure's for this
    frame (a ``slam.Sim3``, applied to the published points only; None: none)."""
    points = colors = conf = depth = None
    for_map = None
    if need_points:
        # the viewer's selection (confidence > threshold, then every stride-th), unprojected
        # for the selected pixels only: select_points(unproject_depth(...)) at ~1/stride the work
        index = np.flatnonzero(r.confidence.reshape(-1) > conf_threshold)[::point_stride]
        pts = unproject_pixels(r.depth, r.intrinsics, r.c2w, index)  # OpenCV world
        colors = r.colors(index)
        points = points_to_map(pts.astype(np.float32))
        conf = r.confidence.reshape(-1)[index].astype(np.float32)
        for_map = (points, colors)
        if correction is not None:
            points = correction.apply(points).astype(np.float32)
        points = (transform or OutputTransform(pose.scale)).points(points)
    if need_depth:
        depth = np.where(r.depth > 0, r.depth, np.nan).astype(np.float32)
        if pose.scale != 1.0:
            depth = scale_depth(depth, pose.scale).astype(np.float32)
    return replace(pose, depth=depth, points=points, colors=colors, confidence=conf), for_map


class CloudOutput:
    """A camera's output thread (``worker``): each frame's clouds go into the map (model units,
    ``seq.add_points``: the sequence's ``runtime.sequence.Sequence``) and out to the sink
    (``Sink.publish_clouds``) there, never holding up the inference thread; at most two frames
    wait, older ones are skipped (counted in ``skipped``, warned)."""

    def __init__(self, sink: Sink, seq, worker: OutputWorker, log: Logger, throttle: Throttle,
                 map_max_points: int = 0) -> None:
        self.sink, self.seq, self.log, self.throttle = sink, seq, log, throttle
        self.map_max_points = map_max_points
        self.skipped = 0  # frames whose clouds the output thread dropped (it fell behind)
        self._warned_thinning = False
        self.worker = worker
        worker.on_skip, worker.on_error = self._skipped, self._failed

    def submit(self, r: FrameResult, pose: FrameOutput, need_points: bool, need_depth: bool, conf_threshold: float,
               point_stride: int, transform: OutputTransform | None = None, correction=None) -> None:
        """Queue the clouds of a frame whose pose went out (inference thread; values, not settings)."""
        self.worker.frame_job(lambda: self.publish(r, pose, need_points, need_depth, conf_threshold, point_stride,
                                                   transform, correction))

    def publish(self, r: FrameResult, pose: FrameOutput, need_points: bool, need_depth: bool, conf_threshold: float,
                point_stride: int, transform: OutputTransform | None = None, correction=None) -> None:
        """Output thread: the frame's point cloud (~/points, map) and depth image; ``transform`` = the
        frame's scale and map offset, ``correction`` loop closure's (the map keeps the sequence's own
        frame and units)."""
        out, for_map = frame_clouds(r, pose, need_points, need_depth, conf_threshold, point_stride, transform,
                                    correction)
        acc = self.seq.map
        if for_map is not None and acc is not None:
            self.seq.add_points(r.frame_index, *for_map)  # model units (transformed at publication and save)
            if acc.thinned and not self._warned_thinning:
                self._warned_thinning = True
                self.log.warning(f"the map reached map_max_points={self.map_max_points}: its older part is thinned "
                                 "uniformly; raise map_voxel_size or map_max_points for a denser map")
        if for_map is not None and self.seq.grid is not None:  # the occupancy grid (runtime/grid.py)
            self.seq.add_grid_frame(r.frame_index, optical_pose_to_map(r.c2w), for_map[0], pose)
        self.sink.publish_clouds(out)

    def _skipped(self) -> None:
        self.skipped += 1
        self.throttle.emit(self.log.warning, "point cloud / depth outputs of a frame skipped: the output thread "
                                             "falls behind (raise point_stride or map_voxel_size)", kind="clouds")

    def _failed(self, exc: Exception) -> None:
        self.log.error(f"unexpected error while publishing clouds: {type(exc).__name__}: {exc}")


class ConfidenceSample:
    """Every CONFIDENCE_SAMPLE-th pixel of a confidence map [H, W] (a strided view, no copy): its
    fraction above ``threshold`` (health, every frame) and, only when ~/frame is published, its mean
    and median (the median is the costly part: skipped when nobody listens)."""

    def __init__(self, confidence: np.ndarray | None, threshold: float) -> None:
        self.sample = None if confidence is None else confidence.reshape(-1)[::CONFIDENCE_SAMPLE]
        self.valid = None if self.sample is None else (
            float(np.count_nonzero(self.sample > threshold)) / self.sample.size if self.sample.size else 0.0)

    def summary(self) -> tuple[float, float, float]:
        if self.sample is None or self.sample.size == 0:
            return 0.0, 0.0, 0.0
        return float(self.sample.mean()), float(np.median(self.sample)), self.valid


__all__ = ["frame_clouds", "CloudOutput", "ConfidenceSample", "CONFIDENCE_SAMPLE"]
