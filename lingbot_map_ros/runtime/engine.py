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

The engine orchestrates parts with one job each, every one tested alone:
``stamps.StampGate`` (which frames may enter, by stamp and age), ``model_input.ModelInput``
(undistortion and preprocessing), ``frame_output.FramePublisher`` (what a processed frame
gives: pose, ~/frame, clouds, status), ``tracking.TrackingJudge`` (tracking health; with
``on_lost=reset`` a lost track starts a new sequence, counted in ``lost_resets``),
``anchor.MapAnchor`` (metric scale, and the map frame across a lost reset: the
``OutputTransform`` every output goes through), ``decisions.KeyframeDecisions`` (hold, its
deadline, the motion reference, the deferral deadline) applied by
``keyframe_control.KeyframeControl`` (keep, drop, the deadlines), ``status.StatusReporter``
(the state and ~/status), ``clouds`` (point clouds and depth on the output thread), ``saving``
(~/save_map's snapshot and files), ``journaling`` (a ``JournaledSession`` is given each frame's
stamp; ``load_session`` replaces the state by a saved session's; ``JournalNotes`` journals the
counters and the anchor). ``focal`` keeps the model's focal lengths for /diagnostics. Settings
changes arrive as values through the queue (``configure``): no other thread writes the
engine's state.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..journal import JournaledSession
from ..robot.intrinsics import FocalTracker
from ..stream import CacheFullError, FrameResult, InvalidFrameError, Session, SessionError
from .anchor import Lookup, MapAnchor
from .clouds import CloudOutput
from .decisions import KeyframeDecisions
from .frame_output import FramePublisher
from .frames import InputFrame, Logger, Sink, State
from .journaling import SESSIONS_OFF, JournalNotes, Resumed, load_saved
from .keyframe_control import KeyframeControl
from .map_journal import MAP_JOURNAL_NAME, MapJournal, RestoredMap, restore_map
from .mapping import MapAccumulator, Trajectory
from .model_input import ModelInput, gpu_device
from .params import NodeSettings
from .saving import SaveError, SaveSnapshot
from .stamps import ZERO_STAMP_WARNING, StampGate
from .status import StatusReporter, release_device_memory
from .tracking import TrackingJudge
from .worker import Command, Counters, RateMeter, Throttle, WorkQueue

