"""One camera's outputs: ``RosOutputs``, the engine's sink, builds and publishes its messages.

``prefix`` ("" for the node's one camera, "<camera>/" for a listed camera) goes between ``~/``
and each output's name: ``~/[<c>/]pose``, ``odometry``, ``path``, ``points``, ``map_points``,
``depth`` (+ ``depth/camera_info``), ``frame``, ``status``, and TF (``tf_tools.TfOutput``).

Every output is placed by the node's ``runtime.multi_map.MapAligner``: the camera's map frame
(``map_frame``, or ``<map_frame>_<c>`` while a listed camera is not joined to the first one) and
the transform ``T_map_mapc`` applied to its poses and points; the node's one camera is the
reference of a set of one, published in ``map_frame`` as its engine gives it. Each frame carries
the ``OutputTransform`` (metric scale, map offset) it went through, so nothing here asks the
engine how it publishes.

Threads: ``publish_frame`` and ``publish_frame_info`` run on the inference thread, ``publish_clouds``
on the camera's output thread, ``flush_path`` and ``publish_map`` on the node's timers.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, replace
from typing import Any, Callable

import numpy as np
from builtin_interfaces.msg import Time as TimeMsg
from geometry_msgs.msg import Point, PoseStamped
from nav_msgs.msg import Odometry, Path
from rclpy.node import Node
from sensor_msgs.msg import CameraInfo, Image, PointCloud2
from std_msgs.msg import Header
from visualization_msgs.msg import Marker, MarkerArray

from lingbot_map_ros.msg import FrameInfo, Status

from ..robot.map_offset import OutputTransform
from ..runtime.corrections import NO_CORRECTIONS, Corrections
from ..runtime.frames import FrameOutput, FrameSummary, StatusFields
from ..runtime.mapping import PoseEntry
from ..runtime.multi_map import MapAligner, Placement, transform_points, unpublished
from ..runtime.params import NodeSettings
from ..runtime.worker import Throttle
from .common import qos_profile
from .conversions import camera_info_msg, depth_to_image_msg, make_pointcloud2, odometry_msg, pose_to_msg
from .tf_tools import SharedTf, TfOutput

PLACED_FRAMES = 64  # frames whose placement is remembered until their clouds are published


class RosOutputs:
    """The sink of camera ``camera`` ("" = the node's one camera) on ``node``; see the module
    docstring. ``tf_settings``: the settings TF is published with (a listed camera other than the
    first publishes its camera frame under the map); ``tf_shared``: the node's TF broadcaster,
    buffer and listener; ``pool``: () -> the shared K/V pool's status for ~/<c>/status (None for
    one camera)."""

    def __init__(self, node: Node, settings: NodeSettings, camera: str, aligner: MapAligner,
                 tf_settings: NodeSettings, tf_shared: SharedTf, pool: Callable[[], Any]) -> None:
        s = self.settings = settings
        self.node, self.camera, self.aligner, self.pool = node, camera, aligner, pool
        p = f"{camera}/" if camera else ""
        self.status = node.create_publisher(Status, f"~/{p}status", qos_profile(depth=20))
        self.pose = node.create_publisher(PoseStamped, f"~/{p}pose", qos_profile()) if s.publish_pose else None
        self.odometry = node.create_publisher(Odometry, f"~/{p}odometry", qos_profile()) if s.publish_odometry else None
        self.path = node.create_publisher(Path, f"~/{p}path", qos_profile(latched=True, depth=1)) \
            if s.publish_path else None
        self.points = node.create_publisher(PointCloud2, f"~/{p}points", qos_profile(depth=2)) if s.publish_points else None
        self.map_points = node.create_publisher(PointCloud2, f"~/{p}map_points", qos_profile(latched=True, depth=1)) \
            if s.publish_map and s.accumulate_map else None
        self.depth = self.depth_info = None
        if s.publish_depth:
            self.depth = node.create_publisher(Image, f"~/{p}depth", qos_profile(depth=2))
            self.depth_info = node.create_publisher(CameraInfo, f"~/{p}depth/camera_info", qos_profile(depth=2))
        self.frame_info = node.create_publisher(FrameInfo, f"~/{p}frame", qos_profile(depth=10))
        self.loop_closures = node.create_publisher(MarkerArray, f"~/{p}loop_closures",
                                                   qos_profile(latched=True, depth=1)) if s.loop_closure else None
        self._markers_made: Any = None  # what the last ~/loop_closures showed
        self.tf = TfOutput(node, tf_settings, node.get_logger().warning, shared=tf_shared)  # follows publish_tf
        self._warn = node.get_logger().warning
        self._scale_wait_throttle = Throttle(5.0)
        self._tf_mode = tf_settings.tf_mode  # this camera's own (kept across parameter sets)
        self.latest_stamp = TimeMsg()
        self._path_lock = threading.Lock()
        self._path: tuple[list[PoseEntry], OutputTransform, Corrections] = ([], OutputTransform(), NO_CORRECTIONS)
        self._path_dirty = False
        self._path_made: tuple | None = None  # what the cached pose messages were made for
        self._placed_lock = threading.Lock()
        self._placed: OrderedDict[int, Placement] = OrderedDict()

    def configure(self, s: NodeSettings) -> None:
        """New settings (a parameter set; the engine hands them over on the inference thread). TF keeps
        this camera's own tf_mode and map frame."""
        self.settings = s
        self.tf.settings = replace(s, tf_mode=self._tf_mode, map_frame=self.tf.settings.map_frame)

    def wants(self, output: str) -> bool:
        if output == "points":
            return self.points is not None and self.points.get_subscription_count() > 0
        if output == "depth":
            return self.depth is not None and (self.depth.get_subscription_count() > 0
                                               or self.depth_info.get_subscription_count() > 0)
        if output == "frame":
            return self.frame_info.get_subscription_count() > 0
        raise ValueError(f"unknown output {output!r}")

    # -------------------------------------------------------------- placement
    def placement(self, cam_output: OutputTransform | None = None) -> Placement:
        """Where the camera's outputs go now; ``cam_output``: as if its engine published through it (a
        save snapshot's)."""
        return self.aligner.placement(self.camera, cam_output=cam_output)

    def _place(self, out: FrameOutput) -> Placement:
        """Where a frame's pose goes; remembers the placement for its clouds."""
        self.aligner.observe(self.camera, out.frame_index, out.stamp_s, out.camera_frame,
                             unpublished(out.T_map_cam, out.transform), out.transform)
        placed = self.aligner.placement(self.camera)
        with self._placed_lock:
            self._placed[out.frame_index] = placed
            while len(self._placed) > PLACED_FRAMES:
                self._placed.popitem(last=False)
        if self.tf.settings.map_frame != placed.frame:  # TF's parent follows the camera's map frame
            self.tf.settings = replace(self.tf.settings, map_frame=placed.frame)
        return placed

    def _placed_for(self, out: FrameOutput) -> Placement:
        with self._placed_lock:
            placed = self._placed.get(out.frame_index)
        return placed if placed is not None else self.placement()

    # -------------------------------------------------------------- sink
    def publish_frame(self, out: FrameOutput) -> None:
        s = self.settings
        self.latest_stamp = out.stamp
        placed = self._place(out)
        T_map_cam = _placed(placed, out.T_map_cam)
        in_map = Header(stamp=out.stamp, frame_id=placed.frame)
        if self.pose is not None:
            self.pose.publish(PoseStamped(header=in_map, pose=pose_to_msg(T_map_cam)))
        if self.odometry is not None:
            msg = odometry_msg(T_map_cam, in_map, out.camera_frame)
            if out.covariance is not None:  # tracking health's heuristic (robot/health.py)
                msg.pose.covariance = [float(v) for v in out.covariance]
            self.odometry.publish(msg)
        if s.publish_tf and not self._tf_waits_for_scale(out):
            # loop closure: odom -> camera is the stream's own pose, map -> odom the correction
            T_front = None if out.T_front is None else _placed(placed, out.T_front)
            self.tf.publish(T_map_cam, out.stamp, out.camera_frame, T_front)

    def _tf_waits_for_scale(self, out: FrameOutput) -> bool:
        """map_to_odom with scale_wait_for_convergence: no TF until the estimated scale converged
        (a map -> odom transform in model units would jump when the scale arrives)."""
        s = self.settings
        mode = self.tf.mode or s.tf_mode
        if out.scale_ready or not s.scale_wait_for_convergence or mode != "map_to_odom":
            return False
        self._scale_wait_throttle.emit(self._warn, f"tf_mode map_to_odom waits for the metric scale "
                                       f"(scale_source {s.scale_source}) to converge: no TF yet")
        return True

    def publish_frame_info(self, info: FrameSummary, out: FrameOutput) -> None:
        placed = self._placed_for(out)
        T = out.T_map_cam if placed.transform is None else placed.transform @ out.T_map_cam
        self.frame_info.publish(FrameInfo(header=Header(stamp=out.stamp, frame_id=placed.frame),
                                          pose=pose_to_msg(T), **asdict(info)))

    def publish_clouds(self, out: FrameOutput) -> None:
        """~/points and ~/depth of a frame whose pose ``publish_frame`` already sent (output thread)."""
        placed = self._placed_for(out)
        in_map = Header(stamp=out.stamp, frame_id=placed.frame)
        if out.points is not None and self.wants("points"):
            points = transform_points(placed.transform, out.points)
            self.points.publish(make_pointcloud2(points, out.colors, out.confidence, in_map))
        if out.depth is not None and self.depth is not None:
            in_camera = Header(stamp=out.stamp, frame_id=out.camera_frame)
            height, width = out.depth.shape
            self.depth.publish(depth_to_image_msg(out.depth, in_camera))
            self.depth_info.publish(camera_info_msg(out.intrinsics, width, height, in_camera))

    def publish_path(self, entries: list[PoseEntry], transform: OutputTransform | None = None,
                     corrections: Corrections | None = None) -> None:
        """Hand over the current path (model units, the stream's poses) and how it leaves
        (``transform``: scale, map offset; ``corrections``: loop closure's); ``flush_path`` (a timer)
        publishes it at path_publish_rate."""
        with self._path_lock:
            self._path = (entries, transform or OutputTransform(),
                          corrections if corrections is not None else NO_CORRECTIONS)
            self._path_dirty = True

    def flush_path(self) -> None:
        with self._path_lock:
            if self.path is None or not self._path_dirty:
                return
            (entries, output, corrections), self._path_dirty = self._path, False
        placed = self.placement()
        made = (output, placed.version, corrections.version)
        rebuild = made != self._path_made
        self._path_made = made
        for e in entries:
            if e.message is None or rebuild:
                T = output.pose(corrections.pose(e.frame_index, e.T_map_cam))
                if placed.transform is not None:
                    T = placed.transform @ T
                e.message = PoseStamped(header=Header(stamp=e.stamp, frame_id=placed.frame), pose=pose_to_msg(T))
        stamp = entries[-1].stamp if entries else self.latest_stamp
        self.path.publish(Path(header=Header(stamp=stamp, frame_id=placed.frame), poses=[e.message for e in entries]))

    def publish_status(self, status: StatusFields, stamp: Any) -> None:
        msg = Status(header=Header(stamp=stamp if stamp is not None else TimeMsg(), frame_id=self.placement().frame),
                     **asdict(status))
        if self.camera:
            msg.camera = self.camera
        pool = self.pool()
        if pool is not None:
            msg.pool_capacity_tokens, msg.pool_leased_tokens = int(pool.capacity_tokens), int(pool.leased_tokens)
            msg.pool_bytes = int(pool.nbytes)
        self.status.publish(msg)

    def publish_map(self, points: np.ndarray, colors: np.ndarray, output: OutputTransform, stamp: Any = None,
                    publisher=None) -> None:
        """Publish this camera's accumulated map (model units, its sequence's frame) on ``publisher``
        (default ``~/[<camera>/]map_points``) through its engine's ``output`` and the placement."""
        placed = self.placement(output)
        if not output.identity:
            points = output.points(points).astype(np.float32)
        points = transform_points(placed.transform, points)
        if placed.transform is not None:
            points = points.astype(np.float32)
        header = Header(stamp=self.latest_stamp if stamp is None else stamp, frame_id=placed.frame)
        (publisher or self.map_points).publish(make_pointcloud2(points, colors, None, header))

    def publish_loop_closures(self, loop, output: OutputTransform) -> None:
        """~/[<camera>/]loop_closures when the closures tried or the corrections changed (node timer)."""
        if self.loop_closures is None or loop is None:
            return
        placed = self.placement(output)
        marks = list(loop.markers)
        made = (len(marks), marks[-1] if marks else None, loop.corrections.version, output, placed.version)
        if made == self._markers_made:
            return
        self.loop_closures.publish(loop_markers(marks, output, placed, self.latest_stamp))
        self._markers_made = made


