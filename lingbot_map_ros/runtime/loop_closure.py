"""Loop closure of one camera's sequence: ``LoopCloser``.

Keyframes (stored frames, as published) come in from the inference thread (``keyframe``); the
loop thread (``lingbot_map_loop``) does the rest, off the frames' path:

1. each keyframe is kept (``loop_keyframes.KeyframeStore``: JPEG input, descriptor, depth thumbnail),
   its descriptor goes into the place database (``slam.PlaceDatabase``) and its pose into the pose
   graph (``slam.PoseGraph``, Sim(3), iSAM2) with an odometry edge from the previous keyframe;
2. the place database is asked for keyframes at least ``min_separation`` frames older (outside the
   model's window) that look alike (``min_similarity``); the best is a *candidate*;
3. a candidate is verified by the model: the inference thread, when it has nothing else to do
   (``run_idle``, called by the scheduler), runs the candidate and the current keyframe through a
   side session (``loop_verify.SideRunner``), and a second pass with the candidate's previous
   keyframe for an independent estimate; the loop thread measures the relative Sim(3) and checks it
   (``loop_verify.measure``: depth reprojection, agreement of the estimates);
4. an accepted loop is a robust edge of the graph; iSAM2 re-solves it and every keyframe's
   correction (``corrections.Corrections``) goes to ``on_corrections`` (the engine applies it to
   the sequence on the inference thread: one operation on the path, the map and what leaves).

Rejected candidates are counted with their reason (``stats``); ``markers`` lists the last closures
tried (accepted or not) for RViz. ``journal`` (``loop_journal.LoopJournal``) records keyframes,
loops and priors so that the graph survives a restart (``restore``). No ROS; the side session is
the only part that runs the model.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from ..slam import EdgeNoise, LoopCheck, PlaceConfig, PlaceDatabase, PoseGraph, PoseGraphConfig, Sim3, \
    gradient_descriptor
from .corrections import Corrections
from .loop_keyframes import KeyframeStore, LoopKeyframe, color_thumbnail, jpeg
from .loop_verify import Measured, SideRunner, SideView, measure, relative_in_stream_units

log = logging.getLogger(__name__)
DESCRIPTOR_DIM = 256  # slam.gradient_descriptor's length with its default grid and bins
MARKERS = 50  # closures tried that ~/loop_closures shows


@dataclass(frozen=True)
class LoopConfig:
    """How loops are found and accepted (the ``loop_*`` node parameters)."""

    min_similarity: float = 0.85  # cosine similarity of the descriptors for a candidate
    min_separation: int = 100  # frames: a candidate is at least this much older than the keyframe
    max_keyframes: int = 5000  # keyframes kept (the oldest goes first)
    check: LoopCheck = field(default_factory=LoopCheck)
    odometry: EdgeNoise = field(default_factory=EdgeNoise)
    loop_sigmas: tuple[float, ...] = (0.02, 0.02, 0.02, 0.05, 0.05, 0.05, 0.02)  # rad x3, units x3, log-scale
    robust_kernel: str = "cauchy"
    map_voxel_size: float = 0.02  # the rendered map (model units; 0 = no downsampling)
    map_max_points: int = 2_000_000

    def __post_init__(self) -> None:
        if not (0.0 < self.min_similarity <= 1.0):
            raise ValueError(f"loop min_similarity must be in (0, 1], got {self.min_similarity!r}")
        if self.min_separation < 1 or self.max_keyframes < 2:
            raise ValueError(f"loop min_separation must be >= 1 and max_keyframes >= 2, got "
                             f"{self.min_separation!r}, {self.max_keyframes!r}")


@dataclass(frozen=True)
class LoopStats:
    """What ~/status and /diagnostics say about loop closure (replaced as a whole)."""

    keyframes: int = 0
    candidates: int = 0
    accepted: int = 0
    rejected: int = 0
    last_reason: str = ""
    last_optimisation_ms: float = 0.0


@dataclass(frozen=True)
class KeyframeIn:
    """A keyframe handed over by the inference thread (private copies)."""

    index: int
    stamp_s: float
    T: np.ndarray  # [4, 4] T_S_cam (model units)
    frame: np.ndarray  # the model input: uint8 [H, W, 3] or float32 [3, H, W] in [0, 1]
    depth: np.ndarray  # [h, w] thumbnail (loop_keyframes.depth_thumbnail), 0 where not confident
    K: np.ndarray  # [3, 3] at [h, w]
    weight: float  # the odometry edge's confidence (tracking health: slam.HEALTH_WEIGHTS)


def loop_config(s) -> LoopConfig:
    """The ``LoopConfig`` of a camera's ``NodeSettings``."""
    check = LoopCheck(min_inlier_ratio=s.loop_min_inlier_ratio, depth_tolerance=s.loop_depth_tolerance,
                      min_overlap=s.loop_min_overlap)
    return LoopConfig(min_similarity=s.loop_min_similarity, min_separation=s.loop_min_separation,
                      max_keyframes=s.loop_max_keyframes, check=check, robust_kernel=s.loop_robust_kernel,
                      map_voxel_size=s.map_voxel_size, map_max_points=s.map_max_points)


