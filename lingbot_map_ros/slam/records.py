"""What a pose graph holds, as plain records, and their numpy form (numpy only).

A ``FactorRecord`` is one constraint as given: its kind, the node(s), the measured Sim(3) and
its covariance in GTSAM's tangent order (rotation, translation[, log-scale]). The pose graph
builds its GTSAM factors from these records, so the records alone rebuild it.

``records_to_arrays`` / ``records_from_arrays`` turn nodes and records into a dict of numpy
arrays (names below) for the journal or a saved session; ``np.savez`` stores it as is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sim3 import Sim3, check_covariance

KINDS = ("anchor", "odometry", "restart", "loop", "prior")
UNARY = ("anchor", "prior")
FORMAT_VERSION = 1


@dataclass(frozen=True, eq=False)
class FactorRecord:
    """One constraint.

    Attributes:
        kind: one of ``KINDS``.
        i: node index (the only one for unary kinds).
        j: second node index; -1 for ``anchor`` and ``prior``.
        measurement: relative ``X_i⁻¹·X_j`` (between) or the absolute pose (unary).
        covariance: [d, d] SPD in GTSAM tangent order, d = 7 (Sim(3)) or 6 (SE(3)).
        robust: whether the graph's robust kernel wraps it.
    """

    kind: str
    i: int
    j: int
    measurement: Sim3
    covariance: np.ndarray
    robust: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown factor kind {self.kind!r}; known: {KINDS}")
        if (self.j < 0) != (self.kind in UNARY):
            raise ValueError(f"factor kind {self.kind!r} with nodes ({self.i}, {self.j}): "
                             f"{'unary kinds take one node' if self.kind in UNARY else 'needs two nodes'}")
        dim = np.asarray(self.covariance).shape[0] if np.ndim(self.covariance) == 2 else -1
        if dim not in (6, 7):
            raise ValueError(f"{self.kind} factor covariance must be [6, 6] or [7, 7], "
                             f"got {np.shape(self.covariance)}")
        cov = check_covariance(self.covariance, f"{self.kind} factor ({self.i}, {self.j}) covariance", dim)
        cov.setflags(write=False)
        object.__setattr__(self, "covariance", cov)


def _sim3_arrays(values: list[Sim3], prefix: str) -> dict[str, np.ndarray]:
    n = len(values)
    return {f"{prefix}_rotation": np.array([v.rotation for v in values]).reshape(n, 3, 3),
            f"{prefix}_translation": np.array([v.translation for v in values]).reshape(n, 3),
            f"{prefix}_scale": np.array([v.scale for v in values], dtype=np.float64)}


def _sim3_list(arrays, prefix: str) -> list[Sim3]:
    rot, trans, scale = (np.asarray(arrays[f"{prefix}_{k}"], dtype=np.float64)
                         for k in ("rotation", "translation", "scale"))
    return [Sim3(r, t, s) for r, t, s in zip(rot, trans, scale)]


def records_to_arrays(nodes: list[int], odom: list[Sim3], estimate: list[Sim3],
                      factors: list[FactorRecord], dim: int) -> dict[str, np.ndarray]:
    """Arrays: ``node_index`` [N] int64, ``node_odom_*`` and ``node_estimate_*`` (``rotation`` [N,3,3],
    ``translation`` [N,3], ``scale`` [N]), ``factor_kind`` [F] int8 (index into ``KINDS``),
    ``factor_i``/``factor_j`` [F] int64, ``factor_measurement_*``, ``factor_covariance`` [F,d,d],
    ``factor_robust`` [F] bool, ``format_version`` (0-d)."""
    out = {"format_version": np.array(FORMAT_VERSION), "node_index": np.array(nodes, dtype=np.int64)}
    out.update(_sim3_arrays(odom, "node_odom"))
    out.update(_sim3_arrays(estimate, "node_estimate"))
    out["factor_kind"] = np.array([KINDS.index(f.kind) for f in factors], dtype=np.int8)
    out["factor_i"] = np.array([f.i for f in factors], dtype=np.int64)
    out["factor_j"] = np.array([f.j for f in factors], dtype=np.int64)
    out.update(_sim3_arrays([f.measurement for f in factors], "factor_measurement"))
    out["factor_covariance"] = np.array([f.covariance for f in factors]).reshape(len(factors), dim, dim)
    out["factor_robust"] = np.array([f.robust for f in factors], dtype=bool)
    return out


def records_from_arrays(arrays) -> tuple[list[int], list[Sim3], list[Sim3], list[FactorRecord]]:
    """Inverse of ``records_to_arrays``: (nodes, odom poses, estimates, factor records)."""
    version = int(np.asarray(arrays["format_version"]))
    if version != FORMAT_VERSION:
        raise ValueError(f"pose graph arrays of format {version}; this code reads {FORMAT_VERSION}")
    nodes = [int(k) for k in np.asarray(arrays["node_index"])]
    odom, estimate = _sim3_list(arrays, "node_odom"), _sim3_list(arrays, "node_estimate")
    if not len(nodes) == len(odom) == len(estimate):
        raise ValueError(f"pose graph arrays: {len(nodes)} nodes but {len(odom)} odom poses and "
                         f"{len(estimate)} estimates")
    kinds = np.asarray(arrays["factor_kind"])
    if kinds.size and (kinds.min() < 0 or kinds.max() >= len(KINDS)):
        raise ValueError(f"pose graph arrays: factor kind codes outside 0..{len(KINDS) - 1}")
    factors = [FactorRecord(KINDS[int(k)], int(i), int(j), m, c, bool(r))
               for k, i, j, m, c, r in zip(kinds, arrays["factor_i"], arrays["factor_j"],
                                           _sim3_list(arrays, "factor_measurement"),
                                           np.asarray(arrays["factor_covariance"], dtype=np.float64),
                                           arrays["factor_robust"])]
    return nodes, odom, estimate, factors
