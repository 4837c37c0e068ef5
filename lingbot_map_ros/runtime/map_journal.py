"""The accumulated map and the path kept on disk beside the keyframe journal: ``map.lbj``.

The keyframe journal (``journal/``) rebuilds the model's state, but the node's map cloud and
path are made of every frame's outputs, and frames that were only attended to are not in it.
So the map has a journal of its own, in the same file format (``journal.format``), written by
its own ``JournalWriter`` thread:

- ``chunk``: a frame's points as the map keeps them (after voxel downsampling: what
  ``MapAccumulator.add`` stores), with their colours;
- ``mapop``: ``protect_from``, ``remove_from`` (a rollback) and ``clear`` of the map, and
  ``remove_from`` / ``clear`` of the path, in the order they were applied;
- ``pose``: a path entry (frame index, image stamp, ``T_map_cam``);
- ``snapshot``: the whole map (consolidated cloud, the chunks still held apart, the floor)
  and path at a compaction. The map and path are pure functions of these operations (the
  accumulator's merge and thinning are deterministic), so replaying a snapshot and the
  records after it gives back the same map, point for point, in the same order.

``MapJournal`` listens to a ``MapAccumulator`` and a ``Trajectory`` (their ``listener``) and
appends a record for every change, after it is applied and under the structure's lock, so
the records are in the order of the changes. It compacts (a new segment: one snapshot) when
the segment has grown past ``COMPACT_FACTOR`` times the last snapshot (and at least
``COMPACT_MIN_BYTES``), and at a ``clear``: the file stays within a few times the map's size.
With a map, only map changes compact (they come from the output thread; a path entry comes
from the inference thread, which should not wait for a copy of the whole map).
Writing happens on the writer's thread; a full disk pauses it as it pauses the keyframe
journal (``JournalWriter``).

``restore_map`` replays ``map.lbj`` into a map and a path and cuts them at the keyframe
journal's next frame (records of frames the keyframe journal did not reach are dropped).
A frame whose clouds were still queued on the output thread at a kill has its pose in the
path but not its points in the map. No ROS, no torch.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..journal.format import JournalError, Record, read_contents
from ..journal.recorder import make_header
from ..journal.writer import JournalStatus, JournalWriter
from .mapping import MapAccumulator, PoseEntry, Trajectory

log = logging.getLogger(__name__)

MAP_JOURNAL_NAME = "map.lbj"
CONTENTS = "map"  # the header's "contents" (a keyframe journal's is "frames", the default)


def stamp_ns(entry: PoseEntry) -> int:
    """The entry's image stamp in nanoseconds (exact for a builtin_interfaces/Time)."""
    st = entry.stamp
    if hasattr(st, "sec") and hasattr(st, "nanosec"):
        return int(st.sec) * 1_000_000_000 + int(st.nanosec)
    return int(round(entry.stamp_s * 1e9))


