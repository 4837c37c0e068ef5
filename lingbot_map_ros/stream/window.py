"""The windows of a long stream: where the current window sits in the global sequence, and
how a new window is started from the kept keyframes (numpy only, no torch).

``Window`` is a value: a restart (or a journaled restart redone by ``resume_window``)
replaces it. ``refeed`` pushes the kept keyframes into the freshly reset inner session
(the oldest ``num_scale_frames`` as the new window's scale frames, the others as
keyframes) and ``fit_window`` pairs their poses and depth maps, as published before and
as predicted now, into the Sim(3) from the new window's world to the global frame
(``alignment.estimate_window_sim3``). ``LongStreamSession.restart`` orders the steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .alignment import AlignmentFit, Sim3, estimate_window_sim3
from .results import FrameResult


@dataclass(frozen=True)
class KeptKeyframe:
    """A stored frame as published: what a restart re-feeds and aligns to."""

    index: int  # global frame index
    frame: np.ndarray  # the model input as pushed, float32 [3, H, W] or uint8 [H, W, 3] (a private copy)
    c2w: np.ndarray  # [4, 4] float64, global frame
    depth: np.ndarray | None  # [H, W] global units
    confidence: np.ndarray | None  # [H, W]


@dataclass(frozen=True, eq=False)
class Window:
    """One window of the inner session's cache in the global sequence."""

    index: int = 0  # restarts since reset (0 = the first window)
    start: int = 0  # global index of the first frame the window processed after its overlap
    overlap_indices: tuple[int, ...] = ()  # global indices of the keyframes re-fed at its start
    alignment: Sim3 = field(default_factory=Sim3)  # the window's world -> global frame
    last_fit: AlignmentFit | None = None  # diagnostics of the restart's alignment (None: not estimated here)

    def to_inner(self, global_index: int) -> int:
        """The inner session's frame index of global frame ``global_index``."""
        return global_index - self.start + len(self.overlap_indices)

    def to_global(self, inner_index: int) -> int:
        """The global frame index of the inner session's frame ``inner_index``."""
        return inner_index - len(self.overlap_indices) + self.start


def refeed(inner, kept: tuple[KeptKeyframe, ...] | list[KeptKeyframe]) -> list[FrameResult]:
    """Push the kept keyframes into ``inner`` (a freshly reset ``StreamingSession``): the
    oldest ``num_scale_frames`` as its scale frames, the others as keyframes; their results
    in the new window's world."""
    s0 = inner.cfg.num_scale_frames
    fed: list[FrameResult] = []
    for k in kept[:s0]:
        fed += inner.push(k.frame)
    for k in kept[s0:]:
        fed += inner.push(k.frame, keyframe=True)
    return fed


def fit_window(kept: tuple[KeptKeyframe, ...] | list[KeptKeyframe], fed: list[FrameResult]) -> AlignmentFit:
    """The Sim(3) from the new window's world to the global frame, from the kept keyframes as
    published (``kept``) and as re-fed (``fed``, in the same order)."""
    return estimate_window_sim3(np.stack([k.c2w for k in kept]), np.stack([r.c2w for r in fed]),
                                *_paired_depths(kept, fed))


def _paired_depths(kept, fed: list[FrameResult]):
    """(old depth, new depth, old conf, new conf) stacks, or Nones where any is missing. A kept
    depth smaller than the model's (a keyframe of the loop-closure map: a thumbnail with 0 where
    not confident) is paired with the new depth at the centre pixel of each block, without
    confidences."""
    if any(k.depth is None for k in kept) or any(r.depth is None for r in fed):
        return None, None, None, None
    if any(k.depth.shape != r.depth.shape for k, r in zip(kept, fed)):
        new = [_sampled_like(r.depth, k.depth.shape) for k, r in zip(kept, fed)]
        if any(n is None for n in new):
            return None, None, None, None
        return np.stack([k.depth for k in kept]), np.stack(new), None, None
    confs = [k.confidence for k in kept] + [r.confidence for r in fed]
    old_conf = new_conf = None
    if all(c is not None for c in confs):
        old_conf, new_conf = np.stack(confs[:len(kept)]), np.stack(confs[len(kept):])
    return np.stack([k.depth for k in kept]), np.stack([r.depth for r in fed]), old_conf, new_conf


def _sampled_like(depth: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``depth`` [H, W] at the centre pixel of each block of a [h, w] grid (None if it does not fit)."""
    d = np.asarray(depth)
    sy, sx = d.shape[0] // shape[0], d.shape[1] // shape[1]
    if sy < 1 or sx < 1:
        return None
    out = d[sy // 2::sy, sx // 2::sx][:shape[0], :shape[1]]
    return out if out.shape == tuple(shape) else None


__all__ = ["KeptKeyframe", "Window", "refeed", "fit_window"]
