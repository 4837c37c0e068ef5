"""Loop-closure maths under the node, without torch or ROS: a keyframe pose graph (GTSAM, imported
lazily), a keyframe place database with descriptors, and the geometric checks of a loop candidate.

* ``sim3``: ``Sim3`` (rotation, translation, scale) and the input checks (ValueError naming the value).
* ``noise``: ``EdgeNoise`` (edge sigmas from a confidence weight), ROS pose covariances → GTSAM tangent.
* ``pose_graph``: ``PoseGraph``, ``PoseGraphConfig`` (iSAM2, batch LM, Sim(3) or SE(3), serialisation).
* ``trajectory``: ``ate`` (Umeyama-aligned RMSE).

Poses are camera-to-world, OpenCV optical camera axes, model units unless said.
"""
from __future__ import annotations

from .noise import HEALTH_WEIGHTS, EdgeNoise, health_weight, ros_covariance_to_tangent, tangent_covariance_to_ros
from .pose_graph import PoseGraph, PoseGraphConfig
from .records import KINDS, FactorRecord
from .sim3 import Sim3, relative
from .trajectory import ate

__all__ = ["HEALTH_WEIGHTS", "KINDS", "EdgeNoise", "FactorRecord", "PoseGraph", "PoseGraphConfig", "Sim3", "ate",
           "health_weight", "relative", "ros_covariance_to_tangent", "tangent_covariance_to_ros"]
