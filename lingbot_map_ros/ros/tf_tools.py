"""TF output of the node: the transform maths (pure numpy, tested) and the broadcaster.

Conventions (REP 105): every ``T_a_b`` is a 4x4 rigid transform mapping points of
frame ``b`` into frame ``a`` (the TF ``a -> b`` with ``a`` the parent). The node
knows ``T_map_cam`` (camera optical frame in the REP-103 map frame, see
``conversions``). Two modes:

- ``map_to_camera``: publish ``map -> base`` with ``T_map_base = T_map_cam · T_cam_base``;
  ``base_frame`` empty means base = the camera optical frame (``T_cam_base = I``). A
  non-empty base_frame needs ``T_cam_base`` from TF (tf2_ros), because on a robot the
  camera frame already has a parent and must not get a second one.
- ``map_to_odom``: a robot's odometry publishes ``odom -> base``; publish
  ``map -> odom`` with ``T_map_odom = T_map_base · inv(T_odom_base)`` at the image stamp,
  so that ``map -> odom -> base`` puts the base where the model sees it. Needs tf2_ros
  for the two look-ups; without it this mode publishes nothing (warning once).

Broadcasting uses tf2_ros where importable, else a plain ``/tf`` publisher of
``tf2_msgs/TFMessage`` where that is importable, else nothing (warning once). Neither
is importable on the pip-only development set-up; robots have both.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..geometry import quaternion_to_matrix
from .worker import Throttle


def transform_to_matrix(transform: Any) -> np.ndarray:
    """4x4 ``T_parent_child`` from a ``geometry_msgs/Transform`` (or ``TransformStamped``)."""
    t = getattr(transform, "transform", transform)
    T = np.eye(4)
    q = t.rotation
    T[:3, :3] = quaternion_to_matrix(np.array([q.x, q.y, q.z, q.w], dtype=np.float64))
    T[:3, 3] = (t.translation.x, t.translation.y, t.translation.z)
    return T


def invert_rigid(T: np.ndarray) -> np.ndarray:
    """Inverse of a rigid 4x4 transform (R^T, -R^T t)."""
    T = np.asarray(T, dtype=np.float64)
    out = np.eye(4)
    out[:3, :3] = T[:3, :3].T
    out[:3, 3] = -T[:3, :3].T @ T[:3, 3]
    return out


def map_to_base(T_map_cam: np.ndarray, T_cam_base: np.ndarray | None = None) -> np.ndarray:
    """``T_map_base = T_map_cam · T_cam_base`` (identity extrinsic when None)."""
    T_map_cam = np.asarray(T_map_cam, dtype=np.float64)
    return T_map_cam if T_cam_base is None else T_map_cam @ np.asarray(T_cam_base, dtype=np.float64)


def map_to_odom(T_map_cam: np.ndarray, T_odom_base: np.ndarray, T_cam_base: np.ndarray | None = None) -> np.ndarray:
    """``T_map_odom = T_map_base · inv(T_odom_base)``: the correction that makes the external
    odometry chain ``map -> odom -> base`` agree with the model's pose of the base."""
    return map_to_base(T_map_cam, T_cam_base) @ invert_rigid(T_odom_base)


class TfOutput:
    """Publishes the node's TF according to ``tf_mode`` (see the module docstring)."""

    def __init__(self, node, settings, warn: Callable[[str], Any]) -> None:
        self.settings = settings
        self._node = node
        self._warn = warn
        self._warned: set[str] = set()
        self._throttle = Throttle(5.0)
        self._send = None
        self._buffer = None
        self._listener = None
        self.backend = "none"
        try:
            import tf2_ros

            self._broadcaster = tf2_ros.TransformBroadcaster(node)
            self._send = self._broadcaster.sendTransform
            self._buffer = tf2_ros.Buffer()
            self._listener = tf2_ros.TransformListener(self._buffer, node)
            self.backend = "tf2_ros"
        except ImportError:
            try:
                from rclpy.qos import QoSProfile
                from tf2_msgs.msg import TFMessage

                pub = node.create_publisher(TFMessage, "/tf", QoSProfile(depth=100))
                self._send = lambda transform: pub.publish(TFMessage(transforms=[transform]))
                self.backend = "tf2_msgs"
            except ImportError:
                pass

    def publish(self, T_map_cam: np.ndarray, stamp: Any, camera_frame: str) -> None:
        from std_msgs.msg import Header

        from .conversions import transform_stamped

        s = self.settings
        if self._send is None:
            self._warn_once("tf-none", "publish_tf is on but neither tf2_ros nor tf2_msgs is importable: "
                                       "no TF is published (poses still go to ~/pose and ~/odometry)")
            return
        base = s.base_frame or camera_frame
        needs_lookup = s.tf_mode == "map_to_odom" or base != camera_frame
        if needs_lookup and self._buffer is None:
            what = "tf_mode map_to_odom" if s.tf_mode == "map_to_odom" else f"base_frame {base!r}"
            self._warn_once("tf-lookup", f"{what} needs transforms from TF (tf2_ros), which is not importable "
                                         "here: no TF is published")
            return
        try:
            T_cam_base = None if base == camera_frame else self._lookup(camera_frame, base, None)
            if s.tf_mode == "map_to_odom":
                T = map_to_odom(T_map_cam, self._lookup(s.odom_frame, base, stamp), T_cam_base)
                parent_child = (s.map_frame, s.odom_frame)
            else:
                T = map_to_base(T_map_cam, T_cam_base)
                parent_child = (s.map_frame, base)
        except LookupFailed as exc:
            self._throttle.emit(self._warn, f"cannot publish TF: {exc}", kind="lookup")
            return
        self._send(transform_stamped(T, Header(stamp=stamp, frame_id=parent_child[0]), parent_child[1]))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._warn(message)

    def _lookup(self, target: str, source: str, stamp: Any) -> np.ndarray:
        from rclpy.time import Time

        try:
            when = Time() if stamp is None else Time.from_msg(stamp)
            return transform_to_matrix(self._buffer.lookup_transform(target, source, when))
        except Exception as exc:  # tf2 raises several lookup/extrapolation exception types
            raise LookupFailed(f"no transform {target} -> {source}: {type(exc).__name__}: {exc}") from None


class LookupFailed(RuntimeError):
    pass


__all__ = ["TfOutput", "transform_to_matrix", "invert_rigid", "map_to_base", "map_to_odom"]
