"""What a session raises, in one light module (no torch): the ROS layer and the command
line catch these without importing the cache or the model.

* ``SessionError``: a request the session cannot honour (nothing to roll back, ...);
  its state is unchanged. ``FrameMismatchError`` is the rollback of another frame than
  the last stored one.
* ``InvalidFrameError`` (a ``ValueError``): a frame the session refuses (shape, dtype,
  size, too few patches, another resolution than the running sequence's); nothing
  changed, the next good frame continues the sequence.
* ``CacheError`` / ``CacheFullError`` (from ``cache.pages``): the cache cannot take the
  step (no free page while evictions are deferred, or the model's temporal horizon).
"""
from __future__ import annotations

from ..cache.pages import CacheError, CacheFullError


class SessionError(RuntimeError):
    """A request the session cannot honour; its state is unchanged."""


class FrameMismatchError(SessionError):
    """rollback_last_frame was asked for another frame than the last stored one (0-based indices)."""

    def __init__(self, last_stored: int, expected: int) -> None:
        super().__init__(f"the last stored frame is {last_stored}, not {expected}")
        self.last_stored, self.expected = last_stored, expected


class InvalidFrameError(ValueError):
    """A frame the session refuses (its message says why, in model-input pixels); nothing changed."""


__all__ = ["SessionError", "FrameMismatchError", "InvalidFrameError", "CacheError", "CacheFullError"]
