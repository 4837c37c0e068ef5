"""What a camera does when a frame goes wrong or tracking is lost: ``Recovery``.

- A step that fails: the cache refusing a frame while eviction is deferred drops that frame and
  keeps the state (a warning asks for ~/commit_eviction or ~/rollback_last_frame); any other
  exception (out of memory, the model's horizon) costs the frames it consumed and starts a new
  sequence (state ERROR, then INITIALIZING).
- A non-finite pose: the frame leaves the cache when it was stored (for the scale frames: all
  of them), its outputs are dropped; a non-finite depth drops the outputs only.
- A lost track with ``on_lost=reset`` (or ``relocalize`` that gave up: ``loop_link.LoopLink``):
  a new sequence, placed in the same map frame through odometry when it can be
  (``anchor.MapAnchor``), else at a new origin.
- ``clear_sequence``: the one way a camera forgets its sequence (the session's cache, the
  ``Sequence``'s path, map, decisions, health and scale).

Inference thread only; no ROS.
"""
from __future__ import annotations

from typing import Any, Callable

from ..stream import CacheFullError, FrameResult, SessionError
from .frames import InputFrame, Logger, State
from .journaling import JournalNotes
from .params import NodeSettings
from .sequence import Sequence
from .stamps import StampGate
from .status import StatusReporter, release_device_memory
from .worker import Throttle


class Recovery:
    """See the module docstring. ``collected``: the engine's frames stepped and waiting for their
    results (the scale frames), shared with it; ``settings()``: the settings in force."""

    def __init__(self, session, seq: Sequence, reporter: StatusReporter, stamps: StampGate, notes: JournalNotes,
                 collected: list[InputFrame], log: Logger, throttle: Throttle,
                 settings: Callable[[], NodeSettings]) -> None:
        self.session, self.seq, self.reporter, self.stamps, self.notes = session, seq, reporter, stamps, notes
        self.collected, self.log, self.throttle, self.settings = collected, log, throttle, settings

    # ------------------------------------------------------------------ a new sequence
    def clear_sequence(self, keep_map_frame: bool = False, reset_session: bool = True) -> None:
        """Forget the sequence (cache, path, map, health, scale). ``keep_map_frame``: a lost reset,
        whose next sequence may continue the map frame (the last good pose stays); otherwise the
        next sequence starts a new map origin. ``reset_session`` False: the session's state stays
        (a rebuilt session's)."""
        if reset_session:
            self.session.reset()
        self.collected.clear()
        self.seq.clear(keep_map_frame)
        self.reporter.refresh_stats()
        self.notes.anchor(self.seq.anchor)

    # ------------------------------------------------------------------ failed steps
    def step_failed(self, frame: InputFrame, exc: Exception) -> None:
        """``frame``'s step raised ``exc`` (the frame is the last of ``collected``)."""
        if isinstance(exc, CacheFullError):
            stats = self.session.stats()
            if self.session.deferred_eviction and stats is not None and stats.pending_evictions > 0:
                # the caller's deferral filled the cache: drop the frame, keep the state
                self.collected.remove(frame)
                self.seq.count("frames_dropped_error")
                text = f"frame dropped, cache full while eviction is deferred: {exc}"
                self.throttle.emit(self.log.warning, text + "; call ~/commit_eviction or ~/rollback_last_frame",
                                   kind="deferred full")
                self.reporter.publish(text, frame.stamp)
                return
        self.inference_error(exc)  # e.g. the model's horizon: a new sequence starts

    def inference_error(self, exc: Exception) -> None:
        """An exception of the model: the frames it consumed are lost, a new sequence starts."""
        seq = self.seq
        lost = len(self.collected)
        seq.count("frames_dropped_error", lost)
        text = f"inference failed: {type(exc).__name__}: {exc}"
        self.log.error(f"{text}; {lost} frame(s) lost, resetting the session (a new sequence starts)")
        stamp = self.collected[-1].stamp if self.collected else self.stamps.last_stamp
        seq.set_state(State.ERROR, text)
        self.reporter.publish(text, stamp)
        try:
            self.clear_sequence()
            release_device_memory(self.session)
        except Exception as reset_exc:
            seq.set_state(State.ERROR, f"{text}; reset failed: {type(reset_exc).__name__}: {reset_exc}")
            self.log.error(seq.text)
            self.reporter.publish(seq.text, stamp)
            return
        seq.set_state(State.INITIALIZING, f"recovered from: {text}; waiting for scale frames")
        self.reporter.publish(seq.text, stamp)

    # ------------------------------------------------------------------ bad outputs
    def non_finite_pose(self, results: list[FrameResult], frames: list[InputFrame]) -> None:
        """Some of ``results`` have a non-finite pose: none is published; a stored step leaves the cache."""
        seq = self.seq
        bad = [r.frame_index + 1 for r in results if not all(map(_finite, r.c2w.reshape(-1)))]
        stored = results[0].is_keyframe
        note = "kept out of the cache"
        if stored:
            try:
                self.session.rollback_last_frame(results[-1].frame_index)
                note = "rolled back from the cache"
                seq.decisions.forget_from(results[0].frame_index + 1)
            except SessionError as exc:
                note = f"could not be rolled back ({exc})"
        dropped = len(results) if stored else len(bad)
        seq.count("frames_dropped_invalid", dropped)
        self.throttle.emit(self.log.warning, f"non-finite pose from the model for frame(s) {bad}: "
                           f"{dropped} frame(s) dropped and {note}", kind="non-finite pose")
        seq.tracking.judge(None, None, finite=False)
        self.reporter.publish(f"dropped frame(s) {bad}: non-finite pose", frames[-1].stamp)

    def non_finite_depth(self, r: FrameResult, frame: InputFrame) -> None:
        """A finite pose with a non-finite depth or confidence: the outputs go, the cache keeps it."""
        self.seq.count("frames_dropped_invalid")
        self.throttle.emit(self.log.warning, f"non-finite depth from the model for frame {r.frame_index + 1}: "
                           "outputs dropped (the frame stays in the cache)", kind="non-finite depth")
        self.seq.tracking.judge(None, None, finite=False)
        self.reporter.publish("dropped: non-finite depth", frame.stamp, frame_index=r.frame_index + 1)

    # ------------------------------------------------------------------ lost track
    def start_over(self, reasons: str, stamp: Any) -> None:
        """A lost track (``reasons``) ends the sequence (on_lost=reset, or relocalize that gave up): a
        new one starts, placed in the same map frame through odometry when it can be (``MapAnchor``)."""
        seq = self.seq
        pending, why = seq.anchor.lost()
        self.clear_sequence(keep_map_frame=True)
        if pending is not None:
            seq.anchor.continue_from(pending)
            self.log.warning(f"tracking lost ({reasons}): starting a new sequence; it continues the "
                             f"map from the last good pose (frame {pending.good.index}) through odometry")
            text = f"tracking lost ({reasons}): new sequence, aligned to the last good pose through odometry"
        else:
            seq.anchor.new_origin()
            self.throttle.emit(self.log.warning, f"tracking lost ({reasons}): starting a new sequence at "
                               f"a NEW map origin (the map frame jumps): {why}", kind="lost origin")
            text = f"tracking lost ({reasons}): new sequence at a new map origin ({why})"
        seq.set_state(State.INITIALIZING, text)
        self.reporter.publish(text, stamp)


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


__all__ = ["Recovery"]