def loop_markers(marks, output: OutputTransform, placed: Placement, stamp: Any) -> MarkerArray:
    """~/loop_closures: the closures tried (``LoopCloser.markers``), accepted ones as green lines and
    refused ones as red lines from the kept keyframe to the current one, in the placement's frame."""
    out = MarkerArray()
    for ident, (accepted, color) in enumerate(((True, (0.1, 0.9, 0.2)), (False, (0.95, 0.2, 0.1)))):
        m = Marker(header=Header(stamp=stamp, frame_id=placed.frame), ns="loop_closures", id=ident,
                   type=Marker.LINE_LIST, action=Marker.ADD)
        m.scale.x = 0.02 if accepted else 0.01
        m.color.r, m.color.g, m.color.b, m.color.a = (*color, 1.0)
        m.pose.orientation.w = 1.0
        ends = np.array([(mk.kept_position, mk.current_position) for mk in marks if mk.accepted == accepted],
                        np.float64).reshape(-1, 3)
        if len(ends):
            ends = transform_points(placed.transform, output.points(ends))
        m.points = [Point(x=float(p[0]), y=float(p[1]), z=float(p[2])) for p in ends]
        out.markers.append(m)
    return out


def _placed(placed: Placement, T: np.ndarray) -> np.ndarray:
    """A pose [4, 4] of the camera's own map frame in the placement's frame."""
    return T if placed.transform is None else placed.transform @ T


__all__ = ["RosOutputs", "PLACED_FRAMES"]
