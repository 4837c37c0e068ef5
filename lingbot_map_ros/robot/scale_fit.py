"""The robust fit of ratio samples behind the metric scale estimators (``robot.scale``), numpy only.

Robust fit (both estimators): the last ``window`` samples; median ``m`` and
``MAD = median |r − m|``; samples further than ``outlier_k · 1.4826 · MAD`` and
``max_spread · m`` from ``m`` are outliers; the estimate is the median of the inliers; ``spread`` is the relative
robust standard deviation of the inliers, ``1.4826 · MAD_inliers / estimate`` (how much
the samples disagree, not a standard error). The fit is *converged* once at least
``min_samples`` inliers agree within ``max_spread``; from then on the published
``scale`` HOLDS: a later converged refit replaces it only when it differs by more than
``hold_tolerance`` (relative), and a refit that is not converged (a burst of bad
samples) never replaces it.

Long-stream window restarts (``restart_window``): the long stream maps each new window
into the global frame with a Sim(3) whose scale comes from a depth ratio over the
overlap frames, so the global frame's unit can drift a little from window to window.
We therefore refit per window: ``restart_window`` drops the samples (they measured the
old window's unit) and the odometry anchor (no increment spans a restart), but keeps
publishing the held scale, still ``converged``, with ``refitting`` set; the first
converged fit of the new window replaces it whatever the difference. ``reset`` forgets
everything (a new sequence: a new world, a new unit).
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ConfigError

log = logging.getLogger("lingbot_map_ros.robot.scale")  # the estimators' logger, as before the split

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this = its standard deviation


def require(cond: bool, message: str) -> None:
    """ConfigError(``message``) unless ``cond``."""
    if not cond:
        raise ConfigError(message)


# ----------------------------------------------------------------------------- robust fit

@dataclass(frozen=True)
class RobustFit:
    """One fit of ratio samples: estimate, relative spread, inliers used, outliers dropped."""

    estimate: float
    spread: float
    inliers: int
    outliers: int


def robust_fit(samples: np.ndarray, outlier_k: float, min_tolerance: float = 0.0) -> RobustFit:
    """Median of the samples within ``outlier_k`` robust sigmas of their median.

    Args:
        samples: [N] positive finite ratios, N ≥ 1.
        outlier_k: rejection threshold in units of ``1.4826 · MAD``.
        min_tolerance: samples within this relative distance of the median are never
            outliers (a few nearly equal samples have a tiny MAD that would otherwise
            reject good ones).
    """
    r = np.asarray(samples, dtype=np.float64)
    m = float(np.median(r))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(r - m)))
    tol = max(outlier_k * sigma, min_tolerance * abs(m), 1e-12 * abs(m))
    inl = r[np.abs(r - m) <= tol]
    est = float(np.median(inl))
    spread = MAD_TO_SIGMA * float(np.median(np.abs(inl - est))) / est
    return RobustFit(est, spread, int(inl.size), int(r.size - inl.size))


@dataclass(frozen=True)
class FitConfig:
    """Shared fit settings (validated by the estimators' constructors)."""

    window: int
    min_samples: int
    max_spread: float
    outlier_k: float
    hold_tolerance: float

    def __post_init__(self) -> None:
        require(isinstance(self.window, int) and self.window >= 1,
                 f"window must be an integer >= 1, got {self.window!r}")
        require(isinstance(self.min_samples, int) and 1 <= self.min_samples <= self.window,
                 f"min_samples must be an integer in [1, window={self.window}], got {self.min_samples!r}")
        require(finite(self.max_spread) and self.max_spread > 0,
                 f"max_spread must be a finite number > 0, got {self.max_spread!r}")
        require(finite(self.outlier_k) and self.outlier_k > 0,
                 f"outlier_k must be a finite number > 0, got {self.outlier_k!r}")
        require(finite(self.hold_tolerance) and self.hold_tolerance >= 0,
                 f"hold_tolerance must be a finite number >= 0, got {self.hold_tolerance!r}")


def finite(x: Any) -> bool:
    """``x`` is a finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RobustRatioScale:
    """Window of ratio samples, robust refit, held value (shared by both estimators)."""

    SOURCE = ""

    def __init__(self, fit: FitConfig) -> None:
        self._fit_cfg = fit
        self._samples: deque[float] = deque(maxlen=fit.window)
        self._held: float | None = None
        self._held_spread = math.nan
        self._last: RobustFit | None = None
        self._refitting = False
        self.rejected: dict[str, int] = {}

    # -- the ScaleSource interface
    @property
    def scale(self) -> float | None:
        return self._held

    @property
    def spread(self) -> float:
        if self._held is not None:
            return self._held_spread
        return self._last.spread if self._last is not None else math.nan

    @property
    def converged(self) -> bool:
        return self._held is not None

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def source(self) -> str:
        return self.SOURCE

    @property
    def estimate(self) -> float | None:
        """The latest fit's value (converged or not); None before any sample."""
        return self._last.estimate if self._last is not None else None

    @property
    def refitting(self) -> bool:
        """True after ``restart_window`` until the new window's fit converges."""
        return self._refitting

    def reset(self) -> None:
        self._samples.clear()
        self._held, self._held_spread, self._last, self._refitting = None, math.nan, None, False
        self.rejected = {}

    def restart_window(self) -> None:
        self._samples.clear()
        self._last = None
        self._refitting = self._held is not None

    def as_status(self) -> dict[str, Any]:
        last = self._last
        return {
            "source": self.source, "scale": self._held, "converged": self.converged, "spread": self.spread,
            "samples": self.samples, "estimate": self.estimate,
            "estimate_spread": last.spread if last is not None else math.nan,
            "inliers": last.inliers if last is not None else 0, "refitting": self._refitting,
            "rejected": dict(self.rejected),
        }

    # -- for the subclasses
    def _reject(self, reason: str) -> bool:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        return False

    def _add(self, ratio: float) -> bool:
        """Append one positive finite ratio sample and refit."""
        self._samples.append(ratio)
        cfg = self._fit_cfg
        fit = robust_fit(np.fromiter(self._samples, dtype=np.float64), cfg.outlier_k, cfg.max_spread)
        self._last = fit
        if fit.inliers < cfg.min_samples or fit.spread > cfg.max_spread:
            return True
        if self._held is None or self._refitting or abs(fit.estimate - self._held) > cfg.hold_tolerance * self._held:
            log.info("%s scale %s: %.6g m/unit (spread %.3g, %d inliers)", self.SOURCE,
                     "updated" if self._held is not None else "converged", fit.estimate, fit.spread, fit.inliers)
            self._held, self._held_spread = fit.estimate, fit.spread
        self._refitting = False
        return True


__all__ = ["MAD_TO_SIGMA", "RobustFit", "robust_fit", "FitConfig", "RobustRatioScale", "require", "finite"]
