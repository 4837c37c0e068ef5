"""A state directory and saved sessions: what a node (or any long-running owner of a session)
does with the journal, without ROS.

- ``open_state_directory``: at start, resume the journal found in the folder (or start a
  new one) and attach a ``JournalRecorder`` to the session. A journal of another
  model, configuration or resolution is never overwritten nor deleted: it is renamed to
  ``journal.refused-<UTC time>.lbj`` (its content untouched) and the reason returned; a
  damaged one is resumed up to its last good record and a copy of it kept as
  ``journal.damaged-<UTC time>.lbj`` before the journal is rewritten.
- ``save_session``: a named, self-contained copy of the current journal (atomic).
- ``load_session``: replace the session's state by a saved session's; refused (state
  unchanged) when the saved session does not fit.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .format import JournalError
from .recorder import JournalRecorder
from .resume import JournalMismatch, Rebuilt, read_journal, rebuild
from .writer import JournalWriter

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.lbj"


@dataclass
class Opened:
    """What ``open_state_directory`` did."""

    recorder: JournalRecorder  # attached to the session (``LongStreamSession.observe``)
    rebuilt: Rebuilt | None  # None: nothing resumed (a new journal)
    refused: str  # why a journal found there was set aside ("" when none was)
    set_aside: Path | None  # where it went


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def set_aside(path: str | Path, why: str) -> Path | None:
    """Rename the journal ``path`` to ``journal.<why>-<UTC time>.lbj`` beside it, content untouched;
    the new path, or None when there was none."""
    path = Path(path)
    if not path.exists():
        return None
    aside = path.with_name(f"journal.{why}-{_stamp()}.lbj")
    os.replace(path, aside)
    return aside


def open_state_directory(folder: str | Path, session, identity: dict[str, Any], width: int | None = None,
                         progress: Callable[[int, int], None] | None = None, **writer_kw) -> Opened:
    """Resume or start the journal in ``folder`` for ``session`` (a fresh LongStreamSession, no
    observer yet). Raises OSError when the folder cannot be created; an exception of the model
    during the replay propagates (the journal is left as it was)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / JOURNAL_NAME
    rebuilt, refused, aside = None, "", None
    if path.exists():
        try:
            rebuilt = rebuild(session, path, identity, width, progress)
        except JournalError as exc:  # another model/config/resolution, not a journal, unreadable
            refused = str(exc)
            aside = set_aside(path, "refused")
            log.warning("the journal in %s was not resumed (%s); kept as %s, a new journal starts", folder, refused,
                        aside.name)
            session.reset()
        else:
            if rebuilt.corrupt:
                aside = folder / f"journal.damaged-{_stamp()}.lbj"
                shutil.copyfile(path, aside)
                log.warning("journal %s: %s; resumed up to the record before it, the damaged file kept as %s",
                            path, rebuilt.stop, aside.name)
    writer = JournalWriter(path, **writer_kw)
    recorder = JournalRecorder(writer, identity, session.deferred_eviction, begin=rebuilt is None)
    if rebuilt is not None:
        recorder.adopt(rebuilt.records, rebuilt.scale_count, rebuilt.state_records, session.inner.resolution)
    session.observe(recorder)
    return Opened(recorder, rebuilt, refused, aside)


def save_session(recorder: JournalRecorder, folder: str | Path) -> tuple[Path, int]:
    """Write the current journal into ``folder`` (created) as a saved session; returns (file,
    bytes). ValueError when nothing was journaled since the start or the last reset; OSError
    when it cannot be written. The caller confines ``folder`` (e.g. under output_directory)."""
    if recorder.writer is None:
        raise ValueError("journaling is off (no state directory)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / JOURNAL_NAME
    return dest, recorder.writer.save_copy(dest)


def load_session(session, recorder: JournalRecorder, folder: str | Path, width: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Rebuilt:
    """Replace the state of ``session`` (a LongStreamSession journaled by ``recorder``) by the
    saved session in ``folder``: frames after it are posed in that session's map.
    JournalError/JournalMismatch (state unchanged) when it cannot be read or does not fit; an
    exception of the model during the replay leaves the session reset (journaled so)."""
    path = Path(folder) / JOURNAL_NAME
    read_journal(path, recorder.identity, width)  # refuse before anything changes
    session.settle()  # frames in flight belong to the state being replaced
    session.observe(None)  # the replay is the saved journal's, not new records
    try:
        rebuilt = rebuild(session, path, recorder.identity, width, progress)
    except BaseException:
        session.observe(recorder)
        session.reset()
        raise
    recorder.adopt(rebuilt.records, rebuilt.scale_count, rebuilt.state_records, session.inner.resolution)
    session.observe(recorder)
    return rebuilt


__all__ = ["JOURNAL_NAME", "Opened", "open_state_directory", "save_session", "load_session", "set_aside",
           "JournalMismatch"]
