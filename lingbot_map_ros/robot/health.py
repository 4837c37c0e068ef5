"""Tracking health: a per-frame state machine and the odometry covariance it implies.

States: ``initializing`` (after start or ``reset``: no trusted pose yet), ``tracking``,
``degraded`` (outputs published but suspect), ``lost`` (outputs not to be trusted).

Rules (heuristics chosen for a streaming reconstruction model, not derived from it;
thresholds are ``HealthConfig`` fields):

* a frame is *bad* for any of these reasons:
  ``non_finite`` (the caller saw a NaN/inf pose, depth or confidence),
  ``confidence_collapse`` (valid fraction — pixels with confidence above the node's
  threshold — below ``lost_valid_fraction``), ``low_confidence`` (below
  ``degraded_valid_fraction``), ``translation_jump`` (camera-centre step larger than
  ``jump_factor`` × the median of the last ``jump_window`` steps AND larger than
  ``jump_floor``; needs ``jump_min_history`` steps first), ``rotation_jump`` (rotation
  step above ``max_rotation_step_deg``), ``scale_spread`` (the scale source's relative
  spread above ``max_scale_spread``, when given);
* ``non_finite`` → ``lost`` at once; ``confidence_collapse`` on ``lost_after``
  consecutive frames → ``lost``; any other bad frame turns ``tracking`` into
  ``degraded`` (``initializing`` and ``lost`` stay where they are);
* good frames in a row: ``init_frames`` of them leave ``initializing``,
  ``recover_after`` of them bring ``degraded`` or ``lost`` back to ``tracking``; a bad frame
  restarts the count.

The node's ``health_*`` parameters set the main thresholds (``HEALTH_PARAMETERS`` maps them
onto the fields; ``config_from_parameters``); they may change while it runs
(``TrackingHealth.reconfigure`` keeps the state).

Steps are measured between consecutive frames given a pose, in the units of the pose
fed in: feed the model's own pose (model units) so that a change of the metric scale
does not look like a jump; ``jump_floor`` is then in model units.

Covariance (``covariance``): a 6×6 diagonal over (x, y, z, roll, pitch, yaw) as in
``nav_msgs/Odometry``: ``(base_translation_std · s)²`` for x, y, z (``s`` the metric scale
applied to the published pose, 1 when none) and ``base_rotation_std_deg`` (radians)²
for the angles, each times the state's factor (×1 tracking, ×10 degraded, ×100
initializing, ×1000 lost by default). A heuristic that grows with bad health for
consumers such as robot_localization, not a calibrated uncertainty.
"""
from __future__ import annotations

import enum
import logging
import math
import re
import statistics
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

from ..config import ConfigError

log = logging.getLogger(__name__)


