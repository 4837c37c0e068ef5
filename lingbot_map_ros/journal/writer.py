"""JournalWriter: appends records to the journal file from a thread of its own.

The producer (the inference thread) calls ``append`` and ``begin``; neither touches the
disk nor ever waits for it. The writer keeps a *mirror*: the records the journal must hold
now (everything since the segment began: the last window restart, a reset, a loaded
session). The file on disk is always a prefix of the mirror, so whatever goes wrong with
the disk, the journal can be made whole again by rewriting the mirror (atomically: a temp
file, fsync, rename; ``io.atomic``):

- ``append``: the record joins the mirror and the queue; the thread appends its bytes.
- ``begin``: a new segment (compaction at a window restart, a reset, a loaded session):
  the mirror is replaced and the thread rewrites the file from it.
- the queue is full (the disk is slower than the frames) or a write fails (disk full,
  folder not writable): journaling *pauses* with the reason (``status()``; a warning is
  logged once per pause); records keep joining the mirror, none is queued. Every
  ``retry_s`` the thread tries to rewrite the whole mirror; when that works journaling
  resumes and the file holds every record again. A frame is never missing from the
  journal while ``status().state`` says "ok".

The mirror is bounded because a segment is: it holds one window's stored frames (they
are what the model's state is made of) plus small records; runs of "seen" records
collapse to the latest, and "state" records to the latest of each name.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..io.atomic import atomic_write, remove_stale_temps
from .format import Record, check_compression, encode_record_parts, lz4_available, write_journal

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class JournalStatus:
    """What ``/diagnostics`` and ``~/status`` show of the journal."""

    state: str  # "ok", "paused" (reason says why) or "closed"
    reason: str  # why it is paused ("" when ok)
    path: str
    records: int  # records in the current segment (the mirror)
    segment_bytes: int  # their array bytes (what a rewrite writes, roughly)
    bytes_written: int  # since the writer started (appends and rewrites)
    file_bytes: int  # the journal file's size after the last write
    queued: int  # records waiting for the thread
    pauses: int  # times journaling paused
    rewrites: int  # whole-file rewrites (compactions, resets, recoveries)
    seconds: float = 0.0  # from the first write to the last (bytes_written / seconds: the write rate)


def usable_compression(requested: str | int) -> str | int:
    """``requested`` as a writer can use it here: "lz4" without the lz4 module falls back to raw,
    with a warning that says how to get it."""
    if requested == "lz4" and not lz4_available():
        log.warning("journal compression lz4: the lz4 module is not installed (pip install lz4, or the python3-lz4 "
                    "package); the journals store frames uncompressed")
        return "none"
    return requested


class JournalWriter:
    """Writes one journal file (``path``) from a thread; see the module docstring.

    ``max_queue_bytes``/``max_queue_records`` bound what waits for the disk;
    ``fsync_s``: the file is fsync-ed at most this often (a kill loses nothing written;
    fsync bounds the loss at a power cut); ``compression``: how the arrays are stored
    (``format.COMPRESSIONS``; an int is a zlib level, 0 = raw; ``usable_compression``).
    ``on_change(status)`` is called from the thread when the state changes.
    """

    def __init__(self, path: str | Path, *, compression: str | int = "none", max_queue_bytes: int = 256 << 20,
                 max_queue_records: int = 4096, fsync_s: float = 1.0, retry_s: float = 2.0,
                 on_change: Callable[[JournalStatus], None] | None = None) -> None:
        self.path = Path(path)
        self.compression = check_compression(compression)
        self.max_queue_bytes, self.max_queue_records = max_queue_bytes, max_queue_records
        self.fsync_s, self.retry_s = fsync_s, retry_s
        self.on_change = on_change
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._header: dict[str, Any] | None = None  # None: no segment yet (nothing to write)
        self._mirror: list[tuple[int, Record]] = []
        self._state_at: dict[str, int] = {}  # state record name -> position in the mirror
        self._seq = 0  # sequence number of the newest record
        self._written = 0  # the file holds every record up to this sequence number
        self._rewrite_seq = 0  # begin() asked for a rewrite with records up to this one
        self._queued = self._queued_bytes = 0
        self._holds = 0  # hold() depth
        self._held: list[tuple] = []  # what was put while held, in order
        self._paused = ""  # reason
        self._pauses = self._rewrites = 0
        self._bytes_written = self._file_bytes = 0
        self._closed = False
        self._file = None
        self._last_fsync = 0.0
        self._first_write = self._last_write = None  # monotonic times
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side (never blocks)
    def begin(self, header: dict[str, Any], records: list[Record] = ()) -> None:
        """Start a new segment: the journal becomes ``header`` + ``records`` (rewritten atomically)."""
        with self._lock:
            self._header = dict(header)
            self._mirror, self._state_at = [], {}
            for r in records:
                self._seq += 1
                self._add(self._seq, r)
            self._rewrite_seq = self._seq
        self._put(("rewrite", self._seq, None), 0)

    def append(self, record: Record) -> None:
        """Add a record to the current segment (ignored before the first ``begin``)."""
        with self._lock:
            if self._header is None or self._closed:
                return
            self._seq += 1
            seq = self._seq
            self._add(seq, record)
            if self._paused:
                return  # the rewrite that resumes journaling includes it
            full = (self._queued + 1 > self.max_queue_records
                    or (self._queued and self._queued_bytes + record.nbytes > self.max_queue_bytes))
            if full:
                self._pause_locked(f"the journal queue is full ({self._queued} records, "
                                   f"{self._queued_bytes / 2**20:.0f} MiB): the disk is slower than the frames")
                return
        self._put(("append", seq, record), record.nbytes)

    def _add(self, seq: int, record: Record) -> None:
        """Into the mirror, collapsing runs of "seen" records and older states of one name."""
        if record.kind == "seen" and self._mirror and self._mirror[-1][1].kind == "seen":
            self._mirror[-1] = (seq, record)
            return
        if record.kind == "state":
            name = record.meta.get("name", "")
            old = self._state_at.pop(name, None)
            if old is not None:
                del self._mirror[old]
                self._state_at = {k: (v - 1 if v > old else v) for k, v in self._state_at.items()}
            self._state_at[name] = len(self._mirror)
        self._mirror.append((seq, record))

    def _put(self, item: tuple, nbytes: int, force: bool = False) -> None:
        """To the thread, or kept back while a ``hold`` lasts (``force``: now, with what was kept
        back before it, in order)."""
        with self._lock:
            self._queued += 1
            self._queued_bytes += nbytes
            if self._holds and not force:
                self._held.append(item)
                return
            self._release_held_locked()
            self._queue.put(item)

    def _release_held_locked(self) -> None:
        held, self._held = self._held, []
        for item in held:
            self._queue.put(item)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep what is appended meanwhile (from any thread) from the writer thread until the
        outermost hold ends, then hand it over at once, in order. A node holds its journals
        while it handles a frame (its records, the pose, the messages), so that the thread's
        work, which needs the interpreter in short turns, comes after the frame's instead of
        interleaving with it. ``flush`` and ``close`` do not wait for a hold to end."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if not self._holds:
                    self._release_held_locked()

    def status(self) -> JournalStatus:
        with self._lock:
            state = "closed" if self._closed else ("paused" if self._paused else "ok")
            seconds = 0.0 if self._first_write is None else self._last_write - self._first_write
            return JournalStatus(state, self._paused, str(self.path), len(self._mirror),
                                 sum(r.nbytes for _, r in self._mirror), self._bytes_written, self._file_bytes,
                                 self._queued, self._pauses, self._rewrites, seconds)

    def snapshot(self) -> tuple[dict[str, Any] | None, list[Record]]:
        """The current segment: (header, records) as the journal should hold them."""
        with self._lock:
            return (None if self._header is None else dict(self._header)), [r for _, r in self._mirror]

    def save_copy(self, dest: str | Path) -> int:
        """Write the current segment to ``dest`` atomically (a saved session); returns its bytes.
        Runs on the caller's thread; raises OSError when it cannot be written."""
        header, records = self.snapshot()
        if header is None:
            raise ValueError("nothing to save: no frame has been journaled since the start or the last reset")
        written = [0]

        def write(f):
            written[0] = write_journal(f, header, records, self.compression)

        atomic_write(dest, write)
        return written[0]

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the thread has handled everything queued (tests, a clean shutdown);
        True when the file then holds the whole segment."""
        done = threading.Event()
        self._put(("mark", 0, done), 0, force=True)
        if not done.wait(timeout):
            return False
        with self._lock:
            return not self._paused and self._written >= self._seq

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the thread."""
        if self._closed:
            return
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._release_held_locked()  # appended under a hold after the flush: still written
            self._queue.put(_STOP)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _pause_locked(self, reason: str) -> None:
        if not self._paused:
            self._pauses += 1
            log.warning("journal %s paused: %s; inference goes on, journaling resumes when the journal can be "
                        "rewritten", self.path, reason)
        self._paused = reason

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.status())
            except Exception:  # a callback must not stop the journal
                log.exception("journal status callback failed")

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.retry_s if self._paused else None)
            except queue.Empty:
                self._recover()
                continue
            if item is _STOP:
                break
            op, seq, arg = item
            with self._lock:
                self._queued -= 1
                if op == "append":
                    self._queued_bytes -= arg.nbytes
            if op == "mark":
                if self._paused and self._queue.empty():
                    self._recover()
                arg.set()
            elif op == "rewrite":
                if seq >= self._rewrite_seq:  # else a newer begin() follows in the queue
                    self._rewrite()
            elif op == "append" and not self._paused and seq > self._written:
                self._append(seq, arg)
        self._close_file()

    def _append(self, seq: int, record: Record) -> None:
        if self._file is None or seq != self._written + 1:
            self._rewrite()  # a gap (records collapsed or skipped): the mirror makes it whole
            return
        try:
            size = 0
            for part in encode_record_parts(record, self.compression):
                size += self._file.write(part)
            self._file.flush()
            now = time.monotonic()
            if now - self._last_fsync >= self.fsync_s:
                os.fsync(self._file.fileno())
                self._last_fsync = now
        except OSError as exc:
            self._failed(exc)
            return
        self._written = seq
        with self._lock:
            self._bytes_written += size
            self._file_bytes += size
            self._wrote(now)

    def _rewrite(self) -> None:
        with self._lock:
            if self._header is None:
                return
            header, records, upto = dict(self._header), [r for _, r in self._mirror], self._seq
            was_paused, self._paused = self._paused, ""  # appends after the snapshot are queued again
        self._close_file()
        written = [0]

        def write(f):
            written[0] = write_journal(f, header, records, self.compression)

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, write)
            self._file = open(self.path, "ab")
        except OSError as exc:
            if was_paused:
                with self._lock:
                    self._paused = was_paused  # still paused: not a new pause
            self._failed(exc)
            return
        self._written = upto
        self._last_fsync = time.monotonic()
        with self._lock:
            self._rewrites += 1
            self._bytes_written += written[0]
            self._file_bytes = written[0]
            self._wrote(self._last_fsync)
        if was_paused:
            log.warning("journal %s resumed: rewritten with the %d records of the current segment", self.path,
                        len(records))
            self._changed()

    def _wrote(self, now: float) -> None:
        if self._first_write is None:
            self._first_write = now
        self._last_write = now

    def _recover(self) -> None:
        if self._paused:
            remove_stale_temps(self.path)
            self._rewrite()

    def _failed(self, exc: OSError) -> None:
        self._close_file()
        with self._lock:
            self._pause_locked(f"cannot write {self.path}: {exc.strerror or exc}")
        self._changed()

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


__all__ = ["JournalWriter", "JournalStatus", "usable_compression"]
