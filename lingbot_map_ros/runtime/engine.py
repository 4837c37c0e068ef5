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
scale converged keep model units. Distorted cameras are undistorted before preprocessing
(``model_input``). Intrinsics (``robot/intrinsics.py``): ``focal`` keeps the model's focal
lengths of the last frames in input-image pixels, for /diagnostics to compare with CameraInfo's.

The engine orchestrates parts with one job each, every one tested alone:
``stamps.StampGate`` (which frames may enter, by stamp and age), ``decisions.KeyframeDecisions``
(hold, its deadline, the motion reference, the deferral deadline), ``anchor.MapAnchor`` (metric
scale, lost-reset alignment: the ``OutputTransform`` of what leaves), ``model_input.ModelInput``
(undistortion and preprocessing), ``clouds`` (a frame's point cloud and depth image, confidence
statistics), ``status`` (the ~/status fields), ``saving`` (~/save_map's snapshot and files), ``journaling``
(the keyframe journal: a ``JournaledSession`` is given each frame's stamp; ``load_session``
replaces the state by a saved session's; the counters are journaled with the heartbeat).
Settings changes arrive as values through the queue (``configure``): no other thread writes
the engine's state.
"""
from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..geometry import optical_pose_to_map, rotation_angle_deg
from ..robot.health import HealthStatus, TrackingHealth, TrackingState, config_from_parameters
from ..robot.intrinsics import FocalTracker
from ..journal import JournaledSession
from ..stream import CacheFullError, FrameMismatchError, FrameResult, InvalidFrameError, Session, SessionError
from .anchor import Lookup, MapAnchor
from .clouds import CloudOutput, ConfidenceSample
from .decisions import KeyframeDecisions
from .frames import FrameOutput, FrameSummary, InputFrame, Logger, Sink, State
from .journaling import ANCHOR_STATE, COUNTERS_STATE, SESSIONS_OFF, Resumed, load_saved
from .mapping import MapAccumulator, PoseEntry, Trajectory
from .model_input import ModelInput, gpu_device
from .params import NodeSettings
from .saving import SaveError, SaveSnapshot, write_map_files
from .stamps import ZERO_STAMP_WARNING, StampGate
from .status import HEARTBEAT_PERIOD, Latency, Tracking, release_device_memory, status_fields
from .worker import Command, Counters, RateMeter, Throttle, WorkQueue

WARN_PERIOD = 5.0  # seconds between two warnings of one kind


class InferenceEngine:
    """A camera's session and per-sequence memory, driven by the one inference thread; see the
    module docstring. ``odom_position`` / ``camera_pose``: (image stamp, camera optical frame) ->
    the camera centre [3] / ``T_odom_cam`` [4, 4] in odom_frame (metres), or None when TF lacks
    it; never waiting (``anchor.MapAnchor``)."""

    def __init__(self, session: Session, settings: NodeSettings, sink: Sink, log: Logger,
                 now: Callable[[], float], monotonic: Callable[[], float] = time.monotonic,
                 odom_position: Lookup | None = None, camera_pose: Lookup | None = None,
                 make_stamp: Callable[[int], Any] = int) -> None:
        self.session = session
        # the keyframe journal (state_directory / load_session), else None
        self.journal: JournaledSession | None = session if isinstance(session, JournaledSession) else None
        self.resumed: Resumed | None = None  # what start-up or the last ~/load_session rebuilt
        self.make_stamp = make_stamp  # nanoseconds -> the sink's stamp (a journaled frame's)
        self._noted_counters: dict[str, int] | None = None
        self._noted_output = None  # the anchor.output last journaled
        self.settings = settings  # in force on the inference thread; replaced through ``configure``
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
        self.stamps = StampGate()
        self.decisions = KeyframeDecisions(self.counters)
        self.anchor = MapAnchor(settings.scale_source, settings.metric_scale, settings.conf_threshold,
                                settings.odom_frame, log, self.throttle, odom_position, camera_pose)
        self.inputs = ModelInput()
        self.health = TrackingHealth(config_from_parameters(settings))  # judged once per processed frame
        self.tracking_reasons: tuple[str, ...] = ()
        self.lost_resets = 0  # sequences restarted by on_lost=reset (cleared by ~/reset)
        self.focal = FocalTracker()  # the model's focal lengths in input pixels (diagnostics)
        self._collected: list[InputFrame] = []  # pushed, waiting for their (scale-frame) results
        self._last_index = 0  # 1-based index of the last processed frame
        self._last_status_time = -float("inf")
        # clouds, depth images and the map on the camera's output thread
        self.clouds = CloudOutput(sink, self.map, log, self.throttle, settings.map_max_points)
        self.outputs = self.clouds.worker  # the output thread (the scheduler starts it; ops run in order there)

    # what the node's timers and diagnostics read (each replaced as a whole, never mutated)
    output = property(lambda self: self.anchor.output, doc="OutputTransform of what leaves the engine now")
    map_alignment = property(lambda self: self.anchor.map_alignment, doc="what the map frame is anchored to")
    applied_scale = property(lambda self: self.anchor.applied_scale, doc="metres per model unit applied")
    scale_source = property(lambda self: self.anchor.scale_source, doc="the scale source, None for none")
    depth_cache = property(lambda self: self.anchor.depth_cache, doc="sensor depth images (scale_source depth)")
    frames_undistorted = property(lambda self: self.inputs.frames_undistorted)
    clouds_skipped = property(lambda self: self.clouds.skipped, doc="frames whose clouds the output thread skipped")

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

    def configure(self, settings: NodeSettings) -> Command:
        """Hand new settings (a parameter set) to the inference thread: they take effect between two
        items, the sink's with them (``Sink.configure``). The deferral in force stays until
        ``settings.deferred_eviction`` differs from it (then it is set as by ~/set_deferred_eviction)."""
        return self.submit("settings", lambda: self._configure(settings))

    def heartbeat(self, clock_problem: str = "") -> Command:
        """Queue a status publication (state WAITING_FOR_IMAGES when the input went quiet);
        ``clock_problem`` ("no clock: ...") is added to its text."""
        return self.submit("heartbeat", lambda: self._heartbeat(clock_problem))

    def seconds_since_input(self) -> float | None:
        last = self.input_rate.last()
        return None if last is None else self.monotonic() - last

    def stop(self, timeout: float = 5.0) -> None:
        """Close the queue (pending commands are cancelled) and drain and stop the output thread;
        ``CameraScheduler.stop`` calls it once its inference thread has left."""
        self.queue.close()
        self.outputs.stop(timeout)

    # ------------------------------------------------------------------ driven by the scheduler
    def run_once(self, timeout: float = 0.0) -> bool:
        """Process one queued item; False when nothing came within ``timeout`` seconds.

        While a frame is held for a keep/drop decision only commands are taken (a frame that
        arrives waits in the latest-frame slot) until the decision or its deadline."""
        self._check_hold_deadline()
        hold = self.decisions.hold
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

    def _process(self, frame: InputFrame) -> None:
        image = self._admit(frame)
        if image is None:
            return
        try:
            if self.journal is None:
                results = self.session.push(image)
            else:
                results = self.journal.push(image, stamp=_stamp_ns(frame), tag=_tag(frame))
        except Exception as exc:
            return self._push_failed(frame, exc)
        self._pushed(frame, results)

    # the parts of ``_process`` around the session's step, so that the scheduler can run several
    # cameras' steps together (``take_batch_frame``, ``admit``, the batched submit, ``complete``) or
    # overlap one camera's step with the next camera's (``launch`` for the submit)
    def take_batch_frame(self) -> InputFrame | None:
        """The waiting frame, taken, when this camera's next item is a frame that may run now
        (no keep/drop decision held, no command queued); else None and nothing is taken."""
        self._check_hold_deadline()
        if self.decisions.hold is not None:
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
        """Submit an admitted frame's step without waiting for it (pipelined steps): its pending
        results, or the exception the submit raised, for ``complete``."""
        try:
            if self.journal is None:
                return self.session.submit(image)
            frame = self._collected[-1]
            return self.journal.submit(image, stamp=_stamp_ns(frame), tag=_tag(frame))
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

    # ------------------------------------------------------------------ frames
    def _admit(self, frame: InputFrame) -> Any | None:
        s = self.settings
        verdict = self.stamps.check(frame.stamp_s, self.now(), s.max_frame_age, s.time_jump_threshold,
                                    s.on_time_jump)
        if verdict.zero_stamp:  # processed once (a later zero stamp is a repeat), never silently
            self.throttle.emit(self.log.warning, ZERO_STAMP_WARNING, kind="zero stamp")
        if verdict.time_jump:
            self.counters.add("time_jumps")
        if not verdict.accept:
            self.counters.add(verdict.counter)
            self.throttle.emit(self.log.warning, verdict.reason, kind=verdict.kind)
            if verdict.status:
                self._publish_status(verdict.reason, frame.stamp)
            return None
        if verdict.new_sequence:  # on_time_jump=reset
            self.log.warning(verdict.reason)
            self._clear_sequence()
            self._set_state(State.INITIALIZING, "time jump: new sequence")
        self._check_deferral_deadline()
        t0 = time.perf_counter()
        try:
            image = self.inputs.image(frame, s.image_width, s.undistort, gpu_device(self.session))
        except ValueError as exc:
            self._drop_invalid(frame.stamp, str(exc))
            return None
        try:
            self.session.check_frame(image)
        except InvalidFrameError as exc:  # layout, size, too few patches, another resolution than the sequence's
            self._drop_invalid(frame.stamp, f"image {frame.rgb.shape[1]}x{frame.rgb.shape[0]}: {exc}")
            return None
        frame.preprocess_ms = frame.convert_ms + (time.perf_counter() - t0) * 1e3
        self.stamps.taken(frame.stamp, frame.stamp_s)
        self._collected.append(frame)
        return image

    def undistort_device(self) -> Any:
        """The session's device when undistortion should run there (not the CPU), else None."""
        return gpu_device(self.session)

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
        self._note_anchor()
        self._note_pending()
        _freeze_long_lived_objects()

    def _handle_results(self, results: list[FrameResult], frames: list[InputFrame]) -> None:
        stored = results[0].is_keyframe
        bad = [r.frame_index + 1 for r in results if not np.isfinite(r.c2w).all()]
        if bad:
            note = "kept out of the cache"
            if stored:
                try:
                    self.session.rollback_last_frame(results[-1].frame_index)
                    note = "rolled back from the cache"
                    self.decisions.forget_from(results[0].frame_index + 1)
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
        if self.anchor.aligning:
            self.anchor.align(results, frames)
        if stored and self.map is not None:
            first, acc = results[0].frame_index, self.map
            self.outputs.op(lambda: acc.protect_from(first))
        # hold a single stored frame (not the scale frames, not a restart's re-fed batch) for a decision
        hold = self.settings.keyframe_decision_timeout > 0 and stored and len(results) == 1
        published = False
        for r, frame in zip(results, frames):
            published |= self._publish_result(r, frame, hold)
        if hold and published:
            self.decisions.start_hold(results[0].frame_index + 1, self.monotonic(),
                                      self.settings.keyframe_decision_timeout)
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
        conf_stats = ConfidenceSample(r.confidence, self.settings.conf_threshold)
        self._judge_health(conf_stats.valid, r.c2w)
        scale, ready = self.anchor.update_scale(T_map_cam, frame, r, self.session.window_index)
        transform = self.anchor.output  # scale and map offset of this frame's outputs
        T_out = transform.pose(T_map_cam)
        if self.health.state == TrackingState.TRACKING:
            self.anchor.good(index, frame, T_out, ready)
        t1 = time.perf_counter()
        pose = FrameOutput(index, frame.stamp, frame.stamp_s, frame.camera_frame, r.is_keyframe, T_out,
                           r.intrinsics, None, None, None, None,
                           covariance=self.health.covariance(scale).ravel(), scale=scale, scale_ready=ready)
        self.sink.publish_frame(pose)
        self._publish_frame_summary(r, pose, hold, conf_stats)
        t2 = time.perf_counter()
        if need_points or need_depth:
            s = self.settings
            self.clouds.submit(r, pose, need_points, need_depth, s.conf_threshold, s.point_stride, transform)
        self.counters.add("frames_processed")
        self.output_rate.tick()
        self._last_index = index
        self._set_state(State.TRACKING, "tracking")
        latency = Latency(preprocess=frame.preprocess_ms, model=r.timings.get("model_ms", 0.0),
                          postprocess=r.timings.get("postprocess_ms", 0.0) + (t1 - t0) * 1e3,
                          publish=(t2 - t1) * 1e3)
        note = self.anchor.take_note()
        self._publish_status(self.state_text + (f"; {note}" if note else ""), frame.stamp, frame_index=index,
                             is_keyframe=r.is_keyframe, latency=latency, stamp_s=frame.stamp_s)
        self.log.debug(f"frame {index}{' (keyframe)' if r.is_keyframe else ''}: preprocess {latency.preprocess:.1f} "
                       f"ms, model {latency.model:.1f} ms, postprocess {latency.postprocess:.1f} ms, publish "
                       f"{latency.publish:.1f} ms")
        return True

    def _publish_frame_summary(self, r: FrameResult, pose: FrameOutput, hold: bool,
                               conf_stats: ConfidenceSample | None = None) -> None:
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
        mean, median, valid = conf_stats.summary() if conf_stats is not None else (0.0, 0.0, 0.0)
        stats = self.session.stats()
        self.sink.publish_frame_info(FrameSummary(
            frame_index=index, window_index=self.session.window_index, stored=r.is_keyframe,
            is_keyframe=r.is_keyframe, decision_pending=hold,
            pending_eviction_pages=stats.pending_evictions if stats is not None else 0,
            confidence_mean=mean, confidence_median=median, valid_fraction=valid,
            translation_since_keyframe=translation, rotation_since_keyframe_deg=rotation,
            latency_ms=max(0.0, (self.now() - pose.stamp_s) * 1e3)), pose)

    def _judge_health(self, valid_fraction: float | None, c2w: np.ndarray | None, finite: bool = True) -> HealthStatus:
        """Update the tracking health with one frame (``c2w`` [4, 4] in model units, OpenCV world)."""
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
        in the same map frame through odometry when it can be (``MapAnchor``)."""
        if self.settings.on_lost != "reset" or self.health.state != TrackingState.LOST:
            return
        reasons = ", ".join(self.tracking_reasons) or "lost"
        self.lost_resets += 1
        pending, why = self.anchor.lost()
        self._clear_sequence(keep_map_frame=True)
        if pending is not None:
            self.anchor.continue_from(pending)
            self.log.warning(f"tracking lost ({reasons}): on_lost=reset, starting a new sequence; it continues the "
                             f"map from the last good pose (frame {pending.good.index}) through odometry")
            text = f"tracking lost ({reasons}): new sequence, aligned to the last good pose through odometry"
        else:
            self.anchor.new_origin()
            self.throttle.emit(self.log.warning, f"tracking lost ({reasons}): on_lost=reset starts a new sequence at "
                               f"a NEW map origin (the map frame jumps): {why}", kind="lost origin")
            text = f"tracking lost ({reasons}): new sequence at a new map origin ({why})"
        self._set_state(State.INITIALIZING, text)
        self._publish_status(self.state_text, stamp)

    # ------------------------------------------------------------------ failures
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
        stamp = self._collected[-1].stamp if self._collected else self.stamps.last_stamp
        self._set_state(State.ERROR, text)
        self._publish_status(text, stamp)
        try:
            self._clear_sequence()
            release_device_memory(self.session)
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
        self._forget_sequence(keep_map_frame)

    def _forget_sequence(self, keep_map_frame: bool = False) -> None:
        """``_clear_sequence`` but the session's state (a rebuilt session keeps it)."""
        self._collected.clear()
        self._last_index = 0
        self.trajectory.clear()
        if self.map is not None:
            self.outputs.op(self.map.clear)
        if self.settings.publish_path:
            self.sink.publish_path([])
        self.last_stats = self.session.stats()
        self.decisions.clear()
        self.health.reset()
        self.tracking_reasons = ()
        self.focal.clear()
        self.anchor.clear(keep_map_frame)
        self._note_anchor()

    # ------------------------------------------------------------------ commands (inference thread)
    def _configure(self, settings: NodeSettings) -> None:
        in_force = self.settings.deferred_eviction
        self.settings = replace(settings, deferred_eviction=in_force)
        config = config_from_parameters(settings)  # checked when the settings were made
        if config != self.health.config:
            self.health.reconfigure(config)
        self.sink.configure(settings)
        if settings.deferred_eviction != in_force:
            self.set_deferred_eviction(settings.deferred_eviction)
        self._check_hold_deadline()  # a keyframe_decision_timeout lowered now applies to the held frame now

    def reset(self) -> str:
        """Empty the cache, path, map and counters; the next image starts a new sequence. A frame
        still waiting in the latest-frame slot (it arrived before the reset, e.g. behind a held
        decision) belongs to the old sequence and is discarded."""
        self._set_state(State.RESETTING, "resetting")
        self._publish_status(self.state_text, self.stamps.last_stamp)
        self.queue.discard_frame()
        self._clear_sequence()
        self.counters.reset()
        self.lost_resets = 0
        self.input_rate.clear()
        self.output_rate.clear()
        self.stamps.clear()
        self._set_state(State.WAITING_FOR_IMAGES, "reset; waiting for images")
        self._note_counters()
        self._publish_status(self.state_text, None)
        return "cache, path, map and counters cleared; the next image starts a new sequence"

    def set_deferred_eviction(self, enabled: bool) -> str:
        self.session.set_deferred_eviction(enabled)
        self.settings = replace(self.settings, deferred_eviction=enabled)
        self.decisions.client_back()
        self.last_stats = self.session.stats()
        self._note_pending()
        self._publish_status(self.state_text, self.stamps.last_stamp)
        pending = self.last_stats.pending_evictions if self.last_stats else 0
        return f"deferred eviction {'on' if enabled else 'off'} ({pending} eviction(s) pending)"

    def commit_eviction(self, expected_frame_index: int = 0) -> int:
        """Run the deferred evictions: the client keeps the latest stored frame (1-based
        ``expected_frame_index``; 0 = whichever it is). With a decision hold this is the "keep"
        decision about the held frame. Returns the pages freed; raises SessionError (nothing
        changed) when the index names another frame or one already decided."""
        held = self.decisions.check(expected_frame_index, commit=True,
                                    hold_mode=self.settings.keyframe_decision_timeout > 0)
        freed = self.session.commit_eviction()
        self.decisions.client_back()
        if held is not None:
            self.decisions.decide(held, "kept")
        self.last_stats = self.session.stats()
        self._note_pending()
        self._publish_status(self.state_text, self.stamps.last_stamp)
        return freed

    def rollback(self, expected_frame_index: int) -> int:
        """Undo the last stored frame (1-based ``expected_frame_index``; 0 = the latest).

        Removes its tokens from the cache and, with it, the points and poses of every frame
        the session forgot. With a decision hold this is the "drop" decision about the held
        frame. Returns its 1-based index; raises SessionError (nothing changed).
        """
        held = self.decisions.check(expected_frame_index, commit=False,
                                    hold_mode=self.settings.keyframe_decision_timeout > 0)
        index = self._rollback_stored(held if held is not None else expected_frame_index)
        self.decisions.client_back()
        if held is not None:
            self.decisions.decide(held, "dropped")
        self._publish_status(f"rolled back frame {index}", self.stamps.last_stamp, frame_index=self._last_index)
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
        self.decisions.forget_from(index + 1)
        self._last_index = min(self._last_index, forgotten_from)
        self.last_stats = self.session.stats()
        self._note_pending()
        if self.settings.publish_path and removed:
            self.sink.publish_path(self.trajectory.entries())
        return index + 1

    # ------------------------------------------------------------------ deadlines
    def _check_hold_deadline(self) -> None:
        """Apply keyframe_decision_default to a held frame whose decision did not come in time."""
        hold = self.decisions.expired(self.monotonic(), self.settings.keyframe_decision_timeout)
        if hold is None:
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
        self.decisions.decide(hold.index, f"{default} by timeout")
        self.throttle.emit(self.log.warning, f"no decision about frame {hold.index} within keyframe_decision_timeout="
                           f"{self.settings.keyframe_decision_timeout} s: applied keyframe_decision_default={default}"
                           f"{note}", kind="decision timeout")
        self.last_stats = self.session.stats()
        self._publish_status(f"frame {hold.index}: {default} by timeout", self.stamps.last_stamp,
                             frame_index=self._last_index)

    def _note_pending(self) -> None:
        """Start (or stop) the clock of deferred_eviction_timeout from the session's pending evictions."""
        stats = self.session.stats()
        self.decisions.note_pending(stats is not None and stats.pending_evictions > 0, self.monotonic())

    def _check_deferral_deadline(self) -> None:
        """Commit deferred evictions that waited longer than deferred_eviction_timeout: a keyframe
        client that died must not blind the robot (the cache would fill and refuse every frame)."""
        timeout = self.settings.deferred_eviction_timeout
        if not self.decisions.deferral_due(timeout, self.monotonic()):
            return
        freed = self.session.commit_eviction()
        self.decisions.auto_committed()
        self.counters.add("evictions_auto_committed")
        self.last_stats = self.session.stats()
        self.throttle.emit(self.log.warning, f"a deferred eviction waited more than deferred_eviction_timeout="
                           f"{timeout} s for ~/commit_eviction: committed automatically ({freed} page(s) freed); "
                           "later ones are committed at once until a client commits again", kind="auto commit")

    # ------------------------------------------------------------------ saved sessions (journaling)
    def load_session(self, folder: Path, progress_period: float = 0.25) -> Resumed:
        """Replace the state by the saved session in ``folder`` (inference thread): the next frames
        are posed in its map and numbered after its frames. A frame waiting in the latest-frame
        slot belongs to the old map: it is dropped as stale. ``journaling.SessionError`` (state
        unchanged) when journaling is off or the session does not fit; an exception of the model
        during the replay ends with a new sequence (as an inference error does)."""
        from .journaling import SessionError

        if self.journal is None:
            raise SessionError(SESSIONS_OFF)
        if self.queue.discard_frame() is not None:
            self.counters.add("frames_dropped_stale")
        try:
            rebuilt = load_saved(self.journal, Path(folder), self.settings.image_width,
                                 self._resume_progress("loading the session", progress_period))
        except SessionError:
            raise
        except Exception as exc:
            self._on_inference_error(exc)
            raise
        self.resumed_from(Resumed.of("session", rebuilt))
        return self.resumed

    def resumed_from(self, resumed: Resumed | None) -> None:
        """The session was rebuilt (start-up resume or a loaded session): forget what belonged to
        the state before it, take the journaled counters, say so in ~/status."""
        self.resumed = resumed
        if resumed is None or not resumed.frames:
            if resumed is not None and resumed.refused:
                self._set_state(self.state, f"journal set aside ({resumed.refused}); a new journal starts")
            return
        self._forget_sequence()
        self.stamps.clear()
        counts = resumed.states.get(COUNTERS_STATE)
        if counts:
            self.counters.restore(counts)
        anchor = resumed.states.get(ANCHOR_STATE)
        if anchor:
            self.anchor.restore(anchor)
        self._note_anchor()
        if self.queue.discard_frame() is not None:  # it arrived during the rebuild
            self.counters.add("frames_dropped_stale")
        for stamp_ns, tag, rgb in resumed.collecting:  # scale frames whose results come with the next ones
            ns = int(stamp_ns or 0)
            self._collected.append(InputFrame(rgb=rgb, stamp=self.make_stamp(ns), stamp_s=ns * 1e-9,
                                              camera_frame=(tag or {}).get("frame_id") or self.settings.camera_frame or "camera_optical_frame"))
        self._noted_counters = counts
        self.last_stats = self.session.stats()
        self._last_index = resumed.next_frame
        self._set_state(State.INITIALIZING, resumed.describe())
        self._publish_status(self.state_text, None)

    def _resume_progress(self, what: str, period: float) -> Callable[[int, int], None]:
        last = [-float("inf")]

        def progress(k: int, n: int) -> None:
            now = self.monotonic()
            if k == n or now - last[0] >= period:
                last[0] = now
                self._set_state(State.INITIALIZING, f"{what}: resuming {k} of {n}")
                self._publish_status(self.state_text, None)
        return progress

    def _note_anchor(self) -> None:
        """Journal where the sequence sits in the map when that changed (a lost reset, a reset, a
        converged scale: ``anchor.output`` is replaced on every change)."""
        if self.journal is None or self.journal.writer is None or self.anchor.output is self._noted_output:
            return
        self._noted_output = self.anchor.output
        self.journal.note_state(ANCHOR_STATE, self.anchor.snapshot())

    def _note_counters(self) -> None:
        """Journal the ~/status counters when they changed (with the heartbeat: at most once a second)."""
        if self.journal is None or self.journal.writer is None:
            return
        values = dict(vars(self.counters.snapshot()))
        if values != self._noted_counters:
            self._noted_counters = values
            self.journal.note_state(COUNTERS_STATE, values)

    # ------------------------------------------------------------------ saving
    def save_snapshot(self) -> SaveSnapshot:
        """Inference thread (fast): the trajectory as it is now, and the map once the output thread
        has added the clouds of every frame up to now (a snapshot queued behind them). The files are
        written by ``write_map_files`` on the caller's thread: a slow disk never holds up inference."""
        if self.map is None:
            raise SaveError("the map is not accumulated (accumulate_map is false); nothing to save")
        snapshot = Command("map snapshot", self.map.snapshot)
        self.outputs.op(snapshot.run)
        out = self.anchor.output
        return SaveSnapshot(self.trajectory.stamps(), self.trajectory.poses(), snapshot, out.scale, out.offset)

    def save_map(self, directory: str) -> tuple[Path, Path]:
        """``save_snapshot`` + ``write_map_files`` in one call (in-process use and tests)."""
        return write_map_files(self.save_snapshot(), directory, self.settings.output_directory,
                               self.settings.service_timeout)

    # ------------------------------------------------------------------ status
    def _heartbeat(self, clock_problem: str = "") -> None:
        """Publish a status when none went out for HEARTBEAT_PERIOD (or the input went quiet)."""
        self._note_counters()
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
            self._publish_status(self.state_text + (f"; {clock_problem}" if clock_problem else ""),
                                 self.stamps.last_stamp)

    def _set_state(self, state: State, text: str) -> None:
        self.state, self.state_text = state, text

    def _publish_status(self, text: str, stamp: Any, frame_index: int | None = None, is_keyframe: bool = False,
                        latency: Latency | None = None, stamp_s: float | None = None) -> None:
        spread, converged = self.anchor.status()
        tracking = Tracking(self.health.state.value, self.tracking_reasons, self.lost_resets,
                            self.anchor.applied_scale, self.settings.scale_source, spread, converged)
        total = None if latency is None or stamp_s is None else max(0.0, (self.now() - stamp_s) * 1e3)
        st = status_fields(int(self.state), text, self._last_index if frame_index is None else frame_index,
                           self.session, self.counters.snapshot(), self.decisions.hold is not None, tracking,
                           is_keyframe, latency, total)
        self.sink.publish_status(st, stamp)
        self._last_status_time = self.monotonic()


def _stamp_ns(frame: InputFrame) -> int:
    """The frame's stamp in nanoseconds (journaled with it)."""
    return int(round(frame.stamp_s * 1e9))


def _tag(frame: InputFrame) -> dict[str, str]:
    """What the journal keeps of a frame besides its stamp (for scale frames resumed before their results)."""
    return {"frame_id": frame.camera_frame}


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


__all__ = ["InferenceEngine", "WARN_PERIOD"]
