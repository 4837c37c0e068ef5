"""Several cameras on one model: ``CameraSessions``.

One model in memory, one K/V storage whose pages every camera's cache draws from,
one ``Session`` per camera (its own scale frames, window, special tokens, window
restarts). Callers drive the sessions from ONE thread (they share the model's
step options and the GPU), e.g. in turn; see ``CameraScheduler``.

(API first; the shared storage lands in the next commit.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..config import LongStreamConfig, StreamConfig
from .protocol import Session


@dataclass(frozen=True)
class CameraPool:
    """What one camera holds of the shared storage."""

    pages: int  # pages of its current extent (0 before its first frame)
    page_tokens: int  # tokens per page (its resolution's patch count)
    used_pages: int  # pages holding its frames now (scale + window + special)


@dataclass(frozen=True)
class PoolStatus:
    """The shared K/V storage: capacity, what is leased, per camera."""

    capacity_tokens: int
    leased_tokens: int
    nbytes: int
    cameras: dict[str, CameraPool]


class CameraSessions:
    """``sessions[name]``: a ``Session`` per camera, all on ``model``.

    ``cameras`` maps each name to its (StreamConfig, LongStreamConfig or None: no windowed
    restarts). Every StreamConfig must name the model's device and dtype.
    """

    def __init__(self, model, cameras: Mapping[str, tuple[StreamConfig, LongStreamConfig | None]]) -> None:
        from .long_stream import LongStreamSession
        from .session import StreamingSession

        if not cameras:
            raise ValueError("CameraSessions needs at least one camera")
        self.model = model
        self.sessions: dict[str, Session] = {}
        for name, (cfg, long_cfg) in cameras.items():
            inner = StreamingSession(model, cfg)
            self.sessions[name] = LongStreamSession(inner, long_cfg) if long_cfg is not None else inner

    def pool_status(self) -> PoolStatus:
        cams = {}
        for name, s in self.sessions.items():
            st = s.stats()
            cams[name] = CameraPool(pages=0, page_tokens=0,
                                    used_pages=0 if st is None else st.scale_pages + st.window_pages + st.special_pages)
        return PoolStatus(capacity_tokens=0, leased_tokens=0, nbytes=0, cameras=cams)


__all__ = ["CameraSessions", "PoolStatus", "CameraPool"]
