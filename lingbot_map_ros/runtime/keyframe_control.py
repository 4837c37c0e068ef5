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

The bookkeeping (hold, deadlines, refusals) is ``decisions.KeyframeDecisions``; this part
applies it to the session and, through the camera's ``runtime.sequence.Sequence``, to the
path, the map and the counters, and reports it (status, throttled warnings). Inference thread
only; no ROS. ``settings()`` is the engine's settings in force.
"""
from __future__ import annotations

from typing import Any, Callable

from ..stream import FrameMismatchError, SessionError
from .decisions import DecisionRefused
from .frames import Logger
from .params import NodeSettings
from .sequence import Sequence
from .stamps import StampGate
from .status import StatusReporter
from .worker import Throttle


class KeyframeControl:
    """See the module docstring."""

    def __init__(self, session: Any, seq: Sequence, settings: Callable[[], NodeSettings], reporter: StatusReporter,
                 stamps: StampGate, log: Logger, throttle: Throttle, monotonic: Callable[[], float]) -> None:
        self.session, self.seq, self.settings, self.reporter = session, seq, settings, reporter
        self.decisions = seq.decisions
        self.stamps = stamps  # the last stamp taken: the status's
        self.log, self.throttle, self.monotonic = log, throttle, monotonic

    def commit_eviction(self, expected_frame_index: int = 0) -> int:
        """Run the deferred evictions: the client keeps the latest stored frame (1-based
        ``expected_frame_index``; 0 = whichever it is). With a decision hold this is the "keep"
        decision about the held frame. Returns the pages freed; raises SessionError (nothing
        changed) when the index names another frame or one already decided."""
        held = self._check(expected_frame_index, commit=True)
        freed = self.session.commit_eviction()
        self.decisions.client_back()
        if held is not None:
            self.seq.count(self.decisions.decide(held, "kept"))
        self.reporter.refresh_stats()
        self.note_pending()
        self.reporter.publish(self.seq.text, self.stamps.last_stamp)
        return freed

    def rollback(self, expected_frame_index: int) -> int:
        """Undo the last stored frame (1-based ``expected_frame_index``; 0 = the latest).

        Removes its tokens from the cache and, with it, the points and poses of every frame
        the session forgot. With a decision hold this is the "drop" decision about the held
        frame. Returns its 1-based index; raises SessionError (nothing changed).
        """
        held = self._check(expected_frame_index, commit=False)
        index = self._rollback_stored(held if held is not None else expected_frame_index)
        self.decisions.client_back()
        if held is not None:
            self.seq.count(self.decisions.decide(held, "dropped"))
        self.reporter.publish(f"rolled back frame {index}", self.stamps.last_stamp)
        return index

    def _check(self, expected_frame_index: int, commit: bool) -> int | None:
        """``KeyframeDecisions.check``, a refusal counted in decisions_refused where it counts."""
        try:
            return self.decisions.check(expected_frame_index, commit=commit,
                                        hold_mode=self.settings().keyframe_decision_timeout > 0)
        except DecisionRefused as exc:
            if exc.counted:
                self.seq.count("decisions_refused")
            raise

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
        self.seq.count(self.decisions.decide(hold.index, f"{default} by timeout"))
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
        self.seq.count("evictions_auto_committed")
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
        self.seq.forget_from(self.session.frames_pushed)  # the frames the session forgot
        self.reporter.refresh_stats()
        self.note_pending()
        return index + 1


__all__ = ["KeyframeControl"]
