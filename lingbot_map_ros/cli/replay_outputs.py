"""``lingbot-map-replay``'s outputs (--out, --trajectory, --ply, --out-bag), written as the
frames come, each under ``<name>.partial`` until it is complete. With --loop-closure, --trajectory
is the optimised trajectory, written at the end (``replay_loop.OptimisedTrajectory``), and the raw
one streams beside it (``RAW_TRAJECTORY``).

``Outputs`` makes the writers when the first result arrives and feeds each frame's results
to them; a writer that fails (a full or read-only disk) is set aside and the others go on.
``Outputs.close`` renames each complete one to its final name and ``Outputs.abort`` keeps
each as ``.partial``; neither raises for a writer that fails: ``Closed`` and ``Unfinished``
say which did what. ``OutputError`` ends the run once no writer is left.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .replay_args import RAW_TRAJECTORY, Settings, node_default, or_node_default, raw_trajectory_path
from .replay_console import describe_os_error, log


@dataclass(frozen=True)
class FrameMeta:
    """What the results of a pushed frame are written with."""

    stamp_ns: int
    camera_frame: str
    name: str
    window: int = 0  # the long-stream window it went into


class OutputError(Exception):
    """An output could not be written (``flag`` ``path``: ``cause``, an OSError)."""

    def __init__(self, flag: str, path: Path, cause: BaseException) -> None:
        super().__init__(f"cannot write {flag} {path}: {describe_os_error(cause)}")
        self.flag, self.path, self.cause = flag, path, cause


@dataclass
class Unfinished:
    """An output whose writer failed: what it was, why, and what of it is on disk."""

    flag: str
    path: Path
    reason: str
    kept: list[Path]  # complete .partial files
    incomplete: list[Path]  # what a failed abort() left on disk

    def note(self) -> str:
        if self.incomplete:
            return f"{', '.join(map(str, self.incomplete))} left incomplete"
        if self.kept:
            return f"kept as {', '.join(map(str, self.kept))}"
        return "nothing of it kept"


@dataclass
class Closed:
    """What ``Outputs.close`` did."""

    written: list[Path]
    failed: list[Unfinished]


class Outputs:
    """The requested writers, made when the first result arrives (a run that fails before
    writes nothing).

    A writer that cannot write (a full or read-only disk) takes no more frames: a warning says
    so and the others go on until the run ends (an ``OutputError`` naming it once no writer is
    left). ``close`` gives each writer its final name (a failed one is kept as ``.partial``
    where possible) and ``abort`` keeps each as ``.partial``; neither raises for a writer that
    fails: they say which did what."""

    def __init__(self, args: argparse.Namespace, settings: Settings, loop=None) -> None:
        self.args, self.settings = args, settings
        self.loop = loop  # replay_loop.ReplayLoop with --loop-closure: its corrections move --trajectory
        self.writers: list[tuple[str, Path, Any]] = []  # (flag, path, writer)
        self.store = self.tum = self.raw = self.ply = self.bag = None
        self.broken: dict[str, str] = {}  # flag -> why its writer failed
        self._opened = False
        self.rows = 0

    def _open(self) -> None:
        """Make the writers, each listed as soon as it exists (so that ``abort`` finds it)."""
        from ..io.results import PlyStreamWriter, PredictionStore, TumStreamWriter
        from ..io.results_bag import ResultsBagWriter

        a, overwrite = self.args, self.args.overwrite
        self._opened = True
        if a.out:
            self.store = self._make("--out", a.out, lambda: PredictionStore(a.out, self.settings.depth, a.chunk_frames,
                                                                            overwrite=overwrite))
        if a.trajectory and self.loop is not None:
            from .replay_loop import OptimisedTrajectory

            raw, loop = raw_trajectory_path(a.trajectory), self.loop
            self.tum = self._make("--trajectory", a.trajectory, lambda: OptimisedTrajectory(
                a.trajectory, overwrite, lambda: loop.corrections))
            self.raw = self._make(RAW_TRAJECTORY, raw, lambda: TumStreamWriter(raw, overwrite))
        elif a.trajectory:
            self.tum = self._make("--trajectory", a.trajectory, lambda: TumStreamWriter(a.trajectory, overwrite))
        if a.ply:
            self.ply = self._make("--ply", a.ply, lambda: PlyStreamWriter(a.ply, overwrite))
        if a.out_bag:
            self.bag = self._make("--out-bag", a.out_bag, lambda: ResultsBagWriter(
                a.out_bag, namespace=a.bag_namespace, map_frame=a.map_frame or node_default("map_frame"),
                path_rate=or_node_default(a.bag_path_rate, "path_publish_rate"),
                path_max_length=or_node_default(a.bag_path_length, "path_max_length"), overwrite=overwrite))

    def _make(self, flag: str, path: Path, make: Callable[[], Any]):
        try:
            writer = make()
        except OSError as exc:
            raise OutputError(flag, path, exc) from None
        self.writers.append((flag, path, writer))
        return writer

    def _call(self, flag: str, writer, method: str, *args) -> None:
        """``writer.method(*args)`` unless the writer failed before. An OSError marks it failed (one
        warning) and the run goes on for the other outputs; OutputError when none is left."""
        if writer is None or flag in self.broken:
            return
        try:
            getattr(writer, method)(*args)
        except OSError as exc:
            path = next(p for f, p, _ in self.writers if f == flag)
            self.broken[flag] = describe_os_error(exc)
            if len(self.broken) == len(self.writers):
                raise OutputError(flag, path, exc) from None
            log.warning("cannot write %s %s after %d frames: %s; the run goes on for the other outputs", flag, path,
                        self.rows - 1, self.broken[flag])

    def add(self, r, meta: FrameMeta) -> None:
        """One FrameResult ``r`` (model world, OpenCV axes) of the input frame ``meta``."""
        from ..geometry import unproject_pixels

        if not self._opened:
            self._open()
        row, self.rows = self.rows, self.rows + 1
        keep_depth = r.depth is not None and self.settings.depth.keeps(row)
        self._call("--out", self.store, "add", r.pose_enc, r.c2w, r.intrinsics, r.is_keyframe, meta.stamp_ns,
                   meta.window, r.depth, r.confidence)
        if self.raw is None:
            self._call("--trajectory", self.tum, "add", meta.stamp_ns / 1e9, r.c2w)
        else:
            self._call("--trajectory", self.tum, "add", meta.stamp_ns / 1e9, r.c2w, r.frame_index)
            self._call(RAW_TRAJECTORY, self.raw, "add", meta.stamp_ns / 1e9, r.c2w)
        points = colors = conf = None
        if r.depth is not None and (self.ply is not None or self.bag is not None):
            index = np.flatnonzero(r.confidence.reshape(-1) > self.settings.conf_threshold)
            index = index[::self.settings.point_stride]
            points = unproject_pixels(r.depth, r.intrinsics, r.c2w, index).astype(np.float32)
            finite = np.isfinite(points).all(axis=1)
            points, index = points[finite], index[finite]
            colors, conf = r.colors(index), r.confidence.reshape(-1)[index].astype(np.float32)
        self._call("--ply", self.ply, "add", points, colors)
        camera = self.args.camera_frame or meta.camera_frame
        self._call("--out-bag", self.bag, "add", meta.stamp_ns, camera, r.c2w, r.intrinsics, r.size, points, colors,
                   conf, r.depth if keep_depth else None)

    def close(self) -> Closed:
        """Give every writer its final name; one that cannot is kept as ``.partial`` where possible."""
        closed = Closed([], [])
        for flag, path, w in self.writers:
            if flag in self.broken:  # failed during the run (the run went on without it)
                closed.failed.append(self._abort_one(flag, path, w, self.broken[flag]))
                continue
            try:
                result = w.close()
            except OSError as exc:
                closed.failed.append(self._abort_one(flag, path, w, describe_os_error(exc)))
                continue
            closed.written += result if isinstance(result, list) else [result]
        return closed

    def abort(self) -> tuple[list[Path], list[Unfinished]]:
        """Finish every writer as a ``.partial`` file (never raises): the paths kept, and the writers
        that could not be finished (with what they left on disk)."""
        kept: list[Path] = []
        unfinished: list[Unfinished] = []
        for flag, path, w in self.writers:
            done = self._abort_one(flag, path, w, self.broken.get(flag, ""))
            if done.incomplete or not done.kept:
                unfinished.append(done)
            kept += done.kept
        return kept, unfinished

    @staticmethod
    def _abort_one(flag: str, path: Path, writer, reason: str) -> Unfinished:
        try:
            result = writer.abort()
        except Exception as exc:  # one broken writer must not hide the others' files
            reason = reason or describe_os_error(exc)
            return Unfinished(flag, path, reason, [], [p for p in writer.leftovers() if os.path.lexists(p)])
        return Unfinished(flag, path, reason, result if isinstance(result, list) else [result], [])


def with_partial(message: str, kept: list[Path], unfinished: list[Unfinished] = ()) -> str:
    """``message``, then the ``.partial`` files kept and the outputs that could not even be kept so."""
    parts = [message]
    if kept:
        parts.append(f"partial outputs kept: {', '.join(map(str, kept))}")
    lost = [u for u in unfinished if not u.kept]
    if lost:
        parts.append("not kept: " + ", ".join(f"{u.flag} {u.path} ({u.reason + '; ' if u.reason else ''}{u.note()})"
                                              for u in lost))
    return "; ".join(parts)


def close_failure(frames: int, closed: Closed) -> str:
    """The error line of a run whose outputs could not all be written at the end."""
    causes = ", ".join(f"{u.flag} {u.path} ({u.reason})" for u in closed.failed)
    written = ", ".join(map(str, closed.written)) or "nothing"
    not_written = ", ".join(f"{u.path} ({u.note()})" for u in closed.failed)
    return (f"{frames} frames replayed, but not every output could be written: {causes}; written: {written}; "
            f"not written: {not_written}")
