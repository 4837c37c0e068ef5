"""Robot-side helpers with no ROS import: metric scale, tracking health, undistortion.

* ``scale``: the factor ``s = metres / model unit`` from wheel/visual odometry or a depth
  sensor (``OdometryScaleEstimator``, ``DepthScaleEstimator``, ``FixedScale``) and
  ``apply_scale`` helpers for poses, points and depth maps.
* ``health``: ``TrackingHealth``, a per-frame state machine (initializing, tracking,
  degraded, lost) and the heuristic pose covariance published with the odometry.
* ``undistort``: ``Undistorter``, remapping plumb_bob / rational_polynomial /
  equidistant images to a pinhole image before the model (numpy and torch paths).

The node (``lingbot_map_ros.ros``) owns the ROS messages and calls these per frame.
"""
from __future__ import annotations

from .health import HealthConfig, HealthStatus, TrackingHealth, TrackingState
from .scale import (
    DepthScaleEstimator,
    FixedScale,
    OdometryScaleEstimator,
    ScaleSource,
    apply_scale,
    depth_to_metres,
    resample_nearest,
    scale_depth,
    scale_points,
)
from .undistort import DISTORTION_MODELS, CameraModel, Undistorter, distort_points, needs_undistortion, undistort_points

__all__ = [
    "DISTORTION_MODELS",
    "CameraModel",
    "DepthScaleEstimator",
    "FixedScale",
    "HealthConfig",
    "HealthStatus",
    "OdometryScaleEstimator",
    "ScaleSource",
    "TrackingHealth",
    "TrackingState",
    "Undistorter",
    "apply_scale",
    "depth_to_metres",
    "distort_points",
    "needs_undistortion",
    "resample_nearest",
    "scale_depth",
    "scale_points",
    "undistort_points",
]
