"""Robot-side helpers with no ROS import: metric scale, tracking health, undistortion.

* ``scale``: the factor ``s = metres / model unit`` from wheel/visual odometry or a depth
  sensor (``OdometryScaleEstimator``, ``DepthScaleEstimator``, ``FixedScale``) and
  ``apply_scale`` helpers for poses, points and depth maps.
* ``health``: ``TrackingHealth``, a per-frame state machine (initializing, tracking,
  degraded, lost) and the heuristic pose covariance published with the odometry.
* ``undistort``: ``Undistorter``, remapping plumb_bob / rational_polynomial /
  equidistant images to a pinhole image before the model (numpy and torch paths; the
  torch one also resizes and crops to the model input on the session's GPU).
* ``map_offset``: ``OutputTransform`` (scale and map offset of everything published) and
  the odometry alignment that lets a sequence started by ``on_lost=reset`` continue the map.
* ``intrinsics``: ``FocalTracker``, the model's focal lengths in input pixels next to
  ``CameraInfo``'s (diagnostics).

The node (``lingbot_map_ros.ros``) owns the ROS messages and calls these per frame.
"""
from __future__ import annotations

from .health import HEALTH_PARAMETERS, HealthConfig, HealthStatus, TrackingHealth, TrackingState, config_from_parameters
from .intrinsics import FocalTracker, IntrinsicsComparison
from .map_offset import OutputTransform, SequenceAnchor, odometry_alignment
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
    "HEALTH_PARAMETERS",
    "FocalTracker",
    "IntrinsicsComparison",
    "OutputTransform",
    "SequenceAnchor",
    "config_from_parameters",
    "odometry_alignment",
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
