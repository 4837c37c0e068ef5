"""One camera of the node: its subscriptions, outputs, inference engine and services.

The node serves one ``CameraChannel`` per camera. With one camera (parameter
``cameras`` empty) the channel has no name and today's names: ``image``,
``camera_info``, ``~/pose``, ``~/reset``, ... With several, camera ``c`` uses
``c/image`` (or ``c/image/compressed``), ``c/camera_info`` (and ``c/depth`` for
``scale_source depth``), publishes ``~/c/odometry``, ``~/c/pose``, ``~/c/path``,
``~/c/points``, ``~/c/map_points``, ``~/c/depth``, ``~/c/frame``, ``~/c/status``,
and serves ``~/c/reset``, ``~/c/set_deferred_eviction``, ``~/c/commit_eviction``,
``~/c/rollback_last_frame``.

``RosOutputs`` is the engine's sink (called on the inference thread, clouds on the
camera's output thread). With several cameras it places each output through a
``Placer`` (``multi_map``): the camera's map frame (the node's ``map_frame`` once the
camera is aligned to the first camera, else ``<map_frame>_<c>``) and the transform
``T_map_mapc`` applied to its poses and points. Without a placer (one camera) the
outputs are exactly today's: ``map_frame`` and the engine's poses as they are.
"""
from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, replace
from typing import Any, Callable, Protocol

import numpy as np
from builtin_interfaces.msg import Time as TimeMsg
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from geometry_msgs.msg import PoseStamped
from nav_msgs.msg import Odometry, Path
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CameraInfo, CompressedImage, Image, PointCloud2
from std_msgs.msg import Header
from std_srvs.srv import SetBool, Trigger

from lingbot_map_ros.msg import FrameInfo, Status
from lingbot_map_ros.srv import CommitEviction, RollbackFrame

from ..robot.map_offset import OutputTransform
from ..robot.undistort import CameraModel
from .conversions import (camera_info_msg, compressed_to_rgb, depth_to_image_msg, image_to_rgb, make_pointcloud2,
                          odometry_msg, pose_to_msg, sensor_depth_array)
from ..runtime.engine import InferenceEngine
from ..runtime.frames import FrameOutput, FrameSummary, InputFrame, StatusFields
from ..runtime.mapping import PoseEntry
from ..runtime.multi_map import MapAligner, Placement, transform_points, unpublished
from ..runtime.params import DEFAULT_CAMERA_FRAME, NodeSettings
from .tf_tools import SharedTf, TfOutput
from ..runtime.worker import Command, Throttle

NODE_NAME = "lingbot_map"
ARRIVAL_WINDOW = 64  # images whose age on arrival /diagnostics summarises
PLACED_FRAMES = 64  # frames whose placement is remembered until their clouds are published
# After a frame is handed over, the executor thread lets go of the GIL at once (``time.sleep(0)``):
# the inference thread, woken by the frame, starts on it instead of waiting until the executor
# has done its own Python bookkeeping or the switch interval forces it off (about 1 ms a frame,
# see docs/performance.md). ``LINGBOT_HANDOVER_YIELD=0`` turns it off (for A/B measurements).
HANDOVER_YIELD = os.environ.get("LINGBOT_HANDOVER_YIELD", "1").strip() != "0"
SETTINGS_WAIT_S = 0.5  # s; longest wait of a parameter set for the inference thread to take the new settings


