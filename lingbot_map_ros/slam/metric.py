"""From a Sim(3) pose graph in model units to an SE(3) graph in metres (numpy only).

Once a metric scale ``m`` (metres per map unit) is known, each keyframe's optimised scale
``s_i`` is frozen: a length of keyframe i's units is ``s_i·m`` metres. A Sim(3) factor's
measurement ``Z = (R_Z, t_Z, s_Z)`` becomes the rigid ``(R_Z, u·t_Z)`` with ``u = s_i·m`` for
a between factor (``t_Z`` is in node i's units) and ``u = m`` for a unary one (map units); its
relative scale ``s_Z`` is dropped (the frozen node scales replace it). Its 7×7 tangent covariance
(ω, t, λ) maps to 6×6 (ω, v) by the first-order change of the retraction: a perturbation
``Z·Exp(ω, t, λ)`` moves the translation by ``s_Z·R_Z·t`` (whatever λ), so ``v = u·s_Z·t``; λ drops.
"""
from __future__ import annotations

import math

import numpy as np

from .records import FactorRecord
from .sim3 import Sim3


def sim3_to_se3_jacobian(measurement: Sim3, unit: float) -> np.ndarray:
    """[6, 7] K with ``(ω, v) = K · (ω, t, λ)`` (module text)."""
    jac = np.zeros((6, 7))
    jac[0:3, 0:3] = np.eye(3)
    jac[3:6, 3:6] = unit * measurement.scale * np.eye(3)
    return jac


def se3_record(record: FactorRecord, unit: float) -> FactorRecord:
    """``record`` (Sim(3), 7×7) as an SE(3) record in metres; ``unit`` = metres per unit of its
    measurement's frame."""
    m = record.measurement
    jac = sim3_to_se3_jacobian(m, unit)
    cov = jac @ record.covariance @ jac.T
    return FactorRecord(record.kind, record.i, record.j, Sim3(m.rotation, unit * m.translation, 1.0),
                        0.5 * (cov + cov.T), record.robust)


def se3_records(odom: dict[int, Sim3], estimate: dict[int, Sim3], factors: list[FactorRecord],
                metres_per_unit: float) -> tuple[dict[int, tuple[Sim3, Sim3]], list[FactorRecord]]:
    """({index: (odom pose, initial pose) in metres, scale 1}, SE(3) factor records)."""
    if not (math.isfinite(metres_per_unit) and metres_per_unit > 0):
        raise ValueError(f"metres_per_unit must be finite and > 0, got {metres_per_unit!r}")
    m = metres_per_unit
    nodes = {k: (Sim3(odom[k].rotation, m * odom[k].translation, 1.0),
                 Sim3(estimate[k].rotation, m * estimate[k].translation, 1.0)) for k in odom}
    records = [se3_record(f, m if f.j < 0 else m * estimate[f.i].scale) for f in factors]
    return nodes, records
