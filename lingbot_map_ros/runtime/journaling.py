"""The keyframe journal in the node: ``state_directory``, ``load_session``, ``~/save_session``.

No ROS here. The node calls ``open_camera_journal`` once per camera at start (after the
model is loaded, before the camera's engine exists): with ``state_directory`` a
``journal.JournalRecorder`` observes the camera's session, its journal in
``<state_directory>[/<camera>]/journal.lbj``; a journal found there is resumed (rebuilt by
replaying its stored frames) or, when it belongs to another model, configuration or
resolution, set aside with the reason (``journal.state_dir``). With ``load_session`` the
journal found there is set aside instead (``journal.replaced-<UTC time>.lbj``) and the
saved session is loaded. Without either there is no recorder: nothing changes.

``save_sessions`` writes every camera's journal as one saved session folder
(``<folder>[/<camera>]/journal.lbj``) on the calling (service) thread: into a temporary
sibling first, then renamed into place, so that a kill leaves either the old session or the
new one, never a mix. ``session_folder`` confines a request under ``output_directory`` as
``~/save_map`` does.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..io.atomic import fsync_directory
from ..io.map_save import MapSaveError, new_save_id, resolve_save_directory
from ..journal import (JOURNAL_NAME, JournalError, JournalRecorder, Rebuilt, journal_identity, load_session,
                       open_state_directory, set_aside)
from ..journal.resume import read_journal
from ..journal.writer import usable_compression
from .loop_journal import LOOP_JOURNAL_NAME
from .map_journal import MAP_JOURNAL_NAME
from .params import NodeSettings

log = logging.getLogger(__name__)

COUNTERS_STATE = "counters"  # the ~/status counters, journaled as a named state (latest kept)
ANCHOR_STATE = "anchor"  # where the sequence sits in the map (a lost reset's offset): MapAnchor.snapshot
SESSIONS_OFF = "sessions are off: start the node with state_directory (or load_session) set to load saved sessions"
LOOP_FLUSH_S = 30.0  # how long a save waits for the loop thread to journal what it was handed
SESSION_FILES = (JOURNAL_NAME, MAP_JOURNAL_NAME, LOOP_JOURNAL_NAME)  # what a saved session's (camera) folder holds
JOURNALING_OFF = "journaling is off: start the node with state_directory set to save sessions"


class SessionError(Exception):
    """A saved session cannot be written or read here; the message says why (state unchanged)."""


@dataclass(frozen=True)
class Resumed:
    """What start-up (or ``~/load_session``) rebuilt, for ~/status and /diagnostics."""

    source: str  # "journal" (state_directory) or "session" (a saved session)
    path: str
    frames: int  # stored frames replayed through the model
    next_frame: int  # 0-based index of the next frame
    seconds: float
    stop: str = ""  # why reading stopped before the end ("" = it did not)
    refused: str = ""  # a journal set aside at start, and why
    set_aside: str = ""  # where it went
    states: dict = field(default_factory=dict, compare=False)  # the journaled named states (counters)
    # scale frames pushed before the interruption whose results the scale step will give with the
    # next frames: (stamp ns, tag, model input [H, W, 3] uint8), oldest first
    collecting: tuple = field(default=(), compare=False)

    @classmethod
    def of(cls, source: str, rebuilt: Rebuilt, refused: str = "", set_aside: str = "") -> "Resumed":
        collecting = ()
        if rebuilt.next_frame == 0 and rebuilt.scale_count:
            scale = [r for r in rebuilt.records if r.kind == "frame" and r.meta.get("decision") == "scale"]
            collecting = tuple((r.meta.get("stamp"), r.meta.get("tag"), _as_rgb(r.arrays["image"]))
                               for r in scale[-rebuilt.scale_count:])
        return cls(source, str(rebuilt.path), rebuilt.frames_replayed, max(rebuilt.next_frame, rebuilt.scale_count),
                   rebuilt.seconds, rebuilt.stop, refused, set_aside, dict(rebuilt.states), collecting)

    def describe(self) -> str:
        what = "resumed the journal" if self.source == "journal" else "loaded the session"
        out = (f"{what} {self.path}: {self.frames} stored frame(s) replayed in {self.seconds:.1f} s; the next frame "
               f"is {self.next_frame + 1}")
        return out + (f" ({self.stop})" if self.stop else "")


def _as_rgb(image) -> np.ndarray:
    """A journaled model input as [H, W, 3] uint8 (float [3, H, W] in 0..1 is converted)."""
    a = np.asarray(image)
    if a.dtype == np.uint8:
        return a
    return np.clip(np.moveaxis(a, 0, -1) * 255.0 + 0.5, 0, 255).astype(np.uint8)


def camera_folder(root: str | Path, camera: str) -> Path:
    """A camera's folder of a state directory or a saved session ("" = the single camera: the root)."""
    return Path(root) / camera if camera else Path(root)


