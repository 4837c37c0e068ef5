"""Metric scale of the model's world: ``s = metres / model unit`` (numpy only, no ROS).

The model's poses and depths are in its own units (metre-like, not guaranteed metric;
SPEC §6). A robot usually knows metres from somewhere else; three sources share one
interface (``ScaleSource``):

* ``OdometryScaleEstimator``: the same body point (camera optical centre, or the base
  with the extrinsic applied) seen by the model and by the robot's odometry at the image
  stamp. Each sample is the ratio of the lengths of one motion increment,
  ``|Δp_odom| / |Δp_model|``. Lengths are invariant under the rigid rotation between the
  odometry frame and the model's world, so no rotation has to be estimated, and the
  ratio is exactly ``s`` for noise-free data.
* ``DepthScaleEstimator``: a depth sensor registered to the colour image; each frame
  gives the median of ``sensor / model`` over confident pixels.
* ``FixedScale``: a value the operator knows.

The robust fit behind both estimators, the held value and the refit per long-stream window:
``robot.scale_fit``.
"""
from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..io.preprocess import target_size
from .scale_fit import FitConfig, RobustRatioScale, finite, require


# ----------------------------------------------------------------------------- protocol

@runtime_checkable
class ScaleSource(Protocol):
    """What the node reads from any scale source (all three classes below)."""

    @property
    def scale(self) -> float | None:
        """Published metres per model unit; None until converged."""

    @property
    def spread(self) -> float:
        """Relative spread of the samples behind ``scale`` (0 = exact; NaN before any fit)."""

    @property
    def converged(self) -> bool:
        """Whether ``scale`` is set (it then holds until ``reset``)."""

    @property
    def samples(self) -> int:
        """Samples in the current window."""

    @property
    def source(self) -> str:
        """"odometry", "depth" or "fixed"."""

    def reset(self) -> None:
        """Forget everything (a new sequence)."""

    def restart_window(self) -> None:
        """The long stream restarted its window: refit, keep publishing the held value."""

    def as_status(self) -> dict[str, Any]:
        """Flat dict of plain Python values for logs / diagnostics / a status message."""


# ----------------------------------------------------------------------------- odometry

class OdometryScaleEstimator(RobustRatioScale):
    """Scale from motion increments of one body point seen by the model and by odometry.

    Feed every frame with ``update(model_position, odom_position)``:

    * ``model_position``: [3] the point in the model's world (model units): the camera
      centre ``c2w[:3, 3]`` (any rigidly rotated frame works too, e.g. the REP-103 map
      ``T_map_cam[:3, 3]``; lengths do not depend on it).
    * ``odom_position``: [3] the same point in the odometry frame (metres) at the image
      stamp: ``(T_odom_base @ T_base_cam)[:3, 3]`` for the camera centre. The caller
      composes the extrinsic; a base position paired with a camera position is wrong
      as soon as the robot turns.

    An increment runs from an anchor pair to the current pair. It becomes a sample when
    the odometry moved at least ``min_motion`` metres since the anchor; the anchor then
    moves to the current pair. Increments where the model moved less than
    ``min_model_motion`` are rejected (the ratio would divide by ~0; a model that does not
    see the motion is not a scale measurement). A stationary robot, or one turning about
    the tracked point, produces no samples and never converges on noise. A non-finite
    input drops the anchor.

    Args:
        window: samples kept (sliding window over accepted increments).
        min_motion: odometry increment length that makes a sample (metres, > 0).
        min_model_motion: smallest model increment accepted (model units, > 0).
        min_samples: inliers needed to converge.
        max_spread: relative spread needed to converge.
        outlier_k: MAD rejection threshold (robust sigmas).
        hold_tolerance: relative change that replaces a held scale.
    """

    SOURCE = "odometry"

    def __init__(self, window: int = 30, min_motion: float = 0.10, min_model_motion: float = 0.01,
                 min_samples: int = 5, max_spread: float = 0.10, outlier_k: float = 3.0,
                 hold_tolerance: float = 0.02) -> None:
        super().__init__(FitConfig(window, min_samples, max_spread, outlier_k, hold_tolerance))
        require(finite(min_motion) and min_motion > 0, f"min_motion must be a finite number > 0, got {min_motion!r}")
        require(finite(min_model_motion) and min_model_motion > 0,
                 f"min_model_motion must be a finite number > 0, got {min_model_motion!r}")
        self.min_motion = float(min_motion)
        self.min_model_motion = float(min_model_motion)
        self._anchor: tuple[np.ndarray, np.ndarray] | None = None

    def update(self, model_position: np.ndarray, odom_position: np.ndarray) -> bool:
        """One frame's pair of positions; returns True when it added a sample.

        Raises:
            ValueError: a position is not 3 numbers (state unchanged).
        """
        m = _point(model_position, "model_position")
        o = _point(odom_position, "odom_position")
        if not (np.isfinite(m).all() and np.isfinite(o).all()):
            self._anchor = None
            return self._reject("non_finite")
        if self._anchor is None:
            self._anchor = (m, o)
            return False
        d_odom = float(np.linalg.norm(o - self._anchor[1]))
        if d_odom < self.min_motion:
            return False  # not moved enough yet: keep the anchor
        d_model = float(np.linalg.norm(m - self._anchor[0]))
        self._anchor = (m, o)
        if d_model < self.min_model_motion:
            return self._reject("model_static")
        return self._add(d_odom / d_model)

    def reset(self) -> None:
        super().reset()
        self._anchor = None

    def restart_window(self) -> None:
        super().restart_window()
        self._anchor = None


