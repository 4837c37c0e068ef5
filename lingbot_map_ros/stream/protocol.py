"""``Session``: what the node and the command line use of a streaming session
(``LongStreamSession``: windowed restarts, or one window without a ``LongStreamConfig``).
A light module: the types it names are imported for type checking only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..cache.pages import CacheStats
    from ..config import StreamConfig
    from .results import FrameResult


class Pending(Protocol):
    """One submitted frame (``Session.submit``): hand it to ``Session.results`` for its results."""


@runtime_checkable
class Session(Protocol):
    """One owner of the model, the cache and the streaming policy (not thread-safe: one
    thread drives it). Indices are 0-based frames since ``reset``; every transition that
    raises leaves the state as it was."""

    @property
    def cfg(self) -> StreamConfig:
        """The streaming configuration."""

    @property
    def device(self) -> torch.device:
        """Where the model runs."""

    @property
    def frames_pushed(self) -> int:
        """Frames processed since reset (the next frame's index)."""

    @property
    def window_index(self) -> int:
        """Cache restarts since reset (always 0 for a session without windows)."""

    @property
    def deferred_eviction(self) -> bool:
        """Window evictions wait for ``commit_eviction``."""

    def push(self, image: torch.Tensor | np.ndarray, keyframe: bool | None = None, stamp: int | None = None,
             tag: Any = None) -> list[FrameResult]:
        """Feed one frame; the results that became available. InvalidFrameError for a refused
        frame, CacheFullError when the cache cannot take it; nothing changed then."""

    def submit(self, image: torch.Tensor | np.ndarray, keyframe: bool | None = None, stamp: int | None = None,
               tag: Any = None) -> Pending:
        """``push`` without waiting for the results."""

    def results(self, pending: Pending) -> list[FrameResult]:
        """The results of a submitted frame (after those of the frames submitted before it)."""

    def check_frame(self, image: torch.Tensor | np.ndarray,
                    resolution: tuple[int, int] | None = None) -> torch.Tensor:
        """InvalidFrameError unless ``push`` would take the frame's layout, dtype and size
        (patch multiple, enough patches, the running sequence's resolution, or
        ``resolution`` (H, W) when given); changes nothing. The frame as a tensor."""

    def reset(self) -> None:
        """Empty the cache; the next frame starts a new sequence."""

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        """Remove the last stored frame from the cache; returns its index. SessionError
        (FrameMismatchError for another index than ``expected_frame_index``) otherwise."""

    def set_deferred_eviction(self, deferred: bool) -> None:
        """Hold window evictions until ``commit_eviction`` (True) or evict at once (False)."""

    def commit_eviction(self) -> int:
        """Perform the pending evictions; returns the pages freed."""

    def stats(self) -> CacheStats | None:
        """The cache's counters (None before the first frame)."""


__all__ = ["Session", "Pending"]