def stamp_seconds(stamp: TimeMsg) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def stamp_of_ns(ns: int) -> TimeMsg:
    """A Time message of ``ns`` nanoseconds (>= 0)."""
    return TimeMsg(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def qos_profile(reliable: bool = True, latched: bool = False, depth: int = 10) -> QoSProfile:
    return QoSProfile(depth=depth,
                      reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


# The services' request queue keeps every request (reliable, keep-all) instead of rclpy's default
# keep-last 10: a call waits for the inference thread on one of main.SERVICE_THREADS threads, and
# while they all wait, a burst of calls (a keyframe client's flood) waits in this queue. With the
# default the 11th queued request overwrote the oldest, which then never got an answer.
SERVICE_QOS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)


class Placer(Protocol):
    """Where one camera's outputs go (several cameras; see ``multi_map``)."""

    def observe(self, out: FrameOutput) -> None: ...
    def place(self, cam_output: OutputTransform | None = None) -> Placement: ...


class AlignedPlacer:
    """``Placer`` of camera ``camera`` through the node's ``MapAligner``. ``output`` and ``ref_output``
    read how this camera's and the reference camera's engines publish now (``engine.output``)."""

    def __init__(self, aligner: MapAligner, camera: str, output: Callable[[], OutputTransform],
                 ref_output: Callable[[], OutputTransform]) -> None:
        self.aligner, self.camera, self.output, self.ref_output = aligner, camera, output, ref_output

    def observe(self, out: FrameOutput) -> None:
        """A published frame (inference thread: ``engine.output`` is the frame's own transform)."""
        T = unpublished(out.T_map_cam, self.output())
        self.aligner.observe(self.camera, out.frame_index, out.stamp_s, out.camera_frame, T)

    def place(self, cam_output: OutputTransform | None = None) -> Placement:
        return self.aligner.placement(self.camera, self.ref_output(),
                                      self.output() if cam_output is None else cam_output)


class RosOutputs:
    """The engine's sink: builds and publishes the messages (called from the inference thread).

    ``prefix`` ("" or "<camera>/") goes between ``~/`` and each output's name; ``placer`` (several
    cameras) gives each output's frame and transform; ``tf_settings`` the settings TF is published
    with (default ``settings``); ``tf_shared`` the node's TF broadcaster, buffer and listener
    (several cameras; None = the camera's own)."""

    def __init__(self, node: Node, settings: NodeSettings, prefix: str = "", placer: Placer | None = None,
                 camera: str = "", tf_settings: NodeSettings | None = None,
                 tf_shared: SharedTf | None = None, pool: Callable[[], Any] | None = None,
                 output: Callable[[], OutputTransform] = OutputTransform) -> None:
        s = self.settings = settings
        self.node = node
        self.camera = camera
        self.placer = placer
        self.pool = pool  # () -> the shared pool's status (named cameras), for ~/<c>/status
        p = prefix
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
        # follows publish_tf, settable at run time
        self.tf = TfOutput(node, tf_settings if tf_settings is not None else s, node.get_logger().warning,
                           shared=tf_shared)
        self._warn = node.get_logger().warning
        self._scale_wait_throttle = Throttle(5.0)
        # () -> how the engine publishes its model-unit path and map now (scale, map offset)
        self.output = output
        self._tf_override = {} if tf_settings is None else {"tf_mode": tf_settings.tf_mode}
        self._path_output = OutputTransform()
        self._path_version: int | None = None
        self.latest_stamp = TimeMsg()
        self._path_lock = threading.Lock()
        self._path_entries: list[PoseEntry] = []
        self._path_dirty = False
        self._placed_lock = threading.Lock()
        self._placed: OrderedDict[int, Placement] = OrderedDict()

    def configure(self, s: NodeSettings) -> None:
        """New settings (a parameter set; the engine hands them over on the inference thread). TF keeps
        this camera's own tf_mode (several cameras: map_to_camera for all but the first)."""
        self.settings = s
        self.tf.settings = replace(s, **self._tf_override) if self._tf_override else s

    def wants(self, output: str) -> bool:
        if output == "points":
            return self.points is not None and self.points.get_subscription_count() > 0
        if output == "depth":
            return self.depth is not None and (self.depth.get_subscription_count() > 0
                                               or self.depth_info.get_subscription_count() > 0)
        if output == "frame":
            return self.frame_info.get_subscription_count() > 0
        raise ValueError(f"unknown output {output!r}")

    # -------------------------------------------------------------- placement (several cameras)
    def placement(self, cam_output: OutputTransform | None = None) -> Placement | None:
        """The camera's placement now (None with one camera); ``cam_output`` instead of the engine's
        output transform now (a save snapshot's)."""
        if self.placer is None:
            return None
        return self.placer.place(cam_output)

    def _place(self, out: FrameOutput) -> tuple[str, np.ndarray]:
        """(frame id, T_frame_cam) of a frame's pose; remembers the placement for its clouds."""
        if self.placer is None:
            return self.settings.map_frame, out.T_map_cam
        self.placer.observe(out)
        placed = self.placer.place()
        with self._placed_lock:
            self._placed[out.frame_index] = placed
            while len(self._placed) > PLACED_FRAMES:
                self._placed.popitem(last=False)
        if self.tf.settings.map_frame != placed.frame:  # TF's parent follows the camera's map frame
            self.tf.settings = replace(self.tf.settings, map_frame=placed.frame)
        T = out.T_map_cam if placed.transform is None else placed.transform @ out.T_map_cam
        return placed.frame, T

    def _placed_for(self, out: FrameOutput) -> Placement | None:
        if self.placer is None:
            return None
        with self._placed_lock:
            placed = self._placed.get(out.frame_index)
        return placed if placed is not None else self.placer.place()

    # -------------------------------------------------------------- sink
    def publish_frame(self, out: FrameOutput) -> None:
        s = self.settings
        self.latest_stamp = out.stamp
        frame_id, T_map_cam = self._place(out)
        in_map = Header(stamp=out.stamp, frame_id=frame_id)
        if self.pose is not None:
            self.pose.publish(PoseStamped(header=in_map, pose=pose_to_msg(T_map_cam)))
        if self.odometry is not None:
            msg = odometry_msg(T_map_cam, in_map, out.camera_frame)
            if out.covariance is not None:  # tracking health's heuristic (robot/health.py)
                msg.pose.covariance = [float(v) for v in out.covariance]
            self.odometry.publish(msg)
        if s.publish_tf and not self._tf_waits_for_scale(out):
            self.tf.publish(T_map_cam, out.stamp, out.camera_frame)
        self.publish_clouds(out)  # nothing when the clouds follow from the output thread

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
        frame_id = self.settings.map_frame if placed is None else placed.frame
        T = out.T_map_cam if placed is None or placed.transform is None else placed.transform @ out.T_map_cam
        self.frame_info.publish(FrameInfo(header=Header(stamp=out.stamp, frame_id=frame_id),
                                          pose=pose_to_msg(T), **asdict(info)))

    def publish_clouds(self, out: FrameOutput) -> None:
        """~/points and ~/depth of a frame whose pose ``publish_frame`` already sent (output thread)."""
        placed = self._placed_for(out)
        in_map = Header(stamp=out.stamp, frame_id=self.settings.map_frame if placed is None else placed.frame)
        if out.points is not None and self.wants("points"):
            points = out.points if placed is None else transform_points(placed.transform, out.points)
            self.points.publish(make_pointcloud2(points, out.colors, out.confidence, in_map))
        if out.depth is not None and self.depth is not None:
            in_camera = Header(stamp=out.stamp, frame_id=out.camera_frame)
            height, width = out.depth.shape
            self.depth.publish(depth_to_image_msg(out.depth, in_camera))
            self.depth_info.publish(camera_info_msg(out.intrinsics, width, height, in_camera))

    def publish_path(self, entries: list[PoseEntry]) -> None:
        """Hand over the current path; ``flush_path`` (a timer) publishes it at path_publish_rate."""
        with self._path_lock:
            self._path_entries, self._path_dirty = entries, True

    def flush_path(self) -> None:
        with self._path_lock:
            if self.path is None or not self._path_dirty:
                return
            entries, self._path_dirty = self._path_entries, False
        output = self.output()  # the engine keeps the path in model units, in the sequence's own frame
        placed = self.placement()
        frame_id = self.settings.map_frame if placed is None else placed.frame
        version = None if placed is None else placed.version
        rebuild = output != self._path_output or version != self._path_version
        self._path_output, self._path_version = output, version
        for e in entries:
            if e.message is None or rebuild:
                T = e.T_map_cam if output.identity else output.pose(e.T_map_cam)
                if placed is not None and placed.transform is not None:
                    T = placed.transform @ T
                e.message = PoseStamped(header=Header(stamp=e.stamp, frame_id=frame_id), pose=pose_to_msg(T))
        stamp = entries[-1].stamp if entries else self.latest_stamp
        self.path.publish(Path(header=Header(stamp=stamp, frame_id=frame_id), poses=[e.message for e in entries]))

    def publish_status(self, status: StatusFields, stamp: Any) -> None:
        placed = self.placement()
        frame_id = self.settings.map_frame if placed is None else placed.frame
        msg = Status(header=Header(stamp=stamp if stamp is not None else TimeMsg(), frame_id=frame_id),
                     **asdict(status))
        if self.camera:
            msg.camera = self.camera
            pool = self.pool() if self.pool is not None else None
            if pool is not None:
                msg.pool_capacity_tokens, msg.pool_leased_tokens = int(pool.capacity_tokens), int(pool.leased_tokens)
                msg.pool_bytes = int(pool.nbytes)
        self.status.publish(msg)

    def publish_map(self, points: np.ndarray, colors: np.ndarray, output: OutputTransform, stamp: Any = None,
                    publisher=None) -> None:
        """Publish this camera's accumulated map (model units, its sequence's frame) on ``publisher``
        (default ``~/[<camera>/]map_points``) through the engine's ``output`` and the placement."""
        placed = self.placement(output)
        if not output.identity:
            points = output.points(points).astype(np.float32)
        if placed is not None:
            points = transform_points(placed.transform, points).astype(np.float32)
        header = Header(stamp=self.latest_stamp if stamp is None else stamp,
                        frame_id=self.settings.map_frame if placed is None else placed.frame)
        (publisher or self.map_points).publish(make_pointcloud2(points, colors, None, header))


class CameraChannel:
    """A camera's subscriptions, outputs (``RosOutputs``), engine and services on ``node``.

    ``name`` "" = the single camera of today's interface. Build order: the channel (outputs),
    ``attach`` (the engine on its session), ``subscribe``, ``create_services``. ``tf_shared``: the
    node's ``SharedTf`` (several cameras: one TF listener for all); None = the camera's own."""

    def __init__(self, node: Node, name: str, settings: NodeSettings, placer: Placer | None = None,
                 tf_settings: NodeSettings | None = None, tf_shared: SharedTf | None = None,
                 pool: Callable[[], Any] | None = None) -> None:
        self.node, self.name = node, name
        self.prefix = f"{name}/" if name else ""
        self.settings = settings
        self.log = node.get_logger().get_child(name) if name else node.get_logger()
        self.outputs = RosOutputs(node, settings, self.prefix, placer, camera=name, tf_settings=tf_settings,
                                  tf_shared=tf_shared, pool=pool, output=self._engine_output)
        self.engine: InferenceEngine | None = None
        self.camera_info: CameraInfo | None = None
        self.camera_model: CameraModel | None = None
        self.arrival_age_s: deque[float] = deque(maxlen=ARRIVAL_WINDOW)  # executor thread only
        self.image_sub = self.camera_info_sub = self.depth_sub = None
        self.service_handles: list = []
        self._heartbeat: Command | None = None

    # -------------------------------------------------------------- build
    def attach(self, session, now: Callable[[], float]) -> InferenceEngine:
        """Create the camera's engine on ``session`` (ROS time ``now`` in seconds)."""
        s = self.settings
        self.engine = InferenceEngine(session, s, self.outputs, self.log, now=now,
                                      odom_position=self.outputs.tf.camera_position,
                                      camera_pose=self.outputs.tf.camera_pose, make_stamp=stamp_of_ns)
        if s.scale_source == "odometry" or s.on_lost == "reset":
            self.outputs.tf.start()  # its buffer serves the odom -> camera look-ups (scale, lost-reset map)
        return self.engine

    def _engine_output(self) -> OutputTransform:
        """How the engine publishes now (``engine.output``; identity before it exists)."""
        return self.engine.output if self.engine is not None else OutputTransform()

    def subscribe(self, group, accept: Callable[[Any, Callable], None] | None = None,
                  convert_raw: Callable = image_to_rgb, convert_compressed: Callable = compressed_to_rgb) -> None:
        """Image (raw or compressed), camera_info and, for scale_source depth, depth subscriptions;
        ``accept(msg, convert)`` takes each image (default ``self.accept``) with ``convert_raw`` or
        ``convert_compressed``."""
        s, p, node = self.settings, self.prefix, self.node
        take = accept if accept is not None else self.accept
        qos = qos_profile_sensor_data if s.input_qos == "sensor_data" else qos_profile(depth=5)
        if s.input_transport == "compressed":
            self.image_sub = node.create_subscription(CompressedImage, f"{p}image/compressed",
                                                      lambda msg: take(msg, convert_compressed), qos,
                                                      callback_group=group)
        else:
            self.image_sub = node.create_subscription(Image, f"{p}image", lambda msg: take(msg, convert_raw), qos,
                                                      callback_group=group)
        self.camera_info_sub = node.create_subscription(CameraInfo, f"{p}camera_info", self.on_camera_info,
                                                        qos_profile_sensor_data, callback_group=group)
        if s.scale_source == "depth":  # registered depth for the metric scale (latest few cached)
            self.depth_sub = node.create_subscription(Image, f"{p}depth", self.on_depth, qos_profile_sensor_data,
                                                      callback_group=group)

    def create_services(self, service_node: Node, node_name: str, group) -> list:
        """~/[<camera>/]reset, set_deferred_eviction, commit_eviction, rollback_last_frame on the
        helper node ``service_node`` under ``node_name`` (this node's fully qualified name)."""
        base = f"{node_name.rstrip('/')}/{self.prefix}"
        self.service_handles = [
            service_node.create_service(Trigger, f"{base}reset", self._srv_reset, qos_profile=SERVICE_QOS,
                                        callback_group=group),
            service_node.create_service(SetBool, f"{base}set_deferred_eviction", self._srv_set_deferred,
                                        qos_profile=SERVICE_QOS, callback_group=group),
            service_node.create_service(CommitEviction, f"{base}commit_eviction", self._srv_commit,
                                        qos_profile=SERVICE_QOS, callback_group=group),
            service_node.create_service(RollbackFrame, f"{base}rollback_last_frame", self._srv_rollback,
                                        qos_profile=SERVICE_QOS, callback_group=group),
        ]
        return self.service_handles

    # -------------------------------------------------------------- settings
    def apply_settings(self, s: NodeSettings) -> None:
        """Run-time parameter changes (executor thread), checked by the node before: the channel's own
        copy here, the engine's and the outputs' as a value through the engine's queue (they take
        effect between two items). Waits up to SETTINGS_WAIT_S for the inference thread to take them
        (about one step), so that a read right after the set sees them; a longer step (the first
        frame's compilation) is not waited for."""
        self.settings = s
        if s.publish_tf or s.on_lost == "reset":
            self.outputs.tf.start()  # the tf2 broadcaster/listener, made once, on this (executor) thread
        self.engine.configure(s).wait(SETTINGS_WAIT_S)

    # -------------------------------------------------------------- input
    def camera_frame(self, header_frame: str) -> str:
        s = self.settings
        if s.camera_frame:
            return s.camera_frame
        if header_frame:
            return header_frame
        info = self.camera_info
        return info.header.frame_id if info is not None and info.header.frame_id else DEFAULT_CAMERA_FRAME

    def accept(self, msg, convert, now: float | None = None) -> None:
        """Convert an image message and hand it to the engine (executor thread)."""
        t0 = time.perf_counter()
        # age on arrival (publisher + transport + executor), reported in /diagnostics: a
        # transport problem (e.g. large raw images as UDP fragments) shows up here first
        now_s = now if now is not None else self.node.get_clock().now().nanoseconds * 1e-9
        self.arrival_age_s.append(now_s - stamp_seconds(msg.header.stamp))
        try:
            rgb = convert(msg)
        except Exception as exc:  # ImageConversionError, and anything odd a decoder raises
            self.engine.reject_frame(msg.header.stamp, str(exc))
            return
        self.engine.submit_frame(InputFrame(rgb=rgb, stamp=msg.header.stamp, stamp_s=stamp_seconds(msg.header.stamp),
                                            camera_frame=self.camera_frame(msg.header.frame_id),
                                            convert_ms=(time.perf_counter() - t0) * 1e3,
                                            camera=self.camera_model))
        if HANDOVER_YIELD:
            time.sleep(0)  # the GIL to the inference thread now (see HANDOVER_YIELD)

    def on_depth(self, msg: Image) -> None:
        """scale_source depth: cache the image (16UC1 millimetres or 32FC1 metres) by its stamp."""
        try:
            depth = sensor_depth_array(msg)
        except Exception as exc:  # ImageConversionError and odd buffers
            self.engine.throttle.emit(self.log.warning, f"ignoring a depth image: {exc}", kind="depth msg")
            return
        self.engine.depth_cache.put(stamp_seconds(msg.header.stamp), depth)

    def on_camera_info(self, msg: CameraInfo) -> None:
        """Keep the latest usable CameraInfo (for /diagnostics); warn (throttled) about unusable ones."""
        fx, fy = msg.k[0], msg.k[4]
        problem = ("an empty image size" if msg.width == 0 or msg.height == 0 else
                   "non-finite K" if not all(math.isfinite(v) for v in msg.k) else
                   "a focal length that is not positive" if not (fx > 0 and fy > 0) else None)
        if problem is not None:
            self.engine.throttle.emit(self.log.warning,
                                      f"ignoring camera_info with {problem} (image size {msg.width}x{msg.height})")
            return
        try:  # the undistortion's camera (the engine thread builds and caches its remap grid)
            self.camera_model = CameraModel.from_camera_info(msg)
        except ValueError as exc:  # e.g. a distortion model it does not know
            self.camera_model = None
            self.engine.throttle.emit(self.log.warning, f"camera_info cannot be used to undistort: {exc}",
                                      kind="camera_info model")
        self.camera_info = msg

    # -------------------------------------------------------------- timers
    def beat(self, clock_problem: str) -> None:
        """1 Hz: a heartbeat (with the clock state for its status text) when the last one ran."""
        if self._heartbeat is None or self._heartbeat.wait(0):
            self._heartbeat = self.engine.heartbeat(clock_problem)

    # -------------------------------------------------------------- services
    def run(self, name: str, fn) -> tuple[bool, Any, str]:
        """Queue ``fn`` on the inference thread and wait for it: (ran successfully, result, error text)."""
        timeout = self.settings.service_timeout
        command = self.engine.submit(name, fn)
        if not command.wait(timeout):
            if command.cancel():
                return False, None, f"timed out after {timeout:.1f} s waiting for the inference thread; not executed"
            command.wait(timeout)
        if command.state == Command.CANCELLED:
            return False, None, "the node is shutting down; not executed"
        if command.state != Command.DONE:
            return False, None, f"still running after {2 * timeout:.1f} s"
        if command.error is not None:
            return False, None, str(command.error) or type(command.error).__name__
        return True, command.result, ""

    def _srv_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        ok, text, error = self.run("reset", self.engine.reset)
        response.success, response.message = ok, text if ok else error
        self.log.info(f"~/{self.prefix}reset: {response.message}")
        return response

    def _srv_set_deferred(self, request: SetBool.Request, response: SetBool.Response) -> SetBool.Response:
        ok, text, error = self.run("set_deferred_eviction", lambda: self.engine.set_deferred_eviction(request.data))
        response.success, response.message = ok, text if ok else error
        return response

    def _srv_commit(self, request, response):
        expected = int(request.expected_frame_index)
        ok, freed, error = self.run("commit_eviction", lambda: self.engine.keyframes.commit_eviction(expected))
        response.success = ok
        response.pages_freed = int(freed or 0)
        response.message = (f"{freed} page(s) freed" if freed else "nothing was pending") if ok else error
        return response

    def _srv_rollback(self, request, response):
        expected = int(request.expected_frame_index)
        ok, index, error = self.run("rollback_last_frame", lambda: self.engine.keyframes.rollback(expected))
        response.success = ok
        response.frame_index = int(index or 0)
        response.message = f"rolled back frame {index}" if ok else f"nothing rolled back: {error}"
        self.log.info(f"~/{self.prefix}rollback_last_frame({expected}): {response.message}")
        return response

    # -------------------------------------------------------------- diagnostics
    def input_diag(self, label: str) -> DiagnosticStatus:
        """/diagnostics "<label>: input": WARN while no image came within input_timeout."""
        s, e = self.settings, self.engine
        c = e.counters.snapshot()
        quiet = e.seconds_since_input()
        topic = self.image_sub.topic_name
        if quiet is None or quiet > s.input_timeout:
            level = DiagnosticStatus.WARN
            message = f"no image on {topic} " + ("yet" if quiet is None else f"for {quiet:.1f} s")
        else:
            level, message = DiagnosticStatus.OK, f"receiving images on {topic}"
        values = {"topic": topic, "input rate (Hz)": f"{e.input_rate.rate():.2f}",
                  "seconds since last image": "never" if quiet is None else f"{quiet:.1f}",
                  "frames received": c.frames_received, "frames dropped (invalid)": c.frames_dropped_invalid,
                  "frames undistorted": e.frames_undistorted,
                  f"image age on arrival, median of the last {ARRIVAL_WINDOW} (ms)":
                      f"{1e3 * statistics.median(self.arrival_age_s):.1f}" if self.arrival_age_s else "n/a"}
        info = self.camera_info
        if info is not None and info.k[0] > 0 and e.last_intrinsics is not None:
            K, width, _ = e.last_intrinsics
            values["camera_info fx (input px)"] = f"{info.k[0]:.1f}"
            values["estimated fx (input px)"] = f"{K[0, 0] * info.width / width:.1f}" if info.width else "n/a"
        return diag(f"{label}: input", level, message, values)

    def state_diags(self, label: str) -> list[DiagnosticStatus]:
        """/diagnostics "output", "tracking", "scale" and "cache" of this camera."""
        e = self.engine
        c = e.counters.snapshot()
        out_level = DiagnosticStatus.ERROR if int(e.state) == Status.STATE_ERROR else DiagnosticStatus.OK
        statuses = [diag(f"{label}: output", out_level, e.state_text, {
            "state": e.state.name, "output rate (Hz)": f"{e.output_rate.rate():.2f}",
            "frames processed": c.frames_processed, "frames dropped (stale)": c.frames_dropped_stale,
            "frames dropped (error)": c.frames_dropped_error, "clouds skipped (output thread behind)": e.clouds_skipped,
            "output thread queue": e.outputs.pending()})]
        statuses.append(tracking_diag(label, e))
        statuses.append(scale_diag(label, e))
        stats = e.last_stats
        if stats is None:
            statuses.append(diag(f"{label}: cache", DiagnosticStatus.OK, "not allocated yet (no frame)", {}))
        else:
            used = stats.scale_pages + stats.window_pages
            total = used + stats.free_pages
            cache_level = DiagnosticStatus.WARN if stats.free_pages == 0 and stats.deferred else DiagnosticStatus.OK
            statuses.append(diag(f"{label}: cache", cache_level, f"{used}/{total} pages in use", {
                "occupancy (%)": f"{100.0 * used / max(total, 1):.1f}", "stored frames": stats.resident_frames,
                "scale pages": stats.scale_pages, "window pages": stats.window_pages, "free pages": stats.free_pages,
                "pending evictions": stats.pending_evictions, "deferred eviction": stats.deferred}))
        statuses.append(self.intrinsics_diag(label))
        return statuses

    def intrinsics_diag(self, label: str) -> DiagnosticStatus:
        """/diagnostics "intrinsics": the model's median focal lengths vs camera_info's K (input pixels),
        WARN beyond ``robot.intrinsics.WARN_FRACTION``."""
        info, focal = self.camera_info, self.engine.focal
        if info is None:
            return diag(f"{label}: intrinsics", DiagnosticStatus.OK, "no camera_info received: nothing to compare", {})
        if len(focal) == 0:
            return diag(f"{label}: intrinsics", DiagnosticStatus.OK, "no frame processed yet", {})
        comparison = focal.compare(info.k, (info.width, info.height))
        return diag(f"{label}: intrinsics", DiagnosticStatus.WARN if comparison.warn else DiagnosticStatus.OK,
                    comparison.message(), comparison.values())


def tracking_diag(name: str, engine: InferenceEngine) -> DiagnosticStatus:
    """/diagnostics "tracking": OK tracking/initializing, WARN degraded, ERROR lost."""
    state = engine.health.state.value
    level = {"degraded": DiagnosticStatus.WARN, "lost": DiagnosticStatus.ERROR}.get(state, DiagnosticStatus.OK)
    reasons = ", ".join(engine.tracking_reasons)
    return diag(f"{name}: tracking", level, state + (f" ({reasons})" if reasons else ""), {
        "state": state, "reasons": reasons or "none", "on_lost": engine.settings.on_lost,
        "lost resets": engine.lost_resets, "map frame anchored to": engine.map_alignment})


def scale_diag(name: str, engine: InferenceEngine) -> DiagnosticStatus:
    """/diagnostics "scale": OK when none/fixed/converged, WARN while an estimate has not converged."""
    kind, src = engine.settings.scale_source, engine.scale_source
    if src is None:
        return diag(f"{name}: scale", DiagnosticStatus.OK, "model units (scale_source none)", {"source": kind})
    status = src.as_status()
    level = DiagnosticStatus.OK if src.converged else DiagnosticStatus.WARN
    message = f"{engine.applied_scale:.4f} m per model unit" if src.converged else "not converged: model units"
    return diag(f"{name}: scale", level, message, {k: v for k, v in status.items()})


def diag(name: str, level: bytes, message: str, values: dict) -> DiagnosticStatus:
    return DiagnosticStatus(level=level, name=name, message=message, hardware_id=NODE_NAME,
                            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])


__all__ = ["CameraChannel", "RosOutputs", "AlignedPlacer", "Placer", "stamp_seconds", "diag", "tracking_diag",
           "scale_diag", "NODE_NAME", "ARRIVAL_WINDOW"]