WARN_PERIOD = 5.0  # seconds between two warnings of one kind
RESTORE_FLUSH_S = 30.0  # s a resume waits for the output thread to finish what it has (the map's clear)


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
        self.notes = JournalNotes(self.journal)
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
        # the map and path journal (map.lbj beside the keyframe journal; journal_map), else None
        self.map_journal: MapJournal | None = None
        if self.journal is not None and self.journal.writer is not None and settings.journal_map:
            self.map_journal = MapJournal(self.journal.writer.path.with_name(MAP_JOURNAL_NAME), self.journal.identity,
                                          compression=self.journal.writer.compression)
            self.map_journal.attach(self.map, self.trajectory)
            # a saved session's map holds every frame its journal does: what the output thread has goes in
            self.map_journal.before_copy = lambda: self.outputs.flush(RESTORE_FLUSH_S)
        self.restored_map: RestoredMap | None = None  # what the last resume took back of the map and path
        self.stamps = StampGate()
        self.decisions = KeyframeDecisions(self.counters)
        self.anchor = MapAnchor(settings.scale_source, settings.metric_scale, settings.conf_threshold,
                                settings.odom_frame, log, self.throttle, odom_position, camera_pose)
        self.inputs = ModelInput()
        self.tracking = TrackingJudge(settings, log)  # judged once per processed frame
        self.focal = FocalTracker()  # the model's focal lengths in input pixels (diagnostics)
        self._collected: list[InputFrame] = []  # pushed, waiting for their (scale-frame) results
        self.status = StatusReporter(sink, session, self.counters, lambda: self.decisions.hold is not None,
                                     lambda: self.tracking.summary(self.anchor, self.settings.scale_source),
                                     now, monotonic)
        # clouds, depth images and the map on the camera's output thread
        self.clouds = CloudOutput(sink, self.map, log, self.throttle, settings.map_max_points)
        self.outputs = self.clouds.worker  # the output thread (the scheduler starts it; ops run in order there)
        self.frame_output = FramePublisher(session, sink, self.status, self.tracking, self.anchor, self.decisions,
                                           self.trajectory, self.map, self.clouds, self.focal, self.counters,
                                           self.output_rate, log, self.throttle, now)
        self.keyframes = KeyframeControl(session, self.decisions, lambda: self.settings, self.status, self.stamps,
                                         self.counters, self.trajectory, self.map, self.outputs, sink, log,
                                         self.throttle, monotonic)

    # what the node's timers and diagnostics read (each replaced as a whole, never mutated)
    output = property(lambda self: self.anchor.output, doc="OutputTransform of what leaves the engine now")
    map_alignment = property(lambda self: self.anchor.map_alignment, doc="what the map frame is anchored to")
    applied_scale = property(lambda self: self.anchor.applied_scale, doc="metres per model unit applied")
    scale_source = property(lambda self: self.anchor.scale_source, doc="the scale source, None for none")
    depth_cache = property(lambda self: self.anchor.depth_cache, doc="sensor depth images (scale_source depth)")
    frames_undistorted = property(lambda self: self.inputs.frames_undistorted)
    clouds_skipped = property(lambda self: self.clouds.skipped, doc="frames whose clouds the output thread skipped")
    state = property(lambda self: self.status.state)
    state_text = property(lambda self: self.status.text)
    last_stats = property(lambda self: self.status.last_stats, doc="the cache statistics last taken")
    last_intrinsics = property(lambda self: self.frame_output.last_intrinsics,
                               doc="K, width, height of the last frame's model input")
    health = property(lambda self: self.tracking.health)
    tracking_reasons = property(lambda self: self.tracking.reasons)
    lost_resets = property(lambda self: self.tracking.lost_resets, doc="sequences restarted by on_lost=reset")

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
        self.submit("status", lambda: self.status.publish(f"dropped invalid image: {reason}", stamp))

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
        self.keyframes.check_hold_deadline()
        hold = self.decisions.hold
        if hold is not None:
            timeout = max(0.0, min(timeout, hold.deadline - self.monotonic()))
        item = self.queue.get(timeout, frames=hold is None)
        if item is None:
            self.keyframes.check_hold_deadline()
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
        with self._journals_held():
            try:
                if self.journal is None:
                    results = self.session.push(image)
                else:
                    results = self.journal.push(image, stamp=_stamp_ns(frame), tag=_tag(frame))
            except Exception as exc:
                return self._push_failed(frame, exc)
            self._pushed(frame, results)

    def _journals_held(self) -> contextlib.AbstractContextManager:
        """The journals' writers held (``JournalWriter.hold``) while a frame is handled: their
        threads take the frame's records once its messages are out."""
        if self.journal is None:  # the map journal exists only beside it
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if self.journal.writer is not None:
            stack.enter_context(self.journal.writer.hold())
        if self.map_journal is not None:
            stack.enter_context(self.map_journal.writer.hold())
        return stack

    # the parts of ``_process`` around the session's step, so that the scheduler can run several
    # cameras' steps together (``take_batch_frame``, ``admit``, the batched submit, ``complete``) or
    # overlap one camera's step with the next camera's (``launch`` for the submit)
    def take_batch_frame(self) -> InputFrame | None:
        """The waiting frame, taken, when this camera's next item is a frame that may run now
        (no keep/drop decision held, no command queued); else None and nothing is taken."""
        self.keyframes.check_hold_deadline()
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
            with self._journals_held():
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
                self.status.publish(verdict.reason, frame.stamp)
            return None
        if verdict.new_sequence:  # on_time_jump=reset
            self.log.warning(verdict.reason)
            self._clear_sequence()
            self.status.set(State.INITIALIZING, "time jump: new sequence")
        self.keyframes.check_deferral_deadline()
        t0 = time.perf_counter()
        try:
            image = self.inputs.image(frame, s.image_width, s.undistort, gpu_device(self.session))
        except ValueError as exc:
            self._drop(frame.stamp, str(exc))
            return None
        try:
            self.session.check_frame(image)
        except InvalidFrameError as exc:  # layout, size, too few patches, another resolution than the sequence's
            self._drop(frame.stamp, f"image {frame.rgb.shape[1]}x{frame.rgb.shape[0]}: {exc}")
            return None
        frame.preprocess_ms = frame.convert_ms + (time.perf_counter() - t0) * 1e3
        self.stamps.taken(frame.stamp, frame.stamp_s)
        self._collected.append(frame)
        return image

    def _pushed(self, frame: InputFrame, results: list[FrameResult]) -> None:
        if not results:
            n, total = len(self._collected), self.session.cfg.num_scale_frames
            self.status.set(State.INITIALIZING, f"collecting scale frames {n}/{total}")
            self.status.publish(self.status.text, frame.stamp, frame_index=self.session.frames_pushed + n)
            return
        frames, self._collected = self._collected[:len(results)], self._collected[len(results):]
        self._handle_results(results, frames)
        self.notes.anchor(self.anchor)
        self.keyframes.note_pending()
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
            self.tracking.judge(None, None, finite=False)
            self.status.publish(f"dropped frame(s) {bad}: non-finite pose", frames[-1].stamp)
            self._reset_if_lost(frames[-1].stamp)
            return
        if self.anchor.aligning:
            self.anchor.align(results, frames)
        protect: Callable[[], None] | None = None
        if stored and self.map is not None:
            # queued by the first frame's publish once its pose is out (before its clouds): waking the
            # output thread earlier would have it compete for the GIL with the pose's own work
            first, acc = results[0].frame_index, self.map

            def protect() -> None:
                self.outputs.op(lambda: acc.protect_from(first))
        # hold a single stored frame (not the scale frames, not a restart's re-fed batch) for a decision
        s = self.settings
        hold = s.keyframe_decision_timeout > 0 and stored and len(results) == 1
        published = False
        for r, frame in zip(results, frames):
            published |= self.frame_output.publish(r, frame, s, hold, before_clouds=protect)
            protect = None
        if hold and published:
            self.decisions.start_hold(results[0].frame_index + 1, self.monotonic(), s.keyframe_decision_timeout)
        if published and s.publish_path:
            self.sink.publish_path(self.trajectory.entries())
        self.status.refresh_stats()
        self._reset_if_lost(frames[-1].stamp)

    def _reset_if_lost(self, stamp: Any) -> None:
        """on_lost=reset: a lost track starts a new sequence (logged, counted in lost_resets), placed
        in the same map frame through odometry when it can be (``MapAnchor``)."""
        reasons = self.tracking.lost_reason(self.settings.on_lost)
        if reasons is None:
            return
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
        self.status.set(State.INITIALIZING, text)
        self.status.publish(text, stamp)

    # ------------------------------------------------------------------ failures
    def _drop(self, stamp: Any, reason: str) -> None:
        self.counters.add("frames_dropped_invalid")
        self.throttle.emit(self.log.warning, f"dropped invalid image: {reason}")
        self.status.publish(f"dropped invalid image: {reason}", stamp)

    def _push_failed(self, frame: InputFrame, exc: Exception) -> None:
        if isinstance(exc, CacheFullError):
            stats = self.session.stats()
            if self.session.deferred_eviction and stats is not None and stats.pending_evictions > 0:
                # the caller's deferral filled the cache: drop the frame, keep the state
                self._collected.remove(frame)
                self.counters.add("frames_dropped_error")
                text = f"frame dropped, cache full while eviction is deferred: {exc}"
                self.throttle.emit(self.log.warning, text + "; call ~/commit_eviction or ~/rollback_last_frame",
                                   kind="deferred full")
                self.status.publish(text, frame.stamp)
                return
        self._on_inference_error(exc)  # e.g. the model's horizon: a new sequence starts

    def _on_inference_error(self, exc: Exception) -> None:
        lost = len(self._collected)
        self.counters.add("frames_dropped_error", lost)
        text = f"inference failed: {type(exc).__name__}: {exc}"
        self.log.error(f"{text}; {lost} frame(s) lost, resetting the session (a new sequence starts)")
        stamp = self._collected[-1].stamp if self._collected else self.stamps.last_stamp
        self.status.set(State.ERROR, text)
        self.status.publish(text, stamp)
        try:
            self._clear_sequence()
            release_device_memory(self.session)
        except Exception as reset_exc:
            self.status.set(State.ERROR, f"{text}; reset failed: {type(reset_exc).__name__}: {reset_exc}")
            self.log.error(self.status.text)
            self.status.publish(self.status.text, stamp)
            return
        self.status.set(State.INITIALIZING, f"recovered from: {text}; waiting for scale frames")
        self.status.publish(self.status.text, stamp)

    def _clear_sequence(self, keep_map_frame: bool = False, reset_session: bool = True) -> None:
        """Forget the sequence (cache, path, map, health, scale). ``keep_map_frame``: a lost reset,
        whose next sequence may continue the map frame (the last good pose stays); otherwise the
        next sequence starts a new map origin. ``reset_session`` False: the session's state stays
        (a rebuilt session's)."""
        if reset_session:
            self.session.reset()
        self._collected.clear()
        self.status.last_index = 0
        self.trajectory.clear()
        if self.map is not None:
            self.outputs.op(self.map.clear)
        if self.settings.publish_path:
            self.sink.publish_path([])
        self.status.refresh_stats()
        self.decisions.clear()
        self.tracking.clear()
        self.focal.clear()
        self.anchor.clear(keep_map_frame)
        self.notes.anchor(self.anchor)

    # ------------------------------------------------------------------ commands (inference thread)
    def _configure(self, settings: NodeSettings) -> None:
        in_force = self.settings.deferred_eviction
        self.settings = replace(settings, deferred_eviction=in_force)
        self.tracking.reconfigure(settings)
        self.sink.configure(settings)
        if settings.deferred_eviction != in_force:
            self.set_deferred_eviction(settings.deferred_eviction)
        self.keyframes.check_hold_deadline()  # a keyframe_decision_timeout lowered now applies to the held frame now

    def reset(self) -> str:
        """Empty the cache, path, map and counters; the next image starts a new sequence. A frame
        still waiting in the latest-frame slot (it arrived before the reset, e.g. behind a held
        decision) belongs to the old sequence and is discarded."""
        self.status.set(State.RESETTING, "resetting")
        self.status.publish(self.status.text, self.stamps.last_stamp)
        self.queue.discard_frame()
        self._clear_sequence()
        self.counters.reset()
        self.tracking.lost_resets = 0
        self.input_rate.clear()
        self.output_rate.clear()
        self.stamps.clear()
        self.status.set(State.WAITING_FOR_IMAGES, "reset; waiting for images")
        self.notes.counters(self.counters)
        self.status.publish(self.status.text, None)
        return "cache, path, map and counters cleared; the next image starts a new sequence"

    def set_deferred_eviction(self, enabled: bool) -> str:
        self.session.set_deferred_eviction(enabled)
        self.settings = replace(self.settings, deferred_eviction=enabled)
        self.keyframes.deferral_changed()
        self.status.publish(self.status.text, self.stamps.last_stamp)
        stats = self.status.last_stats
        return f"deferred eviction {'on' if enabled else 'off'} ({stats.pending_evictions if stats else 0} " \
               "eviction(s) pending)"

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
        last = [-float("inf")]

        def progress(k: int, n: int) -> None:
            now = self.monotonic()
            if k == n or now - last[0] >= progress_period:
                last[0] = now
                self.status.set(State.INITIALIZING, f"loading the session: resuming {k} of {n}")
                self.status.publish(self.status.text, None)
        try:
            rebuilt = load_saved(self.journal, Path(folder), self.settings.image_width, progress)
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
                self.status.set(self.status.state, f"journal set aside ({resumed.refused}); a new journal starts")
            return
        if self.map_journal is not None:
            self.map_journal.pause()  # the map and path are replaced below: not a change to journal
        self._clear_sequence(reset_session=False)
        self._restore_map(resumed)
        self.stamps.clear()
        self.notes.restore(resumed, self.counters, self.anchor)
        if self.queue.discard_frame() is not None:  # it arrived during the rebuild
            self.counters.add("frames_dropped_stale")
        for stamp_ns, tag, rgb in resumed.collecting:  # scale frames whose results come with the next ones
            ns = int(stamp_ns or 0)
            frame_id = (tag or {}).get("frame_id") or self.settings.camera_frame or "camera_optical_frame"
            self._collected.append(InputFrame(rgb=rgb, stamp=self.make_stamp(ns), stamp_s=ns * 1e-9,
                                              camera_frame=frame_id))
        self.status.refresh_stats()
        self.status.last_index = resumed.next_frame
        restored = self.restored_map
        kept = f"; map {restored.points} points, path {restored.poses} poses" if restored and not restored.note \
            else (f"; map and path not restored: {restored.note}" if restored else "")
        self.status.set(State.INITIALIZING, resumed.describe() + kept)
        self.status.publish(self.status.text, None)

    def _restore_map(self, resumed: Resumed) -> None:
        """The map and path of the journal or session ``resumed`` came from (``map.lbj`` beside
        its journal), cut at its next frame; journaled again from there (``MapJournal.start``)."""
        if not self.outputs.flush(RESTORE_FLUSH_S):  # the map's clear runs on the output thread
            self.log.warning("the output thread did not finish in time; the map is restored anyway")
        identity = self.journal.identity if self.journal is not None else None
        self.restored_map = restore_map(Path(resumed.path).parent / MAP_JOURNAL_NAME, self.map, self.trajectory,
                                        resumed.next_frame, self.make_stamp, identity)
        if self.map_journal is not None:
            self.map_journal.start()
        if self.settings.publish_path and len(self.trajectory):
            self.sink.publish_path(self.trajectory.entries())

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

    # ------------------------------------------------------------------ status
    def _heartbeat(self, clock_problem: str = "") -> None:
        """Publish a status when none went out for HEARTBEAT_PERIOD (or the input went quiet)."""
        self.notes.counters(self.counters)
        self.keyframes.check_hold_deadline()
        self.keyframes.check_deferral_deadline()
        quiet = self.seconds_since_input()
        changed = False
        if self.status.state not in (State.ERROR, State.RESETTING) and not self.queue.pending_frame() and (
                quiet is None or quiet > self.settings.input_timeout):
            waited = "no image received yet" if quiet is None else f"no image for {quiet:.1f} s"
            changed = self.status.state != State.WAITING_FOR_IMAGES
            self.status.set(State.WAITING_FOR_IMAGES, waited)
        if changed or self.status.due():
            self.status.publish(self.status.text + (f"; {clock_problem}" if clock_problem else ""),
                                self.stamps.last_stamp)


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
