"""One camera's sequence and the one place it changes: ``Sequence``.

A sequence is what one camera's stream builds between two resets: its path (the poses
published), its accumulated map (and the map journal beside the keyframe journal), the keyframe
decisions, the counters and the state ~/status reports, with the judges that belong to it (the
tracking health, the map anchor with the metric scale, the model's focal lengths), and, with loop
closure, the corrections of its poses (``corrections.Corrections``: one value, replaced as a whole
by ``correct``) and the loop closer that keeps its keyframes (``loop``). Every change
of the path, the map, the counters or the state is a method here, called on the inference thread;
the map's own changes run on the camera's output thread, queued by these methods in the order
they were made (``OutputWorker``), so that a frame's points, a rollback's removal and a reset's
clear reach the map in order. Readers on other threads (timers, diagnostics) read snapshots.

What the other parts do: the engine (``runtime.engine``) runs the frame loop and applies what
its parts decide by calling these methods; ``keyframe_control`` applies keep/drop decisions;
``commands`` the services. No ROS, no torch.

Frames and units: the path and the map are kept in the sequence's own REP-103 map frame and in
model units (``frames``); ``anchor.output`` (scale, map offset) is applied when they leave.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..robot.intrinsics import FocalTracker
from .anchor import MapAnchor
from .corrections import Corrections
from .decisions import KeyframeDecisions
from .frames import FrameOutput, Logger, Sink, State
from .grid import SequenceGrid
from .map_journal import MAP_JOURNAL_NAME, MapJournal, RestoredMap, restore_map
from .mapping import MapAccumulator, PoseEntry, Trajectory
from .output_worker import OutputWorker
from .params import NodeSettings
from .tracking import TrackingJudge
from .worker import CounterValues, Counters, Intake, WorkQueue


class Sequence:
    """See the module docstring. ``queue``: the camera's work queue, whose intake counts (images
    received, replaced while waiting, refused) are part of the counters; ``outputs``: the camera's
    output thread."""

    def __init__(self, settings: NodeSettings, sink: Sink, queue: WorkQueue, outputs: OutputWorker,
                 anchor: MapAnchor, log: Logger) -> None:
        self.sink, self._queue, self.outputs = sink, queue, outputs
        self.path = Trajectory(settings.path_max_length)
        self.map = MapAccumulator(settings.map_voxel_size, settings.map_max_points) \
            if settings.accumulate_map else None
        self.map_journal: MapJournal | None = None  # map.lbj beside the keyframe journal, else None
        self.restored: RestoredMap | None = None  # what the last resume took back of the map and path
        self.counters = Counters()
        self.decisions = KeyframeDecisions()
        self.tracking = TrackingJudge(settings, log)  # judged once per processed frame
        self.anchor = anchor  # where the sequence sits in the published map (scale, map offset)
        self.focal = FocalTracker()  # the model's focal lengths in input pixels (diagnostics)
        self.state = State.WAITING_FOR_IMAGES  # replaced as a whole (diagnostics read it)
        self.text = "ready, waiting for images"
        self.last_index = 0  # 1-based index of the last frame processed (or being collected)
        self.publish_path = settings.publish_path
        self.corrections = Corrections()  # loop closure's, map <- sequence per keyframe (identity without)
        self.loop = None  # runtime.loop_closure.LoopCloser of this camera, or None (loop_closure off)
        self.grid: SequenceGrid | None = None  # the occupancy grid (``attach_grid``), fed on the output thread

    # ------------------------------------------------------------------ counters and state
    def count(self, name: str, n: int = 1) -> None:
        """The one writer of ``counters`` (names as in Status.msg)."""
        self.counters.add(name, n)

    def counter_values(self) -> CounterValues:
        """The counters as ~/status reports them: this sequence's plus the work queue's intake."""
        c, i = self.counters.snapshot(), self._queue.intake()
        c.frames_received += i.received
        c.frames_dropped_stale += i.replaced
        c.frames_dropped_invalid += i.rejected
        return c

    def reset_counters(self) -> None:
        """~/reset: every counter from 0 (the intake's too)."""
        self._queue.clear_intake()
        self.counters.reset()
        self.tracking.lost_resets = 0

    def restore_counters(self, values: dict[str, int]) -> None:
        """Take journaled counter values (a resume): they include the intake counted until then."""
        self._queue.clear_intake()
        self.counters.restore(values)

    def set_state(self, state: State, text: str) -> None:
        self.state, self.text = state, text

    # ------------------------------------------------------------------ path and map
    def add_pose(self, entry: PoseEntry) -> None:
        """A frame's pose was published: it joins the path."""
        self.path.append(entry)
        self.last_index = entry.frame_index + 1

    def stored(self, index: int, T_map_cam: np.ndarray) -> None:
        """Frame ``index`` (1-based) was stored with this pose: the reference of the next frames' motion."""
        self.decisions.stored(index, T_map_cam)

    def add_points(self, frame_index: int, points: np.ndarray, colors: np.ndarray) -> None:
        """Output thread: a frame's points (model units, this sequence's map frame) join the map."""
        if self.map is not None:
            self.map.add(frame_index, points, colors)

    def attach_grid(self, grid: SequenceGrid) -> None:
        """Build an occupancy grid from this sequence's frames (before the first frame)."""
        self.grid = grid

    def add_grid_frame(self, frame_index: int, T_seq_cam: np.ndarray, points: np.ndarray, out: FrameOutput) -> None:
        """Output thread: a frame's pose and points (model units, this sequence's map frame) join the grid
        through the transform it was published with."""
        if self.grid is not None:
            self.grid.add(frame_index, T_seq_cam, points, out.transform, out.scale_ready, out.camera_frame)

    def protect_from(self, frame_index: int) -> None:
        """Frames from 0-based ``frame_index`` on may still be rolled back: the map keeps them apart."""
        if self.map is not None:
            acc = self.map
            self.outputs.op(lambda: acc.protect_from(frame_index))

    def forget_from(self, frame_index: int) -> None:
        """The session forgot the frames from 0-based ``frame_index`` on (a rollback): their poses,
        points, keyframe references and the index go with them."""
        removed = self.path.remove_from(frame_index)
        if self.map is not None:
            acc = self.map

            def forget() -> None:
                acc.remove_from(frame_index)
                acc.protect_from(frame_index)

            self.outputs.op(forget)
        if self.grid is not None:  # the frames leave the grid's history; their cells stay (runtime/grid.py)
            grid = self.grid
            self.outputs.op(lambda: grid.forget_from(frame_index))
        self.decisions.forget_from(frame_index + 1)
        self.last_index = min(self.last_index, frame_index)
        if self.loop is not None:
            self.loop.forget_from(frame_index)
        if removed:
            self.hand_over_path()

    def clear(self, keep_map_frame: bool = False) -> None:
        """A new sequence: no path, map, decisions, health, focal lengths or scale. ``keep_map_frame``:
        a lost reset, whose next sequence may continue the map frame; otherwise a new map origin."""
        self.last_index = 0
        self.path.clear()
        if self.map is not None:
            self.outputs.op(self.map.clear)
        if self.grid is not None:
            self.outputs.op(self.grid.clear)
        if self.publish_path:
            self.sink.publish_path([], self.anchor.output, Corrections())
        self.decisions.clear()
        self.tracking.clear()
        self.focal.clear()
        self.anchor.clear(keep_map_frame)
        self.corrections = Corrections()
        if self.loop is not None:
            self.loop.clear()

    def correct(self, corrections: Corrections) -> None:
        """Loop closure re-solved the pose graph: every pose of the sequence moves by its keyframe's
        correction from now on (the path, the map and what leaves are derived from it)."""
        self.corrections = corrections
        if self.grid is not None:  # rebuilt with them on the output thread, in order with the frames
            grid = self.grid
            self.outputs.op(lambda: grid.correct(corrections))
        self.hand_over_path()

    def hand_over_path(self) -> None:
        """Give the sink the path as it is now and how it leaves (it publishes it at its own rate)."""
        if self.publish_path:
            self.sink.publish_path(self.path.entries(), self.anchor.output, self.corrections)

    # ------------------------------------------------------------------ the map journal and a resume
    def journal_map(self, beside: Path, identity: dict[str, Any], compression: str | int, flush_s: float) -> None:
        """Journal the map and the path in ``map.lbj`` beside the keyframe journal ``beside``."""
        self.map_journal = MapJournal(Path(beside).with_name(MAP_JOURNAL_NAME), identity, compression=compression)
        self.map_journal.attach(self.map, self.path)
        # a saved session's map holds every frame its journal does: what the output thread has goes in
        self.map_journal.before_copy = lambda: self.outputs.flush(flush_s)

    def pause_map_journal(self) -> None:
        """Journal no map or path change until ``restore_map`` starts the map journal again."""
        if self.map_journal is not None:
            self.map_journal.pause()

    def restore_map(self, journal_path: Path, next_frame: int, make_stamp: Callable[[int], Any],
                    identity: dict[str, Any] | None, flush_s: float, warn: Callable[[str], Any]) -> RestoredMap:
        """Take back the map and path of the journal at ``journal_path`` (``map.lbj`` beside it), cut
        at its next frame; journaled again from there (``pause_map_journal`` first: the current map
        and path are replaced, which is not a change to journal)."""
        if not self.outputs.flush(flush_s):  # the map's clear runs on the output thread
            warn("the output thread did not finish in time; the map is restored anyway")
        self.restored = restore_map(Path(journal_path).parent / MAP_JOURNAL_NAME, self.map, self.path, next_frame,
                                    make_stamp, identity)
        if self.map_journal is not None:
            self.map_journal.start()
        if len(self.path):
            self.hand_over_path()
        return self.restored


__all__ = ["Sequence", "Intake"]
