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
the kept keyframes, the motion policy's poses and the undo record, in submission order);
this module orders them and maps the inner session's results to the global frame.

``submit`` is ``push`` without waiting (the pipelined path of ``StreamingSession.submit``):
the returned ``LongPendingResults`` gives the global results later, and what this object
keeps of them (keyframes, poses, the undo record) is recorded then, in submission order.
What needs them takes the earlier results first: a restart, a rollback, and each
decision of the motion policy (which therefore pipelines no further than one frame).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from operator import attrgetter

import numpy as np
from torch import Tensor

from ..cache.pages import CacheStats
from ..config import KEYFRAME_POLICIES, LongStreamConfig
from ..geometry import matrix_to_quaternion
from ..io.preprocess import input_size
from .alignment import Sim3
from .errors import FrameMismatchError, SessionError
from .keyframes import KeyframeLedger, StorePolicy
from .results import FrameResult
from .session import PendingResults, StreamingSession
from .window import KeptKeyframe, Window, fit_window, refeed

log = logging.getLogger(__name__)


def _forwarded(path: str, doc: str) -> property:
    """A read-only attribute of one of the session's parts (``inner``, ``_window``)."""
    return property(attrgetter(path), doc=doc)


class LongStreamSession:
    """A ``StreamingSession`` for unbounded input: windowed restarts with Sim(3)-aligned
    outputs, interval or motion keyframes. A ``stream.Session``, like the inner session."""

    # ------------------------------------------------------------------ state
    cfg = _forwarded("inner.cfg", "The inner session's StreamConfig.")
    device = _forwarded("inner.device", "Where the model runs.")
    backend = _forwarded("inner.backend", "The inner session's attention backend.")
    deferred_eviction = _forwarded("inner.deferred_eviction", "Window evictions wait for ``commit_eviction``.")
    window_index = _forwarded("_window.index", "Restarts since reset (0 = the first window).")
    window_start = _forwarded("_window.start",
                              "Global index of the first frame the current window processed after its overlap.")
    overlap_indices = _forwarded("_window.overlap_indices",
                                 "Global indices of the keyframes re-fed at the start of the current window.")
    alignment = _forwarded("_window.alignment", "The current window's world → global frame (a Sim3).")
    last_fit = _forwarded("_window.last_fit",
                          "Diagnostics of the most recent restart's alignment (None before the first).")

    def __init__(self, session: StreamingSession, cfg: LongStreamConfig | None = None) -> None:
        cfg = cfg or LongStreamConfig()
        cfg.check(session.cfg, session.model.cfg.max_frame_num)
        self.inner = session
        self.long_cfg = cfg
        self.overlap_frames = cfg.overlap_for(session.cfg)
        self._policy = StorePolicy(cfg, session.is_keyframe_index)
        self._ledger = KeyframeLedger(self.overlap_frames)
        self._clear()

    def _clear(self) -> None:
        self._ledger.clear()
        self._policy.new_window()
        self._window = Window()
        self._frames_pushed = 0
        self._restart_pending = False

    @property
    def frames_pushed(self) -> int:
        """Frames processed since reset (the next frame's global index)."""
        return self._frames_pushed

    @property
    def restart_pending(self) -> bool:
        """A restart failed midway; the next push redoes it."""
        return self._restart_pending

    def stats(self) -> CacheStats | None:
        return self.inner.stats()

    # ------------------------------------------------------------------ service transitions
    def reset(self) -> None:
        """Start a new sequence: empty cache, window 0, global frame = the next frame's camera.
        Results of frames submitted before stay available (in the old sequence's frame)."""
        self.inner.reset()
        self._clear()

    def set_deferred_eviction(self, deferred: bool) -> None:
        self.inner.set_deferred_eviction(deferred)

    def commit_eviction(self) -> int:
        return self.inner.commit_eviction()

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        """Remove the caller's most recently stored frame (global index) from the cache.

        Frames pushed after it are forgotten (``frames_pushed`` becomes its index).
        Raises SessionError (state unchanged) when there is nothing to roll back, the index
        does not match, or the last stored frames are a restart's re-fed overlap.
        """
        self._ledger.settle()
        frame = self._ledger.last_stored
        if frame is None:
            raise SessionError("nothing to roll back" + (" since the window restart" if self._window.index else ""))
        if expected_frame_index is not None and expected_frame_index != frame:
            raise FrameMismatchError(frame, expected_frame_index)
        self.inner.rollback_last_frame(self._window.to_inner(frame))
        self._ledger.undo()
        self._frames_pushed = self._window.to_global(self.inner.frames_pushed)
        return frame

    def restart(self) -> None:
        """Start a new window now from the kept keyframes (see the module docstring).

        Raises SessionError when no sequence is running. On an exception from the model
        the inner cache is left empty and the restart pending (redone by the next push).
        """
        self._ledger.settle()  # the keyframes of frames submitted before are kept too
        kept = self._ledger.kept()
        if not kept:
            raise SessionError("nothing to restart: no frame stored since reset")
        self.inner.reset()
        self._restart_pending = True
        self._ledger.forget_undo()
        try:
            fed = refeed(self.inner, kept)
        except BaseException:
            self.inner.reset()
            raise
        fit = fit_window(kept, fed)
        self._window = Window(self._window.index + 1, self._frames_pushed, tuple(k.index for k in kept),
                              fit.sim3, fit)
        self._restart_pending = False
        self._policy.new_window()
        log.info("window %d starts at frame %d: %d keyframes re-fed, scale %.4g (from %s, %d px), rotation "
                 "residual %.3g deg, centre RMSE %.3g", self._window.index, self._window.start, len(kept),
                 fit.sim3.scale, fit.scale_source, fit.depth_pixels, fit.rotation_residual_deg, fit.centre_rmse)

    # ------------------------------------------------------------------ journal (``journal.recorder``, ``journal.resume``)
    def kept_keyframes(self) -> tuple[KeptKeyframe, ...]:
        """The keyframes kept for a restart (index, image, global c2w, depth, confidence) as of the
        results taken so far; right after a restart, the ones it re-fed."""
        return self._ledger.kept()

    def motion_poses(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(last keyframe's, latest frame's) global camera-to-world as of the results taken so far."""
        return self._ledger.last_keyframe_c2w, self._ledger.latest_c2w

    def resume_window(self, kept: list[KeptKeyframe], window_index: int, window_start: int, alignment: Sim3,
                      last_keyframe_c2w: np.ndarray | None, latest_c2w: np.ndarray | None) -> None:
        """Redo a journaled restart on a fresh sequence: re-feed ``kept`` (as ``restart`` did) and
        take the window's numbers as they were (the alignment is not estimated again)."""
        self.reset()
        self._ledger.adopt(kept)
        try:
            refeed(self.inner, list(kept))
        except BaseException:
            self.reset()
            raise
        self._window = Window(int(window_index), int(window_start), tuple(k.index for k in kept), alignment)
        self._frames_pushed = int(window_start)
        self._ledger.set_poses(last_keyframe_c2w, latest_c2w)

    def seek(self, frame_index: int) -> None:
        """``StreamingSession.seek`` in global indices (journal replay)."""
        self._ledger.settle()
        self.inner.seek(self._window.to_inner(frame_index))
        self._frames_pushed = int(frame_index)

    def set_latest_pose(self, c2w: np.ndarray | None) -> None:
        """The latest frame's global camera-to-world, as published (journal replay)."""
        self._ledger.settle()
        self._ledger.set_poses(self._ledger.last_keyframe_c2w,
                               None if c2w is None else np.asarray(c2w, dtype=np.float64))

    # ------------------------------------------------------------------ frames
    def push(self, image: Tensor | np.ndarray, keyframe: bool | None = None) -> list[FrameResult]:
        """Feed one frame [3, H, W] RGB float in [0, 1] (or uint8 [H, W, 3]); returns its results
        in the global frame.

        keyframe: None follows ``keyframe_policy``; True/False forces the decision (the
        scale frames of the first window are always stored; a full window without
        ``auto_restart`` never stores).
        """
        return self.submit(image, keyframe).result()

    def submit(self, image: Tensor | np.ndarray, keyframe: bool | None = None) -> LongPendingResults:
        """``push`` without waiting for the results (``StreamingSession.submit``): the frame is
        checked, decided and launched, ``frames_pushed`` moves on at once, and the returned
        object's ``result()`` gives the global results ``push`` would have. What needs earlier
        results takes them first, oldest first: the motion policy's decision (the latest
        pose), a restart (the kept keyframes), ``rollback_last_frame``. Bad input raises
        InvalidFrameError here and changes nothing."""
        store = self.before_inner_submit(image, keyframe)
        return self.after_inner_submit(self.inner.submit(image, keyframe=store))

    def before_inner_submit(self, image: Tensor | np.ndarray, keyframe: bool | None = None) -> bool | None:
        """The first half of ``submit``: check the frame, decide whether it is stored, restart the
        window when it is full; returns the decision to hand the inner session with the frame
        (None: a scale frame, the inner session's own). The caller then submits the frame to
        ``inner`` (alone, or batched with other cameras' frames: ``stream.multi.submit_batch``)
        and hands the result to ``after_inner_submit``."""
        self.check_frame(image)
        stats = self.inner.stats()
        if self._window.index == 0 and not self._restart_pending and (stats is None or stats.temporal_index == 0):
            return None  # the sequence's scale frames, collected by the inner session
        if keyframe is None and self._policy.reads_poses:
            self._ledger.settle()  # the decision reads the latest pose
        store = self._policy.decide(keyframe, self._frames_pushed, self._ledger.last_keyframe_c2w,
                                    self._ledger.latest_c2w)
        if self._restart_pending or (store and stats.temporal_index >= self.long_cfg.window_frames):
            if self.long_cfg.auto_restart or self._restart_pending:
                self.restart()
            else:
                store = self._policy.window_full()
        return store

    def after_inner_submit(self, inner: PendingResults) -> LongPendingResults:
        """The second half of ``submit``: the inner session's pending results as global ones."""
        window = self._window
        self._frames_pushed = window.to_global(self.inner.frames_pushed)
        pending = LongPendingResults(self._ledger, inner, window.alignment, window.to_global(0))
        self._ledger.enqueue(pending)
        return pending

    def check_frame(self, image: Tensor | np.ndarray, resolution: tuple[int, int] | None = None) -> Tensor:
        """``StreamingSession.check_frame``: InvalidFrameError for a frame ``push`` would refuse,
        raised before anything moves (a restart included); while a restart is pending the
        inner cache is empty, so the kept keyframes give the sequence's resolution."""
        if resolution is None and self._restart_pending:
            kept = self._ledger.kept()
            if kept:
                resolution = input_size(kept[-1].frame)
        return self.inner.check_frame(image, resolution)


class LongPendingResults:
    """The results of one ``LongStreamSession.submit``: ``result()`` waits for them (the
    first time) and returns them in the global frame, as ``push`` does; the session's
    bookkeeping of them (its ``KeyframeLedger``) happens then, after that of the frames
    submitted before. After a ``reset`` the results stay available (in the old sequence's
    frame), unrecorded."""

    __slots__ = ("_owner", "_inner", "_sim", "_offset", "_results")

    def __init__(self, owner: KeyframeLedger, inner, sim: Sim3, offset: int) -> None:
        # inner: the inner session's PendingResults; sim, offset: the window's world -> global
        # frame and global - inner frame index, as when the frame was submitted
        self._owner: KeyframeLedger | None = owner
        self._inner, self._sim, self._offset = inner, sim, offset
        self._results: list[FrameResult] | None = None

    @property
    def done(self) -> bool:
        """The results are ready (``result()`` will not wait for the device)."""
        return self._results is not None or self._inner.done

    def result(self) -> list[FrameResult]:
        if self._results is None:
            if self._owner is not None:
                self._owner.settle(until=self)  # takes this one's results (and earlier ones)
            else:
                self.take()
        return self._results

    def take(self) -> list[FrameResult]:
        """The global results (waiting for them); for the ledger's ``settle``."""
        self._owner = None
        if self._results is None:
            self._results = [_globalised(r, self._sim, self._offset) for r in self._inner.result()]
        return self._results

    def detach(self) -> None:
        """The owner was reset: the results are no longer its business."""
        self._owner = None


def _globalised(r: FrameResult, sim: Sim3, offset: int) -> FrameResult:
    """An inner session's result in the global frame: frame index + ``offset``; pose and depth
    through ``sim`` (the window's world -> global frame)."""
    index = r.frame_index + offset
    if sim.is_identity:
        return replace(r, frame_index=index)
    c2w = sim.apply_to_poses(r.c2w)
    pose_enc = np.concatenate([c2w[:3, 3], matrix_to_quaternion(c2w[:3, :3]), r.pose_enc[7:]])
    depth = None if r.depth is None else (r.depth * sim.scale).astype(r.depth.dtype)
    return replace(r, frame_index=index, c2w=c2w.astype(r.c2w.dtype), pose_enc=pose_enc.astype(r.pose_enc.dtype),
                   depth=depth)


__all__ = ["LongStreamConfig", "LongStreamSession", "LongPendingResults", "KEYFRAME_POLICIES", "KeptKeyframe"]
