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

``submit`` is ``push`` without waiting (the pipelined path of ``StreamingSession.submit``):
the returned ``LongPendingResults`` gives the global results later, and what this object
keeps of them (keyframes, poses, the undo record) is recorded then, in submission order.
What needs them takes the earlier results first: a restart, a rollback, and each
decision of the motion policy (which therefore pipelines no further than one frame).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..cache.pages import CacheStats
from ..config import KEYFRAME_POLICIES, LongStreamConfig, StreamConfig
from ..geometry import matrix_to_quaternion
from ..io.preprocess import input_size
from ..geometry import rotation_angle_deg
from .alignment import AlignmentFit, Sim3, estimate_window_sim3
from .errors import FrameMismatchError, SessionError
from .results import FrameResult
from .session import PendingResults, StreamingSession

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Keyframe:
    """A stored frame as published: what a restart re-feeds and aligns to."""

    index: int  # global frame index
    frame: np.ndarray  # the model input as pushed, float32 [3, H, W] or uint8 [H, W, 3] (a private copy)
    c2w: np.ndarray  # [4, 4] float64, global frame
    depth: np.ndarray | None  # [H, W] global units
    confidence: np.ndarray | None  # [H, W]


@dataclass(frozen=True)
class _Undo:
    """What one stored push changed in this object (the inner session keeps its own undo)."""

    keyframes: tuple[_Keyframe, ...]
    last_keyframe_c2w: np.ndarray | None
    latest_c2w: np.ndarray | None


