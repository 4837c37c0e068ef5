"""Where a camera's outputs sit in the published map: ``MapAnchor`` (metric scale and the map
offset across lost resets), and ``DepthCache`` (sensor depth images for the depth scale).

The engine keeps a sequence's trajectory and map in the sequence's own frame and in model
units; ``MapAnchor.output`` (an ``OutputTransform``: the applied scale and the map offset
``T_map_seq``, ``robot/map_offset.py``) is what every output goes through. It is replaced,
never mutated (the node's timers read it from other threads).

- **Metric scale** (``scale_source``, ``robot/scale.py``): each published frame feeds the
  scale source (odometry: the camera centre in odom_frame at the image stamp; depth: the
  sensor depth image nearest in time); ``applied_scale`` is 1 until it converged.
- **Lost reset** (``on_lost=reset``): the last frame published while the health was
  ``tracking`` is the last good pose. With odometry (``camera_pose``: ``T_odom_cam`` at an
  image stamp) at its stamp, the next sequence continues the map from it: its first frame
  with odometry is placed at the good pose moved by the odometry in between
  (``odometry_alignment``); without, the next sequence starts a new map origin.

Inference thread only (the depth cache excepted: thread-safe); no ROS, no torch.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..geometry import optical_pose_to_map, rotation_angle_deg
from ..robot.map_offset import OutputTransform, SequenceAnchor, invert_rigid, odometry_alignment
from ..robot.scale import DepthScaleEstimator, FixedScale, OdometryScaleEstimator
from ..stream import FrameResult
from .frames import InputFrame, Logger
from .worker import Throttle

DEPTH_MATCH_S = 0.05  # scale_source depth: a sensor depth image counts for a colour image within 50 ms
NEW_ORIGIN = "origin at the first camera of the sequence"

# (image stamp, camera optical frame) -> camera centre [3] / T_odom_cam [4, 4] in odom_frame (metres), or None
Lookup = Callable[[Any, str], "np.ndarray | None"]


@dataclass(frozen=True)
class GoodPose:
    """The last frame published while the health was ``tracking`` (the anchor of a lost reset)."""

    index: int  # 1-based frame index in its sequence
    stamp: Any
    stamp_s: float
    camera_frame: str
    T_map_cam: np.ndarray  # [4, 4] as published (scale and map offset applied)
    metric: bool  # its translation was in metres (a metric scale was applied)


@dataclass(frozen=True)
class PendingAlignment:
    """A lost reset waiting for the new sequence's first results to place them."""

    good: GoodPose
    T_odom_cam: np.ndarray  # [4, 4] metres, odometry at good.stamp


class DepthCache:
    """The last few sensor depth images [H, W] (uint16 mm or float32 m) by stamp; thread-safe
    (the node's depth callback puts, the inference thread takes the nearest)."""

    def __init__(self, size: int = 8) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[float, np.ndarray]] = []
        self.size = size

    def put(self, stamp_s: float, depth: np.ndarray) -> None:
        with self._lock:
            self._items = (self._items + [(stamp_s, depth)])[-self.size:]

    def nearest(self, stamp_s: float, tolerance: float | None = None) -> np.ndarray | None:
        """The image nearest in time to ``stamp_s`` within ``tolerance`` s (DEPTH_MATCH_S), or None."""
        tol = DEPTH_MATCH_S if tolerance is None else tolerance
        with self._lock:
            items = list(self._items)
        if not items:
            return None
        stamp, depth = min(items, key=lambda item: abs(item[0] - stamp_s))
        return depth if abs(stamp - stamp_s) <= tol else None


def make_scale_source(scale_source: str, metric_scale: float = 1.0, conf_threshold: float = 1.0
                      ) -> FixedScale | OdometryScaleEstimator | DepthScaleEstimator | None:
    """The scale source named ``scale_source`` (None for ``none``)."""
    if scale_source == "fixed":
        return FixedScale(metric_scale)
    if scale_source == "odometry":
        return OdometryScaleEstimator()
    if scale_source == "depth":
        return DepthScaleEstimator(conf_threshold=conf_threshold)
    return None


