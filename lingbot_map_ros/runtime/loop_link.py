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
  session relocalises (the camera may be anywhere in its map);
- a lost track with ``on_lost=relocalize`` relocalises too (``relocalize_lost``): the sequence, its
  path and the keyframe map stay, the window is re-seeded where the camera is found; after
  ``relocalize_timeout`` seconds of stamps without a place it gives up (a new sequence);
- a pose from outside (``~/set_pose``, ``~/pose_prior``) is checked against the path and the
  keyframes and handed to the graph (``pose_input``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..geometry import OPTICAL_TO_REP103
from ..slam import Sim3
from ..stream.window import KeptKeyframe
from .corrections import Corrections, rigid
from .frames import InputFrame, State
from .loop_closure import LoopCloser, Relocation, as_rgb, loop_config
from .loop_journal import LOOP_JOURNAL_NAME, LoopJournal
from .loop_verify import ModelSideRunner, SideRunner
from .pose_inputs import PoseInput, PoseRefused, check_pose_input, to_model_units

RESTORE_FLUSH_S = 60.0  # how long a resume waits for the loop thread to rebuild the graph
LOST_FLUSH_S = 5.0  # how long a lost track waits for the loop thread to take the search (keyframes queued before)


class LoopLink:
    """Creates the engine's loop closer when ``loop_closure`` is on (``engine.loop``; None when
    off) and joins it to the engine (module text). ``side``: what verifies candidates (default a
    side session on the engine's model)."""

    def __init__(self, engine, side: SideRunner | None = None) -> None:
        self.engine = engine
        self.lost_at: float | None = None  # stamp (s) of the frame that lost the track, while relocalising after it
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
        self.lost_at = None
        seq.correct(seq.corrections.with_entry(first, reloc.correction))
        loop.relocated(first, reloc.kept)
        seq.set_state(State.INITIALIZING, f"relocalized at keyframe {reloc.kept + 1} ({reloc.reason}); the next "
                                          f"frame is {first + 1}")
        e.log.info(seq.text)
        e.reporter.publish(seq.text, None)

    def relocalize_lost(self, reasons: str, frame: InputFrame) -> bool:
        """on_lost=relocalize: the track was lost at ``frame`` (``reasons``). The camera is looked for
        in the whole keyframe map: the next frames go to ``locate`` and are not posed until it is
        found; the sequence (path, map, keyframes, numbering) stays. False (nothing done) when the
        map has fewer keyframes than a window needs to be re-seeded with."""
        e = self.engine
        loop, seq = e.loop, e.seq
        if loop is None or len(loop.store) < loop.seed_count:
            return False
        seq.tracking.clear()  # judged afresh once re-seeded
        loop.relocalize()
        self.lost_at = frame.stamp_s
        seq.set_state(State.INITIALIZING, f"tracking lost ({reasons}): relocalizing in the map of {len(loop.store)} "
                                          "keyframes; no pose until the camera is found")
        e.log.warning(seq.text)
        e.reporter.publish(seq.text, frame.stamp)
        loop.flush(LOST_FLUSH_S)  # the next frame looked for, not stepped (unless the loop thread is slow)
        return True

    def locate(self, frame: InputFrame, image: Any) -> None:
        """Relocalising: the frame is looked for in the map (one at a time), not posed. After a lost
        track, ``relocalize_timeout`` seconds of stamps without a place start a new sequence."""
        e = self.engine
        loop, seq = e.loop, e.seq
        seq.count("frames_not_localized")
        timeout = e.settings.relocalize_timeout
        if self.lost_at is not None and timeout > 0 and frame.stamp_s - self.lost_at > timeout:
            self.lost_at = None
            e.recovery.start_over(f"not found in the map within relocalize_timeout {timeout:g} s", frame.stamp)
            loop.flush(LOST_FLUSH_S)  # the loop closer cleared before the next frame: it is stepped again
            return
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
        self.lost_at = None
        loop.restore(records, next_frame)
        if relocalize:
            loop.relocalize()
        if not loop.flush(RESTORE_FLUSH_S):
            e.log.warning("loop closure did not finish restoring in time; it goes on in the background")
        if loop.relocalizing:
            e.seq.set_state(State.INITIALIZING, f"relocalizing in the map of {len(loop.store)} keyframes: no pose "
                                                "until the camera is found")


    def pose_input(self, kind: str, p: PoseInput, map_frame: str | None = None) -> str:
        """``kind`` "set_pose" (the frame at ``p``'s stamp, or the latest for a zero stamp, is at
        ``p``: the map moves so that it is, and the graph keeps it as a prior) or "prior" (a prior of
        the keyframe at or before that frame). Returns what was done; PoseRefused (nothing changed)
        for a pose that is not taken, with the reason. ``map_frame``: the frame the camera publishes
        its map in (default the ``map_frame`` parameter)."""
        e = self.engine
        loop, seq, s = e.loop, e.seq, e.settings
        if loop is None:
            raise PoseRefused("loop closure is off (parameter loop_closure): there is no pose graph to take it")
        if loop.relocalizing:
            raise PoseRefused("relocalizing: the camera is not found in the map yet, so no frame can be placed")
        T, cov = check_pose_input(p, map_frame or s.map_frame)
        out = seq.anchor.output
        T, cov = to_model_units(T, cov, out.scale, out.offset)
        entries = seq.path.entries()
        if not entries:
            raise PoseRefused("no frame has been posed yet")
        if kind == "set_pose" and p.stamp_s == 0.0:
            entry = entries[-1]
        else:
            entry = min(entries, key=lambda en: abs(en.stamp_s - p.stamp_s))
            dt = abs(entry.stamp_s - p.stamp_s)
            if dt > s.loop_prior_max_dt:
                raise PoseRefused(f"stamp {p.stamp_s:.3f} s is {dt:.3f} s from the nearest frame of the path "
                                  f"(loop_prior_max_dt {s.loop_prior_max_dt:g} s): no keyframe to put it on")
        if kind == "set_pose":
            loop.pose_input("set_pose", Sim3.from_pose(T), cov, entry.frame_index, entry.T_map_cam)
            # in force for the next frame: the graph's answer is waited for and applied here
            if not loop.flush(RESTORE_FLUSH_S):
                return f"frame {entry.frame_index + 1} is set at the given pose once the pose graph has taken it"
            seq.correct(loop.corrections)
            return f"frame {entry.frame_index + 1} set at the given pose; the map frame moved with it"
        before = [i for i in loop.store.indices() if i <= entry.frame_index]
        if not before:
            raise PoseRefused(f"no keyframe at or before frame {entry.frame_index + 1} to put the prior on")
        kf = loop.store.get(before[-1])
        target = rigid(T @ np.linalg.inv(entry.T_map_cam) @ kf.T)  # the keyframe, moved by the stream's motion since
        loop.pose_input("prior", Sim3.from_pose(target), cov, kf.index)
        return f"prior on keyframe {kf.index + 1} (frame {entry.frame_index + 1} at the given pose)"


__all__ = ["LoopLink", "RESTORE_FLUSH_S", "LOST_FLUSH_S"]
