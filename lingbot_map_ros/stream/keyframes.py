"""Keyframes of a long stream: which frames are stored (``StorePolicy``) and what is kept
of the stored ones (``KeyframeLedger``). numpy only, no torch.

``StorePolicy``: ``"interval"`` stores frame ``i`` (global index) when the inner session
would (``StreamingSession.is_keyframe_index``); ``"motion"`` stores a frame when the latest
predicted pose has moved at least ``motion_min_translation`` or turned at least
``motion_min_rotation_deg`` from the last stored keyframe. A forced decision
(``push(image, keyframe=...)``) wins over either. A full window without ``auto_restart``
stores nothing; the policy warns about it once per window.

``KeyframeLedger``: what the session keeps of the results it took (``record``, in
submission order): the last ``overlap_frames`` keyframes (what a restart re-feeds and
aligns to), the motion policy's two poses (last keyframe's, latest frame's) and a one-step
undo of them for ``rollback_last_frame``.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..config import LongStreamConfig
from ..geometry import rotation_angle_deg
from .results import FrameResult
from .window import KeptKeyframe

log = logging.getLogger(__name__)


class StorePolicy:
    """Whether the next frame is stored, by ``LongStreamConfig.keyframe_policy``."""

    def __init__(self, cfg: LongStreamConfig, is_keyframe_index: Callable[[int], bool]) -> None:
        self.cfg = cfg
        self._is_keyframe_index = is_keyframe_index  # the interval policy (the inner session's)
        self._warned_full = False

    @property
    def reads_poses(self) -> bool:
        """Its own decisions read the latest pose (the results submitted before must be taken)."""
        return self.cfg.keyframe_policy == "motion"

    def decide(self, keyframe: bool | None, frame_index: int, last_keyframe_c2w: np.ndarray | None,
               latest_c2w: np.ndarray | None) -> bool:
        """Store global frame ``frame_index``? ``keyframe`` (not None) forces the answer;
        the two poses are the global camera-to-world of the last keyframe and latest frame."""
        if keyframe is not None:
            return bool(keyframe)
        if self.cfg.keyframe_policy == "interval":
            return self._is_keyframe_index(frame_index)
        return self._moved_enough(last_keyframe_c2w, latest_c2w)

    def window_full(self) -> bool:
        """The decision when the window is full and does not restart: not stored (warned once
        per window)."""
        if not self._warned_full:
            self._warned_full = True
            log.warning("the window holds %d stored frames and auto_restart is off: frames attend only until "
                        "restart() or reset()", self.cfg.window_frames)
        return False

    def new_window(self) -> None:
        """A restart or a reset: the next full window is warned about again."""
        self._warned_full = False

    def _moved_enough(self, last: np.ndarray | None, latest: np.ndarray | None) -> bool:
        if last is None or latest is None:
            return True
        c = self.cfg
        if c.motion_min_translation > 0 and np.linalg.norm(latest[:3, 3] - last[:3, 3]) >= c.motion_min_translation:
            return True
        return bool(c.motion_min_rotation_deg > 0
                    and rotation_angle_deg(last[:3, :3], latest[:3, :3]) >= c.motion_min_rotation_deg)


@dataclass(frozen=True)
class _Undo:
    """What one stored push changed in the ledger (the inner session keeps its own undo)."""

    keyframes: tuple[KeptKeyframe, ...]
    last_keyframe_c2w: np.ndarray | None
    latest_c2w: np.ndarray | None


class KeyframeLedger:
    """What a long stream keeps of its published results, recorded in submission order."""

    def __init__(self, overlap_frames: int) -> None:
        self._keyframes: deque[KeptKeyframe] = deque(maxlen=overlap_frames)
        self.clear()

    def clear(self) -> None:
        """Forget everything (a reset)."""
        self._keyframes.clear()
        self.last_stored: int | None = None  # global index of the caller's last stored frame (None: no undo)
        self._undo: _Undo | None = None
        self.last_keyframe_c2w: np.ndarray | None = None
        self.latest_c2w: np.ndarray | None = None

    def kept(self) -> tuple[KeptKeyframe, ...]:
        """The keyframes kept for a restart, oldest first."""
        return tuple(self._keyframes)

    def undo(self) -> None:
        """Restore what the last stored frame changed (``rollback_last_frame``); the caller
        checked that there is one (``last_stored``)."""
        undo = self._undo
        self._keyframes.clear()
        self._keyframes.extend(undo.keyframes)
        self.last_keyframe_c2w, self.latest_c2w = undo.last_keyframe_c2w, undo.latest_c2w
        self._undo, self.last_stored = None, None

    def forget_undo(self) -> None:
        """A restart: the frames stored before it cannot be rolled back."""
        self._undo, self.last_stored = None, None

    def adopt(self, kept: list[KeptKeyframe] | tuple[KeptKeyframe, ...]) -> None:
        """Keep ``kept`` (a journaled restart redone on a cleared ledger)."""
        self._keyframes.extend(kept)

    def set_poses(self, last_keyframe_c2w: np.ndarray | None, latest_c2w: np.ndarray | None) -> None:
        """The motion policy's poses as published (journal replay)."""
        self.last_keyframe_c2w, self.latest_c2w = last_keyframe_c2w, latest_c2w

    def record(self, out: list[FrameResult]) -> None:
        """The bookkeeping of one submitted frame's global results (taken in submission order)."""
        before = _Undo(tuple(self._keyframes), self.last_keyframe_c2w, self.latest_c2w)
        if out:
            self.latest_c2w = out[-1].c2w.astype(np.float64)
        if out and out[0].is_keyframe:
            self._undo, self.last_stored = before, out[-1].frame_index
            for r in out:
                self._keyframes.append(KeptKeyframe(r.frame_index, np.array(r.frame), r.c2w.astype(np.float64),
                                                    _copy(r.depth), _copy(r.confidence)))
            self.last_keyframe_c2w = out[-1].c2w.astype(np.float64)


def _copy(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.array(a, copy=True)


__all__ = ["StorePolicy", "KeyframeLedger"]