class MapAnchor:
    """See the module docstring. ``odom_position`` / ``camera_pose``: the look-ups (never waiting);
    the scale source uses the first given (a position from ``camera_pose`` otherwise), the lost-reset
    alignment needs ``camera_pose``."""

    def __init__(self, scale_source: str, metric_scale: float, conf_threshold: float, odom_frame: str,
                 log: Logger, throttle: Throttle, odom_position: Lookup | None = None,
                 camera_pose: Lookup | None = None) -> None:
        self.source_name = scale_source
        self.odom_frame = odom_frame
        self.log, self.throttle = log, throttle
        self.odom_position, self.camera_pose = odom_position, camera_pose
        self.scale_source = make_scale_source(scale_source, metric_scale, conf_threshold)
        self.applied_scale = 1.0
        self.depth_cache = DepthCache()  # scale_source depth: the latest sensor depth images (node fills it)
        self.output = OutputTransform()  # replaced, never mutated (the node's timers read it)
        self.map_alignment = NEW_ORIGIN  # what the map frame is anchored to
        self.note = ""  # said once, in the next frame's status text (``take_note``)
        self._scale_window = 0  # session window index the estimator's samples belong to
        self._anchor: SequenceAnchor | None = None  # this sequence's place in the map (after a lost reset)
        self._output_anchor: SequenceAnchor | None = None  # the anchor ``output`` was made with
        self._last_good: GoodPose | None = None  # kept across lost resets, cleared with the map frame
        self._pending: PendingAlignment | None = None

    # ------------------------------------------------------------------ metric scale
    def update_scale(self, T_map_cam: np.ndarray, frame: InputFrame, r: FrameResult, window: int
                     ) -> tuple[float, bool]:
        """Feed the scale source with a frame (``T_map_cam`` in model units, the session's window
        ``window``); (scale to apply, whether it is ready). The model's position is the camera centre
        in the map frame, the odometry's the camera centre in odom_frame (metres) at the image stamp."""
        src = self.scale_source
        if src is None:
            return 1.0, True
        if window != self._scale_window:
            self._scale_window = window
            src.restart_window()
        if isinstance(src, OdometryScaleEstimator) and (self.odom_position or self.camera_pose) is not None:
            odom = self._odom_position(frame)
            if odom is None:
                self.throttle.emit(self.log.warning, "scale_source odometry: no odom -> camera transform at the "
                                   "image stamp; this frame gives no scale sample", kind="odom missing")
            else:
                src.update(T_map_cam[:3, 3], odom)
        if isinstance(src, DepthScaleEstimator) and r.depth is not None and r.confidence is not None:
            sensor = self.depth_cache.nearest(frame.stamp_s)
            if sensor is None:
                self.throttle.emit(self.log.warning, f"scale_source depth: no depth image within "
                                   f"{1e3 * DEPTH_MATCH_S:.0f} ms of the colour image; no scale sample",
                                   kind="depth missing")
            else:
                try:
                    src.update(r.depth, r.confidence, sensor, frame.rgb.shape[:2])
                except ValueError as exc:
                    self.throttle.emit(self.log.warning, f"depth image unusable for the scale: {exc}",
                                       kind="depth bad")
        value = src.scale
        converged = value is not None and src.converged  # an estimator holds its value while refitting
        if converged and value != self.applied_scale:
            self.log.info(f"metric scale {value:.4f} m per model unit ({src.source}, spread {src.spread:.3f})")
        self.applied_scale = float(value) if converged else 1.0
        self._refresh_output()
        return self.applied_scale, converged

    def _odom_position(self, frame: InputFrame) -> np.ndarray | None:
        """Camera centre [3] in odom_frame (metres) at the frame's stamp, or None."""
        try:
            if self.odom_position is not None:
                return self.odom_position(frame.stamp, frame.camera_frame)
            pose = self.camera_pose(frame.stamp, frame.camera_frame)
            return None if pose is None else np.asarray(pose, dtype=np.float64)[:3, 3]
        except Exception as exc:  # a look-up must never cost the frame
            self.throttle.emit(self.log.warning, f"odometry look-up for the scale failed: {exc}", kind="odom")
            return None

    def status(self) -> tuple[float, bool]:
        """(spread, converged) of the scale source for ~/status: spread -1 when not finite."""
        src = self.scale_source
        if src is None:
            return 0.0, False
        return (float(src.spread) if np.isfinite(src.spread) else -1.0), bool(src.converged)

    # ------------------------------------------------------------------ map frame
    def _refresh_output(self) -> None:
        """``output`` from the applied scale and this sequence's anchor (a new object only on a change)."""
        scale, anchor = self.applied_scale, self._anchor
        if self.output.scale == scale and (anchor is None) == (self.output.offset is None) and (
                anchor is None or self._output_anchor is anchor):
            return
        self.output = OutputTransform(scale, None if anchor is None else anchor.offset(scale))
        self._output_anchor = anchor

    def good(self, index: int, frame: InputFrame, T_out: np.ndarray, ready: bool) -> None:
        """Frame ``index`` went out (as ``T_out``) while the health was ``tracking``."""
        metric = ready and self.source_name != "none"
        self._last_good = GoodPose(index, frame.stamp, frame.stamp_s, frame.camera_frame, T_out, metric)

    def take_note(self) -> str:
        note, self.note = self.note, ""
        return note

    @property
    def aligning(self) -> bool:
        """A lost reset waits for the new sequence's first results (``align``)."""
        return self._pending is not None

    def lost(self) -> tuple[PendingAlignment | None, str]:
        """Tracking was lost: (what the next sequence can continue from, or None and why not)."""
        good = self._last_good
        if good is None:
            return None, "no pose was tracked since the map frame started"
        if self.camera_pose is None:
            return None, "no odometry look-up (odom_frame -> camera TF) is available to the engine"
        odom = self.odom_pose(good.stamp, good.camera_frame)
        if odom is None:
            return None, (f"no TF {self.odom_frame} -> {good.camera_frame} at the last good pose's stamp "
                          f"{good.stamp_s:.3f} s")
        return PendingAlignment(good, odom), ""

    def continue_from(self, pending: PendingAlignment) -> None:
        """The next sequence continues the map from ``pending`` (placed by ``align``)."""
        self._pending = pending

    def align(self, results: list[FrameResult], frames: list[InputFrame]) -> None:
        """Place a sequence started by a lost reset in the map: its first frame with odometry ``a``
        gets ``T_map_cam(good) · inv(T_odom_cam(good)) · T_odom_cam(a)`` (``robot/map_offset.py``)."""
        pending, self._pending = self._pending, None
        good = pending.good
        for r, frame in zip(results, frames):
            odom = self.odom_pose(frame.stamp, frame.camera_frame)
            if odom is None:
                continue
            base = odometry_alignment(good.T_map_cam, pending.T_odom_cam, odom)
            self._anchor = SequenceAnchor(base, optical_pose_to_map(r.c2w))
            self._refresh_output()
            motion = invert_rigid(pending.T_odom_cam) @ odom
            moved = float(np.linalg.norm(motion[:3, 3]))
            turned = float(rotation_angle_deg(np.eye(3), motion[:3, :3]))
            self.map_alignment = (f"continued from frame {good.index} of the previous sequence through odometry "
                                  f"(moved {moved:.3f} m, turned {turned:.1f} deg in between)")
            self.log.info(f"new sequence placed in the map: {self.map_alignment}")
            self.note = "map continued from the last good pose through odometry"
            if not good.metric and moved > 0:
                self.throttle.emit(self.log.warning, f"on_lost=reset alignment: the odometry moved {moved:.3f} m "
                                   "between the last good pose and the new sequence, added in model units (no "
                                   "metric scale was applied: scale_source none or not converged): the new "
                                   "sequence's position is off by the model's scale error times that motion",
                                   kind="align units")
            return
        stamps = ", ".join(f"{f.stamp_s:.3f}" for f in frames)
        why = f"no TF {self.odom_frame} -> {frames[0].camera_frame} at its first frames' stamps ({stamps} s)"
        self.new_origin()
        self.throttle.emit(self.log.warning, f"on_lost=reset: the new sequence starts a NEW map origin (the map "
                           f"frame jumps): {why}", kind="lost origin")
        self.note = f"new map origin after a lost reset: {why}"

    def odom_pose(self, stamp: Any, camera_frame: str) -> np.ndarray | None:
        """``T_odom_cam`` [4, 4] (metres) at ``stamp`` through ``camera_pose``, or None (no look-up,
        not in TF, or not a finite [4, 4] transform)."""
        if self.camera_pose is None:
            return None
        try:
            pose = self.camera_pose(stamp, camera_frame)
        except Exception as exc:  # a look-up must never cost the frame
            self.throttle.emit(self.log.warning, f"odometry look-up for the map alignment failed: {exc}",
                               kind="odom pose")
            return None
        if pose is None:
            return None
        pose = np.asarray(pose, dtype=np.float64)
        return pose if pose.shape == (4, 4) and np.isfinite(pose).all() else None

    def snapshot(self) -> dict[str, Any]:
        """The map frame's anchor as JSON-able values (the keyframe journal keeps it: a resumed node
        publishes in the same map frame after a lost reset). The scale source is not in it."""
        a = self._anchor
        flat = lambda m: [float(x) for x in np.asarray(m, dtype=np.float64).reshape(-1)]  # noqa: E731
        return {"anchor": None if a is None else {"base": flat(a.base), "first": flat(a.first)},
                "map_alignment": self.map_alignment}

    def restore(self, data: dict[str, Any]) -> None:
        """Take a ``snapshot`` back (a resumed sequence sits where the journaled one sat)."""
        a = data.get("anchor")
        mat = lambda v: np.asarray(v, dtype=np.float64).reshape(4, 4)  # noqa: E731
        self._anchor = None if a is None else SequenceAnchor(mat(a["base"]), mat(a["first"]))
        self.map_alignment = str(data.get("map_alignment", NEW_ORIGIN))
        self._refresh_output()

    def new_origin(self) -> None:
        """The map frame restarts at this sequence's first camera (no anchor, no last good pose)."""
        self._anchor = self._last_good = self._pending = None
        self._refresh_output()
        self.map_alignment = NEW_ORIGIN

    def clear(self, keep_map_frame: bool = False) -> None:
        """A new sequence: the scale starts again; ``keep_map_frame`` (a lost reset) keeps the last good
        pose for the next sequence to continue from, otherwise the map frame starts a new origin."""
        if self.scale_source is not None:
            self.scale_source.reset()
        self.applied_scale = 1.0
        self._scale_window = 0
        if keep_map_frame:
            self._anchor = self._pending = None
            self._refresh_output()
        else:
            self.new_origin()


__all__ = ["MapAnchor", "DepthCache", "GoodPose", "PendingAlignment", "make_scale_source", "DEPTH_MATCH_S",
           "NEW_ORIGIN"]