class TrackingState(str, enum.Enum):
    INITIALIZING = "initializing"
    TRACKING = "tracking"
    DEGRADED = "degraded"
    LOST = "lost"


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of ``TrackingHealth`` (see the module docstring for the rules)."""

    degraded_valid_fraction: float = 0.20
    lost_valid_fraction: float = 0.05
    lost_after: int = 5
    init_frames: int = 2
    recover_after: int = 3
    jump_factor: float = 5.0
    jump_floor: float = 0.10
    jump_window: int = 10
    jump_min_history: int = 3
    max_rotation_step_deg: float = 30.0
    max_scale_spread: float = 0.20
    base_translation_std: float = 0.02
    base_rotation_std_deg: float = 1.0
    factor_tracking: float = 1.0
    factor_degraded: float = 10.0
    factor_initializing: float = 100.0
    factor_lost: float = 1000.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                         f"{f.name} must be an integer >= 1, got {value!r}")
            else:
                _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                         and value >= 0, f"{f.name} must be a finite number >= 0, got {value!r}")
        _require(self.lost_valid_fraction <= self.degraded_valid_fraction <= 1.0,
                 f"need lost_valid_fraction ({self.lost_valid_fraction}) <= degraded_valid_fraction "
                 f"({self.degraded_valid_fraction}) <= 1")
        _require(self.jump_min_history <= self.jump_window,
                 f"jump_min_history ({self.jump_min_history}) must be <= jump_window ({self.jump_window})")
        for name in ("jump_factor", "max_rotation_step_deg", "base_translation_std", "base_rotation_std_deg",
                     "factor_tracking", "factor_degraded", "factor_initializing", "factor_lost"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)!r}")

    def factor(self, state: TrackingState) -> float:
        """Variance multiplier of ``state``."""
        return getattr(self, f"factor_{state.value}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# The node's parameters that set ``HealthConfig`` fields (the rest keep their defaults).
HEALTH_PARAMETERS: dict[str, str] = {
    "health_degraded_valid_fraction": "degraded_valid_fraction",
    "health_lost_valid_fraction": "lost_valid_fraction",
    "health_lost_after": "lost_after",
    "health_init_frames": "init_frames",
    "health_recover_after": "recover_after",
    "health_jump_factor": "jump_factor",
    "health_jump_floor": "jump_floor",
    "health_max_rotation_deg": "max_rotation_step_deg",
    "health_translation_std": "base_translation_std",
    "health_rotation_std_deg": "base_rotation_std_deg",
}


def config_from_parameters(values: Mapping[str, Any] | Any) -> HealthConfig:
    """``HealthConfig`` from the node's ``health_*`` parameters (a mapping, or an object with
    them as attributes such as ``NodeSettings``; a missing one keeps its default).

    Raises:
        ConfigError: a value or a combination is refused; the message names the parameters
            (``health_lost_valid_fraction``), not the config fields.
    """
    get = values.get if isinstance(values, Mapping) else (lambda name, default: getattr(values, name, default))
    defaults = HealthConfig()
    kwargs = {field: get(param, getattr(defaults, field)) for param, field in HEALTH_PARAMETERS.items()}
    try:
        return HealthConfig(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        for param, field in HEALTH_PARAMETERS.items():
            message = re.sub(rf"\b{field}\b", param, message)
        raise ConfigError(message) from None


@dataclass(frozen=True)
class HealthStatus:
    """Result of one ``TrackingHealth.update``."""

    state: TrackingState
    reasons: tuple[str, ...]  # why this frame was bad (empty = good)
    changed: bool  # the state differs from the previous frame's
    good_run: int  # consecutive good frames, this one included
    collapse_run: int  # consecutive confidence collapses, this one included
    translation_step: float  # camera-centre step from the previous posed frame (pose units; NaN if none)
    rotation_step_deg: float  # rotation from the previous posed frame (degrees; NaN if none)


class TrackingHealth:
    """Per-frame health of the stream (single-threaded; one instance per sequence)."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self._steps: deque[float] = deque(maxlen=self.config.jump_window)
        self.reset()

    @property
    def state(self) -> TrackingState:
        return self._state

    def reconfigure(self, config: HealthConfig) -> None:
        """New thresholds from the next frame on; the state, the runs and the recent steps stay
        (the step history is trimmed to the new ``jump_window``)."""
        self.config = config
        self._steps = deque(self._steps, maxlen=config.jump_window)

    def reset(self) -> None:
        """Back to ``initializing`` with no pose history (a new sequence / world)."""
        self._state = TrackingState.INITIALIZING
        self._good_run = self._collapse_run = 0
        self._prev_pose: np.ndarray | None = None
        self._steps.clear()

    def update(self, valid_fraction: float | None, pose: np.ndarray | None, finite: bool = True,
               scale_spread: float | None = None) -> HealthStatus:
        """Judge one frame.

        Args:
            valid_fraction: fraction (0..1) of pixels with confidence above the node's
                threshold, or None when the frame has no confidence map.
            pose: [4, 4] camera-to-world of the frame in the model's units, or None.
            finite: False when any of the frame's outputs (pose, depth, confidence) was
                non-finite; the pose is then ignored.
            scale_spread: the scale source's relative spread, or None (not judged; NaN
                is treated as None).

        Raises:
            ValueError: ``pose`` is not [4, 4] (state unchanged).
        """
        cfg = self.config
        if pose is not None and finite:
            pose = np.asarray(pose, dtype=np.float64)
            if pose.shape != (4, 4):
                raise ValueError(f"pose must be [4, 4], got shape {pose.shape}")
            finite = bool(np.isfinite(pose).all())
        reasons: list[str] = []
        t_step = r_step = math.nan
        if not finite:
            reasons.append("non_finite")
        else:
            if valid_fraction is not None:
                if not (valid_fraction >= cfg.lost_valid_fraction):  # NaN counts as collapsed
                    reasons.append("confidence_collapse")
                elif valid_fraction < cfg.degraded_valid_fraction:
                    reasons.append("low_confidence")
            if pose is not None:
                t_step, r_step = self._judge_motion(pose, reasons)
            if scale_spread is not None and scale_spread > cfg.max_scale_spread:
                reasons.append("scale_spread")
        self._collapse_run = self._collapse_run + 1 if "confidence_collapse" in reasons else 0
        self._good_run = 0 if reasons else self._good_run + 1
        new = self._next_state(reasons)
        changed = new != self._state
        if changed:  # the caller reports it (the node logs it, throttled); debug here only
            log.debug("tracking %s -> %s (%s)", self._state.value, new.value, ", ".join(reasons) or "good frames")
        self._state = new
        return HealthStatus(new, tuple(reasons), changed, self._good_run, self._collapse_run, t_step, r_step)

    def _judge_motion(self, pose: np.ndarray, reasons: list[str]) -> tuple[float, float]:
        """Translation / rotation step from the previous posed frame; appends jump reasons."""
        cfg = self.config
        prev, self._prev_pose = self._prev_pose, pose
        if prev is None:
            return math.nan, math.nan
        # scalar arithmetic on 3-vectors and 3x3 blocks (NumPy's per-call overhead is most of the cost
        # here, on the path of every frame's pose): the step length, and the angle of prevᵀ·pose
        # from its trace, which is the element-wise product's sum
        t_step = math.dist(pose[:3, 3].tolist(), prev[:3, 3].tolist())
        trace = sum(a * b for a, b in zip(prev[:3, :3].ravel().tolist(), pose[:3, :3].ravel().tolist()))
        r_step = math.degrees(math.acos(min(1.0, max(-1.0, (trace - 1.0) / 2.0))))
        if len(self._steps) >= cfg.jump_min_history:
            median = statistics.median(self._steps)
            if t_step > cfg.jump_factor * median and t_step > cfg.jump_floor:
                reasons.append("translation_jump")
        if r_step > cfg.max_rotation_step_deg:
            reasons.append("rotation_jump")
        self._steps.append(t_step)
        return t_step, r_step

    def _next_state(self, reasons: list[str]) -> TrackingState:
        cfg, state = self.config, self._state
        if "non_finite" in reasons or self._collapse_run >= cfg.lost_after:
            return TrackingState.LOST
        if reasons:
            return TrackingState.DEGRADED if state == TrackingState.TRACKING else state
        if state == TrackingState.INITIALIZING:
            return TrackingState.TRACKING if self._good_run >= cfg.init_frames else state
        if state in (TrackingState.DEGRADED, TrackingState.LOST):
            return TrackingState.TRACKING if self._good_run >= cfg.recover_after else state
        return state

    def covariance(self, scale: float | None = None) -> np.ndarray:
        """[6, 6] diagonal pose covariance (x, y, z in published units², roll, pitch, yaw
        in rad²) for the current state; ``scale`` = metres per model unit applied to the
        published pose (None = model units). Row-major ``.ravel()`` fills
        ``Odometry.pose.covariance``. A heuristic, not a calibrated uncertainty."""
        cfg = self.config
        s = 1.0 if scale is None else float(scale)
        factor = cfg.factor(self._state)
        var_t = (cfg.base_translation_std * s) ** 2 * factor
        var_r = math.radians(cfg.base_rotation_std_deg) ** 2 * factor
        return np.diag([var_t, var_t, var_t, var_r, var_r, var_r])


__all__ = ["HEALTH_PARAMETERS", "HealthConfig", "HealthStatus", "TrackingHealth", "TrackingState",
           "config_from_parameters"]
