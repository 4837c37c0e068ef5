"""A camera's tracking health as the engine uses it: ``TrackingJudge``.

Every processed frame updates ``robot.health.TrackingHealth`` with the valid fraction of its
(subsampled) confidence and the model's own pose; a non-finite pose or depth marks it
(``non_finite`` -> lost). Its thresholds are the ``health_*`` settings (read again when the
settings change). ~/status carries the state and the reasons, each ``FrameOutput`` the 6x6
pose covariance it implies; with ``on_lost=reset`` the engine starts a new sequence when the
state becomes lost (counted here in ``lost_resets``). Changes of state are logged. Inference
thread only; no ROS."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..robot.health import HealthStatus, TrackingHealth, TrackingState, config_from_parameters
from .frames import Logger
from .status import Tracking


class TrackingJudge:
    """``health`` (the thresholds are the ``health_*`` settings), the ``reasons`` of its last
    judgement and ``lost_resets`` (cleared by ~/reset only)."""

    def __init__(self, settings: Any, log: Logger) -> None:
        self.health = TrackingHealth(config_from_parameters(settings))
        self.log = log
        self.reasons: tuple[str, ...] = ()
        self.lost_resets = 0

    @property
    def state(self) -> TrackingState:
        return self.health.state

    def judge(self, valid_fraction: float | None, c2w: np.ndarray | None, finite: bool = True) -> HealthStatus:
        """Update the health with one frame (``c2w`` [4, 4] in model units, OpenCV world)."""
        status = self.health.update(valid_fraction, c2w, finite=finite)
        self.reasons = status.reasons
        if status.changed:
            text = f"tracking {status.state.value}" + (f" ({', '.join(status.reasons)})" if status.reasons else "")
            if status.state in (TrackingState.DEGRADED, TrackingState.LOST):  # rclpy: one severity per call site
                self.log.warning(text)
            else:
                self.log.info(text)
        return status

    def lost_reason(self, on_lost: str) -> str | None:
        """With ``on_lost`` reset or relocalize and a lost track: why it is lost (counted in
        ``lost_resets``); else None."""
        if on_lost not in ("reset", "relocalize") or self.health.state != TrackingState.LOST:
            return None
        self.lost_resets += 1
        return ", ".join(self.reasons) or "lost"

    def summary(self, anchor: Any, scale_source: str) -> Tracking:
        """What ~/status says about tracking: the health, and the scale of ``anchor`` (``MapAnchor``)."""
        spread, converged = anchor.status()
        return Tracking(self.health.state.value, self.reasons, self.lost_resets, anchor.applied_scale, scale_source,
                        spread, converged)

    def reconfigure(self, settings: Any) -> None:
        config = config_from_parameters(settings)  # checked when the settings were made
        if config != self.health.config:
            self.health.reconfigure(config)

    def clear(self) -> None:
        """A new sequence: the health starts again (``lost_resets`` stays)."""
        self.health.reset()
        self.reasons = ()


__all__ = ["TrackingJudge"]
