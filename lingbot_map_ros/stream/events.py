"""What a ``LongStreamSession`` tells the one observer that may listen to it (the keyframe
journal, ``journal.recorder.JournalRecorder``): every change of the model's state, in the order
it happened, as values. numpy only; the types below are imported for type checking only.

The session calls these on its own thread, after the change is made; an observer records and
never calls back into the session.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .alignment import Sim3
    from .results import FrameResult
    from .window import KeptKeyframe


@dataclass(frozen=True)
class Taken:
    """The results of one submitted frame, taken in submission order."""

    results: list[FrameResult]  # global frame; [] for a scale frame whose step has not run yet
    stamp: int | None  # the frame's stamp (ns) as submitted
    tag: Any  # what the caller submitted with it
    scale: bool  # it was one of the sequence's scale frames (recorded when submitted)
    deferred: bool  # eviction deferred when the results were taken


@dataclass(frozen=True)
class Restarted:
    """A window restart: everything a later rebuild needs to redo it."""

    kept: tuple[KeptKeyframe, ...]  # the re-fed keyframes as published
    window_index: int
    window_start: int
    alignment: Sim3
    last_keyframe_c2w: np.ndarray | None  # the motion policy's poses as of the restart
    latest_c2w: np.ndarray | None
    deferred: bool
    resolution: tuple[int, int] | None  # (H, W)


class SessionEvents(Protocol):
    """An observer of a session's state changes (see the module docstring)."""

    def scale_frame(self, frame: np.ndarray | torch.Tensor, stamp: int | None, tag: Any, deferred: bool) -> None:
        """A scale frame was taken (its step runs with the last of them); ``frame`` as checked."""

    def scale_frames_lost(self, deferred: bool) -> None:
        """The scale step failed: the scale frames collected so far are gone."""

    def frame_taken(self, taken: Taken) -> None:
        """A submitted frame's results were taken (oldest first)."""

    def window_restarted(self, restart: Restarted) -> None:
        """A new window started from the kept keyframes (the results before it were taken)."""

    def rolled_back(self, frame: int, next_frame: int, scale_frames_gone: bool) -> None:
        """The last stored frame left the cache; ``next_frame`` is the next frame's index."""

    def committed(self, freed: int) -> None:
        """The deferred evictions ran (``freed`` pages)."""

    def deferral_set(self, deferred: bool) -> None:
        """Evictions now wait for a commit (True) or run at once (False)."""

    def sequence_reset(self, deferred: bool) -> None:
        """A new sequence starts (a reset)."""


__all__ = ["SessionEvents", "Taken", "Restarted"]
