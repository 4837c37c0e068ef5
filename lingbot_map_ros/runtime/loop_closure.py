"""Loop closure of one camera's sequence: ``LoopCloser``.

Keyframes (stored frames, as published) come in from the inference thread (``keyframe``); the
loop thread (``lingbot_map_loop``) does the rest, off the frames' path:

1. each keyframe goes into the loop-closure map (``loop_graph.LoopGraph``: keyframe store, place
   database, Sim(3) pose graph on iSAM2, journaled);
2. the place database is asked for keyframes at least ``min_separation`` frames older (outside the
   model's window) that look alike (``min_similarity``); the best is a *candidate*;
3. a candidate is verified by the model: the inference thread, when it has nothing else to do
   (``run_idle``, called by the scheduler), runs the candidate and the current keyframe through a
   side session (``loop_verify.SideRunner``), and a second pass with the candidate's neighbour
   keyframe for an independent estimate; the loop thread measures the relative Sim(3) and checks it
   (``loop_verify.measure``: depth reprojection, agreement of the estimates);
4. an accepted loop is a robust edge of the graph; iSAM2 re-solves it and every keyframe's
   correction (``corrections.Corrections``) goes to ``on_corrections`` (the engine applies it to
   the sequence on the inference thread: one operation on the path, the map and what leaves).

Relocalisation (after a saved session is loaded: ``relocalize``): frames are not posed; one at a
time goes to ``locate``, is looked up in the whole place database and verified like a loop
candidate (its scale is the kept keyframe's); a verified place goes to ``on_relocated``
(``Relocation``: the engine re-seeds the model's window with the keyframes around it and says
``relocated``). Poses from outside: ``set_pose`` and ``add_prior`` (``LoopGraph``).

Rejected candidates are counted with their reason (``stats``); ``markers`` lists the last closures
tried (accepted or not) for RViz; ``map`` is the keyframes' points at their corrected poses. No
ROS; the side session is the only part that runs the model.
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

from ..slam import EdgeNoise, LoopCheck, Sim3, gradient_descriptor
from .corrections import Corrections, rigid
from .loop_graph import LoopGraph
from .loop_journal import LoopJournal
from .loop_keyframes import LoopKeyframe, color_thumbnail, jpeg
from .loop_verify import Candidate, SideRunner, measure_job

log = logging.getLogger(__name__)
MARKERS = 50  # closures tried that ~/loop_closures shows
MAP_PERIOD_S = 2.0  # the keyframes' map is rendered at most this often (and only when it is wanted)
# A candidate that found no gap between frames long enough for its side run in this long runs in the
# next gap anyway (one frame waits for it): where a side run is longer than the time between two
# frames (a slower GPU, SDPA), loop closure would otherwise never verify one.
MAX_DEFER_S = 2.0


@dataclass(frozen=True)
class LoopConfig:
    """How loops are found and accepted (the ``loop_*`` node parameters)."""

    min_similarity: float = 0.85  # cosine similarity of the descriptors for a candidate
    min_separation: int = 400  # frames: a candidate is at least this much older than the keyframe
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


@dataclass(frozen=True)
class Relocation:
    """A relocalisation the loop thread verified. The inference thread re-seeds the model's window
    with ``seeds`` (consecutive keyframes around ``kept``, oldest first, at their stream poses) and
    tells ``LoopCloser.relocated`` the index of the next frame; ``correction`` (map <- sequence at
    ``kept``) places the frames until their own keyframes are in the graph."""

    kept: int
    seeds: tuple[LoopKeyframe, ...]
    correction: Sim3
    reason: str


class LoopCloser:
    """See the module docstring. ``on_corrections(Corrections)`` is called from the loop thread
    after each change of the corrections; ``on_relocated(Relocation)`` after a verified
    relocalisation. ``seed_count``: keyframes a relocalisation re-seeds the window with (the
    model's scale frames)."""

    def __init__(self, config: LoopConfig, side: SideRunner, on_corrections: Callable[[Corrections], Any],
                 journal: LoopJournal | None = None, on_relocated: Callable[[Relocation], Any] | None = None,
                 seed_count: int = 2) -> None:
        self.config, self.side, self.on_corrections, self.on_relocated = config, side, on_corrections, on_relocated
        self.seed_count = max(1, int(seed_count))
        self.graph = LoopGraph(config, journal)  # the loop thread's (replaced at a clear)
        self.store = self.graph.store  # the keyframes (``loop_keyframes.KeyframeStore``; any thread reads it)
        self.corrections = Corrections()  # replaced as a whole by the loop thread
        self.stats = LoopStats()  # replaced as a whole by the loop thread
        self.localization = ""  # "" | "relocalizing" | "localized" (a saved map to find the camera in)
        self.markers: deque[Marker] = deque(maxlen=MARKERS)
        # the keyframes' points at their corrected poses (points, colours, version), rendered by the loop
        # thread when it runs out of work after a change; replaced as a whole (the map timer reads it)
        self.map: tuple[np.ndarray, np.ndarray, int] = (np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8), 0)
        self.map_wanted = False  # someone shows the map (set by the node's map timer): render it when it changed
        self._map_dirty = False
        self._map_time = -float("inf")  # monotonic time of the last render
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: deque[Candidate] = deque()  # candidates for the model (at most one waits)
        self._busy = False  # a candidate is being verified
        self._locating = False  # a frame to relocalise is with the loop thread
        self._seeding = False  # a relocalisation was verified: the window is being re-seeded
        self.side_s: float | None = None  # one side-session run, seconds (a moving average; None: none yet)
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0  # inbox items not handled yet

    @property
    def relocalizing(self) -> bool:
        """The camera is not found in the map yet: frames go to ``locate``, not to the stream."""
        return self.localization == "relocalizing"

    @property
    def candidate_waiting(self) -> bool:
        """A candidate waits for the model (``run_idle``)."""
        with self._idle:
            return bool(self._jobs)

    @property
    def wants_frame(self) -> bool:
        """Relocalising, and ready for the next frame to look for in the map (``locate``)."""
        with self._idle:
            return self.relocalizing and not (self._locating or self._jobs or self._busy or self._seeding)

    # ------------------------------------------------------------------ any thread
    def stop(self, timeout: float = 5.0) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._put(("stop",), start=False)
            thread.join(timeout)
        if self.graph.journal is not None:
            self.graph.journal.close(timeout)

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
        self._put(("keyframe", kf))

    def forget_from(self, index: int) -> None:
        """The stream forgot its frames from ``index`` on (a rollback)."""
        self._put(("forget", int(index)))

    def clear(self) -> None:
        """A new sequence (a reset): nothing of the old one stays."""
        self._put(("clear",))

    def restore(self, records: list, next_frame: int) -> None:
        """Take back a journaled state (``loop_journal.read_loop_journal``'s records), cut at the
        keyframe journal's ``next_frame``."""
        self._put(("restore", records, int(next_frame)))

    def relocalize(self) -> None:
        """Look for the camera in the map before posing it: frames go to ``locate`` until a place is
        verified (nothing changes with an empty map)."""
        self._put(("relocalize",))

    def locate(self, rgb: np.ndarray, stamp_s: float) -> None:
        """A frame to find in the map (``wants_frame`` was True): the loop thread looks it up."""
        with self._idle:
            self._locating = True
        self._put(("locate", np.ascontiguousarray(rgb), float(stamp_s)))

    def relocated(self, next_frame: int, kept: int) -> None:
        """The window was re-seeded for the ``Relocation`` at keyframe ``kept``; frames from
        ``next_frame`` on follow it (localized from now: the next frames are posed)."""
        with self._idle:
            self.localization, self._seeding = "localized", False
        self._put(("relocated", int(next_frame), int(kept)))

    def pose_input(self, kind: str, target: Sim3, covariance: np.ndarray, frame_index: int = -1,
                   T: np.ndarray | None = None) -> None:
        """A pose from outside (rigid ``target`` in the map, model units; ``covariance`` ROS order,
        model units): ``kind`` "set_pose" (frame ``frame_index`` with stream pose ``T`` is there:
        ``LoopGraph.set_pose``) or "prior" (keyframe ``frame_index`` is there)."""
        self._put(("pose", kind, target, np.asarray(covariance, np.float64), int(frame_index),
                   None if T is None else np.asarray(T, np.float64)))

    def run_idle(self, budget_s: float | None = None) -> bool:
        """One side-session run of the waiting candidate (the candidate with the current frame, then
        its partner with it) on the inference thread, which has nothing else to do; True when one
        ran. ``budget_s``: the time until the next frame is expected (None: no frame is): a run that
        took longer before waits for a longer gap, so that a verification does not delay a frame,
        unless its candidate has waited MAX_DEFER_S for one (then one frame waits for it)."""
        with self._idle:
            if not self._jobs:
                return False
            job = self._jobs[0]
            if (budget_s is not None and self.side_s is not None and self.side_s > budget_s
                    and time.monotonic() - job.queued_at < MAX_DEFER_S):
                return False
            self._busy = True
        started = time.perf_counter()
        last = True
        try:
            current = job.current.rgb()
            if job.views is None:
                job.views = self.side.run([job.kept.rgb(), current])
                last = job.partner is None
            else:
                job.partner_views = self.side.run([job.partner.rgb(), current])
        except Exception as exc:  # a side session that fails costs the candidate, never the stream
            job.error = f"{type(exc).__name__}: {exc}"
            last = True
        took = time.perf_counter() - started
        self.side_s = took if self.side_s is None else 0.8 * self.side_s + 0.2 * took
        if last:
            with self._idle:
                if self._jobs and self._jobs[0] is job:  # (a clear may have emptied the queue meanwhile)
                    self._jobs.popleft()
            self._put(("measured", job))  # counted as pending before it stops being busy: flush never sees a gap
        with self._idle:
            self._busy = False
        return True

    # ------------------------------------------------------------------ the loop thread
    def _put(self, item, start: bool = True) -> None:
        if start and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lingbot_map_loop", daemon=True)
            self._thread.start()
        with self._idle:
            self._pending += 1
        self._inbox.put(item)

    def render_map(self) -> None:
        """Render ``map`` now (after what was handed before; ``flush`` waits for it): a save."""
        self._put(("render",))

    def _loop(self) -> None:
        while True:
            try:  # a changed map waits at most MAP_PERIOD_S for a quiet moment
                item = self._inbox.get(timeout=MAP_PERIOD_S if self._map_dirty else None)
            except queue.Empty:
                self._render()
                continue
            try:
                if item[0] == "stop":
                    return
                if item[0] == "render":
                    self._render(force=True)
                else:
                    self._handle(item)
                    if self._inbox.empty():
                        self._render()
            except Exception as exc:  # the loop thread never dies of one item
                log.error("loop closure: %s failed: %s: %s", item[0], type(exc).__name__, exc)
            finally:
                with self._idle:
                    if item[0] in ("locate", "measured") and not (self._jobs or self._busy):
                        self._locating = False
                    self._pending -= 1
                    self._idle.notify_all()

    def _render(self, force: bool = False) -> None:
        """The map from every keyframe (O(keyframes)): forced (a save), or when it changed, someone
        wants it and MAP_PERIOD_S passed since the last render."""
        if force or (self._map_dirty and self.map_wanted and time.monotonic() - self._map_time >= MAP_PERIOD_S):
            c = self.config
            points, colors = self.store.render(self.corrections, c.map_voxel_size, c.map_max_points)
            self.map, self._map_dirty, self._map_time = (points, colors, self.map[2] + 1), False, time.monotonic()

    def _handle(self, item) -> None:
        kind, g = item[0], self.graph
        self._map_dirty = True
        if kind == "keyframe":
            kin = item[1]
            rgb = as_rgb(kin.frame)
            kf = LoopKeyframe(kin.index, kin.stamp_s, rigid(kin.T), jpeg(rgb),
                              gradient_descriptor(rgb), kin.depth, color_thumbnail(rgb), kin.K, float(kin.weight))
            g.add_keyframe(kf)
            self.stats = replace(self.stats, keyframes=len(g.store))
            return self._candidate(kf)
        if kind == "measured":
            job = item[1]
            return self._decide_relocation(job) if job.relocate else self._decide(job)
        if kind == "locate":
            self._map_dirty = False
            if self.relocalizing and not self._seeding:
                rgb = item[1]
                descriptor = gradient_descriptor(rgb)
                self._candidate(LoopKeyframe(-1, item[2], np.eye(4), jpeg(rgb), descriptor, None, color_thumbnail(rgb),
                                             np.eye(3)))
            return
        if kind == "relocalize":
            if len(g.store):
                self.localization, self._seeding = "relocalizing", False
                self.stats = replace(self.stats, last_reason="looking for the camera in the map")
            return
        if kind == "forget":
            g.forget(item[1])
        elif kind == "clear":
            self.graph = LoopGraph(self.config, g.journal)
            self.store = self.graph.store
            self.localization, self._seeding = "", False
            self.markers.clear()
            with self._idle:
                self._jobs.clear()
            self.stats = LoopStats()
            if g.journal is not None:
                g.journal.begin()
        elif kind == "restore":
            self.graph = g = LoopGraph(self.config, g.journal)
            self.store = g.store
            g.restore(item[1], item[2])
            self.stats = LoopStats(keyframes=len(g.store), accepted=len(g.loops), last_optimisation_ms=g.last_solve_ms)
        elif kind == "relocated":
            g.follow_from(item[1], item[2])
        elif kind == "pose":
            _, what, target, cov, index, T = item
            if what == "set_pose":
                g.set_pose(target, index, T, cov)
            elif index in g.node:
                g.add_prior(index, target, cov)
            if g.node:
                g.solve()
                self.stats = replace(self.stats, last_optimisation_ms=g.last_solve_ms)
        self._publish_corrections()

    def _publish_corrections(self) -> None:
        self.corrections = self.graph.corrections()
        self.on_corrections(self.corrections)

    # -- candidates
    def _candidate(self, kf: LoopKeyframe) -> None:
        """Look for ``kf``'s place in the map; the best match waits for the model (``run_idle``).
        A keyframe (a loop) looks only at keyframes ``min_separation`` frames older; a frame to
        relocalise (index -1) at all of them."""
        relocate = kf.index < 0
        with self._idle:
            if not relocate and (self._jobs or self._busy):
                return  # one candidate at a time: the model's time goes to the stream first
        exclude = None
        if not relocate:
            oldest_allowed = kf.index - self.config.min_separation
            if oldest_allowed < 0:
                return
            exclude = range(oldest_allowed + 1, kf.index + 1)
        found = self.graph.places.query(kf.descriptor, k=1, exclude=exclude, min_similarity=self.config.min_similarity)
        if not found:
            if relocate:
                self.stats = replace(self.stats, last_reason="no place of the map looks like this frame")
            return
        kept = self.store.get(found[0][0])
        if relocate:
            kf = replace(kf, K=kept.K)
        self.stats = replace(self.stats, candidates=self.stats.candidates + 1)
        with self._idle:
            self._jobs.append(Candidate(kept, kf, self.graph.partner_of(kept), relocate=relocate))

    def _decide(self, job: Candidate) -> None:
        measured = measure_job(job, self.graph, self.config.check)
        if isinstance(measured, str):
            return self._refused(job, measured)
        g = self.graph
        g.add_loop(job.kept.index, job.current.index, measured.rel, self.config.loop_sigmas)
        seconds = g.solve()
        self.stats = replace(self.stats, accepted=self.stats.accepted + 1, last_reason=measured.verdict.reason,
                             last_optimisation_ms=g.last_solve_ms)
        log.info("loop closed: keyframe %d seen again at frame %d (%s); graph of %d keyframes re-solved in "
                 "%.1f ms", job.kept.index + 1, job.current.index + 1, measured.verdict.reason,
                 g.graph.node_count, 1e3 * seconds)
        self._publish_corrections()
        self.markers.append(marker(job, self.corrections, True, measured.verdict.reason))

    def _refused(self, job: Candidate, reason: str) -> None:
        self.stats = replace(self.stats, rejected=self.stats.rejected + 1,
                             last_reason=("relocalizing: " if job.relocate else "") + reason)
        what = "relocalisation at keyframe %d" if job.relocate else "loop candidate keyframe %d"
        log.info(what + " for frame %d rejected: %s", job.kept.index + 1, job.current.index + 1, reason)
        if not job.relocate:
            self.markers.append(marker(job, self.corrections, False, reason))

    # -- relocalisation
    def _decide_relocation(self, job: Candidate) -> None:
        if not self.relocalizing or self._seeding:
            return
        measured = measure_job(job, self.graph, self.config.check)
        if isinstance(measured, str):
            return self._refused(job, measured)
        seeds = tuple(self.store.around(job.kept.index, self.seed_count))
        if len(seeds) < self.seed_count:
            return self._refused(job, f"the map holds {len(seeds)} keyframes, the window needs {self.seed_count}")
        self.stats = replace(self.stats, last_reason=f"found at keyframe {job.kept.index + 1} "
                                                     f"({measured.verdict.reason})")
        log.info("relocalized: the camera sees keyframe %d again (%s)", job.kept.index + 1, measured.verdict.reason)
        self._seeding = True
        if self.on_relocated is not None:
            self.on_relocated(Relocation(job.kept.index, seeds, self.corrections.at(job.kept.index),
                                         measured.verdict.reason))


def marker(job: Candidate, c: Corrections, accepted: bool, reason: str) -> Marker:
    """The ~/loop_closures entry of a decided candidate, at the corrected keyframe positions."""
    return Marker(job.kept.index, job.current.index, accepted, reason, c.at(job.kept.index).apply(job.kept.T[:3, 3]),
                  c.at(job.current.index).apply(job.current.T[:3, 3]))


__all__ = ["LoopCloser", "LoopConfig", "LoopStats", "KeyframeIn", "Marker", "Relocation", "MARKERS",
           "loop_config", "as_rgb"]
