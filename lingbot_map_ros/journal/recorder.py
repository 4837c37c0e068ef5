"""``JournalRecorder``: the keyframe journal of a session, kept as the session changes.

It observes a ``LongStreamSession`` (``stream.events.SessionEvents``: the session tells it every
change of the model's state, after the change, in order) and hands a ``JournalWriter`` records
(``format.KINDS``):

- ``frame``: a stored frame's model input exactly as pushed (uint8 [H, W, 3] or float32
  [3, H, W]; lossless), its index, stamp, the decision that stored it ("scale": the
  sequence's scale frames, journaled when submitted because the model holds them from then
  on; "keyframe": a stored frame after them, journaled when its results are taken, with
  its published camera-to-world) and whether eviction was deferred;
- ``seen``: a frame that was only attended to (its index, stamp and pose: the counters and
  the motion policy's latest pose);
- ``rollback``, ``commit``, ``deferred``: the eviction services, in order with the frames;
- ``restart``: a window restart, self-contained (the re-fed keyframes' images, their poses,
  depth and confidence as published, the window's Sim(3), indices): it starts a new segment,
  and the journal is compacted to it (what came before cannot change the state any more);
- ``state``: the caller's non-model state by name (``note_state``: metric scale, map
  offset, counters), the latest of each name kept across compactions;
- ``begin``: a new sequence (start, ``reset``), with the deferred-eviction setting.

Frames whose results were never taken (in flight at a crash) are not journaled: they were
never published either. Nothing here waits for the disk (``JournalWriter``). Without a writer
(journaling off) the recorder only carries the session's ``identity`` (a node that may load
saved sessions) and records nothing.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..stream.events import Restarted, Taken
from .format import FORMAT_VERSION, Record
from .writer import JournalWriter

DECISIONS = ("scale", "keyframe")


def make_header(identity: dict[str, Any], resolution: tuple[int, int] | None = None) -> dict[str, Any]:
    """The journal header: format, what the state depends on (``identity``), resolution (H, W)."""
    return {"format": FORMAT_VERSION, "identity": identity,
            "resolution": None if resolution is None else [int(resolution[0]), int(resolution[1])],
            "created_unix": time.time()}


def _c2w(a) -> list[float]:
    return [float(x) for x in np.asarray(a, dtype=np.float64).reshape(-1)]


class JournalRecorder:
    """The journal of one session (see the module docstring). ``writer`` None: journaling is off.
    ``identity``: what the state depends on (``identity.journal_identity``), written into the
    header and compared when resuming."""

    def __init__(self, writer: JournalWriter | None, identity: dict[str, Any], deferred: bool = False,
                 begin: bool = True) -> None:
        self.writer = writer
        self.identity = identity
        self._scale_count = 0  # scale frames journaled in this sequence (their indices)
        self._states: dict[str, Record] = {}
        if begin:
            self.sequence_reset(deferred)

    # ------------------------------------------------------------------ the session's events
    def scale_frame(self, frame, stamp: int | None, tag: Any, deferred: bool) -> None:
        self._append(Record("frame", {"i": self._scale_count, "stamp": stamp, "tag": tag, "decision": "scale",
                                      "deferred": deferred}, {"image": _host_copy(frame)}))
        self._scale_count += 1

    def scale_frames_lost(self, deferred: bool) -> None:
        if self._scale_count:  # the scale frames journaled so far went with the failed step
            self.sequence_reset(deferred)

    def frame_taken(self, taken: Taken) -> None:
        results = taken.results
        if not results or taken.scale:
            return  # a scale frame: journaled when submitted
        last = results[-1]
        if len(results) == 1 and last.is_keyframe:
            self._append(Record("frame", {"i": int(last.frame_index), "stamp": taken.stamp, "tag": taken.tag,
                                          "decision": "keyframe", "deferred": taken.deferred, "c2w": _c2w(last.c2w)},
                                {"image": np.array(last.frame)}))
        else:
            self._append(Record("seen", {"i": int(last.frame_index), "stamp": taken.stamp, "tag": taken.tag,
                                         "c2w": _c2w(last.c2w)}))

    def window_restarted(self, r: Restarted) -> None:
        arrays: dict[str, np.ndarray] = {}
        entries = []
        for n, k in enumerate(r.kept):
            arrays[f"image{n}"] = np.asarray(k.frame)
            if k.depth is not None:
                arrays[f"depth{n}"] = np.asarray(k.depth)
            if k.confidence is not None:
                arrays[f"conf{n}"] = np.asarray(k.confidence)
            entries.append({"i": int(k.index), "c2w": _c2w(k.c2w)})
        a = r.alignment
        meta = {"window_index": r.window_index, "window_start": r.window_start, "kept": entries,
                "alignment": {"scale": float(a.scale), "rot": _c2w(a.rot), "trans": _c2w(a.trans)},
                "last_keyframe_c2w": None if r.last_keyframe_c2w is None else _c2w(r.last_keyframe_c2w),
                "latest_c2w": None if r.latest_c2w is None else _c2w(r.latest_c2w), "deferred": r.deferred}
        self._scale_count = 0
        if self.writer is not None:
            self.writer.begin(make_header(self.identity, r.resolution),
                              [Record("restart", meta, arrays), *self._states.values()])

    def rolled_back(self, frame: int, next_frame: int, scale_frames_gone: bool) -> None:
        if scale_frames_gone:
            self._scale_count = 0  # the scale frames went back together
        self._append(Record("rollback", {"i": frame, "next": next_frame}))

    def committed(self, freed: int) -> None:
        self._append(Record("commit", {"freed": int(freed)}))

    def deferral_set(self, deferred: bool) -> None:
        self._append(Record("deferred", {"deferred": bool(deferred)}))

    def sequence_reset(self, deferred: bool) -> None:
        """A new sequence: the journal starts again (the old one is kept only if saved)."""
        self._scale_count = 0
        if self.writer is not None:
            self.writer.begin(make_header(self.identity, None),
                              [Record("begin", {"deferred": bool(deferred)}), *self._states.values()])

    # ------------------------------------------------------------------ the caller's state
    def note_state(self, name: str, data: dict[str, Any]) -> None:
        """Journal the caller's state ``name`` (JSON-able ``data``); the latest of each name is
        what a rebuild returns (``Rebuilt.states``)."""
        record = Record("state", {"name": name, "data": data})
        self._states[name] = record
        self._append(record)

    def adopt(self, records: list[Record], scale_count: int, states: dict[str, Record],
              resolution: tuple[int, int] | None) -> None:
        """After ``journal.resume.rebuild`` filled the session: continue the rebuilt journal
        (its good records become the current segment, rewritten without a damaged tail)."""
        self._scale_count = scale_count
        self._states = dict(states)
        if self.writer is not None:
            self.writer.begin(make_header(self.identity, resolution), records)

    def _append(self, record: Record) -> None:
        if self.writer is not None:
            self.writer.append(record)


def _host_copy(image) -> np.ndarray:
    """A private host copy of a frame as pushed (a device tensor comes to the host here)."""
    if isinstance(image, np.ndarray):
        return np.array(image, copy=True)
    return image.detach().cpu().numpy().copy()


__all__ = ["JournalRecorder", "make_header", "DECISIONS"]
