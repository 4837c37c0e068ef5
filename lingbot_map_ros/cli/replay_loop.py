"""``lingbot-map-replay --loop-closure``: the node's loop closer (``runtime.loop_closure``) run
offline, and the optimised trajectory it gives.

``ReplayLoop`` takes every keyframe with depth as its results are written (pose ``c2w``:
camera-to-world, OpenCV axes, the replay's world = first camera, model units; the depth
thumbnail in that camera's frame) and, before the next frame is submitted, hands them to the
closer one at a time, waiting for each to be handled and verifying the candidate it found, if
any, on the thread that drives the session: the side session (``loop_verify.ModelSideRunner``)
shares the model, so the frame in flight is taken first (``settle``). So every keyframe is
looked at with no other candidate waiting, and a run gives the same loops each time.

``OptimisedTrajectory`` is the --trajectory writer of such a run: it keeps every frame's pose and
writes them, each moved by the correction of its keyframe (``Corrections.pose``), when the run
ends, since the corrections are only final then. It opens ``<name>.partial`` at once and renames it
when complete, as the other outputs (``replay_outputs``); the raw trajectory streams beside it
(``replay_args.raw_trajectory_path``).
"""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from .replay_console import log

if TYPE_CHECKING:
    from ..runtime.corrections import Corrections
    from ..runtime.loop_closure import LoopConfig, LoopStats
    from ..runtime.loop_verify import SideRunner
    from ..stream.results import FrameResult

FLUSH_TIMEOUT_S = 300.0  # the loop thread's work on one keyframe or one decision (a re-solve of a large graph)


class ReplayLoop:
    """A ``LoopCloser`` driven by the replay (module text). ``side``: the model's side session
    (``ModelSideRunner``; a stand-in in tests); ``conf_threshold``: depth kept in a keyframe's
    thumbnail needs confidence above it (the node's ``conf_threshold``)."""

    def __init__(self, config: LoopConfig, side: SideRunner, conf_threshold: float) -> None:
        from ..runtime.loop_closure import LoopCloser

        self.closer = LoopCloser(config, side, lambda corrections: None)  # read at the end: ``corrections``
        self.conf_threshold = conf_threshold
        self._taken: deque = deque()  # KeyframeIn taken, not handed to the closer yet

    @property
    def corrections(self) -> Corrections:
        return self.closer.corrections

    @property
    def stats(self) -> LoopStats:
        return self.closer.stats

    def take(self, r: FrameResult, stamp_s: float) -> None:
        """A frame's results as the replay writes them: a keyframe with depth is kept for the closer."""
        from ..runtime.loop_closure import KeyframeIn
        from ..runtime.loop_keyframes import depth_thumbnail

        if r.is_keyframe and r.depth is not None:
            depth, K = depth_thumbnail(r.depth, r.confidence, r.intrinsics, self.conf_threshold)
            self._taken.append(KeyframeIn(r.frame_index, stamp_s, np.array(r.c2w, np.float64), np.array(r.frame),
                                          depth, K, 1.0))

    def between_frames(self, settle: Callable[[], None]) -> None:
        """Before the next frame is submitted: the keyframes taken since go to the closer one at a
        time; for a candidate, ``settle()`` takes the results of the frame in flight (its keyframe
        joins the queue) and the candidate is verified here."""
        while self._taken:
            self.closer.keyframe(self._taken.popleft())
            self._flush()
            if self.closer.candidate_waiting:  # (one at a time; its decision makes no other)
                settle()
                while self.closer.run_idle():  # the candidate, then its partner, with the current frame
                    pass
                self._flush()

    def finish(self) -> LoopStats:
        """After the last frame's results (nothing in flight): the last keyframes, their candidates
        verified and decided; then the loop thread stops."""
        self.between_frames(lambda: None)
        self.closer.stop()
        return self.closer.stats

    def stop(self) -> None:
        self.closer.stop()

    def _flush(self) -> None:
        if not self.closer.flush(FLUSH_TIMEOUT_S):
            log.warning("loop closure: the loop thread is still busy after %.0f s; going on", FLUSH_TIMEOUT_S)


class OptimisedTrajectory:
    """--trajectory of a --loop-closure run (TUM, seconds; module text). ``corrections()`` gives
    the loop closer's corrections when the file is written."""

    def __init__(self, path: Path, overwrite: bool, corrections: Callable[[], Corrections]) -> None:
        from ..io.results import TumStreamWriter

        self.corrections = corrections
        self._tum = TumStreamWriter(path, overwrite)  # <name>.partial, opened now: a bad folder fails at once
        self._frames: list[tuple[int, float, np.ndarray]] = []  # (frame index, stamp s, c2w [4, 4])

    def add(self, stamp_s: float, c2w: np.ndarray, frame_index: int) -> None:
        self._frames.append((frame_index, stamp_s, np.array(c2w, np.float64)))

    def close(self) -> Path:
        self._write()
        return self._tum.close()

    def abort(self) -> Path:
        """The frames so far, moved by the corrections found so far, kept as ``<name>.partial``."""
        try:
            self._write()
        finally:
            partial = self._tum.abort()
        return partial

    def leftovers(self) -> list[Path]:
        return self._tum.leftovers()

    def _write(self) -> None:
        corrections, frames, self._frames = self.corrections(), self._frames, []
        for index, stamp_s, c2w in frames:
            self._tum.add(stamp_s, corrections.pose(index, c2w))


__all__ = ["ReplayLoop", "OptimisedTrajectory"]