def _point(p: Any, name: str) -> np.ndarray:
    arr = np.asarray(p, dtype=np.float64)
    if arr.shape != (3,):
        raise ValueError(f"{name} must be 3 numbers (x, y, z), got shape {arr.shape}")
    return arr


# ----------------------------------------------------------------------------- depth sensor

def depth_to_metres(depth: np.ndarray, uint16_unit: float = 0.001) -> np.ndarray:
    """A depth image as float32 metres with invalid pixels = NaN.

    Args:
        depth: [H, W] ``uint16`` (16UC1, millimetres by ROS convention: times
            ``uint16_unit``) or float (32FC1/64F, metres). 0, NaN and ±inf are invalid.

    Raises:
        ValueError: not 2-D, or another dtype.
    """
    arr = np.asarray(depth)
    if arr.ndim != 2:
        raise ValueError(f"sensor depth must be [H, W], got shape {arr.shape}")
    if arr.dtype == np.uint16:
        out = arr.astype(np.float32) * np.float32(uint16_unit)
    elif np.issubdtype(arr.dtype, np.floating):
        out = arr.astype(np.float32)
    else:
        raise ValueError(f"sensor depth must be uint16 (mm) or float (m), got dtype {arr.dtype}")
    out[~np.isfinite(out) | (out <= 0)] = np.nan
    return out


def resample_nearest(sensor: np.ndarray, model_hw: tuple[int, int], color_hw: tuple[int, int] | None = None
                     ) -> np.ndarray:
    """Nearest-neighbour resample of a registered image onto the model's pixel grid.

    The model input is the colour image (``color_hw``, height × width) resized to width W
    and height ``H' = round(h·W/w/14)·14``, then centre-cropped to the model's H rows
    when ``H' > H`` (SPEC §7). ``sensor`` [Hs, Ws] is registered to that colour image
    and covers the same field of view at any resolution. Model pixel (v, u) takes the
    sensor pixel holding its centre: row ``floor((v + off + ½)·Hs/H')``, column
    ``floor((u + ½)·Ws/W)``, with ``off = (H' − H) // 2``.

    Args:
        sensor: [Hs, Ws] any dtype.
        model_hw: (H, W) of the model's depth map.
        color_hw: (h, w) of the colour image the model saw; default the sensor's size.

    Returns:
        [H, W] of the sensor's dtype.
    """
    sensor = np.asarray(sensor)
    rows, cols = _nearest_index(sensor.shape[:2], tuple(model_hw), tuple(color_hw or sensor.shape[:2]))
    return sensor[rows[:, None], cols[None, :]]


