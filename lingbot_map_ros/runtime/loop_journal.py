"""Loop closure kept on disk beside the keyframe journal: ``loop.lbj``.

The keyframe database, the pose graph's loops and priors and the map frame that ``~/set_pose``
chose are what a restart (or a saved session) needs to give back the same graph, the same
corrected path and the same map. They go into a journal of their own, in the keyframe journal's
file format (``journal.format``), written by its own ``JournalWriter`` thread:

- ``lkf``: a keyframe as ``loop_keyframes.LoopKeyframe`` keeps it (pose, JPEG, descriptor, depth
  and colour thumbnails, intrinsics), its graph node and its odometry weight;
- ``loop``: a verified loop (kept and current keyframe, the measured Sim(3), its sigmas);
- ``prior``: a pose prior on a keyframe (its Sim(3) in the graph's frame, the tangent covariance);
- ``lforget``: keyframes from a frame index on left the sequence (a rollback);
- ``lframe``: the map frame moved (``~/set_pose``: map <- graph);
- ``lreloc``: frames from an index on follow a keyframe (a relocalisation).

``LoopCloser`` replays them in order (``restore``): the graph is rebuilt from the same nodes and
edges in the same order, so its solution is the same. A clear (a reset) starts an empty file.
When the file holds much more than the live keyframes (``max_keyframes`` let old ones go), the
closer rewrites it from what is live (``compact``). Reading: ``read_loop_journal`` (never raises
for the file's sake: a missing, foreign or damaged file gives what it can and says why).
No ROS, no torch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..journal.format import JournalError, Record, read_contents
from ..journal.recorder import make_header
from ..journal.writer import JournalStatus, JournalWriter
from ..slam import Sim3

log = logging.getLogger(__name__)

LOOP_JOURNAL_NAME = "loop.lbj"
CONTENTS = "loop"  # the header's "contents"


def sim3_meta(s: Sim3) -> dict[str, Any]:
    return {"R": s.rotation.reshape(-1).tolist(), "t": s.translation.tolist(), "s": float(s.scale)}


def sim3_of(m: dict[str, Any]) -> Sim3:
    return Sim3(np.asarray(m["R"], np.float64).reshape(3, 3), np.asarray(m["t"], np.float64), float(m["s"]))


def keyframe_record(kf, node: int, weight: float) -> Record:
    return Record("lkf", {"i": int(kf.index), "n": int(node), "s": float(kf.stamp_s), "w": float(weight)},
                  {"T": np.asarray(kf.T, np.float64), "jpeg": np.frombuffer(kf.image, np.uint8),
                   "desc": np.asarray(kf.descriptor, np.float32), "depth": np.asarray(kf.depth, np.float32),
                   "colors": np.asarray(kf.colors, np.uint8), "K": np.asarray(kf.K, np.float64)})


def loop_record(kept: int, current: int, rel: Sim3, sigmas) -> Record:
    return Record("loop", {"a": int(kept), "b": int(current), "rel": sim3_meta(rel),
                           "sig": [float(x) for x in sigmas]})


def prior_record(index: int, pose: Sim3, covariance: np.ndarray) -> Record:
    return Record("prior", {"i": int(index), "pose": sim3_meta(pose)}, {"cov": np.asarray(covariance, np.float64)})


@dataclass
class LoopJournalRead:
    """What ``read_loop_journal`` found: the records after the last clear, and why it stopped."""

    records: list[Record] = field(default_factory=list)
    note: str = ""  # "" = all of it


class LoopJournal:
    """Appends loop-closure records to ``path`` (see the module docstring). Called by the loop
    thread only. ``identity``: the keyframe journal's (header; checked when reading)."""

    COMPACT_MIN_BYTES = 8 << 20
    COMPACT_FACTOR = 2.0

    def __init__(self, path: str | Path, identity: dict[str, Any], compression: str | int = "none") -> None:
        self.path = Path(path)
        self.identity = identity
        self.writer = JournalWriter(self.path, compression=compression)
        self.paused = False  # records are not written (while a restore replays the file)
        self._begun = False
        self._bytes = 0  # this segment's records
        self._live_bytes = 0  # what a compaction would write
        self.compactions = 0

    def status(self) -> JournalStatus:
        return self.writer.status()

    def close(self, timeout: float = 30.0) -> None:
        self.writer.close(timeout)

    def save_copy(self, dest: str | Path) -> int:
        """The current segment written to ``dest`` atomically (a saved session); 0 when nothing
        was journaled yet."""
        header, _ = self.writer.snapshot()
        return 0 if header is None else self.writer.save_copy(dest)

    def begin(self, records: list[Record] = ()) -> None:
        """A new file holding ``records`` (a clear: none; a compaction: what is live)."""
        if self.paused:
            return
        self.writer.begin({**make_header(self.identity), "contents": CONTENTS}, list(records))
        self._begun = True
        self._bytes = self._live_bytes = sum(r.nbytes + 64 for r in records)

    def append(self, record: Record, live: bool = True) -> None:
        if self.paused:
            return
        if not self._begun:
            self.begin()
        self.writer.append(record)
        self._bytes += record.nbytes + 64
        if live:
            self._live_bytes += record.nbytes + 64

    def dropped(self, nbytes: int) -> None:
        """A keyframe of ``nbytes`` left the database (the file still holds it)."""
        self._live_bytes = max(0, self._live_bytes - nbytes)

    def due(self) -> bool:
        """The file holds much more than what is live: time for ``begin(live records)``."""
        return self._bytes > max(self.COMPACT_MIN_BYTES, self.COMPACT_FACTOR * self._live_bytes)


def read_loop_journal(path: str | Path, identity: dict[str, Any] | None = None) -> LoopJournalRead:
    """The records of ``loop.lbj`` at ``path``; never raises for the file's sake."""
    path = Path(path)
    if not path.exists():
        return LoopJournalRead([], f"no {path.name}: loop closure starts empty")
    try:
        records, found = read_contents(path, CONTENTS, "a loop-closure journal", identity)
    except JournalError as exc:
        log.warning("loop closure is not restored: %s", exc)
        return LoopJournalRead([], str(exc))
    if found.stop:
        (log.warning if found.corrupt else log.info)("loop journal %s: %s; restored the %d records before it",
                                                     path, found.stop, len(records))
    return LoopJournalRead(records, found.stop)


__all__ = ["LOOP_JOURNAL_NAME", "LoopJournal", "LoopJournalRead", "read_loop_journal", "keyframe_record",
           "loop_record", "prior_record", "sim3_meta", "sim3_of"]
