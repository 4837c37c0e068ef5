"""A keyframe client's commands and their deadlines, applied to a camera's session:
``KeyframeControl``.

- ``commit_eviction``: keep the latest stored frame (run the deferred evictions); with a
  decision hold, the "keep" decision about the held frame;
- ``rollback``: drop the latest stored frame (its tokens, and the path and map of every
  frame the session forgot); with a decision hold, the "drop" decision;
- ``check_hold_deadline``: a held frame whose decision did not come in time gets
  ``keyframe_decision_default``;
- ``check_deferral_deadline``: deferred evictions older than ``deferred_eviction_timeout``
  are committed (a keyframe client that died must not blind the robot: the cache would fill
  and refuse every frame).

The bookkeeping (hold, deadlines, refusals, counts) is ``decisions.KeyframeDecisions``; this
part applies it to the session, the path and the map, and reports it (status, throttled
warnings). Inference thread only; no ROS. ``settings()`` is the engine's settings in force.
"""
from __future__ import annotations

from typing import Any, Callable

from ..stream import FrameMismatchError, SessionError
from .decisions import KeyframeDecisions
from .frames import Logger, Sink
from .mapping import MapAccumulator, Trajectory
from .output_worker import OutputWorker
from .params import NodeSettings
from .stamps import StampGate
from .status import StatusReporter
from .worker import Counters, Throttle


class KeyframeControl:
    """See the module docstring."""

    def __init__(self, session: Any, decisions: KeyframeDecisions, settings: Callable[[], NodeSettings],
                 reporter: StatusReporter, stamps: StampGate, counters: Counters, trajectory: Trajectory,
                 map_: MapAccumulator | None, outputs: OutputWorker, sink: Sink, log: Logger, throttle: Throttle,
                 monotonic: Callable[[], float]) -> None:
        self.session, self.decisions, self.settings, self.reporter = session, decisions, settings, reporter
        self.stamps = stamps  # the last stamp taken: the status's
        self.counters, self.trajectory, self.map, self.outputs = counters, trajectory, map_, outputs
        self.sink, self.log, self.throttle, self.monotonic = sink, log, throttle, monotonic

    def commit_eviction(self, expected_frame_index: int = 0) -> int:
        """Run the deferred evictions: the client keeps the latest stored frame (1-based
        ``expected_frame_index``; 0 = whichever it is). With a decision hold this is the "keep"
        decision about the held frame. Returns the pages freed; raises SessionError (nothing
        changed) when the index names another frame or one already decided."""
        held = self.decisions.check(expected_frame_index, commit=True,
                                    hold_mode=self.settings().keyframe_decision_timeout > 0)
        freed = self.session.commit_eviction()
        self.decisions.client_back()
        if held is not None:
            self.decisions.decide(held, "kept")
        self.reporter.refresh_stats()
        self.note_pending()
        self.reporter.publish(self.reporter.text, self.stamps.last_stamp)
        return freed

    def rollback(self, expected_frame_index: int) -> int:
        """Undo the last stored frame (1-based ``expected_frame_index``; 0 = the latest).

        Removes its tokens from the cache and, with it, the points and poses of every frame
        the session forgot. With a decision hold this is the "drop" decision about the held
        frame. Returns its 1-based index; raises SessionError (nothing changed).
        """
        held = self.decisions.check(expected_frame_index, commit=False,
                                    hold_mode=self.settings().keyframe_decision_timeout > 0)
        index = self._rollback_stored(held if held is not None else expected_frame_index)
        self.decisions.client_back()
        if held is not None:
            self.decisions.decide(held, "dropped")
        self.reporter.publish(f"rolled back frame {index}", self.stamps.last_stamp)
        return index

    def deferral_changed(self) -> None:
        """Deferred eviction was switched (the session's, by the engine): a client is back."""
        self.decisions.client_back()
        self.reporter.refresh_stats()
        self.note_pending()

    def note_pending(self) -> None:
        """Start (or stop) the clock of deferred_eviction_timeout from the session's pending evictions."""
        stats = self.session.stats()
        self.decisions.note_pending(stats is not None and stats.pending_evictions > 0, self.monotonic())

    def check_hold_deadline(self) -> None:
        """Apply keyframe_decision_default to a held frame whose decision did not come in time."""
        s = self.settings()
        hold = self.decisions.expired(self.monotonic(), s.keyframe_decision_timeout)
        if hold is None:
            return
        default = s.keyframe_decision_default
        try:
            if default == "drop":
                self._rollback_stored(hold.index)
            else:
                self.session.commit_eviction()
                self.note_pending()
            note = ""
        except SessionError as exc:
            note = f" (could not be applied: {exc})"
        self.decisions.decide(hold.index, f"{default} by timeout")
        self.throttle.emit(self.log.warning, f"no decision about frame {hold.index} within keyframe_decision_timeout="
                           f"{s.keyframe_decision_timeout} s: applied keyframe_decision_default={default}"
                           f"{note}", kind="decision timeout")
        self.reporter.refresh_stats()
        self.reporter.publish(f"frame {hold.index}: {default} by timeout", self.stamps.last_stamp)

    def check_deferral_deadline(self) -> None:
        """Commit deferred evictions that waited longer than deferred_eviction_timeout."""
        timeout = self.settings().deferred_eviction_timeout
        if not self.decisions.deferral_due(timeout, self.monotonic()):
            return
        freed = self.session.commit_eviction()
        self.decisions.auto_committed()
        self.counters.add("evictions_auto_committed")
        self.reporter.refresh_stats()
        self.throttle.emit(self.log.warning, f"a deferred eviction waited more than deferred_eviction_timeout="
                           f"{timeout} s for ~/commit_eviction: committed automatically ({freed} page(s) freed); "
                           "later ones are committed at once until a client commits again", kind="auto commit")

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
        self.reporter.last_index = min(self.reporter.last_index, forgotten_from)
        self.reporter.refresh_stats()
        self.note_pending()
        if self.settings().publish_path and removed:
            self.sink.publish_path(self.trajectory.entries())
        return index + 1


__all__ = ["KeyframeControl"]
