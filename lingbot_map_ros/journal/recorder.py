"""JournaledSession: a ``stream.Session`` that journals what the model's state is made of.

It wraps a ``StreamingSession`` or a ``LongStreamSession`` and forwards every call; what
changes the model's state goes to a ``JournalWriter`` as records (``format.KINDS``):

- ``frame``: a stored frame's model input exactly as pushed (uint8 [H, W, 3] or float32
  [3, H, W]; lossless), its index, stamp, the decision that stored it ("scale": the
  sequence's scale frames, journaled when pushed because the model holds them from then
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
never published either. Nothing here waits for the disk (``JournalWriter``).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

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


class JournaledPending:
    """The results of one ``JournaledSession.submit`` (journaled when taken, in order)."""

    __slots__ = ("_owner", "_inner", "stamp", "tag", "stored", "_results")

    def __init__(self, owner: JournaledSession, inner, stamp: int | None, tag, stored: bool) -> None:
        self._owner, self._inner, self.stamp, self.tag, self.stored = owner, inner, stamp, tag, stored
        self._results = None

    @property
    def done(self) -> bool:
        return self._results is not None or self._inner.done

    def result(self):
        if self._results is None:
            if self._owner is not None:
                self._owner._settle(until=self)
            else:
                self._results = self._inner.result()
        return self._results

    def _take(self):
        self._owner = None
        self._results = self._inner.result()
        return self._results


class JournaledSession:
    """``session`` with a journal (``writer``; None: journaling off, a plain pass-through).

    ``identity``: what the state depends on (``identity.journal_identity``), written into
    the header and compared when resuming. ``submit``/``push`` take an optional ``stamp``
    (nanoseconds) journaled with the frame. Attributes not defined here are the session's.
    """

    def __init__(self, session, writer: JournalWriter | None, identity: dict[str, Any],
                 begin: bool = True) -> None:
        self.session = session
        self.writer = writer
        self.identity = identity
        self._long = hasattr(session, "inner")
        self._core = session.inner if self._long else session  # the StreamingSession
        self._pending: deque[JournaledPending] = deque()
        self._scale_count = 0  # scale frames journaled in this sequence (their indices)
        self._states: dict[str, Record] = {}
        if begin:
            self._begin_sequence()

    def __getattr__(self, name: str):
        return getattr(self.session, name)

    # ------------------------------------------------------------------ Session protocol
    @property
    def cfg(self):
        return self.session.cfg

    @property
    def device(self):
        return self.session.device

    @property
    def frames_pushed(self) -> int:
        return self.session.frames_pushed

    @property
    def window_index(self) -> int:
        return self.session.window_index

    @property
    def deferred_eviction(self) -> bool:
        return self.session.deferred_eviction

    def stats(self):
        return self.session.stats()

    def check_frame(self, image, resolution=None):
        return self.session.check_frame(image, resolution)

    def push(self, image, keyframe: bool | None = None, stamp: int | None = None, tag: Any = None):
        return self.submit(image, keyframe, stamp, tag).result()

    def submit(self, image, keyframe: bool | None = None, stamp: int | None = None,
               tag: Any = None) -> JournaledPending:
        """``Session.submit``; the frame is journaled as described in the module docstring.
        ``stamp``: the frame's time (ns); ``tag``: anything JSON-able the caller wants back from
        a rebuild (``Rebuilt.last_tag``: e.g. the position in a recording). Without a writer
        (journaling off: a session that may load saved sessions) the session's own pending
        results come back and nothing is copied."""
        if self.writer is None:
            return self.session.submit(image, keyframe)
        core = self._core
        scale = self._in_scale_phase()
        window = self.session.window_index
        before = core.stats()
        t0 = before.temporal_index if before is not None else 0
        try:
            inner = self.session.submit(image, keyframe)
        except BaseException:
            if scale and self._scale_count and not core._pending:  # the scale step failed: they are gone
                self._begin_sequence()
            raise
        if self.session.window_index != window:
            self._settle()  # the restart took the earlier results: journal them before it
            self._journal_restart()
            t0 = len(self.session.overlap_indices)
        if scale:
            self._append(Record("frame", {"i": self._scale_count, "stamp": stamp, "tag": tag, "decision": "scale",
                                          "deferred": self.deferred_eviction},
                                {"image": _host_copy(self.session.check_frame(image))}))
            self._scale_count += 1
            stored = True
        else:
            after = core.stats()
            stored = after is not None and after.temporal_index > t0
        pending = JournaledPending(self, inner, stamp, tag, stored)
        self._pending.append(pending)
        return pending

    def reset(self) -> None:
        """``Session.reset``; the journal starts again (the old one is kept only if saved)."""
        self.session.reset()
        for p in self._pending:
            p._owner = None
        self._pending.clear()
        self._begin_sequence()

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        self._settle()
        frame = self.session.rollback_last_frame(expected_frame_index)
        if self._in_scale_phase():
            self._scale_count = 0  # the scale frames went back together
        self._append(Record("rollback", {"i": frame, "next": self.session.frames_pushed}))
        return frame

    def set_deferred_eviction(self, deferred: bool) -> None:
        self._settle()
        self.session.set_deferred_eviction(deferred)
        self._append(Record("deferred", {"deferred": bool(deferred)}))

    def commit_eviction(self) -> int:
        self._settle()
        freed = self.session.commit_eviction()
        self._append(Record("commit", {"freed": int(freed)}))
        return freed

    def restart(self) -> None:
        """``LongStreamSession.restart``, journaled (a new segment)."""
        self._settle()
        self.session.restart()
        self._journal_restart()

    # ------------------------------------------------------------------ non-model state
    def note_state(self, name: str, data: dict[str, Any]) -> None:
        """Journal the caller's state ``name`` (JSON-able ``data``); the latest of each name is
        what a rebuild returns (``Rebuilt.states``)."""
        record = Record("state", {"name": name, "data": data})
        self._states[name] = record
        self._append(record)

    def adopt(self, records: list[Record], scale_count: int, states: dict[str, Record]) -> None:
        """After ``journal.resume.rebuild`` filled the session: continue the rebuilt journal
        (its good records become the current segment, rewritten without a damaged tail)."""
        self._scale_count = scale_count
        self._states = dict(states)
        if self.writer is not None:
            self.writer.begin(make_header(self.identity, self._core.resolution), records)

    # ------------------------------------------------------------------ internals
    def _in_scale_phase(self) -> bool:
        """The next frame is one of the sequence's scale frames (journaled when pushed)."""
        if self.session.window_index != 0 or getattr(self.session, "restart_pending", False):
            return False
        stats = self._core.stats()
        return stats is None or stats.temporal_index == 0

    def _append(self, record: Record) -> None:
        if self.writer is not None:
            self.writer.append(record)

    def _begin_sequence(self) -> None:
        self._scale_count = 0
        if self.writer is not None:
            self.writer.begin(make_header(self.identity, None),
                              [Record("begin", {"deferred": self.deferred_eviction}), *self._states.values()])

    def _journal_restart(self) -> None:
        if self.writer is None:
            return
        s = self.session
        kept = s.kept_keyframes()
        last_kf, latest = s.motion_poses()
        a = s.alignment
        arrays: dict[str, np.ndarray] = {}
        entries = []
        for n, k in enumerate(kept):
            arrays[f"image{n}"] = np.asarray(k.frame)
            if k.depth is not None:
                arrays[f"depth{n}"] = np.asarray(k.depth)
            if k.confidence is not None:
                arrays[f"conf{n}"] = np.asarray(k.confidence)
            entries.append({"i": int(k.index), "c2w": _c2w(k.c2w)})
        meta = {"window_index": s.window_index, "window_start": s.window_start, "kept": entries,
                "alignment": {"scale": float(a.scale), "rot": _c2w(a.rot), "trans": _c2w(a.trans)},
                "last_keyframe_c2w": None if last_kf is None else _c2w(last_kf),
                "latest_c2w": None if latest is None else _c2w(latest), "deferred": self.deferred_eviction}
        if self.writer is not None:
            self.writer.begin(make_header(self.identity, self._core.resolution),
                              [Record("restart", meta, arrays), *self._states.values()])

    def _settle(self, until: JournaledPending | None = None) -> None:
        """Take submitted frames' results, oldest first, up to ``until`` (all when None), and
        journal them."""
        while self._pending:
            pending = self._pending.popleft()
            self._journal_results(pending, pending._take())
            if pending is until:
                return

    def _journal_results(self, pending: JournaledPending, results) -> None:
        if not results:
            return  # a scale frame waiting for the others (journaled when pushed)
        last = results[-1]
        if pending.stored and len(results) == 1 and not self._in_first_results(results):
            self._append(Record("frame", {"i": int(last.frame_index), "stamp": pending.stamp, "tag": pending.tag,
                                          "decision": "keyframe",
                                          "deferred": self.deferred_eviction, "c2w": _c2w(last.c2w)},
                                {"image": np.array(last.frame)}))
        else:
            self._append(Record("seen", {"i": int(last.frame_index), "stamp": pending.stamp, "tag": pending.tag,
                                         "c2w": _c2w(last.c2w)}))

    def _in_first_results(self, results) -> bool:
        """The results of the scale step (its frames were journaled when pushed)."""
        return len(results) > 1 or (self.cfg.num_scale_frames == 1 and results[0].frame_index == 0
                                    and self.session.window_index == 0)


def _host_copy(image) -> np.ndarray:
    """A private host copy of a frame as pushed (a device tensor comes to the host here)."""
    if isinstance(image, np.ndarray):
        return np.array(image, copy=True)
    return image.detach().cpu().numpy().copy()


__all__ = ["JournaledSession", "JournaledPending", "make_header", "DECISIONS"]
