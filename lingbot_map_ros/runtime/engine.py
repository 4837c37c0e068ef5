"""A camera's inference, free of rclpy: frames and commands in, outputs to a sink.

The engine has no thread of its own: the one inference thread (``scheduler.CameraScheduler``)
calls ``run_once`` (or ``take_batch_frame``/``admit``/``launch``/``complete``), so the engine
owns the camera's ``Session``, the trajectory and the map on that thread; it takes work from
a ``WorkQueue`` (latest frame + commands, in arrival order) and hands every result to a
``Sink`` (the ROS node builds and publishes the messages). ROS
callbacks only call ``submit_frame`` / ``reject_frame`` / ``submit`` and never wait
for inference; service callbacks wait on the returned ``Command`` with a timeout.

Frames: the session's world is the first camera (OpenCV optical axes: x right, y
down, z forward). Everything leaving this module is in the REP-103 map frame
``M = OPTICAL_TO_REP103 · W`` (x forward, y left, z up, origin at the first camera;
see ``conversions``): poses are ``T_map_cam`` of the camera's optical frame, points
are map-frame coordinates. Units are the model's (metre-like, not guaranteed metric).

Failure policy, per frame (the node keeps running and keeps its stored state):
- input that cannot be converted or preprocessed, or whose size differs from the
  sequence's: dropped, ``frames_dropped_invalid`` += 1, throttled warning;
- a non-finite pose from the model: the frame is rolled back from the cache when it
  was stored (so no poisoned K/V stays; for the scale frames this removes them all),
  its outputs are dropped and counted as invalid;
- a non-finite depth/confidence map with a finite pose: its outputs are dropped and
  counted as invalid; the cache keeps the frame (the tokens behind the pose are sound);
- the cache refusing a frame while eviction is deferred (max_pending_evictions reached):
  the frame is dropped (``frames_dropped_error``), the state kept, a warning asks for
  ~/commit_eviction or ~/rollback_last_frame;
- any other exception from the model (e.g. out of memory, or the model's horizon of
  max_frame_num stored frames since reset): logged, the frames it consumed
  count as ``frames_dropped_error``, the session, path and map are reset (a new
  sequence = a new world frame), state ERROR, then INITIALIZING.

Tracking health (``robot/health.py``): every processed frame updates ``TrackingHealth`` with
the valid fraction of its (subsampled) confidence and the model's own pose; a non-finite pose
or depth marks it (``non_finite`` -> lost). Its thresholds are the ``health_*`` settings (read
again when the settings change). Status carries the state and the reasons, each
``FrameOutput`` the 6x6 pose covariance it implies; ``on_lost=reset`` starts a new sequence
when the state becomes lost (counted in ``lost_resets``).

Published map frame across a lost reset (``robot/map_offset.py``): with a ``camera_pose``
look-up (``T_odom_cam`` at an image stamp) the new sequence continues the old map: its first
frame with odometry is placed at the last good pose (the last frame published while the
health was ``tracking``) moved by the odometry between the two stamps, and the rest follow by
the model's relative motion. Every output goes through one ``OutputTransform`` (``output``:
the applied scale and that map offset ``T_map_seq``): pose, TF, ~/frame, clouds, and, in the
node, the path and the map; the saved files too. The path and the map themselves restart
with the new sequence (each sequence has its own model units). Without odometry at those
stamps the new sequence starts a new map origin (warning, status text). ``~/reset``, a time
jump and an inference error always start a new origin.

Metric scale (``robot/scale.py``, parameter ``scale_source``): the trajectory, the map and
the health's motion checks stay in model units; the scale ``s`` (metres per model unit,
``applied_scale``; 1 until the source converged) multiplies what leaves: the frame's
``T_map_cam`` translation (pose, odometry, TF, ~/frame), its points and depth, the path
and the map at publication (node) and both saved files. Frames published before the
scale converged keep model units. Distorted cameras: each frame is undistorted with its
``InputFrame.camera`` before preprocessing (parameter ``undistort``): on the session's device
when that is a GPU (the frame goes there anyway: bytes up, remap, resize and crop there,
``robot/undistort.model_input_torch``), else with numpy on the host.

Intrinsics (``robot/intrinsics.py``): ``focal`` keeps the model's focal lengths of the last
frames in input-image pixels, for /diagnostics to compare with CameraInfo's.
"""
from __future__ import annotations

import enum
import gc
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from ..geometry import optical_pose_to_map, points_to_map, rotation_angle_deg, unproject_pixels
from ..io.map_save import MAP_FILE, TRAJECTORY_FILE, MapSaveError, save_map_pair
from ..io.preprocess import model_input, target_size
from ..robot.health import HealthStatus, TrackingHealth, TrackingState, config_from_parameters
from ..robot.intrinsics import FocalTracker
from ..robot.map_offset import OutputTransform, SequenceAnchor, invert_rigid, odometry_alignment
from ..robot.undistort import CameraModel, Undistorter
from ..robot.scale import DepthScaleEstimator, FixedScale, OdometryScaleEstimator, scale_depth
from ..stream import CacheFullError, FrameMismatchError, FrameResult, InvalidFrameError, Session, SessionError
from .mapping import MapAccumulator, PoseEntry, Trajectory
from .output_worker import OutputWorker
from .params import NodeSettings
from .worker import Command, Counters, RateMeter, Throttle, WorkQueue

WARN_PERIOD = 5.0  # seconds between two warnings of one kind
MAX_RESIZE_ASPECT = 8  # an image is resized to image_width x (at most this many times image_width) before cropping
HEARTBEAT_PERIOD = 1.0  # longest silence of ~/status
CONFIDENCE_SAMPLE = 4  # ~/frame's confidence statistics read every 4th pixel (0.2 ms instead of 1 ms at 518x378)
DEPTH_MATCH_S = 0.05  # scale_source depth: a sensor depth image counts for a colour image within 50 ms


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


@dataclass
class _Hold:
    """A stored frame waiting for a keep/drop decision (keyframe_decision_timeout > 0)."""

    index: int  # 1-based
    deadline: float  # monotonic seconds


@dataclass(frozen=True)
class _GoodPose:
    """The last frame published while the health was ``tracking`` (the anchor of a lost reset)."""

    index: int  # 1-based frame index in its sequence
    stamp: Any
    stamp_s: float
    camera_frame: str
    T_map_cam: np.ndarray  # [4, 4] as published (scale and map offset applied)
    metric: bool  # its translation was in metres (a metric scale was applied)


@dataclass(frozen=True)
class _PendingAlignment:
    """A lost reset waiting for the new sequence's first results to place them."""

    good: _GoodPose
    T_odom_cam: np.ndarray  # [4, 4] metres, odometry at good.stamp