def _nearest_index(sensor_hw: tuple[int, int], model_hw: tuple[int, int], color_hw: tuple[int, int]):
    (hs, ws), (h, w), (ch, cw) = sensor_hw, model_hw, color_hw
    _, h_resized = target_size(cw, ch, w)
    if h_resized < h or (h_resized > h and h != w):
        raise ValueError(f"a {cw}x{ch} (WxH) colour image is not what a {w}x{h} model input comes from "
                         f"(resized to {w}x{h_resized}{'' if h_resized <= w else f', cropped to {w}x{w}'})")
    off = (h_resized - h) // 2
    rows = np.minimum(((np.arange(h) + off + 0.5) * hs / h_resized).astype(np.int64), hs - 1)
    cols = np.minimum(((np.arange(w) + 0.5) * ws / w).astype(np.int64), ws - 1)
    return rows, cols


class DepthScaleEstimator(RobustRatioScale):
    """Scale from a depth sensor registered to the colour image.

    Per frame (``update``): the sensor depth in metres is resampled onto the model's
    depth grid (``resample_nearest``); pixels count when the model's confidence exceeds
    ``conf_threshold``, both depths are finite and > 0 and the sensor depth lies in
    ``[min_depth, max_depth]``; with at least ``min_pixels`` of them the frame's sample is
    ``median(sensor / model)``. Samples are smoothed over frames by the robust fit (a
    running median over ``window`` frames with MAD outlier rejection).

    Args:
        conf_threshold: model confidence (≥ 1) a pixel needs (strictly above).
        window, min_samples, max_spread, outlier_k, hold_tolerance: the fit (frames).
        min_pixels: valid pixels a frame needs to give a sample.
        min_depth, max_depth: sensor range trusted (metres).
        uint16_unit: metres per unit of a uint16 (16UC1) image.
        pixel_step: use every ``pixel_step``-th row and column (speed; 1 = all).
    """

    SOURCE = "depth"

    def __init__(self, conf_threshold: float = 1.5, window: int = 15, min_samples: int = 3,
                 max_spread: float = 0.05, outlier_k: float = 3.0, hold_tolerance: float = 0.02,
                 min_pixels: int = 200, min_depth: float = 0.1, max_depth: float = 10.0,
                 uint16_unit: float = 0.001, pixel_step: int = 2) -> None:
        super().__init__(FitConfig(window, min_samples, max_spread, outlier_k, hold_tolerance))
        require(finite(conf_threshold), f"conf_threshold must be a finite number, got {conf_threshold!r}")
        require(isinstance(min_pixels, int) and min_pixels >= 1, f"min_pixels must be an integer >= 1, got {min_pixels!r}")
        require(finite(min_depth) and min_depth >= 0, f"min_depth must be a finite number >= 0, got {min_depth!r}")
        require(finite(max_depth) and max_depth > min_depth,
                 f"max_depth must be a finite number > min_depth={min_depth!r}, got {max_depth!r}")
        require(finite(uint16_unit) and uint16_unit > 0, f"uint16_unit must be a finite number > 0, got {uint16_unit!r}")
        require(isinstance(pixel_step, int) and pixel_step >= 1, f"pixel_step must be an integer >= 1, got {pixel_step!r}")
        self.conf_threshold = float(conf_threshold)
        self.min_pixels, self.min_depth, self.max_depth = min_pixels, float(min_depth), float(max_depth)
        self.uint16_unit, self.pixel_step = float(uint16_unit), pixel_step
        self.last_pixels = 0

    def update(self, model_depth: np.ndarray, confidence: np.ndarray, sensor_depth: np.ndarray,
               color_hw: tuple[int, int] | None = None) -> bool:
        """One frame; returns True when it added a sample.

        Args:
            model_depth: [H, W] the model's z-depth (model units).
            confidence: [H, W] its confidence (≥ 1).
            sensor_depth: [Hs, Ws] uint16 millimetres or float metres, registered to the
                colour image (see ``resample_nearest``).
            color_hw: (h, w) of the colour image; default the sensor depth's size.

        Raises:
            ValueError: shapes or dtype that do not fit (state unchanged).
        """
        model = np.asarray(model_depth)
        conf = np.asarray(confidence)
        if model.ndim != 2 or conf.shape != model.shape:
            raise ValueError(f"model depth and confidence must both be [H, W], got {model.shape} and {conf.shape}")
        sensor = resample_nearest(depth_to_metres(sensor_depth, self.uint16_unit), model.shape, color_hw)
        step = self.pixel_step
        model, conf, sensor = model[::step, ::step], conf[::step, ::step], sensor[::step, ::step]
        with np.errstate(invalid="ignore"):
            ok = (conf > self.conf_threshold) & (model > 0) & np.isfinite(model)
            ok &= (sensor >= self.min_depth) & (sensor <= self.max_depth)
        self.last_pixels = int(np.count_nonzero(ok))
        if self.last_pixels < self.min_pixels:
            return self._reject("few_pixels")
        ratio = float(np.median(sensor[ok].astype(np.float64) / model[ok]))
        if not (math.isfinite(ratio) and ratio > 0):
            return self._reject("non_finite")
        return self._add(ratio)

    def as_status(self) -> dict[str, Any]:
        return {**super().as_status(), "last_pixels": self.last_pixels}