def session_folder(requested: str, output_directory: str, default_name: bool = True) -> Path:
    """The folder a ~/save_session or ~/load_session request names: empty = a new
    ``session-<UTC time>-<8 hex>`` under ``output_directory`` (``default_name``; else SessionError),
    relative = under it (may not leave it), absolute = as given."""
    if not requested.strip():
        if not default_name:
            raise SessionError("no directory given: name the saved session's folder")
        requested = f"session-{new_save_id()}"
    try:
        return resolve_save_directory(requested, output_directory)
    except MapSaveError as exc:
        raise SessionError(str(exc)) from None


def journal_label(settings: NodeSettings) -> str:
    """What the journal header names as the weights (shown when a journal is refused)."""
    return settings.checkpoint or f"random seed {settings.seed}"


def open_camera_journal(session, settings: NodeSettings, camera: str,
                        progress: Callable[[int, int], None] | None = None
                        ) -> tuple[JournalRecorder | None, Resumed | None]:
    """The camera's journal recorder (observing ``session``; None without state_directory and
    load_session) and what was rebuilt (None: nothing).

    Raises SessionError when ``load_session`` cannot be loaded (the node refuses to start: the
    operator asked for that map) and OSError when the state directory cannot be made."""
    if not settings.state_directory and not settings.load_session:
        return None, None
    identity = journal_identity(session, journal_label(settings))
    resumed = None
    if settings.state_directory:
        folder = camera_folder(settings.state_directory, camera)
        if settings.load_session:
            aside = set_aside(folder / JOURNAL_NAME, "replaced")
            if aside is not None:
                log.warning("the journal in %s is set aside as %s (load_session replaces it)", folder, aside.name)
        opened = open_state_directory(folder, session, identity, settings.image_width, progress,
                                      compression=usable_compression(settings.journal_compression))
        recorder = opened.recorder
        if opened.rebuilt is not None:
            resumed = Resumed.of("journal", opened.rebuilt)
        elif opened.refused:
            resumed = Resumed("journal", str(folder / JOURNAL_NAME), 0, 0, 0.0, refused=opened.refused,
                              set_aside=str(opened.set_aside or ""))
    else:
        recorder = JournalRecorder(None, identity, begin=False)
        session.observe(recorder)
    if settings.load_session:
        folder = camera_folder(session_folder(settings.load_session, settings.output_directory, False), camera)
        resumed = Resumed.of("session", load_saved(session, recorder, folder, settings.image_width, progress))
    return recorder, resumed


def check_saved(journal: JournalRecorder | None, folder: Path, width: int) -> None:
    """SessionError unless the session of ``journal`` may load the saved session in ``folder``:
    sessions on, the journal there, readable, of this model, configuration and width (nothing
    changes here)."""
    if journal is None:
        raise SessionError(SESSIONS_OFF)
    path = Path(folder) / JOURNAL_NAME
    if not path.is_file():
        raise SessionError(f"{folder} holds no saved session (no {JOURNAL_NAME})")
    try:
        read_journal(path, journal.identity, width)
    except JournalError as exc:
        raise SessionError(f"cannot load {folder}: {exc}") from None


def load_saved(session, journal: JournalRecorder, folder: Path, width: int,
               progress: Callable[[int, int], None] | None = None) -> Rebuilt:
    """``journal.load_session`` with its refusals as SessionError (state unchanged); an exception
    of the model during the replay propagates (the session is then reset)."""
    check_saved(journal, folder, width)
    try:
        return load_session(session, journal, folder, width, progress)
    except JournalError as exc:
        raise SessionError(f"cannot load {folder}: {exc}") from None


