"""A loop candidate measured and checked: the model run on an old keyframe and the current one
together (a *side session*), their relative Sim(3) in the map's units, and the geometric checks
of ``slam.verify_loop``.

``SideRunner`` is what runs the model for a verification: ``run([image_a, image_b])`` feeds the two
model inputs as one fresh sequence and returns each frame's pose and depth in that sequence's
world (``SideView``). ``ModelSideRunner`` does it with a ``StreamingSession`` of its own on the
camera's model (the same weights and kernels; a pool of its own, two scale frames: one phase-1
step, never a CUDA graph); tests hand in a runner that knows the true geometry.

``measure(kept, current, views)``: the side session's world has its own scale. Each keyframe's
depth as the stream published it (its thumbnail, ``loop_keyframes``) against the side session's
depth at the same pixels gives ``a = stream units per side unit`` for both frames; the loop's
relative pose in the stream's units is then ``rel = Sim3(R', a_kept·t', a_kept / a_current)``
(``R'``, ``t'``: current camera in the kept camera's axes in the side world), i.e. ``p_kept =
rel(p_current)``. ``slam.verify_loop`` checks it: the kept frame's confident depth reprojected into
the current frame must land and agree; further estimates (the same current frame against another
kept keyframe, moved through the pose graph) must agree with it. numpy only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..slam import DepthView, LoopCheck, LoopVerdict, Sim3, verify_loop
from .loop_keyframes import THUMB, LoopKeyframe


@dataclass(frozen=True, eq=False)
class SideView:
    """One frame of a side session: ``c2w`` [4, 4] (OpenCV axes, the side world), ``depth`` and
    ``confidence`` [H, W], ``intrinsics`` [3, 3] at [H, W]."""

    c2w: np.ndarray
    depth: np.ndarray
    confidence: np.ndarray
    intrinsics: np.ndarray


class SideRunner(Protocol):
    def run(self, images: list[np.ndarray]) -> list[SideView]:
        """The model on ``images`` (model inputs, uint8 [H, W, 3]) as one fresh sequence."""


@dataclass(frozen=True)
class Measured:
    """A candidate's outcome: the relative pose (kept <- current, stream units) and the verdict."""

    kept: int
    current: int
    rel: Sim3 | None
    verdict: LoopVerdict | None
    reason: str  # why it was refused before the checks ran ("" when they ran)

    @property
    def accepted(self) -> bool:
        return self.verdict is not None and self.verdict.accepted


class ModelSideRunner:
    """``SideRunner`` on a ``StreamingSession`` sharing ``inner``'s model, kernels and backend (the
    inference thread drives both, in turn)."""

    def __init__(self, inner) -> None:
        from ..stream.session import StreamingSession

        cfg = inner.cfg.with_overrides(num_scale_frames=2, keyframe_interval=1, deferred_eviction=False)
        self.session = StreamingSession(inner.model, cfg, share_from=inner)

    def run(self, images: list[np.ndarray]) -> list[SideView]:
        session = self.session
        session.reset()
        results = []
        for image in images:
            results += session.push(image)
        session.reset()
        return [SideView(np.asarray(r.c2w, np.float64), r.depth, r.confidence, r.intrinsics) for r in results]


def depth_scale(kf: LoopKeyframe, view: SideView) -> float:
    """Stream units per side unit at keyframe ``kf``: the median ratio of its published depth
    (thumbnail) to the side session's depth at the same pixels; NaN without common pixels."""
    o = THUMB // 2
    side = np.asarray(view.depth, np.float64)[o::THUMB, o::THUMB]
    if side.shape != kf.depth.shape:
        return math.nan
    ok = (kf.depth > 0) & np.isfinite(side) & (side > 0)
    return float(np.median(kf.depth[ok] / side[ok])) if ok.sum() >= 8 else math.nan


