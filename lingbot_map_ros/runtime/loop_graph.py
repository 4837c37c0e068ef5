"""The loop-closure map of one camera: ``LoopGraph`` — the keyframe database, the pose graph
and the map frame, built by the loop thread (``loop_closure.LoopCloser``) one operation at a time.

- ``add_keyframe``: the keyframe is kept (``loop_keyframes.KeyframeStore``), its descriptor goes
  into the place database (``slam.PlaceDatabase``) and its pose into the pose graph
  (``slam.PoseGraph``, Sim(3), iSAM2) with an odometry edge from the keyframe before it (or from
  the keyframe a relocalised stretch follows: ``follow_from``). Graph nodes are numbered apart
  from frame indices: a rolled-back index that comes back is a new node.
- ``add_loop`` (a verified loop: a robust edge), ``add_prior`` (a pose from outside),
  ``set_pose`` (``~/set_pose``: the map frame moves so that a frame is where it is said to be,
  and its keyframe gets a prior there), ``forget`` (a rollback).
- ``corrections()``: every keyframe's correction (map <- sequence, ``corrections.Corrections``)
  from the graph's solution, and the relocalised stretches' (their keyframe's until they have
  their own keyframes).

Every operation is journaled (``loop_journal``) as it is applied; ``restore`` replays a journal
through the same operations in the same order, so the graph and its solution come back the same.
One thread (the loop thread) calls it; the store may be read from others. No ROS, no torch.
"""
from __future__ import annotations

import logging

import numpy as np

from ..journal.format import Record
from ..slam import PlaceConfig, PlaceDatabase, PoseGraph, PoseGraphConfig, Sim3
from .corrections import Corrections, rigid
from .loop_journal import LoopJournal, keyframe_record, loop_record, prior_record, sim3_meta, sim3_of
from .loop_keyframes import KeyframeStore, LoopKeyframe

log = logging.getLogger(__name__)
DESCRIPTOR_DIM = 256  # slam.gradient_descriptor's length with its default grid and bins


