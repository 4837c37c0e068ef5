"""Where loop closure meets a camera's frame loop: ``LoopLink``.

The loop closer (``loop_closure.LoopCloser``) works on its own thread; what it decides reaches the
sequence through the inference thread, between two frames (``InferenceEngine.submit``):

- new corrections (a loop closed, a pose from outside) go to ``Sequence.correct``;
- a verified relocalisation re-seeds the model's window with the keyframes the camera was found
  at (``LongStreamSession.restart(seeds)``), and the frames after it follow that keyframe's
  correction;
- while relocalising, frames are not posed: ``locate`` hands one at a time to the place search and
  says so on ~/status (``frames_not_localized``);
- a resumed journal or a loaded session takes its loop closure back (``restore``), and a loaded
  session relocalises (the camera may be anywhere in its map).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..geometry import OPTICAL_TO_REP103
from ..stream.window import KeptKeyframe
from .corrections import Corrections
from .frames import InputFrame, State
from .loop_closure import LoopCloser, Relocation, as_rgb, loop_config
from .loop_journal import LOOP_JOURNAL_NAME, LoopJournal
from .loop_verify import ModelSideRunner, SideRunner

RESTORE_FLUSH_S = 60.0  # how long a resume waits for the loop thread to rebuild the graph


class LoopLink:
    """Creates the engine's loop closer when ``loop_closure`` is on (``engine.loop``; None when
    off) and joins it to the engine (module text). ``side``: what verifies candidates (default a
    side session on the engine's model)."""

    def __init__(self, engine, side: SideRunner | None = None) -> None:
        self.engine = engine
        settings, session, journal = engine.settings, engine.session, engine.journal
        if not settings.loop_closure:
            return
        loop_journal = None
        if journal is not None and journal.writer is not None:
            loop_journal = LoopJournal(Path(journal.writer.path).with_name(LOOP_JOURNAL_NAME), journal.identity,
                                       journal.writer.compression)
        engine.loop = engine.seq.loop = LoopCloser(
            loop_config(settings), side or ModelSideRunner(session.inner), self._corrected, loop_journal,
            self._relocated, seed_count=session.cfg.num_scale_frames)

    # ------------------------------------------------------------------ the loop thread's callbacks
    def _corrected(self, corrections: Corrections) -> None:
        self.engine.submit("loop correction", lambda: self.engine.seq.correct(corrections))

    def _relocated(self, reloc: Relocation) -> None:
        self.engine.submit("relocation", lambda: self.relocate(reloc))

    # ------------------------------------------------------------------ the inference thread
    def relocate(self, reloc: Relocation) -> None:
        """Re-seed the model's window with the keyframes the camera was found at (their stream poses
        and depths), so that the next frames are posed in the map; they follow the kept keyframe's
        correction until their own keyframes are in the graph."""
        e = self.engine
        loop, seq = e.loop, e.seq
        if loop is None or not loop.relocalizing:
            return
        to_stream = np.linalg.inv(OPTICAL_TO_REP103)
        seeds = [KeptKeyframe(kf.index, kf.rgb(), to_stream @ kf.T, kf.depth, None) for kf in reloc.seeds]
        try:
            e.session.restart(seeds)
        except Exception as exc:
            e.log.warning(f"relocalization at keyframe {reloc.kept + 1} failed while re-seeding the window: "
                          f"{type(exc).__name__}: {exc}; still looking")
            loop.relocalize()
            return
        first = e.session.frames_pushed
        seq.correct(seq.corrections.with_entry(first, reloc.correction))
        loop.relocated(first, reloc.kept)
        seq.set_state(State.INITIALIZING, f"relocalized at keyframe {reloc.kept + 1} ({reloc.reason}); the next "
                                          f"frame is {first + 1}")
        e.log.info(seq.text)
        e.reporter.publish(seq.text, None)

    def locate(self, frame: InputFrame, image: Any) -> None:
        """Relocalising: the frame is looked for in the map (one at a time), not posed."""
        e = self.engine
        loop, seq = e.loop, e.seq
        seq.count("frames_not_localized")
        if loop.wants_frame:
            data = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
            loop.locate(as_rgb(data), frame.stamp_s)
        seq.set_state(State.INITIALIZING, f"relocalizing: {loop.stats.last_reason or 'looking for the camera'}")
        e.reporter.publish(seq.text, frame.stamp)

    def restore(self, records: list, next_frame: int, relocalize: bool) -> None:
        """Take back journaled loop closure (``loop_journal.read_loop_journal``'s records, read before
        the sequence was cleared) cut at ``next_frame``; ``relocalize``: a saved session, where the
        camera may be anywhere in its map (frames go to the place search until it is found)."""
        e = self.engine
        loop = e.loop
        if loop is None:
            return
        loop.restore(records, next_frame)
        if relocalize:
            loop.relocalize()
        if not loop.flush(RESTORE_FLUSH_S):
            e.log.warning("loop closure did not finish restoring in time; it goes on in the background")
        if loop.relocalizing:
            e.seq.set_state(State.INITIALIZING, f"relocalizing in the map of {len(loop.store)} keyframes: no pose "
                                                "until the camera is found")


__all__ = ["LoopLink", "RESTORE_FLUSH_S"]