def relative_in_stream_units(kept: LoopKeyframe, current: LoopKeyframe, views: list[SideView]
                             ) -> tuple[Sim3 | None, float, float]:
    """(rel: kept <- current in stream units, a_kept, a_current) from the side views of [kept,
    current]; rel None when a scale cannot be measured. ``current.depth`` None (a frame to
    relocalise): its scale is the kept keyframe's."""
    a_k = depth_scale(kept, views[0])
    # a frame the stream has not posed (a relocalisation) has no depth of its own: the side
    # session's units are one world, so the kept keyframe's scale holds for it too
    a_c = a_k if current.depth is None else depth_scale(current, views[1])
    if not (math.isfinite(a_k) and math.isfinite(a_c) and a_k > 0 and a_c > 0):
        return None, a_k, a_c
    side = np.linalg.inv(views[0].c2w) @ views[1].c2w
    return Sim3(side[:3, :3], a_k * side[:3, 3], a_k / a_c), a_k, a_c


def measure(kept: LoopKeyframe, current: LoopKeyframe, views: list[SideView], check: LoopCheck,
            others: tuple[Sim3, ...] = ()) -> Measured:
    """The loop kept <- current from the side views of [kept, current] (module text); ``others``:
    further estimates of the same relative pose (kept <- current, stream units)."""
    rel, a_k, a_c = relative_in_stream_units(kept, current, views)
    if rel is None:
        return Measured(kept.index, current.index, None, None,
                        f"no depth in common with the stream's (scales {a_k:.3g}, {a_c:.3g})")
    a = DepthView(np.asarray(views[0].depth, np.float64) * a_k, views[0].confidence, views[0].intrinsics)
    b = DepthView(np.asarray(views[1].depth, np.float64) * a_c, views[1].confidence, views[1].intrinsics)
    return Measured(kept.index, current.index, rel, verify_loop(a, b, rel, others, check), "")


@dataclass
class Candidate:
    """A candidate waiting for the model (inference thread) and then for its checks (loop thread).
    ``relocate``: the current frame is a frame to find in the map (not a keyframe of the graph)."""

    kept: LoopKeyframe
    current: LoopKeyframe
    partner: LoopKeyframe | None
    relocate: bool = False
    views: list[SideView] | None = None
    partner_views: list[SideView] | None = None
    error: str = ""
    queued_at: float = field(default_factory=time.monotonic)  # when it started waiting for the model


def measure_job(job: Candidate, g, check: LoopCheck) -> Measured | str:
    """A verified candidate's measurement (``loop_verify.measure``, with the estimate through its
    partner keyframe and the graph), or why there is none."""
    if job.kept.index not in g.node or not (job.relocate or job.current.index in g.node):
        return "a keyframe of the candidate left the map (rollback or reset)"
    if job.error or not job.views or len(job.views) != 2:
        return f"the side session failed: {job.error or 'no results'}"
    others: tuple[Sim3, ...] = ()
    if any(not _finite(v) for v in job.views):
        return "the side session gave non-finite poses, depths or intrinsics"
    try:
        if job.partner is not None and job.partner_views and job.partner.index in g.node \
                and all(_finite(v) for v in job.partner_views):
            rel_partner, _, _ = relative_in_stream_units(job.partner, job.current, job.partner_views)
            if rel_partner is not None:  # kept <- partner through the graph, then partner <- current
                between = g.graph.pose(g.node[job.kept.index]).inverse() @ g.graph.pose(g.node[job.partner.index])
                others = (between @ rel_partner,)
        measured = measure(job.kept, job.current, job.views, check, others)
    except ValueError as exc:  # the side session's output does not hold together (NaN, inf, shapes)
        return f"the side session's output cannot be used: {exc}"
    return measured if measured.accepted else (measured.reason or measured.verdict.reason)


def _finite(view: SideView) -> bool:
    """A side view the checks can use: finite pose and intrinsics (depth may hold non-finite pixels:
    they are left out)."""
    return bool(np.all(np.isfinite(view.c2w)) and np.all(np.isfinite(view.intrinsics)))


__all__ = ["Candidate", "measure_job", "SideView", "SideRunner", "ModelSideRunner", "Measured", "measure", "depth_scale",
           "relative_in_stream_units"]