class LoopGraph:
    """See the module docstring. ``config``: ``loop_closure.LoopConfig``."""

    def __init__(self, config, journal: LoopJournal | None = None) -> None:
        self.config, self.journal = config, journal
        self.store = KeyframeStore(config.max_keyframes)
        self.places = PlaceDatabase(PlaceConfig(DESCRIPTOR_DIM, capacity=config.max_keyframes))
        self.graph = PoseGraph(PoseGraphConfig(mode="sim3", robust_kernel=config.robust_kernel))
        self.previous: int | None = None  # the keyframe the next one's odometry edge starts from
        self.node: dict[int, int] = {}  # frame index -> graph node
        self._next_node = 0
        self.loops: list[tuple[int, int, Sim3, tuple[float, ...]]] = []  # accepted, by frame index
        self.priors: list[tuple[int, Sim3, np.ndarray]] = []  # (frame index, pose in the graph's frame, ROS cov)
        self.follow: dict[int, int] = {}  # first frame of a relocalised stretch -> the keyframe it follows
        self.frame = Sim3.identity()  # map <- the graph's frame (``set_pose`` moves it)
        self.last_solve_ms = 0.0

    # ------------------------------------------------------------------ operations (journaled)
    def add_keyframe(self, kf: LoopKeyframe) -> None:
        gone = self.store.add(kf)
        if gone is not None:
            if gone in self.places:
                self.places.remove(gone)
            if self.journal is not None:
                self.journal.dropped(len(kf.image) + kf.depth.nbytes + kf.colors.nbytes)
        self.places.add(kf.index, kf.descriptor)
        node = self._next_node
        self._next_node += 1
        self.node[kf.index] = node
        pose = Sim3.from_pose(kf.T)
        self.graph.add_keyframe(node, pose)
        if self.previous is not None and self.previous in self.node:
            prev = self.node[self.previous]
            rel = self.graph.odom_pose(prev).inverse() @ pose
            self.graph.add_odometry(prev, node, sigmas=self.config.odometry.sigmas_for(rel, kf.weight))
        self.previous = kf.index
        self.graph.update()
        self._record(keyframe_record(kf, node, kf.weight))
        if self.journal is not None and self.journal.due():
            self.journal.begin(self.live_records())

    def add_loop(self, kept: int, current: int, rel: Sim3, sigmas) -> None:
        self.graph.add_loop(self.node[kept], self.node[current], rel, sigmas=np.asarray(sigmas, np.float64))
        self.loops.append((kept, current, rel, tuple(float(x) for x in sigmas)))
        self._record(loop_record(kept, current, rel, sigmas))

    def add_prior(self, index: int, target: Sim3, covariance: np.ndarray) -> None:
        """Keyframe ``index`` is at ``target`` in the map (rigid, model units), with ``covariance``
        (ROS order, model units, the map's axes)."""
        pose, cov = self.frame.inverse() @ target, _rotated(covariance, self.frame.rotation.T)
        self._prior(index, pose, cov)

    def set_pose(self, target: Sim3, frame_index: int, T: np.ndarray, covariance: np.ndarray) -> None:
        """Frame ``frame_index`` (stream pose ``T``) is at ``target`` in the map: the map frame moves
        so that it is, and the keyframe at or before it gets a prior where that puts it."""
        T = rigid(T)
        now = rigid(self.corrections().pose(frame_index, T))  # where the frame is in the map now
        self._set_frame(target @ Sim3.from_pose(now).inverse() @ self.frame)
        kf = self.keyframe_at_or_before(frame_index)
        if kf is not None:  # the keyframe, moved by the frame's stream motion since it
            self.add_prior(kf.index, target @ Sim3.from_pose(T).inverse() @ Sim3.from_pose(kf.T), covariance)

    def follow_from(self, next_frame: int, kept: int) -> None:
        """Frames from ``next_frame`` on were posed after keyframe ``kept`` (a relocalisation)."""
        self.follow = {f: k for f, k in self.follow.items() if f < next_frame}
        self.follow[next_frame] = kept
        self.previous = kept  # the next keyframe's odometry starts at the keyframe it was found at
        self._record(Record("lreloc", {"f": int(next_frame), "k": int(kept)}))

    def forget(self, index: int) -> None:
        """Keyframes from frame ``index`` on left the sequence (a rollback). The graph keeps their
        nodes (iSAM2 keeps what it solved): they dangle on their odometry edge and correct nothing."""
        self.store.forget_from(index)
        for i in [int(i) for i in self.places.indices() if i >= index]:
            self.places.remove(i)
        self.follow = {f: k for f, k in self.follow.items() if f < index}
        indices = self.store.indices()
        self.previous = indices[-1] if indices else None
        for i in [i for i in self.node if i >= index]:
            del self.node[i]
        self._record(Record("lforget", {"i": int(index)}), live=False)

    def solve(self) -> float:
        """Re-solve (iSAM2) what was added; seconds."""
        seconds = self.graph.update()
        self.last_solve_ms = 1e3 * seconds
        return seconds

    # ------------------------------------------------------------------ queries
    def corrections(self) -> Corrections:
        """Every keyframe's correction (map <- sequence) from the graph's solution, and the
        relocalised stretches' (their keyframe's until they have their own)."""
        by_index: dict[int, Sim3] = {}
        if self.node:
            nodes, mats = self.graph.poses()
            solved = {int(n): m for n, m in zip(nodes, mats)}
            for index in self.store.indices():
                node, kf = self.node.get(index), self.store.get(index)
                if node is not None and kf is not None and node in solved:
                    by_index[index] = self.frame @ Sim3.from_matrix(solved[node]) @ Sim3.from_pose(kf.T).inverse()
            for first, kept in self.follow.items():  # frames before the stretch's first keyframe
                if kept in by_index and first not in by_index:
                    by_index[first] = by_index[kept]
        if not by_index and not np.allclose(self.frame.matrix(), np.eye(4)):
            by_index[0] = self.frame  # ~/set_pose before any keyframe
        return Corrections(by_index)

    def keyframe_at_or_before(self, frame_index: int) -> LoopKeyframe | None:
        indices = [i for i in self.store.indices() if i <= frame_index and i in self.node]
        return self.store.get(indices[-1]) if indices else None

    def partner_of(self, kept: LoopKeyframe) -> LoopKeyframe | None:
        """The keyframe before ``kept`` (after it for the first): a second, independent estimate."""
        indices = self.store.indices()
        at = indices.index(kept.index)
        return self.store.get(indices[at - 1]) if at > 0 else (self.store.get(indices[1]) if len(indices) > 1 else None)

    def live_records(self) -> list[Record]:
        """What the journal holds after a compaction: the live keyframes and relocalisations in
        frame order, the map frame, the loops and priors between live keyframes."""
        items: list[tuple[int, int, Record]] = []
        for index in self.store.indices():
            kf = self.store.get(index)
            items.append((index, 1, keyframe_record(kf, self.node.get(index, -1), kf.weight)))
        for first, kept in self.follow.items():
            items.append((first, 0, Record("lreloc", {"f": first, "k": kept})))
        records = [r for _, _, r in sorted(items, key=lambda x: (x[0], x[1]))]
        live = set(self.store.indices())
        records += [loop_record(a, b, rel, sig) for a, b, rel, sig in self.loops if a in live and b in live]
        records += [prior_record(i, pose, cov) for i, pose, cov in self.priors if i in live]
        records.append(Record("lframe", {"frame": sim3_meta(self.frame)}))
        return records

    # ------------------------------------------------------------------ a journal back
    def restore(self, records: list[Record], next_frame: int) -> None:
        """Replay a journal's records (``loop_journal.read_loop_journal``) on an empty graph, cut at
        the keyframe journal's ``next_frame``; the journal then holds exactly what was restored."""
        journal, self.journal = self.journal, None  # replayed, not journaled again
        try:
            for r in records:
                m, a = r.meta, r.arrays
                if r.kind == "lkf" and int(m["i"]) < next_frame:
                    self.add_keyframe(LoopKeyframe(
                        int(m["i"]), float(m["s"]), np.array(a["T"], np.float64), bytes(a["jpeg"]),
                        np.asarray(a["desc"], np.float32), np.asarray(a["depth"], np.float32),
                        np.asarray(a["colors"], np.uint8), np.asarray(a["K"], np.float64), float(m["w"])))
                elif r.kind == "loop" and m["a"] in self.node and m["b"] in self.node:
                    self.add_loop(int(m["a"]), int(m["b"]), sim3_of(m["rel"]), m["sig"])
                    self.solve()  # as when it was accepted: iSAM2 comes to the same solution
                elif r.kind == "prior" and m["i"] in self.node:
                    self._prior(int(m["i"]), sim3_of(m["pose"]), a["cov"])
                    self.solve()
                elif r.kind == "lforget":
                    self.forget(int(m["i"]))
                elif r.kind == "lframe":
                    self._set_frame(sim3_of(m["frame"]))
                elif r.kind == "lreloc" and m["k"] in self.node and m["f"] < next_frame:
                    self.follow_from(int(m["f"]), int(m["k"]))
            self.forget(next_frame)
            if self.node:
                self.solve()
        finally:
            self.journal = journal
        if self.journal is not None:
            self.journal.begin(self.live_records())
        log.info("loop closure restored: %d keyframes, %d loops, %d priors", len(self.store), len(self.loops),
                 len(self.priors))

    # ------------------------------------------------------------------ internals
    def _record(self, record: Record, live: bool = True) -> None:
        if self.journal is not None:
            self.journal.append(record, live)

    def _prior(self, index: int, pose: Sim3, covariance: np.ndarray) -> None:
        """A prior in the graph's own frame."""
        self.graph.add_prior(self.node[index], pose, covariance)
        self.priors.append((index, pose, np.asarray(covariance, np.float64)))
        self._record(prior_record(index, pose, covariance))

    def _set_frame(self, frame: Sim3) -> None:
        self.frame = frame
        self._record(Record("lframe", {"frame": sim3_meta(frame)}))


def _rotated(covariance: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """A ROS 6x6 pose covariance (x y z, then rotations about fixed x y z) in axes turned by ``rot``."""
    J = np.zeros((6, 6))
    J[:3, :3] = J[3:, 3:] = rot
    cov = np.asarray(covariance, np.float64).reshape(6, 6)
    return J @ cov @ J.T


__all__ = ["LoopGraph", "DESCRIPTOR_DIM"]
