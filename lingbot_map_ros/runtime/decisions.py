"""A camera's keyframe decisions: ``KeyframeDecisions``.

- **Hold** (``keyframe_decision_timeout`` > 0): a stored frame waits for a keep
  (~/commit_eviction) or drop (~/rollback_last_frame) decision about it until its
  deadline; meanwhile the engine takes only commands. A decision names the held frame
  (1-based, 0 = whichever it is); another index, or a frame already decided, is refused
  (``DecisionRefused``, which says whether it counts in ``decisions_refused``) and nothing
  changes.
- **Motion reference** of ~/frame: the poses of the last stored frames (the newest is
  the reference of the next frames' translation and rotation since the keyframe).
- **Deferral deadline** (``deferred_eviction_timeout``): the time the oldest deferred
  eviction has waited; past the timeout the engine commits it, and later ones at once
  until a client decides again (a keyframe client that died must not blind the robot).

Bookkeeping only: ``keyframe_control`` applies the decisions to the session and the
``Sequence`` counts them (``decide`` returns the counter). Inference thread only; no ROS,
no torch. Owned by the camera's ``runtime.sequence.Sequence``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..stream import SessionError

KEYFRAME_POSES = 8  # stored frames' poses kept as motion references


class DecisionRefused(SessionError):
    """A keep/drop decision that cannot apply (nothing changed); ``counted``: it counts in
    ``decisions_refused`` (a decision about a held or decided frame, or any in hold mode)."""

    def __init__(self, message: str, counted: bool) -> None:
        super().__init__(message)
        self.counted = counted


DECISION_COUNTERS = {"kept": "decisions_kept", "dropped": "decisions_dropped"}  # else decisions_timed_out


@dataclass(frozen=True)
class Hold:
    """A stored frame waiting for a keep/drop decision."""

    index: int  # 1-based
    deadline: float  # monotonic seconds
    timeout: float = 0.0  # the keyframe_decision_timeout it runs under (a run-time change is seen against it)


class KeyframeDecisions:
    """See the module docstring."""

    def __init__(self) -> None:
        self.hold: Hold | None = None
        self.decided: tuple[int, str] | None = None  # the last decided frame (hold mode): (index, how)
        self.last_stored = 0  # 1-based index of the newest stored frame still in the cache; 0 = none
        self.poses: list[tuple[int, np.ndarray]] = []  # (1-based index, T_map_cam) of stored frames
        self.pending_since: float | None = None  # monotonic time the oldest deferred eviction started waiting
        self.client_gone = False  # the deferral deadline passed: commit at once until a client decides

    # ------------------------------------------------------------------ hold
    def start_hold(self, index: int, now: float, timeout: float) -> None:
        """Hold frame ``index`` (1-based) for ``timeout`` seconds from ``now``."""
        self.hold = Hold(index, now + timeout, timeout)
        self.decided = None

    def expired(self, now: float, timeout: float) -> Hold | None:
        """The held frame whose deadline passed at ``now``, else None.

        ``timeout`` is the keyframe_decision_timeout in force now: one lowered at run time applies
        to the held frame from now (its deadline becomes now + timeout when that is sooner; 0
        releases it at once); a longer one starts with the next hold."""
        hold = self.hold
        if hold is None:
            return None
        if timeout < hold.timeout:  # shortened at run time (0 included): the new timeout counts from now
            hold = self.hold = Hold(hold.index, min(hold.deadline, now + timeout), timeout)
        return hold if now >= hold.deadline else None

    def check(self, expected: int, commit: bool, hold_mode: bool) -> int | None:
        """The held frame a decision is about (None without a hold); ``DecisionRefused`` when
        ``expected`` (1-based, 0 = the latest) names another frame or one already decided. ``commit``:
        a keep, whose index must be the latest stored frame (a rollback's is checked by the session);
        ``hold_mode``: keyframe_decision_timeout > 0 (a refused commit counts as a refused decision)."""
        hold = self.hold
        if hold is not None:
            if expected not in (0, hold.index):
                raise DecisionRefused(f"frame {expected} is not the frame waiting for a decision ({hold.index}); "
                                      "nothing changed", counted=True)
            return hold.index
        if self.decided is not None and expected == self.decided[0]:
            raise DecisionRefused(f"frame {expected} was already decided ({self.decided[1]}); nothing changed",
                                  counted=True)
        if commit and expected not in (0, self.last_stored):
            latest = self.last_stored or "none (nothing stored since the last reset or rollback)"
            raise DecisionRefused(f"the last stored frame is {latest}, not {expected}; nothing changed",
                                  counted=hold_mode)
        return None

    def decide(self, index: int, how: str) -> str:
        """``how``: "kept", "dropped" or "<default> by timeout"; returns the counter it counts in."""
        self.hold = None
        self.decided = (index, how)
        return DECISION_COUNTERS.get(how, "decisions_timed_out")

    # ------------------------------------------------------------------ motion reference
    def stored(self, index: int, T_map_cam: np.ndarray) -> None:
        """Frame ``index`` (1-based) was stored with this pose: the next frames' reference."""
        self.last_stored = index
        self.poses = self.poses[-(KEYFRAME_POSES - 1):] + [(index, T_map_cam)]

    def reference(self) -> np.ndarray | None:
        """T_map_cam [4, 4] of the newest stored frame, or None."""
        return self.poses[-1][1] if self.poses else None

    def forget_from(self, index: int) -> None:
        """Frames from 1-based ``index`` on left the cache: they are no reference any more."""
        self.poses = [(i, T) for i, T in self.poses if i < index]
        if self.last_stored >= index:
            self.last_stored = 0

    # ------------------------------------------------------------------ deferral deadline
    def note_pending(self, pending: bool, now: float) -> None:
        """Start (or stop) the deferral clock from whether evictions are pending."""
        if not pending:
            self.pending_since = None
        elif self.pending_since is None:
            self.pending_since = now

    def deferral_due(self, timeout: float, now: float) -> bool:
        """Whether the pending evictions must be committed now (``timeout`` s; 0 = never)."""
        since = self.pending_since
        return timeout > 0 and since is not None and (self.client_gone or now - since >= timeout)

    def auto_committed(self) -> None:
        self.pending_since = None
        self.client_gone = True  # until the client commits, rolls back or sets the deferral again

    def client_back(self) -> None:
        self.client_gone = False

    def clear(self) -> None:
        """A new sequence: no hold, no decided frame, no reference, no deferral clock."""
        self.hold = self.decided = self.pending_since = None
        self.last_stored = 0
        self.poses = []


__all__ = ["KeyframeDecisions", "DecisionRefused", "Hold", "KEYFRAME_POSES", "DECISION_COUNTERS"]