class MapJournal:
    """Journals a map and a path into ``path`` (``map.lbj``); see the module docstring.

    States: *new* (nothing written yet: the first change begins the file), *active*, *paused*
    (changes are not journaled: while a resume replaces the map; ``start`` begins the file from
    what the map and path are then). ``identity``: the keyframe journal's (written in the header,
    checked by ``restore_map``)."""

    COMPACT_MIN_BYTES = 16 << 20
    COMPACT_FACTOR = 2.0

    def __init__(self, path: str | Path, identity: dict[str, Any], compression: str | int = "none") -> None:
        self.path = Path(path)
        self.identity = identity
        self.writer = JournalWriter(self.path, compression=compression)
        self._lock = threading.Lock()
        self._state = "new"
        self._map: MapAccumulator | None = None
        self._trajectory: Trajectory | None = None
        self._poses: deque[tuple[int, int, float, np.ndarray]] = deque()  # the path as journaled
        self._segment_bytes = 0
        self._snapshot_bytes = 0
        self.compactions = 0
        self.before_copy: Callable[[], Any] | None = None  # run by ``save_copy`` first (the output thread's flush)

    def attach(self, map_: MapAccumulator | None, trajectory: Trajectory) -> None:
        """Listen to ``map_`` (None: no map is accumulated; the path alone) and ``trajectory``."""
        self._map, self._trajectory = map_, trajectory
        if map_ is not None:
            map_.listener = self
        trajectory.listener = self
        self._poses = self._path_of(trajectory)

    def status(self) -> JournalStatus:
        return self.writer.status()

    def pause(self) -> None:
        """Stop journaling changes (until ``start``)."""
        with self._lock:
            self._state = "paused"

    def start(self) -> None:
        """Journal from now on: the file becomes one snapshot of the map and path as they are
        (e.g. after a restore, which changed them while paused)."""
        with self._map_lock(), self._lock:
            self._poses = self._path_of(self._trajectory)
            self._state = "active"
            self._compact_locked()

    @staticmethod
    def _path_of(trajectory: Trajectory) -> deque:
        return deque((_pose_item(e) for e in trajectory.entries()), maxlen=trajectory.max_length)

    def close(self, timeout: float = 30.0) -> None:
        self.writer.close(timeout)

    def save_copy(self, dest: str | Path) -> int:
        """The current segment written to ``dest`` atomically (a saved session); 0 when nothing
        was journaled yet (nothing written then)."""
        if self.before_copy is not None:
            self.before_copy()
        header, _ = self.writer.snapshot()
        return 0 if header is None else self.writer.save_copy(dest)

    # ------------------------------------------------------------------ listener (MapAccumulator, under its lock)
    def map_added(self, map_: MapAccumulator, frame_index: int, points: np.ndarray, colors: np.ndarray) -> None:
        with self._lock:
            if self._go():
                self._append(Record("chunk", {"i": int(frame_index)}, {"p": points, "c": colors}))
                self._maybe_compact()

    def map_op(self, map_: MapAccumulator, op: str, frame_index: int) -> None:
        with self._lock:
            if self._go():
                if op == "clear":
                    self._compact_locked()
                else:
                    self._append(Record("mapop", {"of": "map", "op": op, "i": int(frame_index)}))

    # ------------------------------------------------------------------ listener (Trajectory, inference thread)
    def path_appended(self, entry: PoseEntry) -> None:
        item = _pose_item(entry)
        with self._lock:
            if self._state == "paused":
                return
            self._poses.append(item)
            if self._state == "active":
                self._append(Record("pose", {"i": item[0], "ns": item[1], "s": item[2], "T": item[3].tolist()}))
            # a grown journal with a map is compacted by the next map change (on the output thread:
            # a snapshot copies the whole map, which the inference thread should not wait for);
            # here only when no map change came for long (frames without points: a bound)
            due = self._state == "new" or self._grown(1 if self._map is None else 4)
        if due:
            self._compact()

    def path_op(self, op: str, frame_index: int) -> None:
        with self._lock:
            if self._state == "paused":
                return
            if op == "clear":
                self._poses.clear()
            else:
                while self._poses and self._poses[-1][0] >= frame_index:
                    self._poses.pop()
            if self._state == "active":
                self._append(Record("mapop", {"of": "path", "op": op, "i": int(frame_index)}))
            due = self._state == "new"
        if due:
            self._compact()

    # ------------------------------------------------------------------ internals
    def _go(self) -> bool:
        """Journal this map change as a record? A *new* journal begins here instead (the change
        is in its snapshot); a paused one ignores it."""
        if self._state == "paused":
            return False
        if self._state == "new":
            self._state = "active"
            self._compact_locked()
            return False
        return True

    def _append(self, record: Record) -> None:
        self._segment_bytes += record.nbytes + 64
        self.writer.append(record)

    def _grown(self, times: float = 1) -> bool:
        return self._segment_bytes > times * max(self.COMPACT_MIN_BYTES, self.COMPACT_FACTOR * self._snapshot_bytes)

    def _maybe_compact(self) -> None:
        if self._grown():
            self._compact_locked()

    def _map_lock(self):
        return self._map.lock if self._map is not None else contextlib.nullcontext()

    def _compact(self) -> None:
        """Begin a new journal or compact a grown one (the map's lock first, as its listener calls)."""
        with self._map_lock(), self._lock:
            if self._state == "new" or (self._state == "active" and self._grown()):
                self._state = "active"
                self._compact_locked()

    def _compact_locked(self) -> None:
        """A new segment: one snapshot of the map (its lock is held) and the path."""
        state = None if self._map is None else self._map.state_locked()
        record = snapshot_record(state, list(self._poses))
        self._snapshot_bytes = self._segment_bytes = record.nbytes + 64
        header = {**make_header(self.identity), "contents": CONTENTS}
        self.writer.begin(header, [record])
        self.compactions += 1


def _pose_item(entry: PoseEntry) -> tuple[int, int, float, np.ndarray]:
    """A path entry as journaled: (frame index, stamp ns, stamp s, T_map_cam [16] float64)."""
    return int(entry.frame_index), stamp_ns(entry), float(entry.stamp_s), np.asarray(entry.T_map_cam, np.float64).reshape(16)


