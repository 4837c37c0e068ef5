"""A camera's commands: what its services and timers run on the inference thread between two
frames (``CameraCommands``).

- ``configure``: new settings (a parameter set) take effect;
- ``heartbeat``: a ~/status when none went out for a second (WAITING_FOR_IMAGES when the input
  went quiet), the deadlines of keyframe decisions and deferred evictions, the counters journaled;
- ``reset``: a new sequence, the counters from 0;
- ``set_deferred_eviction``: evictions wait for ~/commit_eviction, or not;
- ``load_session`` / ``resumed_from``: the state replaced by a saved session's (or, at start, by
  the state directory's journal), the map and path taken back from its map journal;
- ``save_snapshot``: what ~/save_map writes, taken at one moment (the files are written on the
  caller's thread: a slow disk never holds up inference).

They work on the camera's ``InferenceEngine`` parts (its session, ``Sequence``, status,
keyframe control, recovery) exactly as the frame loop does; no ROS.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .frames import InputFrame, State
from .journaling import SESSIONS_OFF, Resumed, SessionError, load_saved
from .loop_journal import LOOP_JOURNAL_NAME, read_loop_journal
from .params import NodeSettings
from .saving import SaveError, SaveSnapshot
from .worker import Command


class CameraCommands:
    """The commands of ``engine`` (its ``runtime.engine.InferenceEngine``; see the module docstring); ``make_stamp``: nanoseconds -> the
    sink's stamp (a resumed scale frame's); ``flush_s``: how long a resume waits for the output
    thread. ``resumed``: what start-up or the last ~/load_session rebuilt (None: nothing)."""

    def __init__(self, engine: Any, make_stamp: Callable[[int], Any], flush_s: float) -> None:
        self.engine, self.make_stamp, self.flush_s = engine, make_stamp, flush_s
        self.resumed: Resumed | None = None

    # ------------------------------------------------------------------ settings and the heartbeat
    def configure(self, settings: NodeSettings) -> None:
        """New settings: they apply from the next item. The deferral in force stays until
        ``settings.deferred_eviction`` differs from it (then it is set as by ~/set_deferred_eviction)."""
        e = self.engine
        in_force = e.settings.deferred_eviction
        e.settings = replace(settings, deferred_eviction=in_force)
        e.seq.tracking.reconfigure(settings)
        e.sink.configure(settings)
        if settings.deferred_eviction != in_force:
            self.set_deferred_eviction(settings.deferred_eviction)
        e.keyframes.check_hold_deadline()  # a keyframe_decision_timeout lowered now applies to the held frame now

    def heartbeat(self, clock_problem: str = "") -> None:
        """Publish a status when none went out for HEARTBEAT_PERIOD (or the input went quiet);
        ``clock_problem`` ("no clock: ...") is added to its text."""
        e, seq = self.engine, self.engine.seq
        e.notes.counters(seq.counter_values())
        e.keyframes.check_hold_deadline()
        e.keyframes.check_deferral_deadline()
        quiet = e.seconds_since_input()
        changed = False
        if seq.state not in (State.ERROR, State.RESETTING) and not e.queue.pending_frame() and (
                quiet is None or quiet > e.settings.input_timeout):
            waited = "no image received yet" if quiet is None else f"no image for {quiet:.1f} s"
            changed = seq.state != State.WAITING_FOR_IMAGES
            seq.set_state(State.WAITING_FOR_IMAGES, waited)
        if changed or e.reporter.due():
            e.reporter.publish(seq.text + (f"; {clock_problem}" if clock_problem else ""), e.stamps.last_stamp)

    # ------------------------------------------------------------------ services
    def reset(self) -> str:
        """Empty the cache, path, map and counters; the next image starts a new sequence. A frame
        still waiting in the latest-frame slot (it arrived before the reset, e.g. behind a held
        decision) belongs to the old sequence and is discarded."""
        e, seq = self.engine, self.engine.seq
        seq.set_state(State.RESETTING, "resetting")
        e.reporter.publish(seq.text, e.stamps.last_stamp)
        e.queue.discard_frame()
        e.recovery.clear_sequence()
        seq.reset_counters()
        e.input_rate.clear()
        e.output_rate.clear()
        e.stamps.clear()
        seq.set_state(State.WAITING_FOR_IMAGES, "reset; waiting for images")
        e.notes.counters(seq.counter_values())
        e.reporter.publish(seq.text, None)
        return "cache, path, map and counters cleared; the next image starts a new sequence"

    def set_deferred_eviction(self, enabled: bool) -> str:
        e = self.engine
        e.session.set_deferred_eviction(enabled)
        e.settings = replace(e.settings, deferred_eviction=enabled)
        e.keyframes.deferral_changed()
        e.reporter.publish(e.seq.text, e.stamps.last_stamp)
        stats = e.reporter.last_stats
        return f"deferred eviction {'on' if enabled else 'off'} ({stats.pending_evictions if stats else 0} " \
               "eviction(s) pending)"

    def save_snapshot(self) -> SaveSnapshot:
        """The trajectory as it is now, and the map once the output thread has added the clouds of
        every frame up to now (a snapshot queued behind them); ``runtime.saving.write_map_files``
        writes the files on the caller's thread."""
        seq, loop = self.engine.seq, self.engine.loop
        out = seq.anchor.output
        if loop is not None:
            # loop closure: the corrected path, the keyframes' map at the corrected poses, and the
            # front end's own path beside them (trajectory_raw.tum)
            loop.render_map()
            loop.flush(self.flush_s)
            points, colors, version = loop.map
            snapshot = Command("loop map", lambda: (points, colors, version))
            snapshot.run()
            entries = seq.path.entries()
            corrected = np.array([seq.corrections.pose(e.frame_index, e.T_map_cam) for e in entries]).reshape(-1, 4, 4)
            return SaveSnapshot(seq.path.stamps(), corrected, snapshot, out.scale, out.offset,
                                raw_poses=seq.path.poses())
        if seq.map is None:
            raise SaveError("the map is not accumulated (accumulate_map is false); nothing to save")
        snapshot = Command("map snapshot", seq.map.snapshot)
        seq.outputs.op(snapshot.run)
        return SaveSnapshot(seq.path.stamps(), seq.path.poses(), snapshot, out.scale, out.offset)

    # ------------------------------------------------------------------ saved sessions (journaling)
    def load_session(self, folder: Path, progress_period: float = 0.25) -> Resumed:
        """Replace the state by the saved session in ``folder``: the next frames are posed in its
        map and numbered after its frames. A frame waiting in the latest-frame slot belongs to the
        old map: it is dropped as stale. ``journaling.SessionError`` (state unchanged) when
        journaling is off or the session does not fit; an exception of the model during the
        replay ends with a new sequence (as an inference error does)."""
        e = self.engine
        if e.journal is None:
            raise SessionError(SESSIONS_OFF)
        if e.queue.discard_frame() is not None:
            e.seq.count("frames_dropped_stale")
        last = [-float("inf")]

        def progress(k: int, n: int) -> None:
            now = e.monotonic()
            if k == n or now - last[0] >= progress_period:
                last[0] = now
                e.seq.set_state(State.INITIALIZING, f"loading the session: resuming {k} of {n}")
                e.reporter.publish(e.seq.text, None)
        try:
            rebuilt = load_saved(e.session, e.journal, Path(folder), e.settings.image_width, progress)
        except SessionError:
            raise
        except Exception as exc:
            e.recovery.inference_error(exc)
            raise
        self.resumed_from(Resumed.of("session", rebuilt))
        return self.resumed

    def resumed_from(self, resumed: Resumed | None) -> None:
        """The session was rebuilt (start-up resume or a loaded session): forget what belonged to
        the state before it, take the journaled counters, say so in ~/status."""
        e, seq = self.engine, self.engine.seq
        self.resumed = resumed
        if resumed is None or not resumed.frames:
            if resumed is not None and resumed.refused:
                seq.set_state(seq.state, f"journal set aside ({resumed.refused}); a new journal starts")
            return
        seq.pause_map_journal()  # the map and path are replaced below: not a change to journal
        identity = e.journal.identity if e.journal is not None else None
        # read before the clear below, which empties the loop journal (it may be this very file)
        loop_read = read_loop_journal(Path(resumed.path).parent / LOOP_JOURNAL_NAME, identity) \
            if e.loop is not None else None
        e.recovery.clear_sequence(reset_session=False)
        restored = seq.restore_map(Path(resumed.path), resumed.next_frame, self.make_stamp, identity, self.flush_s,
                                   e.log.warning)
        e.stamps.clear()
        e.notes.restore(resumed, seq)
        if e.queue.discard_frame() is not None:  # it arrived during the rebuild
            seq.count("frames_dropped_stale")
        for stamp_ns, tag, rgb in resumed.collecting:  # scale frames whose results come with the next ones
            ns = int(stamp_ns or 0)
            frame_id = (tag or {}).get("frame_id") or e.settings.camera_frame or "camera_optical_frame"
            e.recovery.collected.append(InputFrame(rgb=rgb, stamp=self.make_stamp(ns), stamp_s=ns * 1e-9,
                                                   camera_frame=frame_id))
        e.reporter.refresh_stats()
        seq.last_index = resumed.next_frame
        kept = f"; map {restored.points} points, path {restored.poses} poses" if not restored.note \
            else f"; map and path not restored: {restored.note}"
        seq.set_state(State.INITIALIZING, resumed.describe() + kept)
        if loop_read is not None:
            # a saved session's camera may be anywhere in its map; after a restart it is where it was
            e.loop_link.restore(loop_read.records, resumed.next_frame, relocalize=resumed.source == "session")
            if e.loop.relocalizing:
                seq.set_state(State.INITIALIZING, resumed.describe() + kept + "; " + seq.text)
        e.reporter.publish(seq.text, None)


__all__ = ["CameraCommands"]