class Sink(Protocol):
    def wants(self, output: str) -> bool:
        """Whether anyone consumes ``output`` ("points" or "depth") right now."""

    def publish_frame(self, out: FrameOutput) -> None: ...
    def publish_clouds(self, out: FrameOutput) -> None: ...  # points and depth of an already published frame
    def publish_path(self, entries: list[PoseEntry]) -> None: ...
    def publish_status(self, status: StatusFields, stamp: Any) -> None: ...
    def publish_frame_info(self, info: FrameSummary, out: FrameOutput) -> None: ...


class SaveError(RuntimeError):
    """~/save_map cannot write what was asked."""


@dataclass
class _Latency:
    preprocess: float = 0.0
    model: float = 0.0
    postprocess: float = 0.0
    publish: float = 0.0


class InferenceEngine:
    """Owns the session and the node's per-sequence memory; runs on one thread."""

    def __init__(self, session: Session, settings: NodeSettings, sink: Sink, log: Logger,
                 now: Callable[[], float], monotonic: Callable[[], float] = time.monotonic,
                 odom_position: Callable[[Any, str], np.ndarray | None] | None = None,
                 camera_pose: Callable[[Any, str], np.ndarray | None] | None = None) -> None:
        """``odom_position`` / ``camera_pose``: (image stamp, camera optical frame) -> the camera
        centre [3] / ``T_odom_cam`` [4, 4] in odom_frame (metres), or None when TF lacks it; never
        waiting. The scale source uses the first given (a position from ``camera_pose`` otherwise),
        the alignment after a lost reset needs ``camera_pose``."""
        self.session = session
        self.settings = settings
        self.sink = sink
        self.log = log
        self.now = now  # ROS time in seconds (image stamps live on this clock)
        self.monotonic = monotonic
        self.queue = WorkQueue()
        self.counters = Counters()
        self.input_rate = RateMeter(clock=monotonic)
        self.output_rate = RateMeter(clock=monotonic)
        self.throttle = Throttle(WARN_PERIOD, clock=monotonic)
        self.trajectory = Trajectory(settings.path_max_length)
        self.map = MapAccumulator(settings.map_voxel_size, settings.map_max_points) \
            if settings.accumulate_map else None
        self.state = State.WAITING_FOR_IMAGES
        self.state_text = "ready, waiting for images"
        self.last_stats = session.stats()
        self.last_intrinsics: tuple[np.ndarray, int, int] | None = None  # K, width, height of the model input
        self._collected: list[InputFrame] = []  # pushed, waiting for their (scale-frame) results
        self._last_stamp: Any = None
        self._last_index = 0  # 1-based index of the last processed frame
        self._warned_thinning = False
        self._behind = False  # on_time_jump=drop: stamps are behind the last processed frame's
        self._client_gone = False  # deferred_eviction_timeout passed: commit at once until a client commits
        self.clock_problem = ""  # set by the node: "no clock: ..." while sim time does not advance
        self._last_status_time = -float("inf")
        self._last_stamp_s: float | None = None  # stamp of the last frame taken for inference (seconds)
        self._pending_since: float | None = None  # monotonic time the oldest deferred eviction started waiting
        self._hold: _Hold | None = None  # decision hold
        self._decided: tuple[int, str] | None = None  # last decided frame (hold mode): (index, how)
        self._last_stored_index = 0  # 1-based index of the newest stored frame still in the cache; 0 = none
        self._keyframe_poses: list[tuple[int, np.ndarray]] = []  # (1-based index, T_map_cam) of stored frames
        # tracking health (robot/health.py): judged once per processed frame on the model's own pose
        self.health = TrackingHealth(config_from_parameters(settings))
        self._health_settings = settings  # the settings the health's thresholds were read from
        self.tracking_reasons: tuple[str, ...] = ()
        self.lost_resets = 0  # sequences restarted by on_lost=reset (cleared by ~/reset)
        # metric scale (robot/scale.py): the trajectory and the map stay in model units; published
        # outputs and saved files are multiplied by ``applied_scale`` (1 until the source converged)
        self.odom_position = odom_position  # (image stamp, camera frame) -> camera centre in odom [3] m, or None
        self.camera_pose = camera_pose  # (image stamp, camera frame) -> T_odom_cam [4, 4] m, or None
        # published map frame (robot/map_offset.py): scale and map offset of what leaves the engine
        self.output = OutputTransform()  # replaced, never mutated (the node's timers read it)
        self._output_anchor: SequenceAnchor | None = None  # the anchor ``output`` was made with
        self.map_alignment = "origin at the first camera of the sequence"  # what the map frame is anchored to
        self._anchor: SequenceAnchor | None = None  # this sequence's place in the map (after a lost reset)
        self._last_good: _GoodPose | None = None  # kept across lost resets, cleared with the map frame
        self._pending_alignment: _PendingAlignment | None = None
        self._status_note = ""  # said once, in the next frame's status text
        self.focal = FocalTracker()  # the model's focal lengths in input pixels (diagnostics)
        self.scale_source = _make_scale_source(settings)
        self.applied_scale = 1.0
        self._scale_window = 0  # session.window_index the estimator's samples belong to
        self.undistorter = Undistorter()  # remap grids cached per CameraInfo
        self.depth_cache = DepthCache()  # scale_source depth: the latest sensor depth images (node fills it)
        self.frames_undistorted = 0
        # clouds, depth images and the map on their own thread (see output_worker.py)
        self.clouds_skipped = 0  # frames whose clouds the output thread dropped (it fell behind)
        self.outputs = OutputWorker(max_pending=2, on_skip=self._clouds_skipped, on_error=self._outputs_failed)

    # ------------------------------------------------------------------ producer side (any thread)
    def submit_frame(self, frame: InputFrame) -> None:
        """Offer a converted frame; a frame still waiting is replaced and counted as stale."""
        self.counters.add("frames_received")
        self.input_rate.tick()
        if self.queue.put_frame(frame) is not None:
            self.counters.add("frames_dropped_stale")

    def reject_frame(self, stamp: Any, reason: str) -> None:
        """Count an image that could not be converted; warn (throttled) and report it in a status."""
        self.counters.add("frames_received")
        self.counters.add("frames_dropped_invalid")
        self.input_rate.tick()
        self.throttle.emit(self.log.warning, f"dropped invalid image: {reason}")
        self.submit("status", lambda: self._publish_status(f"dropped invalid image: {reason}", stamp))

    def submit(self, name: str, fn: Callable[[], Any]) -> Command:
        """Queue ``fn`` to run on the inference thread between frames; wait on the result."""
        return self.queue.put_command(Command(name, fn))

    def heartbeat(self) -> Command:
        """Queue a status publication (state WAITING_FOR_IMAGES when the input went quiet)."""
        return self.submit("heartbeat", self._heartbeat)

    def seconds_since_input(self) -> float | None:
        last = self.input_rate.last()
        return None if last is None else self.monotonic() - last

    # ------------------------------------------------------------------ driven by the scheduler
    def stop(self, timeout: float = 5.0) -> None:
        """Close the queue (pending commands are cancelled) and drain and stop the output thread;
        ``CameraScheduler.stop`` calls it once its inference thread has left."""
        self.queue.close()
        self.outputs.stop(timeout)

    def run_once(self, timeout: float = 0.0) -> bool:
        """Process one queued item; False when nothing came within ``timeout`` seconds.

        While a frame is held for a keep/drop decision only commands are taken (a frame that
        arrives waits in the latest-frame slot) until the decision or its deadline."""
        self._check_hold_deadline()
        hold = self._hold
        if hold is not None:
            timeout = max(0.0, min(timeout, hold.deadline - self.monotonic()))
        item = self.queue.get(timeout, frames=hold is None)
        if item is None:
            self._check_hold_deadline()
            return False
        if isinstance(item, Command):
            item.run()
        else:
            try:
                self._process(item)
            except Exception as exc:  # never let the inference thread die
                self.log.error(f"unexpected error while handling a frame: {type(exc).__name__}: {exc}")
        return True

    # ------------------------------------------------------------------ frames
    def _process(self, frame: InputFrame) -> None:
        image = self._admit(frame)
        if image is None:
            return
        try:
            results = self.session.push(image)
        except Exception as exc:
            return self._push_failed(frame, exc)
        self._pushed(frame, results)

    # the two halves of ``_process`` around the session's step, so that a scheduler can run
    # several cameras' steps together (``CameraScheduler(batch=...)``: ``take_batch_frame``,
    # ``admit``, the batched submit, then ``complete`` with each camera's outcome) or overlap
    # one camera's step with the next camera's (``pipeline=True``: ``launch`` for the submit)
    def take_batch_frame(self) -> InputFrame | None:
        """The waiting frame, taken, when this camera's next item is a frame that may run now
        (no keep/drop decision held, no command queued); else None and nothing is taken."""
        self._check_hold_deadline()
        if self._hold is not None:
            return None
        return self.queue.take_frame()

    def admit(self, frame: InputFrame) -> Any | None:
        """The checks and preprocessing of ``frame`` before its step: the image to submit, or
        None when the frame was dropped (too old, a stamp out of order, an invalid image: each
        counted and reported as for a frame run alone)."""
        try:
            return self._admit(frame)
        except Exception as exc:  # never let the inference thread die
            self.log.error(f"unexpected error while handling a frame: {type(exc).__name__}: {exc}")
            return None

    def launch(self, image: Any) -> Any:
        """Submit an admitted frame's step without waiting for it (pipelined steps,
        ``CameraScheduler(pipeline=True)``): its pending results, or the exception the submit
        raised, for ``complete``."""
        try:
            return self.session.submit(image)
        except Exception as exc:  # as push would raise it: complete() reports it
            return exc

    def complete(self, frame: InputFrame, outcome: Any) -> None:
        """Handle the outcome of ``frame``'s step (its pending results, or the exception its
        submit raised) as ``_process`` handles a push's."""
        try:
            if isinstance(outcome, Exception):
                return self._push_failed(frame, outcome)
            try:
                results = outcome.result()
            except Exception as exc:
                return self._push_failed(frame, exc)
            self._pushed(frame, results)
        except Exception as exc:  # never let the inference thread die
            self.log.error(f"unexpected error while handling a frame: {type(exc).__name__}: {exc}")

    def _admit(self, frame: InputFrame) -> Any | None:
        s = self.settings
        if s.max_frame_age > 0 and self.now() - frame.stamp_s > s.max_frame_age:
            self.counters.add("frames_dropped_stale")
            self.throttle.emit(self.log.warning, f"dropped a frame older than max_frame_age={s.max_frame_age} s "
                                                 f"(age {self.now() - frame.stamp_s:.2f} s)", kind="too old")
            return None
        if not self._stamp_ok(frame):
            return None
        self._check_deferral_deadline()
        t0 = time.perf_counter()
        try:
            image = self._model_image(frame)
        except ValueError as exc:
            self._drop_invalid(frame.stamp, str(exc))
            return None
        try:
            self.session.check_frame(image)
        except InvalidFrameError as exc:  # layout, size, too few patches, another resolution than the sequence's
            self._drop_invalid(frame.stamp, f"image {frame.rgb.shape[1]}x{frame.rgb.shape[0]}: {exc}")
            return None
        frame.preprocess_ms = frame.convert_ms + (time.perf_counter() - t0) * 1e3
        self._last_stamp, self._last_stamp_s = frame.stamp, frame.stamp_s
        self._collected.append(frame)
        return image

    def _push_failed(self, frame: InputFrame, exc: Exception) -> None:
        if isinstance(exc, CacheFullError):
            stats = self.session.stats()
            if self.session.deferred_eviction and stats is not None and stats.pending_evictions > 0:
                return self._drop_while_deferred(frame, exc)  # the caller's deferral filled the cache
        return self._on_inference_error(exc)  # e.g. the model's horizon: a new sequence starts

    def _pushed(self, frame: InputFrame, results: list[FrameResult]) -> None:
        if not results:
            n, total = len(self._collected), self.session.cfg.num_scale_frames
            self._set_state(State.INITIALIZING, f"collecting scale frames {n}/{total}")
            self._publish_status(self.state_text, frame.stamp, frame_index=self.session.frames_pushed + n)
            return
        frames, self._collected = self._collected[:len(results)], self._collected[len(results):]
        self._handle_results(results, frames)
        self._note_pending()
        _freeze_long_lived_objects()

    def _model_image(self, frame: InputFrame) -> Any:
        """What to push for ``frame``: uint8 [H, W, 3] when it is already the model's size, float32
        [3, H', W'] otherwise, on the host; undistorted first when its camera is distorted (the
        model assumes a pinhole camera), on the session's device when that is a GPU (a float
        tensor there). Raises ValueError with the reason to report (camera_info of another size,
        an image too tall to resize)."""
        s = self.settings
        camera = frame.camera if s.undistort and frame.camera is not None and frame.camera.distorted else None
        if camera is not None:
            camera.check_image(*frame.rgb.shape[:2])  # "CameraInfo is WxH (WxH) but the image is ..."
        try:
            _check_resize(frame.rgb.shape, s.image_width)
            if camera is None:
                return model_input(frame.rgb, s.image_width)  # uint8 as it came when no resize is needed
            device = self.undistort_device()
            if device is not None:
                image = self.undistorter.model_input_torch(frame.rgb, camera, s.image_width, device)
            else:
                image = model_input(self.undistorter.undistort(frame.rgb, camera), s.image_width)
        except ValueError as exc:
            raise ValueError(f"cannot preprocess the image: {exc}") from None
        self.frames_undistorted += 1
        return image

    def undistort_device(self) -> Any:
        """The session's device when undistortion should run there (not the CPU), else None."""
        device = getattr(self.session, "device", None)
        return device if device is not None and getattr(device, "type", "cpu") != "cpu" else None

    def _handle_results(self, results: list[FrameResult], frames: list[InputFrame]) -> None:
        stored = results[0].is_keyframe
        bad = [r.frame_index + 1 for r in results if not np.isfinite(r.c2w).all()]
        if bad:
            note = "kept out of the cache"
            if stored:
                try:
                    self.session.rollback_last_frame(results[-1].frame_index)
                    note = "rolled back from the cache"
                    self._forget_keyframes_from(results[0].frame_index + 1)
                except SessionError as exc:
                    note = f"could not be rolled back ({exc})"
            dropped = len(results) if stored else len(bad)
            self.counters.add("frames_dropped_invalid", dropped)
            self.throttle.emit(self.log.warning, f"non-finite pose from the model for frame(s) {bad}: "
                               f"{dropped} frame(s) dropped and {note}", kind="non-finite pose")
            self._judge_health(None, None, finite=False)
            self._publish_status(f"dropped frame(s) {bad}: non-finite pose", frames[-1].stamp)
            self._reset_if_lost(frames[-1].stamp)
            return
        if self._pending_alignment is not None:
            self._align_sequence(results, frames)
        if stored and self.map is not None:
            first, acc = results[0].frame_index, self.map
            self.outputs.op(lambda: acc.protect_from(first))
        # hold a single stored frame (not the scale frames, not a restart's re-fed batch) for a decision
        hold = self.settings.keyframe_decision_timeout > 0 and stored and len(results) == 1
        published = False
        for r, frame in zip(results, frames):
            published |= self._publish_result(r, frame, hold)
        if hold and published:
            self._hold = _Hold(results[0].frame_index + 1, self.monotonic() + self.settings.keyframe_decision_timeout)
            self._decided = None
        if published and self.settings.publish_path:
            self.sink.publish_path(self.trajectory.entries())
        self.last_stats = self.session.stats()
        self._reset_if_lost(frames[-1].stamp)

    def _publish_result(self, r: FrameResult, frame: InputFrame, hold: bool = False) -> bool:
        t0 = time.perf_counter()
        if r.depth is not None and not (np.isfinite(r.depth).all() and np.isfinite(r.confidence).all()):
            self.counters.add("frames_dropped_invalid")
            self.throttle.emit(self.log.warning, f"non-finite depth from the model for frame {r.frame_index + 1}: "
                               "outputs dropped (the frame stays in the cache)", kind="non-finite depth")
            self._judge_health(None, None, finite=False)
            self._publish_status("dropped: non-finite depth", frame.stamp, frame_index=r.frame_index + 1)
            return False
        T_map_cam = optical_pose_to_map(r.c2w)
        need_points = r.depth is not None and (self.map is not None or self.sink.wants("points"))
        need_depth = r.depth is not None and self.sink.wants("depth")
        h, w = r.size
        self.last_intrinsics = (r.intrinsics, w, h)
        index = r.frame_index + 1
        self.trajectory.append(PoseEntry(r.frame_index, frame.stamp, frame.stamp_s, T_map_cam))
        self.focal.add(r.intrinsics, (w, h), (frame.rgb.shape[1], frame.rgb.shape[0]))
        conf_stats = _ConfidenceSample(r.confidence, self.settings.conf_threshold)
        self._judge_health(conf_stats.valid, r.c2w)
        scale, ready = self._update_scale(T_map_cam, frame, r)
        transform = self.output  # scale and map offset of this frame's outputs
        T_out = transform.pose(T_map_cam)
        if self.health.state == TrackingState.TRACKING:
            metric = ready and self.settings.scale_source != "none"
            self._last_good = _GoodPose(index, frame.stamp, frame.stamp_s, frame.camera_frame, T_out, metric)
        t1 = time.perf_counter()
        pose = FrameOutput(index, frame.stamp, frame.stamp_s, frame.camera_frame, r.is_keyframe, T_out,
                           r.intrinsics, None, None, None, None,
                           covariance=self.health.covariance(scale).ravel(), scale=scale, scale_ready=ready)
        self.sink.publish_frame(pose)
        self._publish_frame_summary(r, pose, hold, conf_stats)
        t2 = time.perf_counter()
        if need_points or need_depth:
            self.outputs.frame_job(lambda: self._publish_clouds(r, pose, need_points, need_depth, transform))
        self.counters.add("frames_processed")
        self.output_rate.tick()
        self._last_index = index
        self._set_state(State.TRACKING, "tracking")
        latency = _Latency(preprocess=frame.preprocess_ms, model=r.timings.get("model_ms", 0.0),
                           postprocess=r.timings.get("postprocess_ms", 0.0) + (t1 - t0) * 1e3,
                           publish=(t2 - t1) * 1e3)
        note, self._status_note = self._status_note, ""
        self._publish_status(self.state_text + (f"; {note}" if note else ""), frame.stamp, frame_index=index,
                             is_keyframe=r.is_keyframe, latency=latency, stamp_s=frame.stamp_s)
        self.log.debug(f"frame {index}{' (keyframe)' if r.is_keyframe else ''}: preprocess {latency.preprocess:.1f} "
                       f"ms, model {latency.model:.1f} ms, postprocess {latency.postprocess:.1f} ms, publish "
                       f"{latency.publish:.1f} ms")
        return True

    def _publish_frame_summary(self, r: FrameResult, pose: FrameOutput, hold: bool,
                               conf_stats: "_ConfidenceSample | None" = None) -> None:
        """~/frame: what a keyframe client needs about this frame (see msg/FrameInfo.msg); also notes
        a stored frame's pose as the reference of the next frames' motion."""
        index = r.frame_index + 1
        ref = self._keyframe_poses[-1][1] if self._keyframe_poses else None
        if r.is_keyframe:
            self._last_stored_index = index
            self._keyframe_poses = self._keyframe_poses[-7:] + [(index, pose.T_map_cam)]
        if not self.sink.wants("frame"):
            return
        translation = rotation = 0.0
        if ref is not None:
            translation = float(np.linalg.norm(pose.T_map_cam[:3, 3] - ref[:3, 3]))
            rotation = float(rotation_angle_deg(ref[:3, :3], pose.T_map_cam[:3, :3]))
        mean, median, valid = conf_stats.summary() if conf_stats is not None else (0.0, 0.0, 0.0)
        stats = self.session.stats()
        self.sink.publish_frame_info(FrameSummary(
            frame_index=index, window_index=self.session.window_index, stored=r.is_keyframe,
            is_keyframe=r.is_keyframe, decision_pending=hold,
            pending_eviction_pages=stats.pending_evictions if stats is not None else 0,
            confidence_mean=mean, confidence_median=median, valid_fraction=valid,
            translation_since_keyframe=translation, rotation_since_keyframe_deg=rotation,
            latency_ms=max(0.0, (self.now() - pose.stamp_s) * 1e3)), pose)

    def _update_scale(self, T_map_cam: np.ndarray, frame: InputFrame, r: FrameResult) -> tuple[float, bool]:
        """Feed the scale source with this frame; (scale to apply, whether it is ready). The model's
        position is the camera centre in the map frame (model units), the odometry's the camera
        centre in odom_frame (metres) at the image stamp."""
        src = self.scale_source
        if src is None:
            return 1.0, True
        window = self.session.window_index
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

    def _odom_pose(self, stamp: Any, camera_frame: str) -> np.ndarray | None:
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

    def _refresh_output(self) -> None:
        """``output`` from the applied scale and this sequence's anchor (a new object only on a change)."""
        scale, anchor = self.applied_scale, self._anchor
        if self.output.scale == scale and (anchor is None) == (self.output.offset is None) and (
                anchor is None or self._output_anchor is anchor):
            return
        self.output = OutputTransform(scale, None if anchor is None else anchor.offset(scale))
        self._output_anchor = anchor
    def _judge_health(self, valid_fraction: float | None, c2w: np.ndarray | None, finite: bool = True) -> HealthStatus:
        """Update the tracking health with one frame (``c2w`` [4, 4] in model units, OpenCV world)."""
        if self.settings is not self._health_settings:  # the node replaced them (a parameter set)
            self._health_settings = self.settings
            config = config_from_parameters(self.settings)  # checked when the settings were made
            if config != self.health.config:
                self.health.reconfigure(config)
        status = self.health.update(valid_fraction, c2w, finite=finite)
        self.tracking_reasons = status.reasons
        if status.changed:
            text = f"tracking {status.state.value}" + (f" ({', '.join(status.reasons)})" if status.reasons else "")
            if status.state in (TrackingState.DEGRADED, TrackingState.LOST):  # rclpy: one severity per call site
                self.log.warning(text)
            else:
                self.log.info(text)
        return status

    def _reset_if_lost(self, stamp: Any) -> None:
        """on_lost=reset: a lost track starts a new sequence (logged, counted in lost_resets), placed
        in the same map frame through odometry when it can be (see ``_align_sequence``)."""
        if self.settings.on_lost != "reset" or self.health.state != TrackingState.LOST:
            return
        reasons = ", ".join(self.tracking_reasons) or "lost"
        self.lost_resets += 1
        good, why = self._last_good, ""
        odom = None
        if good is None:
            why = "no pose was tracked since the map frame started"
        elif self.camera_pose is None:
            why = "no odometry look-up (odom_frame -> camera TF) is available to the engine"
        else:
            odom = self._odom_pose(good.stamp, good.camera_frame)
            if odom is None:
                why = (f"no TF {self.settings.odom_frame} -> {good.camera_frame} at the last good pose's stamp "
                       f"{good.stamp_s:.3f} s")
        self._clear_sequence(keep_map_frame=True)
        if odom is not None:
            self._pending_alignment = _PendingAlignment(good, odom)
            self.log.warning(f"tracking lost ({reasons}): on_lost=reset, starting a new sequence; it continues the "
                             f"map from the last good pose (frame {good.index}) through odometry")
            text = f"tracking lost ({reasons}): new sequence, aligned to the last good pose through odometry"
        else:
            self._new_map_origin()
            self.throttle.emit(self.log.warning, f"tracking lost ({reasons}): on_lost=reset starts a new sequence at "
                               f"a NEW map origin (the map frame jumps): {why}", kind="lost origin")
            text = f"tracking lost ({reasons}): new sequence at a new map origin ({why})"
        self._set_state(State.INITIALIZING, text)
        self._publish_status(self.state_text, stamp)

    def _align_sequence(self, results: list[FrameResult], frames: list[InputFrame]) -> None:
        """Place a sequence started by a lost reset in the map: its first frame with odometry ``a``
        gets ``T_map_cam(good) · inv(T_odom_cam(good)) · T_odom_cam(a)`` (``robot/map_offset.py``)."""
        pending, self._pending_alignment = self._pending_alignment, None
        good = pending.good
        for r, frame in zip(results, frames):
            odom = self._odom_pose(frame.stamp, frame.camera_frame)
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
            self._status_note = "map continued from the last good pose through odometry"
            if not good.metric and moved > 0:
                self.throttle.emit(self.log.warning, f"on_lost=reset alignment: the odometry moved {moved:.3f} m "
                                   "between the last good pose and the new sequence, added in model units (no "
                                   "metric scale was applied: scale_source none or not converged): the new "
                                   "sequence's position is off by the model's scale error times that motion",
                                   kind="align units")
            return
        stamps = ", ".join(f"{f.stamp_s:.3f}" for f in frames)
        why = f"no TF {self.settings.odom_frame} -> {frames[0].camera_frame} at its first frames' stamps ({stamps} s)"
        self._new_map_origin()
        self.throttle.emit(self.log.warning, f"on_lost=reset: the new sequence starts a NEW map origin (the map "
                           f"frame jumps): {why}", kind="lost origin")
        self._status_note = f"new map origin after a lost reset: {why}"

    def _new_map_origin(self) -> None:
        """The map frame restarts at this sequence's first camera (no anchor, no last good pose)."""
        self._anchor = self._last_good = self._pending_alignment = None
        self._refresh_output()
        self.map_alignment = "origin at the first camera of the sequence"

    def _forget_keyframes_from(self, index: int) -> None:
        """Frames from 1-based ``index`` on left the cache: they are no motion reference any more."""
        self._keyframe_poses = [(i, T) for i, T in self._keyframe_poses if i < index]
        if self._last_stored_index >= index:
            self._last_stored_index = 0

    def _publish_clouds(self, r: FrameResult, pose: FrameOutput, need_points: bool, need_depth: bool,
                        transform: OutputTransform | None = None) -> None:
        """Output thread: the frame's point cloud (~/points, map) and depth image; ``transform`` = the
        frame's scale and map offset (the map keeps the sequence's own frame and units)."""
        s = self.settings
        points = colors = conf = depth = None
        if need_points:
            # the viewer's selection (confidence > threshold, then every stride-th), unprojected
            # for the selected pixels only: select_points(unproject_depth(...)) at ~1/stride the work
            index = np.flatnonzero(r.confidence.reshape(-1) > s.conf_threshold)[::s.point_stride]
            pts = unproject_pixels(r.depth, r.intrinsics, r.c2w, index)  # OpenCV world
            colors = r.colors(index)
            points = points_to_map(pts.astype(np.float32))
            conf = r.confidence.reshape(-1)[index].astype(np.float32)
            if self.map is not None:
                self.map.add(r.frame_index, points, colors)  # model units (transformed at publication and save)
                self._warn_if_thinned()
            points = (transform or OutputTransform(pose.scale)).points(points)
        if need_depth:
            depth = np.where(r.depth > 0, r.depth, np.nan).astype(np.float32)
            if pose.scale != 1.0:
                depth = scale_depth(depth, pose.scale).astype(np.float32)
        self.sink.publish_clouds(replace(pose, depth=depth, points=points, colors=colors, confidence=conf))

    def _clouds_skipped(self) -> None:
        self.clouds_skipped += 1
        self.throttle.emit(self.log.warning, "point cloud / depth outputs of a frame skipped: the output thread "
                                             "falls behind (raise point_stride or map_voxel_size)", kind="clouds")

    def _outputs_failed(self, exc: Exception) -> None:
        self.log.error(f"unexpected error while publishing clouds: {type(exc).__name__}: {exc}")

    def _warn_if_thinned(self) -> None:
        if self.map is not None and self.map.thinned and not self._warned_thinning:
            self._warned_thinning = True
            self.log.warning(f"the map reached map_max_points={self.settings.map_max_points}: its older part is "
                             "thinned uniformly; raise map_voxel_size or map_max_points for a denser map")

    def _drop_invalid(self, stamp: Any, reason: str) -> None:
        self.counters.add("frames_dropped_invalid")
        self.throttle.emit(self.log.warning, f"dropped invalid image: {reason}")
        self._publish_status(f"dropped invalid image: {reason}", stamp)

    def _drop_while_deferred(self, frame: InputFrame, exc: Exception) -> None:
        """The cache refused to store a frame because eviction is deferred: drop it, keep the state."""
        self._collected.remove(frame)
        self.counters.add("frames_dropped_error")
        text = f"frame dropped, cache full while eviction is deferred: {exc}"
        self.throttle.emit(self.log.warning, text + "; call ~/commit_eviction or ~/rollback_last_frame",
                           kind="deferred full")
        self._publish_status(text, frame.stamp)

    def _on_inference_error(self, exc: Exception) -> None:
        lost = len(self._collected)
        self.counters.add("frames_dropped_error", lost)
        text = f"inference failed: {type(exc).__name__}: {exc}"
        self.log.error(f"{text}; {lost} frame(s) lost, resetting the session (a new sequence starts)")
        stamp = self._collected[-1].stamp if self._collected else self._last_stamp
        self._set_state(State.ERROR, text)
        self._publish_status(text, stamp)
        try:
            self._clear_sequence()
            _release_device_memory(self.session)
        except Exception as reset_exc:
            self._set_state(State.ERROR, f"{text}; reset failed: {type(reset_exc).__name__}: {reset_exc}")
            self.log.error(self.state_text)
            self._publish_status(self.state_text, stamp)
            return
        self._set_state(State.INITIALIZING, f"recovered from: {text}; waiting for scale frames")
        self._publish_status(self.state_text, stamp)

    def _clear_sequence(self, keep_map_frame: bool = False) -> None:
        """Forget the sequence (cache, path, map, health, scale). ``keep_map_frame``: a lost reset,
        whose next sequence may continue the map frame (the last good pose stays); otherwise the
        next sequence starts a new map origin."""
        self.session.reset()
        self._collected.clear()
        self._last_index = 0
        self.trajectory.clear()
        if self.map is not None:
            self.outputs.op(self.map.clear)
        if self.settings.publish_path:
            self.sink.publish_path([])
        self.last_stats = self.session.stats()
        self._hold = self._decided = self._pending_since = None
        self._last_stored_index = 0
        self._keyframe_poses = []
        self.health.reset()
        self.tracking_reasons = ()
        if self.scale_source is not None:
            self.scale_source.reset()
        self.applied_scale = 1.0
        self._scale_window = 0
        self.focal.clear()
        if keep_map_frame:
            self._anchor = self._pending_alignment = None
            self._refresh_output()
        else:
            self._new_map_origin()

    # ------------------------------------------------------------------ commands (inference thread)
    def reset(self) -> str:
        """Empty the cache, path, map and counters; the next image starts a new sequence."""
        self._set_state(State.RESETTING, "resetting")
        self._publish_status(self.state_text, self._last_stamp)
        self._clear_sequence()
        self.counters.reset()
        self.lost_resets = 0
        self.input_rate.clear()
        self.output_rate.clear()
        self._last_stamp = self._last_stamp_s = None
        self._behind = False
        self._set_state(State.WAITING_FOR_IMAGES, "reset; waiting for images")
        self._publish_status(self.state_text, None)
        return "cache, path, map and counters cleared; the next image starts a new sequence"

    def set_deferred_eviction(self, enabled: bool) -> str:
        self.session.set_deferred_eviction(enabled)
        self.settings = replace(self.settings, deferred_eviction=enabled)
        self._client_gone = False
        self.last_stats = self.session.stats()
        self._note_pending()
        self._publish_status(self.state_text, self._last_stamp)
        pending = self.last_stats.pending_evictions if self.last_stats else 0
        return f"deferred eviction {'on' if enabled else 'off'} ({pending} eviction(s) pending)"

    def commit_eviction(self, expected_frame_index: int = 0) -> int:
        """Run the deferred evictions: the client keeps the latest stored frame (1-based
        ``expected_frame_index``; 0 = whichever it is). With a decision hold this is the "keep"
        decision about the held frame. Returns the pages freed; raises SessionError (nothing
        changed) when the index names another frame or one already decided."""
        held = self._check_decision(expected_frame_index, commit=True)
        freed = self.session.commit_eviction()
        self._client_gone = False
        if held is not None:
            self._decide(held, "kept")
        self.last_stats = self.session.stats()
        self._note_pending()
        self._publish_status(self.state_text, self._last_stamp)
        return freed

    def rollback(self, expected_frame_index: int) -> int:
        """Undo the last stored frame (1-based ``expected_frame_index``; 0 = the latest).

        Removes its tokens from the cache and, with it, the points and poses of every frame
        the session forgot. With a decision hold this is the "drop" decision about the held
        frame. Returns its 1-based index; raises SessionError (nothing changed).
        """
        held = self._check_decision(expected_frame_index)
        index = self._rollback_stored(held if held is not None else expected_frame_index)
        self._client_gone = False
        if held is not None:
            self._decide(held, "dropped")
        self._publish_status(f"rolled back frame {index}", self._last_stamp, frame_index=self._last_index)
        return index

    def _rollback_stored(self, expected_frame_index: int) -> int:
        expected = None if expected_frame_index == 0 else expected_frame_index - 1
        try:
            index = self.session.rollback_last_frame(expected)
        except FrameMismatchError as exc:  # the session counts from 0, the node's interface from 1
            raise SessionError(f"the last stored frame is {exc.last_stored + 1}, not {exc.expected + 1}") from None
        forgotten_from = self.session.frames_pushed
        removed = self.trajectory.remove_from(forgotten_from)
        if self.map is not None:
            acc = self.map

            def forget() -> None:
                acc.remove_from(forgotten_from)
                acc.protect_from(forgotten_from)

            self.outputs.op(forget)
        self._forget_keyframes_from(index + 1)
        self._last_index = min(self._last_index, forgotten_from)
        self.last_stats = self.session.stats()
        self._note_pending()
        if self.settings.publish_path and removed:
            self.sink.publish_path(self.trajectory.entries())
        return index + 1

    # ------------------------------------------------------------------ keyframe decisions
    def _check_decision(self, expected: int, commit: bool = False) -> int | None:
        """The held frame a decision is about (None without a hold); SessionError when ``expected``
        (1-based, 0 = the latest) names another frame or a frame already decided (a rollback's index
        is checked by the session)."""
        hold = self._hold
        if hold is not None:
            if expected not in (0, hold.index):
                self.counters.add("decisions_refused")
                raise SessionError(f"frame {expected} is not the frame waiting for a decision ({hold.index}); "
                                   "nothing changed")
            return hold.index
        if self._decided is not None and expected == self._decided[0]:
            self.counters.add("decisions_refused")
            raise SessionError(f"frame {expected} was already decided ({self._decided[1]}); nothing changed")
        if commit and expected not in (0, self._last_stored_index):
            if self.settings.keyframe_decision_timeout > 0:
                self.counters.add("decisions_refused")
            latest = self._last_stored_index or "none (nothing stored since the last reset or rollback)"
            raise SessionError(f"the last stored frame is {latest}, not {expected}; nothing changed")
        return None

    def _decide(self, index: int, how: str) -> None:
        self._hold = None
        self._decided = (index, how)
        self.counters.add({"kept": "decisions_kept", "dropped": "decisions_dropped"}.get(how, "decisions_timed_out"))

    def _check_hold_deadline(self) -> None:
        """Apply keyframe_decision_default to a held frame whose decision did not come in time."""
        hold = self._hold
        if hold is None or self.monotonic() < hold.deadline:
            return
        default = self.settings.keyframe_decision_default
        try:
            if default == "drop":
                self._rollback_stored(hold.index)
            else:
                self.session.commit_eviction()
                self._note_pending()
            note = ""
        except SessionError as exc:
            note = f" (could not be applied: {exc})"
        self._decide(hold.index, f"{default} by timeout")
        self.throttle.emit(self.log.warning, f"no decision about frame {hold.index} within keyframe_decision_timeout="
                           f"{self.settings.keyframe_decision_timeout} s: applied keyframe_decision_default={default}"
                           f"{note}", kind="decision timeout")
        self.last_stats = self.session.stats()
        self._publish_status(f"frame {hold.index}: {default} by timeout", self._last_stamp,
                             frame_index=self._last_index)

    # ------------------------------------------------------------------ deferral deadline, stamps
    def _note_pending(self) -> None:
        """Start (or stop) the clock of deferred_eviction_timeout from the session's pending evictions."""
        stats = self.session.stats()
        if stats is not None and stats.pending_evictions > 0:
            if self._pending_since is None:
                self._pending_since = self.monotonic()
        else:
            self._pending_since = None

    def _check_deferral_deadline(self) -> None:
        """Commit deferred evictions that waited longer than deferred_eviction_timeout: a keyframe
        client that died must not blind the robot (the cache would fill and refuse every frame)."""
        timeout = self.settings.deferred_eviction_timeout
        since = self._pending_since
        if timeout <= 0 or since is None or not (self._client_gone or self.monotonic() - since >= timeout):
            return
        freed = self.session.commit_eviction()
        self._pending_since = None
        self._client_gone = True  # until the client commits, rolls back or sets the deferral again
        self.counters.add("evictions_auto_committed")
        self.last_stats = self.session.stats()
        self.throttle.emit(self.log.warning, f"a deferred eviction waited more than deferred_eviction_timeout="
                           f"{timeout} s for ~/commit_eviction: committed automatically ({freed} page(s) freed); "
                           "later ones are committed at once until a client commits again", kind="auto commit")

    def _stamp_ok(self, frame: InputFrame) -> bool:
        """Refuse zero, repeated and backwards stamps (the trajectory stays monotonic); a stamp more than
        time_jump_threshold before the last one is a time jump: on_time_jump=reset starts a new sequence."""
        s, last = self.settings, self._last_stamp_s
        if frame.stamp_s == 0.0:  # processed once (a later zero stamp is a repeat), never silently
            self.throttle.emit(self.log.warning, "image with a zero stamp: its driver does not stamp images (TF, "
                               "latency and the trajectory need the capture time; repeats are dropped)",
                               kind="zero stamp")
        if last is None or frame.stamp_s > last:
            self._behind = False
            return True
        if frame.stamp_s == last:
            return self._drop_stamp(frame, f"dropped an image with the same stamp as the previous frame "
                                           f"({frame.stamp_s:.9f} s): a duplicate", "repeated stamp")
        back = last - frame.stamp_s
        if back <= s.time_jump_threshold:
            return self._drop_stamp(frame, f"dropped an image {1e3 * back:.1f} ms older than the previous frame "
                                           "(out of order; the trajectory stays monotonic)", "older stamp")
        if not self._behind:
            self.counters.add("time_jumps")
        if s.on_time_jump == "drop":
            self._behind = True
            return self._drop_stamp(frame, f"time jump: image stamp {frame.stamp_s:.3f} s is {back:.3f} s before the "
                                           f"previous frame's; on_time_jump=drop: dropping frames until the stamps "
                                           f"pass {last:.3f} s (or call ~/reset)", "time jump drop")
        self.log.warning(f"time jump: image stamp {frame.stamp_s:.3f} s is {back:.3f} s before the previous frame's "
                         f"(more than time_jump_threshold={s.time_jump_threshold} s): on_time_jump=reset, starting a "
                         "new sequence")
        self._clear_sequence()
        self._behind = False
        self._set_state(State.INITIALIZING, "time jump: new sequence")
        return True

    def _drop_stamp(self, frame: InputFrame, reason: str, kind: str) -> bool:
        self.counters.add("frames_dropped_stamp")
        self.throttle.emit(self.log.warning, reason, kind=kind)
        self._publish_status(reason, frame.stamp)
        return False

    def save_snapshot(self) -> "SaveSnapshot":
        """Inference thread (fast): the trajectory as it is now, and the map once the output thread
        has added the clouds of every frame up to now (a snapshot queued behind them). The files are
        written by ``write_map_files`` on the caller's thread: a slow disk never holds up inference."""
        if self.map is None:
            raise SaveError("the map is not accumulated (accumulate_map is false); nothing to save")
        snapshot = Command("map snapshot", self.map.snapshot)
        self.outputs.op(snapshot.run)
        out = self.output
        return SaveSnapshot(self.trajectory.stamps(), self.trajectory.poses(), snapshot, out.scale, out.offset)

    def save_map(self, directory: str) -> tuple[Path, Path]:
        """``save_snapshot`` + ``write_map_files`` in one call (in-process use and tests)."""
        return write_map_files(self.save_snapshot(), directory, self.settings.output_directory,
                               self.settings.service_timeout)

    # ------------------------------------------------------------------ status
    def _heartbeat(self) -> None:
        """Publish a status when none went out for HEARTBEAT_PERIOD (or the input went quiet)."""
        self._check_hold_deadline()
        self._check_deferral_deadline()
        quiet = self.seconds_since_input()
        changed = False
        if self.state not in (State.ERROR, State.RESETTING) and not self.queue.pending_frame() and (
                quiet is None or quiet > self.settings.input_timeout):
            waited = "no image received yet" if quiet is None else f"no image for {quiet:.1f} s"
            changed = self.state != State.WAITING_FOR_IMAGES
            self._set_state(State.WAITING_FOR_IMAGES, waited)
        if changed or self.monotonic() - self._last_status_time >= HEARTBEAT_PERIOD:
            clock = self.clock_problem
            self._publish_status(self.state_text + (f"; {clock}" if clock else ""), self._last_stamp)

    def _set_state(self, state: State, text: str) -> None:
        self.state, self.state_text = state, text

    def _publish_status(self, text: str, stamp: Any, frame_index: int | None = None, is_keyframe: bool = False,
                        latency: _Latency | None = None, stamp_s: float | None = None) -> None:
        stats = self.session.stats()
        c = self.counters.snapshot()
        st = StatusFields(state=int(self.state), state_text=text,
                          frame_index=self._last_index if frame_index is None else frame_index,
                          window_index=self.session.window_index,
                          is_keyframe=is_keyframe, deferred_eviction=bool(self.session.deferred_eviction),
                          frames_received=c.frames_received, frames_processed=c.frames_processed,
                          frames_dropped_stale=c.frames_dropped_stale,
                          frames_dropped_invalid=c.frames_dropped_invalid,
                          frames_dropped_error=c.frames_dropped_error,
                          frames_dropped_stamp=c.frames_dropped_stamp, time_jumps=c.time_jumps,
                          evictions_auto_committed=c.evictions_auto_committed,
                          decision_pending=self._hold is not None, decisions_kept=c.decisions_kept,
                          decisions_dropped=c.decisions_dropped, decisions_timed_out=c.decisions_timed_out,
                          decisions_refused=c.decisions_refused, tracking_state=self.health.state.value,
                          tracking_reasons=",".join(self.tracking_reasons), lost_resets=self.lost_resets,
                          scale=self.applied_scale, scale_source=self.settings.scale_source)
        if self.scale_source is not None:
            st.scale_spread = float(self.scale_source.spread) if np.isfinite(self.scale_source.spread) else -1.0
            st.scale_converged = bool(self.scale_source.converged)
        if stats is not None:
            st.pending_evictions, st.stored_frames = stats.pending_evictions, stats.resident_frames
            st.temporal_index, st.scale_pages = stats.temporal_index, stats.scale_pages
            st.window_pages, st.free_pages = stats.window_pages, stats.free_pages
            st.special_tokens = stats.special_tokens
        if latency is not None:
            st.latency_preprocess_ms, st.latency_model_ms = latency.preprocess, latency.model
            st.latency_postprocess_ms, st.latency_publish_ms = latency.postprocess, latency.publish
            if stamp_s is not None:
                st.latency_total_ms = max(0.0, (self.now() - stamp_s) * 1e3)
        st.gpu_memory_allocated_mb, st.gpu_memory_reserved_mb = _device_memory_mb(self.session)
        self.sink.publish_status(st, stamp)
        self._last_status_time = self.monotonic()


