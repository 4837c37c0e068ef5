"""Deviation of one stream's outputs from another's (a lower precision against a reference).

``deviation(reference, other)`` compares two lists of ``FrameResult`` of the same frames
(same order) and returns, over all frames:

* ``translation_rel``: the largest camera-centre difference, relative to the reference
  trajectory's extent (the largest distance of a reference centre from the first);
* ``rotation_deg``: the largest rotation between the two cameras' orientations (degrees);
* ``depth_rel`` / ``confidence_rel``: the mean absolute difference over all pixels relative to
  the reference's mean absolute value, and ``depth_rel_max`` / ``confidence_rel_max`` the
  largest per-pixel difference relative to the reference's largest value.

Pure numpy: used by the accuracy benchmark and by ``lingbot-map-replay --compare-precision``.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def _rotation_deg(a: np.ndarray, b: np.ndarray) -> float:
    r = a[:3, :3].T @ b[:3, :3]
    cos = (np.trace(r) - 1.0) / 2.0
    return math.degrees(math.acos(float(np.clip(cos, -1.0, 1.0))))


def deviation(reference: Sequence, other: Sequence) -> dict[str, float]:
    """See the module text; ValueError when the streams do not cover the same frames."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"the streams differ in length ({len(reference)} vs {len(other)} frames) or are empty")
    if [r.frame_index for r in reference] != [r.frame_index for r in other]:
        raise ValueError("the streams' frame indices differ")
    centres = np.stack([r.c2w[:3, 3] for r in reference]).astype(np.float64)
    others = np.stack([r.c2w[:3, 3] for r in other]).astype(np.float64)
    extent = max(float(np.linalg.norm(centres - centres[0], axis=1).max()), 1e-9)
    out = {"frames": len(reference),
           "translation_rel": float(np.linalg.norm(others - centres, axis=1).max() / extent),
           "rotation_deg": max(_rotation_deg(a.c2w.astype(np.float64), b.c2w.astype(np.float64))
                               for a, b in zip(reference, other))}
    for key, name in (("depth", "depth"), ("confidence", "confidence")):
        if reference[0].__dict__.get(key) is None or other[0].__dict__.get(key) is None:
            continue
        a = np.stack([getattr(r, key) for r in reference]).astype(np.float64)
        b = np.stack([getattr(r, key) for r in other]).astype(np.float64)
        diff = np.abs(b - a)
        out[f"{name}_rel"] = float(diff.mean() / max(np.abs(a).mean(), 1e-12))
        out[f"{name}_rel_max"] = float(diff.max() / max(np.abs(a).max(), 1e-12))
    return out


__all__ = ["deviation"]
