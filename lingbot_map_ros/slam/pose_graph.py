"""A keyframe pose graph optimised with GTSAM's iSAM2 (``PoseGraph``).

Nodes are keyframes keyed by their frame index (int ≥ 0). Each node has the pose the stream
gave it in the **odom** frame (the stream's own world, OpenCV optical camera axes, model units)
and an optimised pose in the **map** frame. Poses are camera-to-world ``Sim3``: rotation,
camera centre, and scale = world units per unit of that keyframe (``sim3`` module).

Modes (``PoseGraphConfig.mode``):

- ``sim3`` (while the scale is the model's): nodes are GTSAM ``Similarity3``; every edge also
  constrains the relative scale, so scale drift between windows is corrected by loops.
- ``se3`` (once metric scale is known): nodes are ``Pose3``; a scale other than 1 is refused.
  ``to_se3(metres_per_unit)`` turns an optimised Sim(3) graph into an SE(3) graph in metres
  (node scales frozen at their estimates, edge scale parts dropped).

Edges (``edge_counts`` kinds): ``anchor`` (a tight prior holding the first keyframe at its odom
pose, ``PoseGraphConfig.anchor``), ``odometry`` and ``restart`` (relative poses of the stream:
consecutive keyframes, window-restart alignments), ``loop`` (verified loops, under the robust
kernel), ``prior`` (absolute poses with a ROS covariance, ``noise.ros_covariance_to_tangent``).
Between edges measure ``X_i⁻¹·X_j`` with a covariance in GTSAM tangent order: rotation (rad),
translation (node i's units), log-scale (``noise`` module; ``EdgeNoise.sigmas`` builds one).

The graph is the one writer of its estimate: ``add_*`` queue keyframes and edges, ``update()``
runs iSAM2 on them (more iterations after a loop), ``batch_solve()`` re-solves everything with
Levenberg–Marquardt. ``to_arrays`` / ``from_arrays`` serialise it (``records`` module).
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from . import gtsam_bridge as bridge
from .noise import ros_covariance_to_tangent
from .records import FactorRecord, records_from_arrays, records_to_arrays
from .sim3 import Sim3, check_covariance, check_sigmas, relative

LOG = logging.getLogger(__name__)
MODES = ("sim3", "se3")


@dataclass(frozen=True)
class PoseGraphConfig:
    """Attributes:
        mode: ``sim3`` or ``se3`` (module text).
        robust_kernel: M-estimator of loop edges (and priors added with ``robust=True``):
            ``cauchy``, ``huber``, ``dcs`` or ``none``.
        robust_param: its parameter in whitened units (Cauchy/Huber k, DCS Φ). A true loop whose
            drift is m sigmas of the odometry chain converges from the odometry start when
            m ≲ 2k (Cauchy); a loop far beyond that is treated as an outlier.
        anchor: hold the first keyframe at its odom pose with sigma ``anchor_sigma`` (all axes).
        prior_log_scale_sigma: log-scale sigma of a Sim(3) prior (ROS covariances have none).
        relinearize_threshold, relinearize_skip: iSAM2's relinearisation settings.
        iterations_after_loop: at most this many extra iSAM2 iterations in an ``update()`` that
            adds a loop (a robust loop pulls the chain over several reweighted iterations) ...
        loop_tolerance: ... stopping once no loop end moved more than this in one iteration
            (norm of the tangent change).
        batch_max_iterations, batch_relative_tol: ``batch_solve``'s LM stopping rule.
    """

    mode: str = "sim3"
    robust_kernel: str = "cauchy"
    robust_param: float = 10.0
    anchor: bool = True
    anchor_sigma: float = 1e-6
    prior_log_scale_sigma: float = 1.0
    relinearize_threshold: float = 0.01
    relinearize_skip: int = 1
    iterations_after_loop: int = 10
    loop_tolerance: float = 1e-5
    batch_max_iterations: int = 100
    batch_relative_tol: float = 1e-10

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"PoseGraphConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.robust_kernel not in bridge.ROBUST_KERNELS:
            raise ValueError(f"PoseGraphConfig.robust_kernel must be one of {bridge.ROBUST_KERNELS}, "
                             f"got {self.robust_kernel!r}")
        for name in ("robust_param", "anchor_sigma", "prior_log_scale_sigma", "relinearize_threshold",
                     "loop_tolerance", "batch_relative_tol"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"PoseGraphConfig.{name} must be finite and > 0, got {value!r}")
        for name, low in (("relinearize_skip", 1), ("iterations_after_loop", 0), ("batch_max_iterations", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"PoseGraphConfig.{name} must be an int >= {low}, got {value!r}")

    @property
    def dim(self) -> int:
        return 7 if self.mode == "sim3" else 6


class PoseGraph:
    """Keyframe pose graph (module text). Not thread-safe: one owner calls it."""

    def __init__(self, config: PoseGraphConfig | None = None) -> None:
        self.config = config or PoseGraphConfig()
        self._sim3 = self.config.mode == "sim3"
        self._isam = bridge.isam2(self.config.relinearize_threshold, self.config.relinearize_skip)
        self._all = bridge.new_graph()  # every factor, for batch_solve
        self._pending_graph, self._pending_values = bridge.new_graph(), bridge.new_values()
        self._pending_loops: set[int] = set()  # ends of loops added since the last update
        self._estimate = None  # iSAM2's estimate (gtsam Values), computed on demand
        self._odom: dict[int, Sim3] = {}  # insertion order = keyframe order
        self._factors: list[FactorRecord] = []
        self._parts = _Components()  # which keyframes the edges connect, and which parts are held
        self.newest: int | None = None  # index of the last keyframe added (None while empty)
        self.last_solve_seconds = 0.0  # wall time of the last ``update`` or ``batch_solve`` (0 before the first)
        self.last_iterations = 0  # iSAM2 iterations of the last ``update`` (more after a loop; 0 after a batch)

    # ------------------------------------------------------------------ queries
    @property
    def node_count(self) -> int:
        return len(self._odom)

    def edge_counts(self) -> dict[str, int]:
        """Number of factors of each kind (``records.KINDS``)."""
        return dict(Counter(f.kind for f in self._factors))

    def odom_pose(self, index: int) -> Sim3:
        """The pose the stream gave keyframe ``index`` (odom frame)."""
        return self._odom[self._known(index)]

    def pose(self, index: int) -> Sim3:
        """Optimised camera-to-map pose of ``index`` after the last solve (a keyframe added
        since is reported at its initial guess: the newest correction applied to its odom pose)."""
        key = self._known(index)
        if self._pending_values.exists(key):
            return bridge.value_at(self._pending_values, key, self._sim3)
        if self._estimate is not None:
            return bridge.value_at(self._estimate, key, self._sim3)
        return bridge.from_gtsam(self._isam_value(key), self._sim3)  # one variable, not all

    def poses(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices [N] int64, Sim(3) matrices [N, 4, 4] ``[[s·R, t], [0, 1]]``) of every keyframe."""
        keys = list(self._odom)
        estimate = self._current()
        mats = [bridge.matrix_at(self._pending_values if self._pending_values.exists(k) else estimate, k, self._sim3)
                for k in keys]
        return np.array(keys, dtype=np.int64), np.array(mats).reshape(-1, 4, 4)

    def correction(self, index: int | None = None) -> Sim3:
        """``T_map_odom = T_map_kf · inv(T_odom_kf)`` at keyframe ``index`` (default the newest);
        identity while the graph is empty."""
        if index is None:
            if self.newest is None:
                return Sim3.identity()
            index = self.newest
        return self.pose(index) @ self.odom_pose(index).inverse()

    # ------------------------------------------------------------------ building
    def add_keyframe(self, index: int, pose, scale: float = 1.0) -> None:
        """Add keyframe ``index`` with its odom-frame camera-to-world ``pose`` (``Sim3``, or a rigid
        [4, 4] with ``scale``). Its initial map pose is the newest correction times ``pose``; the
        first keyframe gets the anchor (``PoseGraphConfig.anchor``)."""
        index = self._new_index(index)
        odom = pose if isinstance(pose, Sim3) else Sim3.from_pose(pose, scale, f"pose of keyframe {index}")
        if isinstance(pose, Sim3) and scale != 1.0:
            raise ValueError(f"keyframe {index}: pass the scale inside the Sim3, not also as scale={scale}")
        _check_scale(self._sim3, odom, f"pose of keyframe {index}")
        initial = self.correction() @ odom
        self._insert_node(index, odom, initial)
        if self.config.anchor and len(self._odom) == 1:
            cov = np.eye(self.config.dim) * self.config.anchor_sigma ** 2
            self._add(FactorRecord("anchor", index, -1, odom, cov))

    def add_odometry(self, i: int, j: int, sigmas=None, covariance=None, relative_pose: Sim3 | None = None) -> None:
        """Relative constraint from the stream between keyframes ``i`` and ``j``; ``relative_pose``
        defaults to ``odom_i⁻¹·odom_j``. Give ``sigmas`` [d] or ``covariance`` [d, d] (d = 7 in
        sim3 mode, 6 in se3; GTSAM tangent order, ``EdgeNoise.sigmas``)."""
        self._between("odometry", i, j, relative_pose, sigmas, covariance, robust=False)

    def add_restart(self, i: int, j: int, sigmas=None, covariance=None, relative_pose: Sim3 | None = None) -> None:
        """A window-restart alignment between ``i`` (old window) and ``j`` (new): as ``add_odometry``."""
        self._between("restart", i, j, relative_pose, sigmas, covariance, robust=False)

    def add_loop(self, i: int, j: int, relative_pose: Sim3, sigmas=None, covariance=None) -> None:
        """A verified loop: ``relative_pose`` = ``X_i⁻¹·X_j`` (j seen from i, in i's units, scale =
        j's units per i's), under the robust kernel."""
        if relative_pose is None:
            raise ValueError(f"loop ({i}, {j}) needs its measured relative pose")
        self._between("loop", i, j, relative_pose, sigmas, covariance, robust=True)

    def add_prior(self, index: int, pose, covariance, robust: bool = False,
                  log_scale_sigma: float | None = None) -> None:
        """Absolute camera-to-map ``pose`` (``Sim3`` or rigid [4, 4], map units) of ``index`` with a
        ROS covariance (6×6 or 36 values: x y z, then rotations about the map's fixed x y z axes;
        ``noise.ros_to_tangent_jacobian``); in sim3 mode the
        log-scale gets ``log_scale_sigma`` (default ``PoseGraphConfig.prior_log_scale_sigma``)."""
        key = self._known(index)
        value = pose if isinstance(pose, Sim3) else Sim3.from_pose(pose, 1.0, f"prior pose of keyframe {key}")
        _check_scale(self._sim3, value, f"prior pose of keyframe {key}")
        if not self._sim3 and log_scale_sigma is not None:
            raise ValueError(f"prior of keyframe {key}: an se3 graph has no scale to give log_scale_sigma for")
        sigma = (self.config.prior_log_scale_sigma if log_scale_sigma is None else log_scale_sigma) \
            if self._sim3 else None
        self._add(FactorRecord("prior", key, -1, value, ros_covariance_to_tangent(value, covariance, sigma),
                               robust=bool(robust)))

    # ------------------------------------------------------------------ solving
    def update(self) -> float:
        """Run iSAM2 on what was added since the last call (1 iteration, 1 + ``iterations_after_loop``
        when a loop was added); returns the wall time in seconds. A keyframe not connected to an
        anchor or prior is refused (ValueError) and nothing is applied."""
        loose = self._parts.ungrounded(int(k) for k in self._pending_values.keys())
        if loose:
            raise ValueError(f"keyframes {loose[:10]} are connected to no anchor or prior: add their "
                             "odometry or a prior first (nothing was applied)")
        start = time.perf_counter()
        self._isam.update(self._pending_graph, self._pending_values)
        self._pending_graph, self._pending_values = bridge.new_graph(), bridge.new_values()
        self.last_iterations = 1 + (self._iterate_loop(sorted(self._pending_loops)) if self._pending_loops else 0)
        self._pending_loops, self._estimate = set(), None
        self.last_solve_seconds = time.perf_counter() - start
        LOG.debug("pose graph update: %d keyframes, %.2f ms", self.node_count, 1e3 * self.last_solve_seconds)
        return self.last_solve_seconds

    def batch_solve(self) -> float:
        """Re-solve the whole graph with Levenberg–Marquardt from the current estimate, then restart
        iSAM2 from the result; returns the wall time in seconds."""
        loose = self._parts.ungrounded(int(k) for k in self._pending_values.keys())
        if loose:
            raise ValueError(f"keyframes {loose[:10]} are connected to no anchor or prior")
        start = time.perf_counter()
        initial = bridge.new_values()
        for key in self._odom:
            initial.insert(key, bridge.to_gtsam(self.pose(key), self._sim3))
        result = bridge.levenberg_marquardt(self._all, initial, self.config.batch_max_iterations,
                                            self.config.batch_relative_tol)
        self._isam = bridge.isam2(self.config.relinearize_threshold, self.config.relinearize_skip)
        self._isam.update(self._all, result)
        self._pending_graph, self._pending_values = bridge.new_graph(), bridge.new_values()
        self._pending_loops, self._estimate = set(), result
        self.last_iterations = 0
        self.last_solve_seconds = time.perf_counter() - start
        return self.last_solve_seconds

    # ------------------------------------------------------------------ serialisation
    def to_arrays(self) -> dict[str, np.ndarray]:
        """Nodes, factors, current estimate and config as numpy arrays (``records.records_to_arrays``
        plus ``config_json``, a 0-d string array)."""
        keys = list(self._odom)
        out = records_to_arrays(keys, [self._odom[k] for k in keys], [self.pose(k) for k in keys],
                                self._factors, self.config.dim)
        out["config_json"] = np.array(json.dumps(asdict(self.config)))
        return out

    @classmethod
    def from_arrays(cls, arrays) -> "PoseGraph":
        """Rebuild from ``to_arrays``: the same factors, and the stored estimate reported as is
        until the next ``update`` (which re-solves from it)."""
        graph = cls(PoseGraphConfig(**json.loads(str(np.asarray(arrays["config_json"])))))
        nodes, odom, estimate, factors = records_from_arrays(arrays)
        for key, odom_pose, value in zip(nodes, odom, estimate):
            graph._insert_node(graph._new_index(key), odom_pose, value)
        for record in factors:
            graph._add(record)
        graph._pending_loops = set()
        return graph

    def to_se3(self, metres_per_unit: float) -> "PoseGraph":
        """An SE(3) graph in metres from this Sim(3) graph's estimate (module text)."""
        from .metric import se3_records

        if not self._sim3:
            raise ValueError("to_se3 needs a sim3 graph")
        keys = list(self._odom)
        estimate = {k: self.pose(k) for k in keys}
        config = PoseGraphConfig(**{**asdict(self.config), "mode": "se3"})
        nodes, factors = se3_records(self._odom, estimate, self._factors, metres_per_unit)
        graph = PoseGraph(config)
        for key in keys:
            graph._insert_node(graph._new_index(key), nodes[key][0], nodes[key][1])
        for record in factors:
            graph._add(record)
        graph._pending_loops = set()
        return graph

    # ------------------------------------------------------------------ internals
    def _current(self):
        """iSAM2's whole estimate (all keyframes: O(N), kept until the next update)."""
        if self._estimate is None:
            self._estimate = self._isam.calculateEstimate()
        return self._estimate

    def _known(self, index) -> int:
        if index not in self._odom:
            raise ValueError(f"unknown keyframe {index!r} (the graph has {self.node_count} keyframes)")
        return int(index)

    def _new_index(self, index) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise ValueError(f"keyframe index must be an int >= 0, got {index!r}")
        if int(index) in self._odom:
            raise ValueError(f"duplicate keyframe {int(index)}: already in the graph")
        return int(index)

    def _insert_node(self, index: int, odom: Sim3, initial: Sim3) -> None:
        self._odom[index] = odom
        self._parts.add(index)
        self._pending_values.insert(index, bridge.to_gtsam(initial, self._sim3))
        self.newest = index

    def _between(self, kind, i, j, rel, sigmas, covariance, robust: bool) -> None:
        i, j = self._known(i), self._known(j)
        if i == j:
            raise ValueError(f"{kind} edge from keyframe {i} to itself")
        if rel is None:
            rel = relative(self._odom[i], self._odom[j])
        elif not isinstance(rel, Sim3):
            raise ValueError(f"{kind} ({i}, {j}): relative_pose must be a Sim3, got {type(rel).__name__}")
        _check_scale(self._sim3, rel, f"{kind} ({i}, {j}) relative pose")
        cov = _covariance(self.config.dim, sigmas, covariance, f"{kind} ({i}, {j})")
        self._add(FactorRecord(kind, i, j, rel, cov, robust=robust))

    def _add(self, record: FactorRecord) -> None:
        if record.covariance.shape[0] != self.config.dim:
            raise ValueError(f"{record.kind} factor covariance is {record.covariance.shape}; "
                             f"a {self.config.mode} graph needs [{self.config.dim}, {self.config.dim}]")
        item = bridge.factor(record, self._sim3, self.config.robust_kernel, self.config.robust_param)
        self._pending_graph.add(item)
        self._all.add(item)
        self._factors.append(record)
        if record.kind == "loop":
            self._pending_loops |= {record.i, record.j}
        if record.j < 0:
            self._parts.ground(record.i)
        else:
            self._parts.join(record.i, record.j)

    def _iterate_loop(self, ends: list[int]) -> int:
        """Extra iSAM2 iterations until no loop end moves more than ``loop_tolerance``; returns
        how many ran."""
        before = [self._isam_value(k) for k in ends]
        for done in range(1, self.config.iterations_after_loop + 1):
            self._isam.update()
            after = [self._isam_value(k) for k in ends]
            moved = max(float(np.linalg.norm(a.localCoordinates(b))) for a, b in zip(before, after))
            if moved < self.config.loop_tolerance:
                return done
            before = after
        return self.config.iterations_after_loop

    def _isam_value(self, key: int):
        if self._sim3:
            return self._isam.calculateEstimateSimilarity3(key)
        return self._isam.calculateEstimatePose3(key)



