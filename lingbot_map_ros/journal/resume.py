"""Rebuild a session's state from a journal: replay its stored frames, then restore the rest.

The model's state since the last window restart is a function of the frames it stored
(the re-fed overlap, the scale frames, the keyframes, in order, with the eviction
services in between); frames that were only attended to changed nothing. So a fresh
session fed exactly those frames, with the same decisions, holds the same cache as the
one that wrote the journal. The window's Sim(3), the kept keyframes' published poses and
depth, the counters and the caller's named states are then taken from the records.

``rebuild`` refuses a journal written for another model, configuration or resolution
(``JournalMismatch``, the journal untouched) and stops at a damaged record (everything
before it is used; ``Rebuilt.stop`` names it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .format import JournalError, Record, iter_records, scan

log = logging.getLogger(__name__)


class JournalMismatch(JournalError):
    """The journal was written for another model, configuration or resolution."""


@dataclass
class Rebuilt:
    """What ``rebuild`` did."""

    path: Path
    records: list[Record]  # the good records (the segment to continue: ``JournalRecorder.adopt``)
    frames_replayed: int  # model steps' frames: re-fed overlap, scale frames, keyframes
    next_frame: int  # the next frame's index (= frames_pushed)
    window_index: int
    scale_count: int  # scale frames journaled in the running sequence
    states: dict[str, dict[str, Any]] = field(default_factory=dict)  # the caller's named states, latest
    state_records: dict[str, Record] = field(default_factory=dict)
    stop: str = ""  # why reading stopped early ("" = at the end)
    corrupt: bool = False  # a damaged record (not merely a torn last write) ended it
    seconds: float = 0.0
    max_pose_error: float = 0.0  # largest |c2w| difference between a keyframe as journaled and as replayed
    last_tag: Any = None  # the tag of the last frame journaled (``LongStreamSession.submit``'s ``tag``)
    last_stamp: int | None = None  # its stamp


def frames_in(records: list[Record]) -> int:
    """Frames a replay of ``records`` runs through the model (for "resuming k of n")."""
    n = 0
    for r in records:
        if r.kind == "frame":
            n += 1
        elif r.kind == "restart":
            n += len(r.meta["kept"])
    return n


def mismatch(header: dict[str, Any], identity: dict[str, Any] | None, width: int | None = None) -> str:
    """Why a journal with ``header`` cannot be resumed here ("" when it can): the identity's
    differing fields, or another image width."""
    if identity is not None:
        theirs, ours = _flat(header.get("identity", {})), _flat(identity)
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if diff:
            shown = "; ".join(f"{k}: journal {theirs.get(k)!r}, here {ours.get(k)!r}" for k in diff[:4])
            return f"written for another model or configuration ({shown}{'; ...' if len(diff) > 4 else ''})"
    res = header.get("resolution")
    if width is not None and res is not None and int(res[1]) != int(width):
        return f"written at {res[1]}x{res[0]}, this node's image_width is {width}"
    return ""


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_journal(path: str | Path, identity: dict[str, Any] | None = None, width: int | None = None
                 ) -> tuple[dict[str, Any], list[Record], str, bool]:
    """(header, good records, stop reason, corrupt). Raises JournalError (unreadable) or
    JournalMismatch (another model, configuration or resolution)."""
    found = scan(path)
    if found.header.get("contents", "frames") != "frames":
        raise JournalError(f"{found.path} is a {found.header['contents']} journal, not a keyframe journal")
    reason = mismatch(found.header, identity, width)
    if reason:
        raise JournalMismatch(f"{found.path}: {reason}")
    records = list(iter_records(found))
    if width is not None:
        for r in records:
            image = r.arrays.get("image") if r.kind == "frame" else r.arrays.get("image0")
            if image is not None:
                w = image.shape[1] if image.dtype == np.uint8 else image.shape[-1]
                if w != width:
                    raise JournalMismatch(f"{found.path}: written at width {w}, this node's image_width is {width}")
                break
    return found.header, records, found.stop, found.corrupt


def rebuild(session, path: str | Path, identity: dict[str, Any] | None = None, width: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> Rebuilt:
    """Replay the journal at ``path`` into ``session`` (a ``LongStreamSession`` without an observer:
    journal the result with ``JournalRecorder.adopt``).
    ``progress(k, n)`` is called after each replayed frame. Raises JournalError /
    JournalMismatch before touching the session; an exception of the model leaves the
    session to be reset by the caller."""
    t0 = time.perf_counter()
    _, records, stop, corrupt = read_journal(path, identity, width)
    if stop:
        (log.warning if corrupt else log.info)("journal %s: %s; using the %d records before it", path, stop,
                                               len(records))
    total = frames_in(records)
    out = Rebuilt(Path(path), records, 0, 0, 0, 0, stop=stop, corrupt=corrupt)
    long = session.long_cfg is not None
    next_frame, latest = 0, None

    def step(n: int = 1) -> None:
        out.frames_replayed += n
        if progress is not None:
            progress(out.frames_replayed, total)

    session.reset()
    for r in records:
        m = r.meta
        if r.kind in ("frame", "seen"):
            out.last_tag, out.last_stamp = m.get("tag"), m.get("stamp")
        if r.kind == "begin":
            session.reset()
            session.set_deferred_eviction(bool(m["deferred"]))
            next_frame, latest, out.scale_count = 0, None, 0
        elif r.kind == "restart":
            if not long:
                raise JournalError(f"{path}: a window restart, but the session has no windows (long_stream off)")
            _resume_window(session, r)
            session.set_deferred_eviction(bool(m["deferred"]))
            next_frame = int(m["window_start"])
            latest = None if m["latest_c2w"] is None else _mat(m["latest_c2w"])
            step(len(m["kept"]))
        elif r.kind == "frame" and m["decision"] == "scale":
            session.push(r.arrays["image"])
            out.scale_count += 1
            step()
        elif r.kind == "frame":
            i = int(m["i"])
            if i > session.frames_pushed:
                session.seek(i)
            if long and latest is not None:
                session.set_latest_pose(latest)  # what the motion policy and the undo record saw
            results = session.push(r.arrays["image"], keyframe=True)
            if not results or results[-1].frame_index != i or not results[-1].is_keyframe:
                got = [(x.frame_index, x.is_keyframe) for x in results]
                raise JournalError(f"{path}: replaying keyframe {i} gave {got}; the journal does not match the "
                                   "session's configuration")
            latest = _mat(m["c2w"])
            out.max_pose_error = max(out.max_pose_error, float(np.max(np.abs(results[-1].c2w - latest))))
            next_frame = i + 1
            step()
        elif r.kind == "seen":
            next_frame, latest = int(m["i"]) + 1, _mat(m["c2w"])
        elif r.kind == "rollback":
            session.rollback_last_frame(int(m["i"]))
            next_frame = int(m["next"])
            if session.frames_pushed == 0:
                out.scale_count = 0
        elif r.kind == "commit":
            session.commit_eviction()
        elif r.kind == "deferred":
            session.set_deferred_eviction(bool(m["deferred"]))
        elif r.kind == "state":
            out.states[m["name"]] = m["data"]
            out.state_records[m["name"]] = r
    if next_frame > session.frames_pushed:
        session.seek(next_frame)
    if long and latest is not None:
        session.set_latest_pose(latest)
    out.next_frame = session.frames_pushed
    out.window_index = session.window_index
    out.seconds = time.perf_counter() - t0
    return out


def _mat(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(4, 4)


def _resume_window(session, r: Record) -> None:
    from ..stream.alignment import Sim3
    from ..stream.long_stream import KeptKeyframe

    m = r.meta
    kept = []
    for n, k in enumerate(m["kept"]):
        kept.append(KeptKeyframe(int(k["i"]), np.array(r.arrays[f"image{n}"]), _mat(k["c2w"]),
                                 _copy(r.arrays.get(f"depth{n}")), _copy(r.arrays.get(f"conf{n}"))))
    a = m["alignment"]
    sim = Sim3(float(a["scale"]), np.asarray(a["rot"], dtype=np.float64).reshape(3, 3),
               np.asarray(a["trans"], dtype=np.float64))
    session.resume_window(kept, int(m["window_index"]), int(m["window_start"]), sim,
                          None if m["last_keyframe_c2w"] is None else _mat(m["last_keyframe_c2w"]),
                          None if m["latest_c2w"] is None else _mat(m["latest_c2w"]))


def _copy(a):
    return None if a is None else np.array(a)


__all__ = ["Rebuilt", "JournalMismatch", "rebuild", "read_journal", "mismatch", "frames_in"]