@dataclass
class SaveSnapshot:
    """What one ~/save_map writes: poses [N] (TUM: image stamps, camera optical frame in the map
    frame) and the map [M] (map frame), taken at one moment of the stream."""

    stamps: np.ndarray  # [N] float64 seconds
    poses: np.ndarray  # [N, 4, 4] T_map_cam
    map: Command  # runs on the output thread; result (points [M, 3] float32, colors [M, 3] uint8, version)
    scale: float = 1.0  # metres per model unit applied to both files (1 = model units)
    offset: np.ndarray | None = None  # [4, 4] map offset T_map_seq applied after the scale (None = identity)

    def output(self, timeout: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(points [M, 3] float32, colors [M, 3] uint8, poses [N, 4, 4]) as they leave the node:
        the map once the output thread has taken it (SaveError after ``timeout`` s or on its
        error), both through the scale and the map offset."""
        if not self.map.wait(timeout):
            raise SaveError("the output thread did not catch up in time; try again")
        if self.map.error is not None:
            raise SaveError(f"cannot take the map: {self.map.error}")
        points, colors, _ = self.map.result
        poses = self.poses
        transform = OutputTransform(self.scale, self.offset)
        if not transform.identity:
            points, poses = transform.points(points).astype(np.float32), transform.pose(poses)
        return points, colors, poses


def write_map_files(snapshot: SaveSnapshot, directory: str, output_directory: str,
                    timeout: float) -> tuple[Path, Path]:
    """Write ``snapshot`` as one crash-safe PLY + TUM pair (``io.map_save.save_map_pair``): ``directory``
    empty = ``output_directory``, relative = under it (may not leave it), absolute = as given; an empty
    map is refused and existing files stay as they were (any thread; see ``save_snapshot``)."""
    points, colors, poses = snapshot.output(timeout)
    try:
        return save_map_pair(directory, output_directory, points, colors, snapshot.stamps, poses,
                             map_name=MAP_FILE, trajectory_name=TRAJECTORY_FILE)
    except MapSaveError as exc:
        raise SaveError(str(exc)) from None


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


def _make_scale_source(settings: NodeSettings) -> FixedScale | OdometryScaleEstimator | DepthScaleEstimator | None:
    """The scale source of ``scale_source`` (None for ``none``)."""
    if settings.scale_source == "fixed":
        return FixedScale(settings.metric_scale)
    if settings.scale_source == "odometry":
        return OdometryScaleEstimator()
    if settings.scale_source == "depth":
        return DepthScaleEstimator(conf_threshold=settings.conf_threshold)
    return None


class _ConfidenceSample:
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


def _check_resize(shape: tuple[int, ...], width: int) -> None:
    """Refuse (ValueError) an image so tall that its resize before the centre crop would be huge:
    preprocessing resizes the whole image to ``width`` x ``H'`` (float32) and keeps a centred square,
    so a 1 x 60000 image would cost gigabytes."""
    height_in, width_in = shape[:2]
    w_out, h_out = target_size(width_in, height_in, width)
    if h_out > MAX_RESIZE_ASPECT * w_out:
        raise ValueError(f"image {width_in}x{height_in} (WxH) is too tall: resized to width {w_out} it would be "
                         f"{h_out} px high, more than {MAX_RESIZE_ASPECT} times its width")


_frozen = False


def _freeze_long_lived_objects() -> None:
    """Once per process, after the first results: move every object alive now (the model, the
    CUDA graph, FlashInfer's plans, rclpy's entities) out of the garbage collector's reach.
    A full collection stops the whole process for as long as it takes to scan them: ~130 ms
    each, 56 times in a 3-minute GPU node run before this (benchmarks/node/node_probe.py)."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


def _device_memory_mb(session) -> tuple[float, float]:
    device = getattr(session, "device", None)
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return 0.0, 0.0
    import torch

    return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.memory_reserved(device) / 2**20


def _release_device_memory(session) -> None:
    device = getattr(session, "device", None)
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()


__all__ = ["InferenceEngine", "InputFrame", "FrameOutput", "FrameSummary", "StatusFields", "State", "Sink",
           "SaveError", "SaveSnapshot", "write_map_files"]
