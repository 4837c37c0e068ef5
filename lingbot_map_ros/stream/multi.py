"""Several cameras on one model: ``CameraSessions``.

One model in memory, one K/V storage whose pages every camera's cache draws from,
one ``Session`` per camera (its own scale frames, window, special tokens, window
restarts). Callers drive the sessions from ONE thread (they share the model's
step options and the GPU), in turn: the node's scheduler (``runtime.scheduler``) takes
the cameras' latest frames round-robin; ``benchmarks/stream/multi_camera.py`` feeds
them at a camera rate and submits one camera's frame before taking another's results.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..config import LongStreamConfig, StreamConfig


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
    ``SharedKVStorage``). ``steps``: how the sessions capture their one-frame steps
    (``graphs.StepCapture``; default CUDA graphs where they apply); ``fused``: force the
    kernel decision (``StreamingSession``).

    One camera is the case of many: a single camera's session gets a pool of its own
    (``cache.storage.PrivateStorage``, FP8 K/V allowed), several share one ``SharedKVStorage``.

    Page ownership: each camera's ``PageTable`` numbers pages 0..n-1 inside its own
    extent, its pool is a view that ends there, and every step's page ids are checked
    against the extent before anything runs (``CrossedExtentError``).
    """

    def __init__(self, model, cameras: Mapping[str, tuple[StreamConfig, LongStreamConfig | None]],
                 pool_tokens: int = 0, with_depth: bool = True, steps=None, fused: bool | None = None) -> None:
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
        # several cameras share one storage; one camera alone has a pool of its own
        self.storage = SharedKVStorage(mcfg.depth, mcfg.num_heads, mcfg.head_dim, torch_dtype(dtypes.pop()),
                                       device, capacity_tokens=pool_tokens, reserve=len(cameras)) \
            if len(cameras) > 1 else None
        self.inner: dict[str, StreamingSession] = {}
        self.sessions: dict[str, LongStreamSession] = {}
        first = None
        for name, (cfg, long_cfg) in cameras.items():
            inner = StreamingSession(model, cfg, with_depth=with_depth, storage=self.storage, owner=name,
                                     share_from=first, steps=steps, fused=fused)
            first = first or inner
            self.inner[name] = inner
            self.sessions[name] = LongStreamSession(inner, long_cfg)

    @property
    def names(self) -> list[str]:
        return list(self.sessions)

    def submit_many(self, frames: Mapping[str, object], keyframes: Mapping[str, bool | None] | None = None
                    ) -> dict[str, object]:
        """One frame for each named camera, as each camera's ``submit`` would take it, but the
        frames whose steps can go together run in one batched trunk (``submit_batch``:
        phase-2 one-frame steps with captured CUDA graphs). Returns per camera its ``Pending``
        (``sessions[camera].results`` takes its results), or the exception its ``submit``
        raised (that camera is unchanged; the others are not affected). Each camera checks,
        decides and restarts first (``LongStreamSession.decide``)."""
        keyframes = keyframes or {}
        unknown = [c for c in frames if c not in self.sessions]
        if unknown:
            raise KeyError(f"unknown cameras {unknown}; cameras: {self.names}")
        out: dict[str, object] = {}
        decisions = {}
        for c in frames:
            try:
                decisions[c] = self.sessions[c].decide(frames[c], keyframes.get(c))
            except Exception as exc:  # InvalidFrameError, a failed restart: this camera is unchanged
                out[c] = exc
        names = list(decisions)
        steps = submit_batch([self.inner[c] for c in names], [decisions[c].frame for c in names],
                             [decisions[c].store for c in names]) if names else []
        for c, step in zip(names, steps):
            out[c] = self.sessions[c].track(decisions[c], step)
        return {c: out[c] for c in frames}

    def wait(self) -> None:
        """Take every camera's in-flight results onto the host (the GPU is idle afterwards)."""
        for inner in self.inner.values():
            inner.wait()

    def pool_status(self) -> PoolStatus | None:
        """The shared storage's status (None for one camera: its pool is its own)."""
        if self.storage is None:
            return None
        cams = {}
        for name, session in self.sessions.items():
            lease = self.storage.lease_of(name)
            st = session.stats()
            used = 0 if st is None else st.scale_pages + st.window_pages + st.special_pages
            cams[name] = CameraPool(pages=0 if lease is None else lease.pages,
                                    page_tokens=0 if lease is None else lease.page_size, used_pages=used)
        return PoolStatus(capacity_tokens=self.storage.capacity, leased_tokens=self.storage.leased_tokens,
                          nbytes=self.storage.nbytes, cameras=cams)