# ----------------------------------------------------------------------------- fixed

class FixedScale:
    """A known scale (metres per model unit): always converged, spread 0."""

    def __init__(self, value: float) -> None:
        require(finite(value) and value > 0, f"fixed scale must be a finite number > 0, got {value!r}")
        self._value = float(value)

    @property
    def scale(self) -> float:
        return self._value

    @property
    def spread(self) -> float:
        return 0.0

    @property
    def converged(self) -> bool:
        return True

    @property
    def samples(self) -> int:
        return 0

    @property
    def source(self) -> str:
        return "fixed"

    def reset(self) -> None:
        """Nothing to forget."""

    def restart_window(self) -> None:
        """Nothing to refit."""

    def as_status(self) -> dict[str, Any]:
        return {"source": "fixed", "scale": self._value, "converged": True, "spread": 0.0, "samples": 0}


# ----------------------------------------------------------------------------- applying it

def apply_scale(T: np.ndarray, s: float) -> np.ndarray:
    """Poses [..., 4, 4] (rigid, e.g. ``T_map_cam``) with translations times ``s``.

    Rotations are unchanged: the world is scaled about its origin, the same map as
    ``scale_points``. Compose metric extrinsics (``T_cam_base``) *after* scaling.
    Returns a new float64 array.
    """
    out = np.array(T, dtype=np.float64, copy=True)
    if out.shape[-2:] != (4, 4):
        raise ValueError(f"poses must be [..., 4, 4], got shape {out.shape}")
    out[..., :3, 3] *= s
    return out


def scale_points(points: np.ndarray, s: float) -> np.ndarray:
    """World points [..., 3] times ``s`` (dtype kept for float inputs)."""
    p = np.asarray(points)
    return p * np.asarray(s, dtype=p.dtype if np.issubdtype(p.dtype, np.floating) else np.float64)


def scale_depth(depth: np.ndarray, s: float) -> np.ndarray:
    """Z-depth [..., H, W] times ``s`` (dtype kept for float inputs)."""
    return scale_points(depth, s)


__all__ = [
    "DepthScaleEstimator",
    "FixedScale",
    "OdometryScaleEstimator",
    "ScaleSource",
    "apply_scale",
    "depth_to_metres",
    "resample_nearest",
    "scale_depth",
    "scale_points",
]