def snapshot_record(state: dict[str, Any] | None, poses: list[tuple[int, int, float, np.ndarray]]) -> Record:
    """The ``snapshot`` record of a map state (``MapAccumulator.state``; None: no map) and path."""
    arrays: dict[str, np.ndarray] = {
        "path_i": np.array([p[0] for p in poses], np.int64),
        "path_ns": np.array([p[1] for p in poses], np.int64),
        "path_s": np.array([p[2] for p in poses], np.float64),
        "path_T": np.array([p[3] for p in poses], np.float64).reshape(len(poses), 16)}
    meta: dict[str, Any] = {"map": state is not None}
    if state is not None:
        arrays["base_p"], arrays["base_c"] = state["base"]
        for n, (_, (p, c)) in enumerate(state["chunks"]):
            arrays[f"p{n}"], arrays[f"c{n}"] = p, c
        meta.update(chunks=[int(i) for i, _ in state["chunks"]], floor=int(state["floor"]),
                    thinned=bool(state["thinned"]))
    return Record("snapshot", meta, arrays)


@dataclass(frozen=True)
class RestoredMap:
    """What ``restore_map`` took back."""

    points: int  # in the map after the restore
    poses: int  # in the path
    records: int  # records replayed
    note: str = ""  # why nothing or not everything was restored ("" = all of it)


def restore_map(path: str | Path, map_: MapAccumulator | None, trajectory: Trajectory, next_frame: int,
                make_stamp: Callable[[int], Any] = int, identity: dict[str, Any] | None = None) -> RestoredMap:
    """Replay ``map.lbj`` at ``path`` into ``map_`` and ``trajectory`` (their listeners should be
    paused), then forget what belongs to frames from ``next_frame`` on. A missing file, another
    model's journal or an unreadable one restores nothing (the note says why); a damaged record
    ends the replay there (the note names it). Never raises for the file's sake."""
    path = Path(path)
    if not path.exists():
        return RestoredMap(0, 0, 0, f"no {path.name}: the map and path start empty")
    try:
        records, found = read_contents(path, CONTENTS, "a map journal", identity)
    except JournalError as exc:
        log.warning("the map and path are not restored: %s", exc)
        return RestoredMap(0, 0, 0, str(exc))
    for r in records:
        _apply(r, map_, trajectory, make_stamp)
    if map_ is not None:
        map_.remove_from(next_frame)
    trajectory.remove_from(next_frame)
    note = found.stop
    if note:
        (log.warning if found.corrupt else log.info)("map journal %s: %s; restored the %d records before it",
                                                     path, note, len(records))
    return RestoredMap(0 if map_ is None else len(map_), len(trajectory), len(records), note)


def _apply(r: Record, map_: MapAccumulator | None, trajectory: Trajectory, make_stamp: Callable[[int], Any]) -> None:
    m, a = r.meta, r.arrays
    if r.kind == "snapshot":
        trajectory.clear()
        for i, ns, s, T in zip(a["path_i"], a["path_ns"], a["path_s"], a["path_T"]):
            trajectory.append(PoseEntry(int(i), make_stamp(int(ns)), float(s), np.array(T, np.float64).reshape(4, 4)))
        if map_ is not None:
            if m.get("map"):
                map_.load_state({"base": (a["base_p"], a["base_c"]), "floor": m["floor"], "thinned": m["thinned"],
                                 "chunks": [(i, (a[f"p{n}"], a[f"c{n}"])) for n, i in enumerate(m["chunks"])]})
            else:
                map_.clear()
    elif r.kind == "chunk":
        if map_ is not None:
            map_.add(int(m["i"]), a["p"], a["c"], downsampled=True)
    elif r.kind == "pose":
        trajectory.append(PoseEntry(int(m["i"]), make_stamp(int(m["ns"])), float(m["s"]),
                                    np.asarray(m["T"], np.float64).reshape(4, 4)))
    elif r.kind == "mapop":
        target, op, i = m["of"], m["op"], int(m["i"])
        if target == "path":
            trajectory.clear() if op == "clear" else trajectory.remove_from(i)
        elif map_ is not None:
            {"protect": map_.protect_from, "remove": map_.remove_from}[op](i)


__all__ = ["MAP_JOURNAL_NAME", "MapJournal", "RestoredMap", "restore_map", "snapshot_record", "stamp_ns"]