def _check_scale(sim3: bool, value: Sim3, what: str) -> None:
    if not sim3 and abs(value.scale - 1.0) > 1e-12:
        raise ValueError(f"{what} has scale {value.scale:.9g}; an se3 graph takes scale 1 only")


def _covariance(dim: int, sigmas, covariance, what: str) -> np.ndarray:
    if (sigmas is None) == (covariance is None):
        raise ValueError(f"{what}: give exactly one of sigmas [{dim}] or covariance [{dim}, {dim}]")
    if sigmas is not None:
        return np.diag(check_sigmas(sigmas, f"{what} sigmas", dim) ** 2)
    return check_covariance(covariance, f"{what} covariance", dim)


class _Components:
    """Union-find over the keyframes the edges connect, and which connected parts hold a unary
    factor (an anchor or a prior): a part without one floats and needs one before a solve."""

    def __init__(self) -> None:
        self._root: dict[int, int] = {}
        self._grounded: set[int] = set()  # roots of grounded parts

    def add(self, key: int) -> None:
        self._root[key] = key

    def ground(self, key: int) -> None:
        self._grounded.add(self._find(key))

    def join(self, a: int, b: int) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self._root[ra] = rb
            if ra in self._grounded:
                self._grounded.add(rb)

    def ungrounded(self, keys) -> list[int]:
        return [k for k in keys if self._find(k) not in self._grounded]

    def _find(self, key: int) -> int:
        root = key
        while self._root[root] != root:
            root = self._root[root]
        while self._root[key] != root:  # path compression
            self._root[key], key = root, self._root[key]
        return root
