"""Streaming sessions: the model, the paged cache and the streaming policy in one owner.

What the node and the command line need without importing torch, the cache or the model
comes from here: the ``Session`` protocol, ``FrameResult`` and the errors
(``SessionError``, ``FrameMismatchError``, ``InvalidFrameError``, ``CacheError``,
``CacheFullError``). The sessions themselves and ``BackendUnavailable`` are loaded on
first use (``from lingbot_map_ros.stream import StreamingSession`` imports torch then).
"""
from __future__ import annotations

from typing import Any

from .errors import CacheError, CacheFullError, FrameMismatchError, InvalidFrameError, SessionError
from .protocol import Pending, Session
from .results import FrameResult

_LAZY = ("StreamingSession", "PendingResults", "LongStreamSession", "BackendUnavailable")  # they import torch


def __getattr__(name: str) -> Any:
    if name in ("StreamingSession", "PendingResults"):
        from . import session as module
    elif name == "LongStreamSession":
        from . import long_stream as module
    elif name == "BackendUnavailable":
        from ..cache import attention as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)
    return value


__all__ = ["Session", "Pending", "FrameResult", "SessionError", "FrameMismatchError", "InvalidFrameError",
           "CacheError", "CacheFullError", *_LAZY]