def as_rgb(frame: np.ndarray) -> np.ndarray:
    """A model input as uint8 [H, W, 3]."""
    a = np.asarray(frame)
    if a.dtype == np.uint8:
        return np.ascontiguousarray(a)
    return np.clip(np.rint(np.moveaxis(a, 0, -1) * 255.0), 0, 255).astype(np.uint8)


@dataclass(frozen=True)
class Marker:
    kept: int
    current: int
    accepted: bool
    reason: str
    kept_position: np.ndarray  # [3] map frame (model units), at the time of the decision
    current_position: np.ndarray


@dataclass
class _Job:
    """A candidate waiting for the model (inference thread) and then for its checks (loop thread)."""

    kept: LoopKeyframe
    current: LoopKeyframe
    partner: LoopKeyframe | None
    views: list[SideView] | None = None
    partner_views: list[SideView] | None = None
    error: str = ""


class LoopCloser:
    """See the module docstring. ``on_corrections(Corrections)`` is called from the loop thread
    after each optimisation that changed the corrections."""

    def __init__(self, config: LoopConfig, side: SideRunner, on_corrections: Callable[[Corrections], Any],
                 journal=None) -> None:
        self.config, self.side, self.on_corrections, self.journal = config, side, on_corrections, journal
        self.store = KeyframeStore(config.max_keyframes)
        self.places = PlaceDatabase(PlaceConfig(DESCRIPTOR_DIM, capacity=config.max_keyframes))
        self.graph = PoseGraph(PoseGraphConfig(mode="sim3", robust_kernel=config.robust_kernel))
        self.corrections = Corrections()  # replaced as a whole by the loop thread
        self.stats = LoopStats()  # replaced as a whole by the loop thread
        self.localization = ""  # "" | "relocalizing" | "localized" (a saved map to find the camera in)
        self.markers: deque[Marker] = deque(maxlen=MARKERS)
        # the keyframes' points at their corrected poses (points, colours, version), rendered by the loop
        # thread when it runs out of work after a change; replaced as a whole (the map timer reads it)
        self.map: tuple[np.ndarray, np.ndarray, int] = (np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8), 0)
        self._map_dirty = False
        self._previous: int | None = None  # the last keyframe in the graph
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: deque[_Job] = deque()  # candidates for the model (at most one waits)
        self._busy = False  # a candidate is being verified
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0  # inbox items not handled yet

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lingbot_map_loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._put(("stop",))
            thread.join(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the loop thread handled everything handed to it (a candidate may still wait
        for the model: ``run_idle``); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0 and not self._busy,
                                       max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ inference thread
    def keyframe(self, kf: KeyframeIn) -> None:
        """A keyframe was published (its pose is final in the stream's frame)."""
        self.start()
        self._put(("keyframe", kf))

    def forget_from(self, index: int) -> None:
        """The stream forgot its frames from ``index`` on (a rollback)."""
        self._put(("forget", index))

    def clear(self) -> None:
        """A new sequence (a reset): nothing of the old one stays."""
        self._put(("clear",))

    @property
    def candidate_waiting(self) -> bool:
        """A candidate waits for the model (``run_idle`` would run it)."""
        with self._idle:
            return bool(self._jobs)

    def run_idle(self) -> bool:
        """Run a waiting candidate through the model (inference thread, nothing else to do); True
        when it did."""
        with self._idle:
            if not self._jobs:
                return False
            job = self._jobs.popleft()
            self._busy = True
        try:
            current = job.current.rgb()
            job.views = self.side.run([job.kept.rgb(), current])
            if job.partner is not None:
                job.partner_views = self.side.run([job.partner.rgb(), current])
        except Exception as exc:  # a side session that fails costs the candidate, never the stream
            job.error = f"{type(exc).__name__}: {exc}"
        with self._idle:
            self._busy = False
        self._put(("measured", job))
        return True

    # ------------------------------------------------------------------ the loop thread
    def _put(self, item) -> None:
        with self._idle:
            self._pending += 1
        self._inbox.put(item)

    def _loop(self) -> None:
        while True:
            item = self._inbox.get()
            try:
                if item[0] == "stop":
                    return
                self._handle(item)
                if self._map_dirty and self._inbox.empty():  # a burst of changes, one render
                    self._render_map()
            except Exception as exc:  # the loop thread never dies of one item
                log.error("loop closure: %s failed: %s: %s", item[0], type(exc).__name__, exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _render_map(self) -> None:
        c = self.config
        points, colors = self.store.render(self.corrections, c.map_voxel_size, c.map_max_points)
        self.map = (points, colors, self.map[2] + 1)
        self._map_dirty = False

    def _handle(self, item) -> None:
        self._map_dirty = True
        kind = item[0]
        if kind == "keyframe":
            self._add_keyframe(item[1])
        elif kind == "measured":
            self._decide(item[1])
        elif kind == "forget":
            self.store.forget_from(item[1])
            for index in [int(i) for i in self.places.indices() if i >= item[1]]:
                self.places.remove(index)
        elif kind == "clear":
            self._reset()

    def _add_keyframe(self, kin: KeyframeIn) -> None:
        rgb = as_rgb(kin.frame)
        kf = LoopKeyframe(kin.index, kin.stamp_s, np.asarray(kin.T, np.float64), jpeg(rgb), gradient_descriptor(rgb),
                          kin.depth, color_thumbnail(rgb), kin.K)
        gone = self.store.add(kf)
        if gone is not None and gone in self.places:
            self.places.remove(gone)
        self.places.add(kf.index, kf.descriptor)
        pose = Sim3.from_pose(kf.T)
        self.graph.add_keyframe(kf.index, pose)
        if self._previous is not None:
            rel = self.graph.odom_pose(self._previous).inverse() @ pose
            self.graph.add_odometry(self._previous, kf.index, sigmas=self.config.odometry.sigmas_for(rel, kin.weight))
        self._previous = kf.index
        self.graph.update()
        if self.journal is not None:
            self.journal.keyframe(kf, kin.weight)
        self.stats = replace(self.stats, keyframes=len(self.store))
        self._look_for_a_loop(kf)

    def _look_for_a_loop(self, kf: LoopKeyframe) -> None:
        with self._idle:
            if self._jobs or self._busy:
                return  # one candidate at a time: the model's time goes to the stream first
        oldest_allowed = kf.index - self.config.min_separation
        if oldest_allowed < 0:
            return
        found = self.places.query(kf.descriptor, k=1, exclude=range(oldest_allowed + 1, kf.index + 1),
                                  min_similarity=self.config.min_similarity)
        if not found:
            return
        kept = self.store.get(found[0][0])
        indices = self.store.indices()
        at = indices.index(kept.index)
        partner = self.store.get(indices[at - 1]) if at > 0 else None
        self.stats = replace(self.stats, candidates=self.stats.candidates + 1)
        with self._idle:
            self._jobs.append(_Job(kept, kf, partner))

    def _decide(self, job: _Job) -> None:
        if job.kept.index not in self.store or job.current.index not in self.store:
            return self._refused(job, None, "a keyframe of the candidate left the map (rollback or reset)")
        if job.error or not job.views or len(job.views) != 2:
            return self._refused(job, None, f"the side session failed: {job.error or 'no results'}")
        try:
            measured = self._measure(job)
        except ValueError as exc:  # the side session's outputs are not finite or degenerate (poses, intrinsics)
            return self._refused(job, None, f"the side session's outputs cannot be measured: {exc}")
        if not measured.accepted:
            return self._refused(job, measured, measured.reason or measured.verdict.reason)
        self.graph.add_loop(job.kept.index, job.current.index, measured.rel, sigmas=np.array(self.config.loop_sigmas))
        seconds = self.graph.update()
        if self.journal is not None:
            self.journal.loop(job.kept.index, job.current.index, measured.rel, self.config.loop_sigmas)
        self.stats = replace(self.stats, accepted=self.stats.accepted + 1, last_reason=measured.verdict.reason,
                             last_optimisation_ms=1e3 * seconds)
        log.info("loop closed: keyframe %d seen again at frame %d (%s); graph of %d keyframes re-solved in "
                 "%.1f ms", job.kept.index + 1, job.current.index + 1, measured.verdict.reason,
                 self.graph.node_count, 1e3 * seconds)
        self._publish(job, measured, True)

    def _measure(self, job: _Job) -> Measured:
        """The candidate's relative pose and verdict from its side views (and its partner's, as a
        second estimate moved through the graph)."""
        others = ()
        if job.partner is not None and job.partner_views and job.partner.index in self.store:
            rel_partner, _, _ = relative_in_stream_units(job.partner, job.current, job.partner_views)
            if rel_partner is not None:  # kept <- partner through the graph, then partner <- current
                between = self.graph.pose(job.kept.index).inverse() @ self.graph.pose(job.partner.index)
                others = (between @ rel_partner,)
        return measure(job.kept, job.current, job.views, self.config.check, others)

    def _refused(self, job: _Job, measured: Measured | None, reason: str) -> None:
        self.stats = replace(self.stats, rejected=self.stats.rejected + 1, last_reason=reason)
        log.info("loop candidate keyframe %d for frame %d rejected: %s", job.kept.index + 1, job.current.index + 1,
                 reason)
        self._mark(job, False, reason)

    def _publish(self, job: _Job, measured: Measured, accepted: bool) -> None:
        """New corrections for every keyframe after an optimisation (and the marker)."""
        indices, mats = self.graph.poses()
        by_index = {}
        for index, mat in zip(indices, mats):
            kf = self.store.get(int(index))
            if kf is not None:
                by_index[int(index)] = Sim3.from_matrix(mat) @ Sim3.from_pose(kf.T).inverse()
        self.corrections = Corrections(by_index, self.corrections.version + 1)
        self._mark(job, accepted, measured.verdict.reason)
        self.on_corrections(self.corrections)

    def _mark(self, job: _Job, accepted: bool, reason: str) -> None:
        c = self.corrections
        kept = c.at(job.kept.index).apply(job.kept.T[:3, 3])
        current = c.at(job.current.index).apply(job.current.T[:3, 3])
        self.markers.append(Marker(job.kept.index, job.current.index, accepted, reason, kept, current))

    def _reset(self) -> None:
        self.store.clear()
        self.places = PlaceDatabase(PlaceConfig(DESCRIPTOR_DIM, capacity=self.config.max_keyframes))
        self.graph = PoseGraph(self.graph.config)
        self._previous = None
        self.markers.clear()
        with self._idle:
            self._jobs.clear()
        self.corrections = Corrections(version=self.corrections.version + 1)
        self.stats = LoopStats()
        if self.journal is not None:
            self.journal.begin()
        self.on_corrections(self.corrections)


__all__ = ["LoopCloser", "LoopConfig", "LoopStats", "KeyframeIn", "Marker", "DESCRIPTOR_DIM", "MARKERS",
           "loop_config", "as_rgb"]
