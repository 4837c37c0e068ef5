"""Our values to GTSAM's and back: the one module of the slam package that imports ``gtsam``
(lazily, inside functions, so the package imports without it).

Checked in the GTSAM 4.3 Python wheel: ``Similarity3``, ``BetweenFactorSimilarity3``,
``PriorFactorSimilarity3`` and ``Values.insert/atSimilarity3`` are wrapped, and ISAM2 and
Levenberg–Marquardt optimise them like ``Pose3``. ``Similarity3(R, t_g, s)`` maps
``p ↦ s·(R·p + t_g)``; our ``Sim3(R, t, s)`` maps ``p ↦ s·R·p + t``, so ``t_g = t / s``. Its
tangent is (ω rotation, u translation, λ log-scale), perturbed on the right.
"""
from __future__ import annotations

from .records import FactorRecord
from .sim3 import Sim3

ROBUST_KERNELS = ("cauchy", "huber", "dcs", "none")


def gtsam_module():
    """``import gtsam`` with an install hint when it is missing."""
    try:
        import gtsam
    except ImportError as exc:  # pragma: no cover - the test environment installs it
        raise ImportError("the pose graph needs GTSAM's Python wheel: pip install gtsam "
                          "(or pip install lingbot_map_ros[slam])") from exc
    return gtsam


def to_gtsam(value: Sim3, sim3: bool):
    """``Similarity3`` (``sim3``) or ``Pose3`` (the scale must then be 1)."""
    gtsam = gtsam_module()
    rot = gtsam.Rot3(value.rotation)
    if sim3:
        return gtsam.Similarity3(rot, value.translation / value.scale, value.scale)
    return gtsam.Pose3(rot, value.translation)


def from_gtsam(value, sim3: bool) -> Sim3:
    if sim3:
        scale = float(value.scale())
        return Sim3(value.rotation().matrix(), scale * value.translation(), scale)
    return Sim3(value.rotation().matrix(), value.translation(), 1.0)


def value_at(values, key: int, sim3: bool) -> Sim3:
    return from_gtsam(values.atSimilarity3(key) if sim3 else values.atPose3(key), sim3)


def matrix_at(values, key: int, sim3: bool):
    """[4, 4] ``[[s·R, t], [0, 1]]`` of ``key`` without building a checked ``Sim3`` (bulk reads)."""
    if not sim3:
        return values.atPose3(key).matrix()
    mat = values.atSimilarity3(key).matrix()  # [[R, t/s], [0, 1/s]]
    return mat / mat[3, 3]


def noise_model(record: FactorRecord, kernel: str, param: float):
    """Gaussian noise of ``record.covariance``, wrapped in the robust kernel when ``record.robust``."""
    gtsam = gtsam_module()
    gaussian = gtsam.noiseModel.Gaussian.Covariance(record.covariance)
    if not record.robust or kernel == "none":
        return gaussian
    estimator = {"cauchy": gtsam.noiseModel.mEstimator.Cauchy,
                 "huber": gtsam.noiseModel.mEstimator.Huber,
                 "dcs": gtsam.noiseModel.mEstimator.DCS}[kernel].Create(param)
    return gtsam.noiseModel.Robust.Create(estimator, gaussian)


def factor(record: FactorRecord, sim3: bool, kernel: str, param: float):
    """The GTSAM factor of ``record``: a prior (unary, ``record.j < 0``) or a between factor."""
    gtsam = gtsam_module()
    measured = to_gtsam(record.measurement, sim3)
    noise = noise_model(record, kernel, param)
    if record.j < 0:
        cls = gtsam.PriorFactorSimilarity3 if sim3 else gtsam.PriorFactorPose3
        return cls(record.i, measured, noise)
    cls = gtsam.BetweenFactorSimilarity3 if sim3 else gtsam.BetweenFactorPose3
    return cls(record.i, record.j, measured, noise)


def isam2(relinearize_threshold: float, relinearize_skip: int):
    gtsam = gtsam_module()
    params = gtsam.ISAM2Params()
    params.setRelinearizeThreshold(relinearize_threshold)
    params.relinearizeSkip = relinearize_skip
    # check for relinearisation only the variables of the cliques an update touches (else every
    # variable, every update: O(N) per keyframe)
    params.enablePartialRelinearizationCheck = True
    return gtsam.ISAM2(params)


def levenberg_marquardt(graph, initial, max_iterations: int, relative_tol: float):
    """Batch LM from ``initial``; returns the optimised ``Values``."""
    gtsam = gtsam_module()
    params = gtsam.LevenbergMarquardtParams()
    params.setMaxIterations(max_iterations)
    params.setRelativeErrorTol(relative_tol)
    params.setAbsoluteErrorTol(0.0)
    return gtsam.LevenbergMarquardtOptimizer(graph, initial, params).optimize()


def new_graph():
    return gtsam_module().NonlinearFactorGraph()


def new_values():
    return gtsam_module().Values()
