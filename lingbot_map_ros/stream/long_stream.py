"""LongStreamSession: unbounded streams on a model with a finite temporal horizon.

The model's temporal RoPE table has ``max_frame_num`` rows and it was trained on a
few hundred cached views; the special stream and the camera-head cache grow by one
stored frame each keyframe. A long stream is therefore cut into *windows*: when the
current window holds ``window_frames`` stored frames and the next frame is to be
stored, the cache is restarted.

Restart (``restart``; automatic with ``auto_restart``):

1. The inner ``StreamingSession`` is reset.
2. The last ``overlap_frames`` keyframes of the old window (images kept in a bounded
   deque) are fed again: the oldest ``num_scale_frames`` of them as the new window's
   scale frames (phase 1), the others as keyframes. Their results are not returned
   again (they were returned when the frames first came).
3. Their poses and depth maps in the new window, paired with the ones published
   before, give the Sim(3) from the new window's world to the global map frame
   (``alignment.estimate_window_sim3``: rotation from the keyframes' camera-to-world
   rotations, scale from the median depth ratio, translation from the camera centres).
4. Every later result is composed with it: ``c2w`` and ``pose_enc`` (translation,
   unit quaternion) are in the global frame and ``depth`` is multiplied by the scale,
   so the trajectory and the unprojected map stay continuous across restarts.
   ``frame_index`` counts every frame pushed since ``reset``; ``position`` stays the
   model's temporal index inside the window.

The global frame is the first window's world (the sequence's first camera, OpenCV
axes); results of the first window are passed through unchanged.

Keyframes: ``"interval"`` stores frame ``i`` (global index) when
``(i - num_scale_frames) % keyframe_interval == 0``. ``"motion"`` stores a frame when
the latest predicted pose (the previous frame's, in the global frame) has moved at
least ``motion_min_translation`` (model units) or turned at least
``motion_min_rotation_deg`` from the last stored keyframe; other frames attend only.
The decision lags one frame behind the motion because a frame's own pose is known
only after its step; deciding afterwards would need a second pass or a store-then-
rollback that spends the caller's one-step undo. ``push(image, keyframe=...)``
overrides either policy.

Memory is bounded: besides the inner session's fixed buffers this object keeps
``overlap_frames`` keyframes (image, pose, depth, confidence) and a one-step undo
record. With ``auto_restart`` off, a full window stops storing (frames attend only)
until ``restart()`` or ``reset()``; the horizon is never reached either way because
``window_frames < max_frame_num``.

Faults: a step that raises (e.g. ``torch.cuda.OutOfMemoryError``) leaves the session
as it was before the push, and the frame is not counted. A failure while the restart
re-feeds the overlap leaves the inner cache empty and the restart pending: the next
push redoes it from the kept keyframes. Recommended recovery after an out-of-memory
error: drop the frame, call ``reset()`` (a new sequence; ``torch.cuda.empty_cache()``
afterwards to return the freed blocks), continue with the next frame.

Rollback undoes the most recent keyframe pushed by the caller; the frames re-fed by
a restart cannot be rolled back (the old window's cache is gone), so right after a
restart, before a new frame is stored, there is nothing to roll back. A restart drops
pending (deferred) evictions along with the old cache. Not thread-safe: one thread
owns the session, as with ``StreamingSession``.

The parts: ``stream.window`` (the current ``Window``, re-feeding and aligning a new one),
``stream.keyframes`` (``StorePolicy``: which frames are stored; ``KeyframeLedger``:
the kept keyframes, the motion policy's poses and the undo record); this module orders
them and maps the inner session's results to the global frame.

This is the session the node and the command line hold (the ``stream.Session`` protocol).
Without a ``LongStreamConfig`` it is one window (no restarts: the model's horizon ends the
sequence), as ``StreamingSession`` alone.

``submit`` is ``push`` without waiting: it checks the frame (the one check of a frame,
``decide``), steps it (``StreamingSession.step``) and returns a ``Pending``;
``results(pending)`` takes the results of every frame submitted up to it, oldest first, and
records them (the ledger; the observer, ``observe``). What needs earlier results takes them
first: a restart, a rollback, the eviction services and each decision of the motion policy
(which therefore pipelines no further than one frame). ``decide`` and ``track`` are the two
halves of ``submit`` around the inner step, for a caller that batches several cameras' steps
(``stream.multi``).

Every change of the model's state is told to the observer (``stream.events.SessionEvents``,
the keyframe journal) after it is made, in order.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from torch import Tensor

from ..cache.pages import CacheStats
from ..config import KEYFRAME_POLICIES, LongStreamConfig
from ..geometry import matrix_to_quaternion
from ..io.preprocess import input_size
from .alignment import Sim3
from .errors import FrameMismatchError, SessionError
from .events import Restarted, SessionEvents, Taken
from .keyframes import KeyframeLedger, StorePolicy
from .results import FrameResult
from .session import PendingResults, StreamingSession
from .window import KeptKeyframe, Window, fit_window, refeed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """A checked frame and whether it is stored (``LongStreamSession.decide``)."""

    frame: Tensor  # as ``check_frame`` returned it
    store: bool | None  # None: a scale frame (the inner session collects it)

    @property
    def scale(self) -> bool:
        return self.store is None


class Pending:
    """One submitted frame until its results are taken (``LongStreamSession.results``)."""

    __slots__ = ("step", "sim", "offset", "stamp", "tag", "scale", "results")

    def __init__(self, step: PendingResults, sim: Sim3, offset: int, stamp: int | None, tag: Any,
                 scale: bool) -> None:
        # step: the inner session's pending results; sim, offset: the window's world -> global
        # frame and global - inner frame index, as when the frame was submitted
        self.step, self.sim, self.offset = step, sim, offset
        self.stamp, self.tag, self.scale = stamp, tag, scale
        self.results: list[FrameResult] | None = None

    def take(self) -> list[FrameResult]:
        """The global results (waiting for the device the first time)."""
        if self.results is None:
            self.results = [_globalised(r, self.sim, self.offset) for r in self.step.result()]
        return self.results


class LongStreamSession:
    """A ``StreamingSession`` for unbounded input: windowed restarts with Sim(3)-aligned
    outputs, interval or motion keyframes. ``cfg`` None: one window, no restarts."""

    def __init__(self, session: StreamingSession, cfg: LongStreamConfig | None = None,
                 events: SessionEvents | None = None) -> None:
        if cfg is not None:
            cfg.check(session.cfg, session.model.cfg.max_frame_num)
        self.inner = session
        self.long_cfg = cfg
        self.overlap_frames = cfg.overlap_for(session.cfg) if cfg is not None else 0
        self._policy = StorePolicy(cfg or LongStreamConfig(), session.is_keyframe_index)
        self.ledger = KeyframeLedger(self.overlap_frames)  # what is kept of the published results
        self.events = events  # the one observer of state changes (the keyframe journal), or None
        self._queue: deque[Pending] = deque()  # submitted, results not taken yet
        self.window = Window()  # where the current window sits in the global sequence
        self.restart_pending = False  # a restart failed midway; the next frame redoes it
        self._frames_pushed = 0

    # ------------------------------------------------------------------ state
    @property
    def cfg(self):
        """The inner session's StreamConfig."""
        return self.inner.cfg

    @property
    def device(self):
        return self.inner.device

    @property
    def deferred_eviction(self) -> bool:
        """Window evictions wait for ``commit_eviction``."""
        return self.inner.deferred_eviction

    @property
    def window_index(self) -> int:
        """Restarts since reset (0 = the first window)."""
        return self.window.index

    @property
    def frames_pushed(self) -> int:
        """Frames processed since reset (the next frame's global index)."""
        return self._frames_pushed

    def stats(self) -> CacheStats | None:
        return self.inner.stats()

    def observe(self, events: SessionEvents | None) -> None:
        """Tell ``events`` (None: nobody) every state change from now on (a journal rebuild
        replays without its observer, then attaches it)."""
        self.events = events

    # ------------------------------------------------------------------ service transitions
    def reset(self) -> None:
        """Start a new sequence: empty cache, window 0, global frame = the next frame's camera.
        Results of frames submitted before stay available (in the old sequence's frame)."""
        self.inner.reset()
        self.ledger.clear()
        self._policy.new_window()
        self._queue = deque()
        self.window = Window()
        self._frames_pushed = 0
        self.restart_pending = False
        if self.events is not None:
            self.events.sequence_reset(self.deferred_eviction)

    def set_deferred_eviction(self, deferred: bool) -> None:
        self.settle()
        self.inner.set_deferred_eviction(deferred)
        if self.events is not None:
            self.events.deferral_set(bool(deferred))

    def commit_eviction(self) -> int:
        self.settle()
        freed = self.inner.commit_eviction()
        if self.events is not None:
            self.events.committed(int(freed))
        return freed

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        """Remove the caller's most recently stored frame (global index) from the cache.

        Frames pushed after it are forgotten (``frames_pushed`` becomes its index).
        Raises SessionError (state unchanged) when there is nothing to roll back, the index
        does not match, or the last stored frames are a restart's re-fed overlap.
        """
        self.settle()
        frame = self.ledger.last_stored
        if frame is None:
            raise SessionError("nothing to roll back" + (" since the window restart" if self.window.index else ""))
        if expected_frame_index is not None and expected_frame_index != frame:
            raise FrameMismatchError(frame, expected_frame_index)
        self.inner.rollback_last_frame(self.window.to_inner(frame))
        self.ledger.undo()
        self._frames_pushed = self.window.to_global(self.inner.frames_pushed)
        if self.events is not None:
            self.events.rolled_back(frame, self._frames_pushed, self._in_scale_phase())
        return frame

    def restart(self, seeds: list[KeptKeyframe] | None = None) -> None:
        """Start a new window now from the kept keyframes (see the module docstring), or from
        ``seeds``: keyframes of a map the camera was found in (a relocalisation; oldest first, their
        poses as published in the global frame, their depths possibly thumbnails), which replace the
        kept ones. The next frame keeps the global numbering either way.

        Raises SessionError when no sequence is running, the session has no windows or there are
        fewer seeds than scale frames. On an exception from the model the inner cache is left empty
        and the restart pending (redone from the kept keyframes by the next frame; after a failed
        relocalisation, relocate again before a frame)."""
        if self.long_cfg is None:
            raise SessionError("this session has no windows (no LongStreamConfig): nothing to restart")
        if seeds is not None and len(seeds) < self.cfg.num_scale_frames:
            raise SessionError(f"relocating needs {self.cfg.num_scale_frames} keyframes (the scale frames), "
                               f"got {len(seeds)}")
        self.settle()  # the keyframes of frames submitted before are kept too
        kept = self.ledger.kept() if seeds is None else tuple(seeds)
        if not kept:
            raise SessionError("nothing to restart: no frame stored since reset")
        self.inner.reset()
        self.restart_pending = seeds is None
        self.ledger.forget_undo()
        try:
            fed = refeed(self.inner, kept)
        except BaseException:
            self.inner.reset()
            raise
        fit = fit_window(kept, fed)
        if seeds is not None:
            self.ledger.clear()
            self.ledger.adopt(kept)
            self.ledger.set_poses(kept[-1].c2w, kept[-1].c2w)
        self.window = Window(self.window.index + 1, self._frames_pushed, tuple(k.index for k in kept), fit.sim3, fit)
        self.restart_pending = False
        self._policy.new_window()
        log.info("window %d starts at frame %d: %d keyframes re-fed%s, scale %.4g (from %s, %d px), rotation "
                 "residual %.3g deg, centre RMSE %.3g", self.window.index, self.window.start, len(kept),
                 "" if seeds is None else " (relocated at keyframes " + ", ".join(str(k.index + 1) for k in kept) + ")",
                 fit.sim3.scale, fit.scale_source, fit.depth_pixels, fit.rotation_residual_deg, fit.centre_rmse)
        if self.events is not None:
            self.events.window_restarted(Restarted(
                kept, self.window.index, self.window.start, self.window.alignment, self.ledger.last_keyframe_c2w,
                self.ledger.latest_c2w, self.deferred_eviction, self.inner.resolution))

    # ------------------------------------------------------------------ journal replay (``journal.resume``)
    def resume_window(self, kept: list[KeptKeyframe], window_index: int, window_start: int, alignment: Sim3,
                      last_keyframe_c2w: np.ndarray | None, latest_c2w: np.ndarray | None) -> None:
        """Redo a journaled restart on a fresh sequence: re-feed ``kept`` (as ``restart`` did) and
        take the window's numbers as they were (the alignment is not estimated again)."""
        self.reset()
        self.ledger.adopt(kept)
        try:
            refeed(self.inner, list(kept))
        except BaseException:
            self.reset()
            raise
        self.window = Window(int(window_index), int(window_start), tuple(k.index for k in kept), alignment)
        self._frames_pushed = int(window_start)
        self.ledger.set_poses(last_keyframe_c2w, latest_c2w)

    def seek(self, frame_index: int) -> None:
        """``StreamingSession.seek`` in global indices (journal replay)."""
        self.settle()
        self.inner.seek(self.window.to_inner(frame_index))
        self._frames_pushed = int(frame_index)

    def set_latest_pose(self, c2w: np.ndarray | None) -> None:
        """The latest frame's global camera-to-world, as published (journal replay)."""
        self.settle()
        self.ledger.set_poses(self.ledger.last_keyframe_c2w,
                              None if c2w is None else np.asarray(c2w, dtype=np.float64))

    # ------------------------------------------------------------------ frames
    def push(self, image: Tensor | np.ndarray, keyframe: bool | None = None, stamp: int | None = None,
             tag: Any = None) -> list[FrameResult]:
        """Feed one frame [3, H, W] RGB float in [0, 1] (or uint8 [H, W, 3]); returns its results
        in the global frame. ``keyframe``: None follows ``keyframe_policy``; True/False forces the
        decision (the scale frames of the first window are always stored; a full window without
        ``auto_restart`` never stores). ``stamp`` (ns) and ``tag`` go to the observer with it."""
        return self.results(self.submit(image, keyframe, stamp, tag))

    def submit(self, image: Tensor | np.ndarray, keyframe: bool | None = None, stamp: int | None = None,
               tag: Any = None) -> Pending:
        """``push`` without waiting for the results (``results(pending)`` takes them). Bad input
        raises InvalidFrameError here and changes nothing."""
        decision = self.decide(image, keyframe)
        try:
            step = self.inner.step(decision.frame, decision.store)
        except BaseException as exc:
            self.track(decision, exc)
            raise
        return self.track(decision, step, stamp, tag)

    def decide(self, image: Tensor | np.ndarray, keyframe: bool | None = None) -> Decision:
        """The first half of ``submit``: check the frame (InvalidFrameError before anything moves),
        decide whether it is stored, restart the window when it is full. Hand ``Decision.frame``
        and ``.store`` to the inner session's ``step`` (alone, or batched with other cameras'
        frames: ``stream.multi.submit_batch``), then its outcome to ``track``."""
        frame = self.check_frame(image)
        if self._in_scale_phase():
            return Decision(frame, None)  # the sequence's scale frames, collected by the inner session
        if keyframe is None and self._policy.reads_poses:
            self.settle()  # the decision reads the latest pose
        store = self._policy.decide(keyframe, self._frames_pushed, self.ledger.last_keyframe_c2w,
                                    self.ledger.latest_c2w)
        cfg = self.long_cfg
        if cfg is not None and (self.restart_pending or (store and self.inner.stats().temporal_index
                                                         >= cfg.window_frames)):
            if cfg.auto_restart or self.restart_pending:
                self.restart()
            else:
                store = self._policy.window_full()
        return Decision(frame, store)

    def track(self, decision: Decision, step: PendingResults | BaseException, stamp: int | None = None,
              tag: Any = None) -> Pending | BaseException:
        """The second half of ``submit``: the inner step's pending results as this session's
        ``Pending`` (its results come in the global frame), or ``step`` itself when the inner
        step raised it (a failed scale step loses the scale frames collected so far: told to
        the observer)."""
        if isinstance(step, BaseException):
            if decision.scale and self.inner.scale_frames_waiting == 0 and self.events is not None:
                self.events.scale_frames_lost(self.deferred_eviction)
            return step
        window = self.window
        self._frames_pushed = window.to_global(self.inner.frames_pushed)
        pending = Pending(step, window.alignment, window.to_global(0), stamp, tag, decision.scale)
        self._queue.append(pending)
        if decision.scale and self.events is not None:
            self.events.scale_frame(decision.frame, stamp, tag, self.deferred_eviction)
        return pending

    def results(self, pending: Pending) -> list[FrameResult]:
        """The global results of ``pending`` (waiting for them), after those of every frame
        submitted before it; each frame's are recorded when taken. A frame submitted before a
        reset gives its results unrecorded (in the old sequence's frame)."""
        if pending.results is None:
            if any(q is pending for q in self._queue):
                while self._queue:
                    if self._take(self._queue.popleft()) is pending:
                        break
            else:
                pending.take()
        return pending.results

    def settle(self) -> None:
        """Take (and record) the results of every frame submitted so far."""
        while self._queue:
            self._take(self._queue.popleft())

    def check_frame(self, image: Tensor | np.ndarray, resolution: tuple[int, int] | None = None) -> Tensor:
        """``StreamingSession.check_frame``: InvalidFrameError for a frame ``push`` would refuse,
        raised before anything moves (a restart included); while a restart is pending the
        inner cache is empty, so the kept keyframes give the sequence's resolution."""
        if resolution is None and self.restart_pending:
            kept = self.ledger.kept()
            if kept:
                resolution = input_size(kept[-1].frame)
        return self.inner.check_frame(image, resolution)

    # ------------------------------------------------------------------ internals
    def _take(self, pending: Pending) -> Pending:
        results = pending.take()
        self.ledger.record(results)
        if self.events is not None:
            self.events.frame_taken(Taken(results, pending.stamp, pending.tag, pending.scale,
                                          self.deferred_eviction))
        return pending

    def _in_scale_phase(self) -> bool:
        """The next frame is one of the sequence's scale frames."""
        if self.window.index != 0 or self.restart_pending:
            return False
        stats = self.inner.stats()
        return stats is None or stats.temporal_index == 0


def _globalised(r: FrameResult, sim: Sim3, offset: int) -> FrameResult:
    """An inner session's result in the global frame: frame index + ``offset``; pose and depth
    through ``sim`` (the window's world -> global frame)."""
    index = r.frame_index + offset
    if sim.is_identity:
        return replace(r, frame_index=index) if offset else r
    c2w = sim.apply_to_poses(r.c2w)
    pose_enc = np.concatenate([c2w[:3, 3], matrix_to_quaternion(c2w[:3, :3]), r.pose_enc[7:]])
    depth = None if r.depth is None else (r.depth * sim.scale).astype(r.depth.dtype)
    return replace(r, frame_index=index, c2w=c2w.astype(r.c2w.dtype), pose_enc=pose_enc.astype(r.pose_enc.dtype),
                   depth=depth)


__all__ = ["LongStreamConfig", "LongStreamSession", "Pending", "Decision", "KEYFRAME_POLICIES", "KeptKeyframe"]