class JournalNotes:
    """What a camera's engine journals besides its frames, each only when it changed: the
    ~/status counters (``counters``, with the heartbeat: at most once a second) and where the
    sequence sits in the map (``anchor``: ``MapAnchor.output`` is replaced on every change, a
    lost reset's offset or a converged scale). ``restore`` takes both back from a rebuilt
    session. Inference thread only; nothing happens without a journal writer."""

    def __init__(self, journal: JournalRecorder | None) -> None:
        self.journal = journal
        self._counters: dict[str, int] | None = None
        self._output = None  # the anchor's output last journaled

    @property
    def writing(self) -> bool:
        return self.journal is not None and self.journal.writer is not None

    def anchor(self, anchor: Any) -> None:
        if not self.writing or anchor.output is self._output:
            return
        self._output = anchor.output
        self.journal.note_state(ANCHOR_STATE, anchor.snapshot())

    def counters(self, counters: Any) -> None:
        """``counters``: the ``CounterValues`` ~/status reports now."""
        if not self.writing:
            return
        values = dict(vars(counters))
        if values != self._counters:
            self._counters = values
            self.journal.note_state(COUNTERS_STATE, values)

    def restore(self, resumed: Resumed, seq: Any) -> None:
        """Take the journaled counters and the anchor back into the sequence ``seq``."""
        counts = resumed.states.get(COUNTERS_STATE)
        if counts:
            seq.restore_counters(counts)
        state = resumed.states.get(ANCHOR_STATE)
        if state:
            seq.anchor.restore(state)
        self.anchor(seq.anchor)
        self._counters = counts


def save_sessions(sessions: dict[str, JournalRecorder | None], folder: Path, maps: dict[str, Any] | None = None,
                  loops: dict[str, Any] | None = None) -> int:
    """Write every camera's journal (``{camera: recorder}``, "" = the single camera) as one saved
    session in ``folder`` (replacing one there), with the camera's map journal (``maps``:
    ``{camera: MapJournal}``, taken after the keyframe journal so that it holds every frame
    that one does) and its loop closure (``loops``: ``{camera: LoopCloser}``, flushed first, its
    journal's ``loop.lbj``); returns the bytes written. SessionError when journaling is off or nothing
    was journaled yet, OSError when the disk refuses (nothing of the new session is left then,
    the old one is kept)."""
    if any(s is None or s.writer is None for s in sessions.values()):
        raise SessionError(JOURNALING_OFF)
    folder = Path(folder)
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise SessionError(f"{folder} exists and is not a folder")
    tmp = parent / f".{folder.name}.saving-{secrets.token_hex(4)}"
    total = 0
    try:
        for camera, s in sessions.items():
            dest = camera_folder(tmp, camera)
            dest.mkdir(parents=True, exist_ok=True)
            try:
                total += s.writer.save_copy(dest / JOURNAL_NAME)
            except ValueError as exc:
                raise SessionError(f"camera {camera}: {exc}" if camera else str(exc)) from None
            map_journal = (maps or {}).get(camera)
            if map_journal is not None:
                total += map_journal.save_copy(dest / MAP_JOURNAL_NAME)
            loop = (loops or {}).get(camera)
            if loop is not None and loop.graph.journal is not None:
                loop.flush(LOOP_FLUSH_S)
                total += loop.graph.journal.save_copy(dest / LOOP_JOURNAL_NAME)
        old = None
        if folder.exists():
            if any(p.name not in SESSION_FILES and not (p.is_dir() and (p / JOURNAL_NAME).exists())
                   for p in folder.iterdir()):
                raise SessionError(f"{folder} holds other files than a saved session; not replaced")
            old = parent / f".{folder.name}.old-{secrets.token_hex(4)}"
            os.replace(folder, old)
        os.replace(tmp, folder)
        fsync_directory(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return total


def close_journals(engine: Any, timeout: float) -> str:
    """A stopped camera's journals closed (what was queued reaches the disk, ``timeout`` s at most
    each); what journaling cost the disk as one line ("" without journals; docs/sessions.md)."""
    written = []
    if engine.journal is not None and engine.journal.writer is not None:
        engine.journal.writer.close(timeout=timeout)
        written.append(("journal", engine.journal.writer.status()))
    if engine.seq.map_journal is not None:
        engine.seq.map_journal.close(timeout=timeout)
        written.append(("map journal", engine.seq.map_journal.status()))
    return "; ".join(f"{what} {st.bytes_written / 1e6:.1f} MB written in {st.seconds:.1f} s"
                     f" ({st.bytes_written / 1e6 / max(st.seconds, 1e-9):.2f} MB/s, {st.rewrites} rewrites)"
                     for what, st in written)


__all__ = ["ANCHOR_STATE", "COUNTERS_STATE", "JOURNALING_OFF", "JournalNotes", "SESSIONS_OFF", "Resumed",
           "SessionError", "camera_folder", "check_saved", "close_journals", "journal_label", "load_saved", "open_camera_journal", "save_sessions",
           "session_folder"]