class LongStreamSession:
    """A ``StreamingSession`` for unbounded input: windowed restarts with Sim(3)-aligned
    outputs, interval or motion keyframes. A ``stream.Session``, like the inner session."""

    def __init__(self, session: StreamingSession, cfg: LongStreamConfig | None = None) -> None:
        cfg = cfg or LongStreamConfig()
        cfg.check(session.cfg, session.model.cfg.max_frame_num)
        self.inner = session
        self.long_cfg = cfg
        self.overlap_frames = cfg.overlap_for(session.cfg)
        self._keyframes: deque[_Keyframe] = deque(maxlen=self.overlap_frames)
        self._clear()

    def _clear(self) -> None:
        self._keyframes.clear()
        self._alignment = Sim3()
        self._last_fit: AlignmentFit | None = None
        self._window_index = 0
        self._window_start = 0  # global index of the window's first new frame
        self._overlap_indices: tuple[int, ...] = ()  # global indices re-fed at the window's start
        self._frames_pushed = 0
        self._last_stored: int | None = None  # global index of the caller's last stored frame
        self._undo: _Undo | None = None
        self._last_keyframe_c2w: np.ndarray | None = None
        self._latest_c2w: np.ndarray | None = None
        self._restart_pending = False
        self._warned_full = False
        self._unsettled: deque[LongPendingResults] = deque()  # submitted, bookkeeping not done yet

    # ------------------------------------------------------------------ state
    @property
    def cfg(self) -> StreamConfig:
        return self.inner.cfg

    @property
    def model(self):
        return self.inner.model

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def backend(self):
        return self.inner.backend

    @property
    def resolution(self) -> tuple[int, int] | None:
        return self.inner.resolution

    @property
    def deferred_eviction(self) -> bool:
        return self.inner.deferred_eviction

    @property
    def frames_pushed(self) -> int:
        """Frames processed since reset (the next frame's global index)."""
        return self._frames_pushed

    @property
    def window_index(self) -> int:
        """Restarts since reset (0 = the first window)."""
        return self._window_index

    @property
    def window_start(self) -> int:
        """Global index of the first frame the current window processed after its overlap."""
        return self._window_start

    @property
    def overlap_indices(self) -> tuple[int, ...]:
        """Global indices of the keyframes re-fed at the start of the current window."""
        return self._overlap_indices

    @property
    def alignment(self) -> Sim3:
        """The current window's world → global frame."""
        return self._alignment

    @property
    def last_fit(self) -> AlignmentFit | None:
        """Diagnostics of the most recent restart's alignment (None before the first)."""
        return self._last_fit

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
        for pending in self._unsettled:
            pending.detach()
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
        self._settle()
        if self._last_stored is None:
            raise SessionError("nothing to roll back" + (" since the window restart" if self._window_index else ""))
        if expected_frame_index is not None and expected_frame_index != self._last_stored:
            raise FrameMismatchError(self._last_stored, expected_frame_index)
        frame = self._last_stored
        self.inner.rollback_last_frame(self._inner_index(frame))
        undo = self._undo
        self._keyframes.clear()
        self._keyframes.extend(undo.keyframes)
        self._last_keyframe_c2w, self._latest_c2w = undo.last_keyframe_c2w, undo.latest_c2w
        self._undo, self._last_stored = None, None
        self._frames_pushed = self._global_index(self.inner.frames_pushed)
        return frame

    def restart(self) -> None:
        """Start a new window now from the kept keyframes (see the module docstring).

        Raises SessionError when no sequence is running. On an exception from the model
        the inner cache is left empty and the restart pending (redone by the next push).
        """
        self._settle()  # the keyframes of frames submitted before are kept too
        if not self._keyframes:
            raise SessionError("nothing to restart: no frame stored since reset")
        kept = list(self._keyframes)
        self.inner.reset()
        self._restart_pending = True
        self._undo, self._last_stored = None, None
        try:
            fed = self._refeed(kept)
        except BaseException:
            self.inner.reset()
            raise
        fit = estimate_window_sim3(np.stack([k.c2w for k in kept]), np.stack([r.c2w for r in fed]),
                                   *self._paired_depths(kept, fed))
        self._alignment, self._last_fit = fit.sim3, fit
        self._window_index += 1
        self._window_start = self._frames_pushed
        self._overlap_indices = tuple(k.index for k in kept)
        self._restart_pending = False
        self._warned_full = False
        self._unsettled: deque[LongPendingResults] = deque()  # submitted, bookkeeping not done yet
        log.info("window %d starts at frame %d: %d keyframes re-fed, scale %.4g (from %s, %d px), rotation "
                 "residual %.3g deg, centre RMSE %.3g", self._window_index, self._window_start, len(kept),
                 fit.sim3.scale, fit.scale_source, fit.depth_pixels, fit.rotation_residual_deg, fit.centre_rmse)

    # ------------------------------------------------------------------ journal (``journal.recorder``, ``journal.resume``)
    def kept_keyframes(self) -> tuple[_Keyframe, ...]:
        """The keyframes kept for a restart (index, image, global c2w, depth, confidence) as of the
        results taken so far; right after a restart, the ones it re-fed."""
        return tuple(self._keyframes)

    def motion_poses(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(last keyframe's, latest frame's) global camera-to-world as of the results taken so far."""
        return self._last_keyframe_c2w, self._latest_c2w

    def resume_window(self, kept: list[_Keyframe], window_index: int, window_start: int, alignment: Sim3,
                      last_keyframe_c2w: np.ndarray | None, latest_c2w: np.ndarray | None) -> None:
        """Redo a journaled restart on a fresh sequence: re-feed ``kept`` (as ``restart`` did) and
        take the window's numbers as they were (the alignment is not estimated again)."""
        self.reset()
        self._keyframes.extend(kept)
        try:
            self._refeed(list(kept))
        except BaseException:
            self.reset()
            raise
        self._alignment, self._window_index, self._window_start = alignment, int(window_index), int(window_start)
        self._overlap_indices = tuple(k.index for k in kept)
        self._frames_pushed = int(window_start)
        self._last_keyframe_c2w, self._latest_c2w = last_keyframe_c2w, latest_c2w

    def seek(self, frame_index: int) -> None:
        """``StreamingSession.seek`` in global indices (journal replay)."""
        self._settle()
        self.inner.seek(self._inner_index(frame_index))
        self._frames_pushed = int(frame_index)

    def set_latest_pose(self, c2w: np.ndarray | None) -> None:
        """The latest frame's global camera-to-world, as published (journal replay)."""
        self._settle()
        self._latest_c2w = None if c2w is None else np.asarray(c2w, dtype=np.float64)

    def _refeed(self, kept: list[_Keyframe]) -> list[FrameResult]:
        s0 = self.cfg.num_scale_frames
        fed: list[FrameResult] = []
        for k in kept[:s0]:
            fed += self.inner.push(k.frame)
        for k in kept[s0:]:
            fed += self.inner.push(k.frame, keyframe=True)
        return fed

    @staticmethod
    def _paired_depths(kept: list[_Keyframe], fed: list[FrameResult]):
        """(old depth, new depth, old conf, new conf) stacks, or Nones where any is missing."""
        if any(k.depth is None for k in kept) or any(r.depth is None for r in fed):
            return None, None, None, None
        confs = [k.confidence for k in kept] + [r.confidence for r in fed]
        old_conf = new_conf = None
        if all(c is not None for c in confs):
            old_conf, new_conf = np.stack(confs[:len(kept)]), np.stack(confs[len(kept):])
        return np.stack([k.depth for k in kept]), np.stack([r.depth for r in fed]), old_conf, new_conf

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
        if self._window_index == 0 and not self._restart_pending and (stats is None or stats.temporal_index == 0):
            return None  # the sequence's scale frames, collected by the inner session
        if keyframe is None and self.long_cfg.keyframe_policy == "motion":
            self._settle()  # the decision reads the latest pose
        store = self._decide(keyframe)
        if self._restart_pending or (store and stats.temporal_index >= self.long_cfg.window_frames):
            if self.long_cfg.auto_restart or self._restart_pending:
                self.restart()
            else:
                store = self._window_full()
        return store

    def after_inner_submit(self, inner: PendingResults) -> LongPendingResults:
        """The second half of ``submit``: the inner session's pending results as global ones."""
        self._frames_pushed = self._global_index(self.inner.frames_pushed)
        pending = LongPendingResults(self, inner, self._alignment, self._global_index(0))
        self._unsettled.append(pending)
        return pending

    def _settle(self, until: LongPendingResults | None = None) -> None:
        """Take the results of submitted frames, oldest first, up to ``until`` (all when None),
        and keep what they change here: the keyframes a restart re-feeds, the motion
        policy's poses, the one-step undo."""
        while self._unsettled:
            pending = self._unsettled.popleft()
            self._record(pending.take())
            if pending is until:
                return

    def _record(self, out: list[FrameResult]) -> None:
        """The bookkeeping of one frame's global results (in submission order)."""
        before = _Undo(tuple(self._keyframes), self._last_keyframe_c2w, self._latest_c2w)
        if out:
            self._latest_c2w = out[-1].c2w.astype(np.float64)
        if out and out[0].is_keyframe:
            self._undo, self._last_stored = before, out[-1].frame_index
            for r in out:
                self._keyframes.append(_Keyframe(r.frame_index, np.array(r.frame),
                                                 r.c2w.astype(np.float64), _copy(r.depth), _copy(r.confidence)))
            self._last_keyframe_c2w = out[-1].c2w.astype(np.float64)

    def check_frame(self, image: Tensor | np.ndarray, resolution: tuple[int, int] | None = None) -> Tensor:
        """``StreamingSession.check_frame``: InvalidFrameError for a frame ``push`` would refuse,
        raised before anything moves (a restart included); while a restart is pending the
        inner cache is empty, so the kept keyframes give the sequence's resolution."""
        if resolution is None and self._restart_pending and self._keyframes:
            resolution = input_size(self._keyframes[-1].frame)
        return self.inner.check_frame(image, resolution)

    def _decide(self, keyframe: bool | None) -> bool:
        if keyframe is not None:
            return bool(keyframe)
        if self.long_cfg.keyframe_policy == "interval":
            return self.inner.is_keyframe_index(self._frames_pushed)
        return self._moved_enough()

    def _moved_enough(self) -> bool:
        last, latest = self._last_keyframe_c2w, self._latest_c2w
        if last is None or latest is None:
            return True
        c = self.long_cfg
        if c.motion_min_translation > 0 and np.linalg.norm(latest[:3, 3] - last[:3, 3]) >= c.motion_min_translation:
            return True
        return bool(c.motion_min_rotation_deg > 0
                    and rotation_angle_deg(last[:3, :3], latest[:3, :3]) >= c.motion_min_rotation_deg)

    def _window_full(self) -> bool:
        if not self._warned_full:
            self._warned_full = True
            log.warning("the window holds %d stored frames and auto_restart is off: frames attend only until "
                        "restart() or reset()", self.long_cfg.window_frames)
        return False

    def _inner_index(self, global_index: int) -> int:
        return global_index - self._window_start + len(self._overlap_indices)

    def _global_index(self, inner_index: int) -> int:
        return inner_index - len(self._overlap_indices) + self._window_start


class LongPendingResults:
    """The results of one ``LongStreamSession.submit``: ``result()`` waits for them (the
    first time) and returns them in the global frame, as ``push`` does; the session's
    bookkeeping of them happens then, after that of the frames submitted before. After a
    ``reset`` the results stay available (in the old sequence's frame), unrecorded."""

    __slots__ = ("_owner", "_inner", "_sim", "_offset", "_results")

    def __init__(self, owner: LongStreamSession, inner, sim: Sim3, offset: int) -> None:
        # inner: the inner session's PendingResults; sim, offset: the window's world -> global
        # frame and global - inner frame index, as when the frame was submitted
        self._owner: LongStreamSession | None = owner
        self._inner, self._sim, self._offset = inner, sim, offset
        self._results: list[FrameResult] | None = None

    @property
    def done(self) -> bool:
        """The results are ready (``result()`` will not wait for the device)."""
        return self._results is not None or self._inner.done

    def result(self) -> list[FrameResult]:
        if self._results is None:
            if self._owner is not None:
                self._owner._settle(until=self)  # takes this one's results (and earlier ones)
            else:
                self.take()
        return self._results

    def take(self) -> list[FrameResult]:
        """The global results (waiting for them); for the owner's ``_settle``."""
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


def _copy(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else np.array(a, copy=True)


KeptKeyframe = _Keyframe  # what a restart re-feeds (journal records and rebuilds them)

__all__ = ["LongStreamConfig", "LongStreamSession", "LongPendingResults", "KEYFRAME_POLICIES", "KeptKeyframe"]