def submit_batch(sessions: Sequence, frames: Sequence, keyframes: Sequence[bool | None] | None = None) -> list:
    """Step one checked frame (as ``check_frame`` returned it) in each of several cameras'
    ``StreamingSession``s (on one ``SharedKVStorage``, driven from one thread), running the frames
    that can go together in one batched trunk (``graphs.BatchedTrunk``): each camera's frame
    attends over its own cache only, and each camera gets exactly what
    ``sessions[i].step(frames[i], keyframes[i])`` would give.

    Written against the sessions' public step seam: ``batch_key``, then ``plan_step`` ->
    ``run_step`` (alone) or the batched trunk -> ``finish_batched``. A frame joins the batch
    when its camera's one-frame step has a captured graph at the running resolution (phase 2,
    storage unchanged: ``batch_key``); the others (scale frames, a first frame at a new size, eager
    backends) are submitted on their own, as are the batch's frames when fewer than two can go
    together. Returns per camera its ``PendingResults``, or the exception its ``submit`` would
    have raised (a full cache); a failing camera changes nothing of its own
    state and nothing of the others'. When a batched trunk fails (before anything was applied),
    its cameras' steps run on their own, and that set of cameras is not batched again
    (``SharedGpuState.refused``, one warning)."""
    import torch

    from ..cache.attention import UngraphableStep

    n = len(sessions)
    if len(frames) != n or (keyframes is not None and len(keyframes) != n):
        raise ValueError(f"submit_batch: {n} sessions, {len(frames)} frames, "
                         f"{n if keyframes is None else len(keyframes)} keyframe decisions")
    if len({id(x) for x in sessions}) != n:
        raise ValueError("submit_batch: a session appears twice (one frame per camera and batch)")
    keyframes = list(keyframes) if keyframes is not None else [None] * n
    results: list = [None] * n
    checked = dict(enumerate(frames))
    single: list[int] = []
    groups: dict[tuple, list[int]] = {}
    with torch.inference_mode():
        for i, session in enumerate(sessions):
            key = session.batch_key(checked[i])
            if key is None:
                single.append(i)
            else:
                groups.setdefault(key, []).append(i)
        for members in groups.values():
            if len(members) < 2:
                single.extend(members)
                continue
            _launch_group(sessions, members, checked, keyframes, results, single, UngraphableStep)
        for i in single:
            try:
                results[i] = sessions[i].step(checked[i], keyframes[i])
            except Exception as exc:
                results[i] = exc
    return results


def _launch_group(sessions, members: list[int], checked: dict, keyframes: list, results: list, single: list[int],
                  ungraphable: type) -> None:
    """The frames of one batch group: planned (each prepared into its graphed step), then one
    batched trunk and each camera's heads and landing in turn; alone or one after another when
    fewer than two are left or the trunk fails. Fills ``results``; frames that cannot use their
    graph go to ``single``."""
    t0 = time.perf_counter()
    planned = []  # (index, PlannedFrame)
    for i in members:
        try:
            planned.append((i, sessions[i].plan_step(checked[i], keyframes[i], prepare=True, t0=t0)))
        except ungraphable:  # counted by the session: this frame goes on its own
            single.append(i)
        except Exception as exc:  # CacheFullError, CrossedExtentError: nothing changed
            results[i] = exc
    if len(planned) == 1:  # the others dropped out: this one goes on its own
        (i, frame), = planned
        results[i] = sessions[i].run_step(frame)
        return
    if not planned:
        return
    owners = tuple(sessions[i].owner for i, _ in planned)
    group = sessions[planned[0][0]].batch_group
    batch = None
    if owners not in group.refused:
        try:
            batch = group.batch_for(owners, [frame.graphed for _, frame in planned])
            batch.launch([frame.frame for _, frame in planned], [frame.dplan for _, frame in planned])
        except Exception as exc:  # nothing was applied: each camera's step runs on its own below
            group.refuse(owners, exc)
            batch = None
    if batch is None:  # their own one-frame steps, one after another (the plans still hold)
        for i, frame in planned:
            try:
                results[i] = sessions[i].run_step(frame)
            except Exception as exc:
                results[i] = exc
        return
    for k, (i, frame) in enumerate(planned):
        # camera k's heads, then its landing (in complete), before camera k+1's heads
        results[i] = sessions[i].finish_batched(frame, batch.heads(k))


__all__ = ["CameraSessions", "PoolStatus", "CameraPool", "submit_batch"]
