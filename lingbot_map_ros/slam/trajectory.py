"""Trajectory error metrics (numpy only).

``ate`` is the absolute trajectory error: the RMSE of camera centres after aligning the estimate
onto the reference with Umeyama's least-squares similarity (``with_scale``; the right choice while
the estimate is in model units) or rigid transform.
"""
from __future__ import annotations

import numpy as np

from ..geometry import apply_sim3, umeyama_sim3


def ate(estimate, reference, with_scale: bool = True) -> float:
    """RMSE (reference units) of aligned camera centres.

    Args:
        estimate, reference: [N, 3] camera centres, or [N, 4, 4] poses (their translations),
            in corresponding order, N ≥ 3.
        with_scale: Sim(3) alignment (else SE(3)).
    """
    est, ref = _centres(estimate, "estimate"), _centres(reference, "reference")
    if est.shape != ref.shape:
        raise ValueError(f"estimate has {est.shape[0]} centres, reference {ref.shape[0]}")
    scale, rot, trans = umeyama_sim3(est, ref, with_scale=with_scale)
    err = apply_sim3(scale, rot, trans, est) - ref
    return float(np.sqrt(np.mean(np.sum(err ** 2, axis=1))))


def _centres(value, what: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 3 and arr.shape[1:] == (4, 4):
        arr = arr[:, :3, 3]
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"{what} must be [N, 3] centres or [N, 4, 4] poses, got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} has non-finite values")
    return arr
