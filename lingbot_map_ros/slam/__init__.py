"""Loop-closure maths under the node, without torch or ROS: a keyframe pose graph (GTSAM, imported
lazily), a keyframe place database with descriptors, and the geometric checks of a loop candidate.

* ``sim3``: ``Sim3`` (rotation, translation, scale) and the input checks (ValueError naming the value).
* ``noise``: ``EdgeNoise`` (edge sigmas from a confidence weight), ROS pose covariances → GTSAM tangent.
* ``pose_graph``: ``PoseGraph``, ``PoseGraphConfig`` (iSAM2, batch LM, Sim(3) or SE(3), serialisation).
* ``trajectory``: ``ate`` (Umeyama-aligned RMSE).
* ``places``: ``PlaceDatabase``, ``PlaceConfig`` (nearest keyframes by cosine similarity).
* ``descriptors``: ``token_descriptor`` (model tokens), ``gradient_descriptor``, ``thumbnail_descriptor``.
* ``verify``: ``verify_loop``, ``LoopCheck``, ``DepthView`` (depth reprojection, estimate agreement).
* ``synthetic``: drifting synthetic trajectories (tests, benchmarks).

Poses are camera-to-world, OpenCV optical camera axes, model units unless said.
"""
from __future__ import annotations

from .descriptors import gradient_descriptor, thumbnail_descriptor, token_descriptor
from .noise import HEALTH_WEIGHTS, EdgeNoise, health_weight, ros_covariance_to_tangent, tangent_covariance_to_ros
from .places import PlaceConfig, PlaceDatabase
from .pose_graph import PoseGraph, PoseGraphConfig
from .records import KINDS, FactorRecord
from .sim3 import Sim3, relative
from .trajectory import ate
from .verify import DepthView, LoopCheck, LoopVerdict, verify_loop

__all__ = ["HEALTH_WEIGHTS", "KINDS", "DepthView", "EdgeNoise", "FactorRecord", "LoopCheck", "LoopVerdict",
           "PlaceConfig", "PlaceDatabase", "PoseGraph", "PoseGraphConfig", "Sim3", "ate", "gradient_descriptor",
           "health_weight", "relative", "ros_covariance_to_tangent", "tangent_covariance_to_ros",
           "thumbnail_descriptor", "token_descriptor", "verify_loop"]
