"""Several cameras on one model: ``CameraSessions``.

One model in memory, one K/V storage whose pages every camera's cache draws from,
one ``Session`` per camera (its own scale frames, window, special tokens, window
restarts). Callers drive the sessions from ONE thread (they share the model's
step options and the GPU), in turn: the node's scheduler (``runtime.scheduler``) takes
the cameras' latest frames round-robin; ``benchmarks/stream/multi_camera.py`` feeds
them at a camera rate and submits one camera's frame before taking another's results.
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
    """``sessions[name]``: a ``Session`` per camera, all on ``model``, all drawing their K/V
    pages from ``storage`` (one ``SharedKVStorage``).

    ``cameras`` maps each name to its (StreamConfig, LongStreamConfig or None: no windowed
    restarts). Every StreamConfig must name the same dtype (the model's) and backend
    kind. The first camera's session makes the heads' reduced-precision copies and the
    kernel decision; the others share them (one copy of the weights). ``pool_tokens``:
    the storage's capacity in tokens, 0 = sized at the first camera's first frame for
    all cameras at that camera's resolution (it grows if a camera needs more, see
    ``SharedKVStorage``).

    Page ownership: each camera's ``PageTable`` numbers pages 0..n-1 inside its own
    extent, its pool is a view that ends there, and every step's page ids are checked
    against the extent before anything runs (``CrossedExtentError``).
    """

    def __init__(self, model, cameras: Mapping[str, tuple[StreamConfig, LongStreamConfig | None]],
                 pool_tokens: int = 0, with_depth: bool = True) -> None:
        from ..cache.pool import SharedKVStorage
        from .long_stream import LongStreamSession
        from .session import StreamingSession, torch_dtype

        if not cameras:
            raise ValueError("CameraSessions needs at least one camera")
        dtypes = {cfg.dtype for cfg, _ in cameras.values()}
        if len(dtypes) != 1:
            raise ValueError(f"every camera must stream in the same dtype (the model's), got {sorted(dtypes)}")
        self.model = model
        mcfg = model.cfg
        device = next(model.parameters()).device
        self.storage = SharedKVStorage(mcfg.depth, mcfg.num_heads, mcfg.head_dim, torch_dtype(dtypes.pop()),
                                       device, capacity_tokens=pool_tokens, reserve=len(cameras))
        self.inner: dict[str, StreamingSession] = {}
        self.sessions: dict[str, Session] = {}
        first = None
        for name, (cfg, long_cfg) in cameras.items():
            inner = StreamingSession(model, cfg, with_depth=with_depth, storage=self.storage, owner=name,
                                     share_from=first)
            first = first or inner
            self.inner[name] = inner
            self.sessions[name] = LongStreamSession(inner, long_cfg) if long_cfg is not None else inner

    @property
    def names(self) -> list[str]:
        return list(self.sessions)

    def submit_many(self, frames: Mapping[str, object], keyframes: Mapping[str, bool | None] | None = None
                    ) -> dict[str, object]:
        """One frame for each named camera, as each camera's ``submit`` would take it, but the
        frames whose steps can go together run in one batched trunk (``session.submit_batch``:
        phase-2 one-frame steps with captured CUDA graphs). Returns per camera its pending
        results, or the exception its ``submit`` raised (that camera is unchanged; the others
        are not affected). Cameras with windowed restarts decide and restart first, as in
        ``LongStreamSession.submit``."""
        from .session import submit_batch

        keyframes = keyframes or {}
        unknown = [c for c in frames if c not in self.sessions]
        if unknown:
            raise KeyError(f"unknown cameras {unknown}; cameras: {self.names}")
        out: dict[str, object] = {}
        names, stores = [], []
        for c in frames:
            session = self.sessions[c]
            if session is self.inner[c]:
                stores.append(keyframes.get(c))
            else:  # LongStreamSession: its decision (and restart) before the inner step
                try:
                    stores.append(session.before_inner_submit(frames[c], keyframes.get(c)))
                except Exception as exc:
                    out[c] = exc
                    continue
            names.append(c)
        results = submit_batch([self.inner[c] for c in names], [frames[c] for c in names], stores) if names else []
        for c, result in zip(names, results):
            session = self.sessions[c]
            out[c] = result if isinstance(result, Exception) or session is self.inner[c] \
                else session.after_inner_submit(result)
        return {c: out[c] for c in frames}

    def wait(self) -> None:
        """Take every camera's in-flight results onto the host (the GPU is idle afterwards)."""
        for inner in self.inner.values():
            inner.wait()

    def pool_status(self) -> PoolStatus:
        cams = {}
        for name, session in self.sessions.items():
            lease = self.storage.lease_of(name)
            st = session.stats()
            used = 0 if st is None else st.scale_pages + st.window_pages + st.special_pages
            cams[name] = CameraPool(pages=0 if lease is None else lease.pages,
                                    page_tokens=0 if lease is None else lease.page_size, used_pages=used)
        return PoolStatus(capacity_tokens=self.storage.capacity, leased_tokens=self.storage.leased_tokens,
                          nbytes=self.storage.nbytes, cameras=cams)


__all__ = ["CameraSessions", "PoolStatus", "CameraPool"]
