"""``lingbot_map_node``: the ROS 2 shell around the streaming session.

    python -m lingbot_map_ros.ros.node --ros-args --params-file config/lingbot_map.yaml
    ros2 launch lingbot_map_ros lingbot_map.launch.py checkpoint:=/path/lingbot-map.pt

Interface (node-private names resolve to ``/<namespace>/<node name>/...``):

- Subscriptions: ``image`` (sensor_msgs/Image) or ``image/compressed``
  (sensor_msgs/CompressedImage, JPEG/PNG) by ``input_transport``; ``camera_info``
  (latest cached, never synchronised; only reported in /diagnostics next to the
  model's own focal estimate). QoS: sensor data (best effort) unless
  ``input_qos:=reliable``.
- Publications, all stamped with the IMAGE's stamp: ``~/odometry``, ``~/pose``,
  ``~/path`` (reliable, transient local, ``path_max_length`` poses, at most
  ``path_publish_rate`` Hz), ``~/points``
  (per-frame cloud: x, y, z, rgb, confidence), ``~/map_points`` (accumulated,
  voxel-downsampled, transient local, at most ``map_publish_rate`` Hz and
  ``map_max_points`` points), ``~/depth`` (32FC1, model units, NaN where not > 0)
  and ``~/depth/camera_info`` (estimated intrinsics at the depth resolution),
  ``~/status`` (lingbot_map_ros/msg/Status: one per input frame consumed, plus a
  1 Hz heartbeat), ``/diagnostics`` (1 Hz) and TF (see ``tf_tools``).
- Services (run on the inference thread between frames, in arrival order):
  ``~/reset``, ``~/set_deferred_eviction``, ``~/commit_eviction``,
  ``~/rollback_last_frame``, ``~/save_map``.

Frames. The model's world ``W`` is the first camera of the sequence in OpenCV
optical axes (x right, y down, z forward). It is published as the REP-103 map
frame ``map_frame``: same origin, axes x = forward (optical z), y = left
(-optical x), z = up (-optical y) of the first camera (``conversions.
OPTICAL_TO_REP103``). So a level first camera gives a map with z up; a tilted one
gives a map tilted the same way. Poses (~/pose, ~/odometry, ~/path, the saved TUM
file) are ``T_map_cam`` of the camera's OPTICAL frame (child_frame_id = the image's
frame_id or ``camera_frame``); points are map-frame coordinates; depth and its
camera_info are in the optical frame. Units are the model's (metre-like, not
guaranteed metric). A reset (service, or recovery from an error) starts a new map
at the next first camera.

Threads. One executor thread runs the callbacks (``main``): image callbacks only
convert the message and put it in a depth-1 latest-frame slot (a frame still waiting
is replaced and counted as stale); one inference thread (``engine.InferenceEngine``)
runs the model and publishes poses and status; one output thread
(``output_worker``) builds the clouds, depth images and the map. The services are
served by a helper node (``<name>_services``, same service names under this node)
on a second executor thread: a call queues a command for the inference thread and
waits for it with ``service_timeout`` without holding up image intake. Skipped when
nobody listens: per-frame clouds, depth; the map is still accumulated when
``accumulate_map`` (``~/save_map`` needs it).

Start-up. Parameters map onto ModelConfig/StreamConfig in ``params.resolve_settings``
(each value logged); the model is loaded in ``_load_session``. A bad parameter,
checkpoint or backend ends the process with exit status 1 and one error line.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, replace
from typing import Any, Callable

import numpy as np
import rclpy
from rclpy.signals import SignalHandlerOptions
from builtin_interfaces.msg import Time as TimeMsg
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import PoseStamped
from nav_msgs.msg import Odometry, Path
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CameraInfo, CompressedImage, Image, PointCloud2
from std_msgs.msg import Header
from std_srvs.srv import SetBool, Trigger

from lingbot_map_ros.msg import FrameInfo, Status
from lingbot_map_ros.srv import CommitEviction, RollbackFrame, SaveMap

from ..config import ConfigError
from .conversions import (camera_info_msg, compressed_to_rgb, depth_to_image_msg, image_to_rgb, make_pointcloud2,
                          odometry_msg, pose_to_msg, sensor_depth_array)
from .engine import FrameOutput, FrameSummary, InferenceEngine, InputFrame, SaveError, StatusFields, write_map_files
from .mapping import PoseEntry
from .params import DEFAULT_CAMERA_FRAME, PARAMETERS, NodeSettings, Param, apply_dynamic, resolve_settings
from .tf_tools import TfOutput
from ..robot.scale import apply_scale, scale_points
from ..robot.undistort import CameraModel
from .worker import Command, Throttle

NODE_NAME = "lingbot_map"
_PARAMETER_TABLE = {p.name: p for p in PARAMETERS}
ARRIVAL_WINDOW = 64  # images whose age on arrival /diagnostics summarises


class StartupError(RuntimeError):
    """The node cannot start; the message says why (logged as one line, exit status 1)."""


def descriptor(p: Param) -> ParameterDescriptor:
    """ParameterDescriptor with the description, range or choices of ``p`` (read-only unless dynamic)."""
    d = ParameterDescriptor(description=p.description, read_only=not p.dynamic)
    if p.choices is not None:
        d.additional_constraints = "one of: " + ", ".join(p.choices)
    if p.limits is not None:
        lo, hi, step = p.limits
        if isinstance(p.default, bool):
            pass
        elif isinstance(p.default, int):
            d.integer_range = [IntegerRange(from_value=int(lo), to_value=int(hi), step=int(step))]
        else:
            d.floating_point_range = [FloatingPointRange(from_value=float(lo), to_value=float(hi), step=float(step))]
    return d


def stamp_seconds(stamp: TimeMsg) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def _qos(reliable: bool = True, latched: bool = False, depth: int = 10) -> QoSProfile:
    return QoSProfile(depth=depth,
                      reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


class _ForwardToRos(logging.Handler):
    """Sends the library's Python log records (model loading, cache sizes) to the node's logger."""

    def __init__(self, logger) -> None:
        super().__init__()
        self._logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        text = f"[{record.name.rsplit('.', 1)[-1]}] {record.getMessage()}"
        level = record.levelno
        # One call site per severity: rclpy refuses a call site whose severity changes between calls.
        if level >= logging.ERROR:
            self._logger.error(text)
        elif level >= logging.WARNING:
            self._logger.warning(text)
        elif level >= logging.INFO:
            self._logger.info(text)
        else:
            self._logger.debug(text)


class RosOutputs:
    """The engine's sink: builds and publishes the messages (called from the inference thread)."""

    def __init__(self, node: Node, settings: NodeSettings) -> None:
        s = self.settings = settings
        self.node = node
        self.status = node.create_publisher(Status, "~/status", _qos(depth=20))
        self.pose = node.create_publisher(PoseStamped, "~/pose", _qos()) if s.publish_pose else None
        self.odometry = node.create_publisher(Odometry, "~/odometry", _qos()) if s.publish_odometry else None
        self.path = node.create_publisher(Path, "~/path", _qos(latched=True, depth=1)) if s.publish_path else None
        self.points = node.create_publisher(PointCloud2, "~/points", _qos(depth=2)) if s.publish_points else None
        self.map_points = node.create_publisher(PointCloud2, "~/map_points", _qos(latched=True, depth=1)) \
            if s.publish_map and s.accumulate_map else None
        self.depth = self.depth_info = None
        if s.publish_depth:
            self.depth = node.create_publisher(Image, "~/depth", _qos(depth=2))
            self.depth_info = node.create_publisher(CameraInfo, "~/depth/camera_info", _qos(depth=2))
        self.frame_info = node.create_publisher(FrameInfo, "~/frame", _qos(depth=10))
        self.tf = TfOutput(node, s, node.get_logger().warning)  # follows publish_tf, settable at run time
        self._warn = node.get_logger().warning
        self._scale_wait_throttle = Throttle(5.0)
        self.scale: Callable[[], float] = lambda: 1.0  # metres per model unit of the path (set by the node)
        self._path_scale = 1.0
        self.latest_stamp = TimeMsg()
        self._path_lock = threading.Lock()
        self._path_entries: list[PoseEntry] = []
        self._path_dirty = False

    def wants(self, output: str) -> bool:
        if output == "points":
            return self.points is not None and self.points.get_subscription_count() > 0
        if output == "depth":
            return self.depth is not None and (self.depth.get_subscription_count() > 0
                                               or self.depth_info.get_subscription_count() > 0)
        if output == "frame":
            return self.frame_info.get_subscription_count() > 0
        raise ValueError(f"unknown output {output!r}")

    def publish_frame(self, out: FrameOutput) -> None:
        s = self.settings
        self.latest_stamp = out.stamp
        in_map = Header(stamp=out.stamp, frame_id=s.map_frame)
        if self.pose is not None:
            self.pose.publish(PoseStamped(header=in_map, pose=pose_to_msg(out.T_map_cam)))
        if self.odometry is not None:
            msg = odometry_msg(out.T_map_cam, in_map, out.camera_frame)
            if out.covariance is not None:  # tracking health's heuristic (robot/health.py)
                msg.pose.covariance = [float(v) for v in out.covariance]
            self.odometry.publish(msg)
        if self.settings.publish_tf and not self._tf_waits_for_scale(out):
            self.tf.publish(out.T_map_cam, out.stamp, out.camera_frame)
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
        self.frame_info.publish(FrameInfo(header=Header(stamp=out.stamp, frame_id=self.settings.map_frame),
                                          pose=pose_to_msg(out.T_map_cam), **asdict(info)))

    def publish_clouds(self, out: FrameOutput) -> None:
        """~/points and ~/depth of a frame whose pose ``publish_frame`` already sent (output thread)."""
        in_map = Header(stamp=out.stamp, frame_id=self.settings.map_frame)
        if out.points is not None and self.wants("points"):
            self.points.publish(make_pointcloud2(out.points, out.colors, out.confidence, in_map))
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
        scale = self.scale()  # the engine keeps the path in model units
        rebuild, self._path_scale = scale != self._path_scale, scale
        for e in entries:
            if e.message is None or rebuild:
                T = apply_scale(e.T_map_cam, scale) if scale != 1.0 else e.T_map_cam
                e.message = PoseStamped(header=Header(stamp=e.stamp, frame_id=self.settings.map_frame),
                                        pose=pose_to_msg(T))
        stamp = entries[-1].stamp if entries else self.latest_stamp
        self.path.publish(Path(header=Header(stamp=stamp, frame_id=self.settings.map_frame),
                               poses=[e.message for e in entries]))

    def publish_status(self, status: StatusFields, stamp: Any) -> None:
        msg = Status(header=Header(stamp=stamp if stamp is not None else TimeMsg(), frame_id=self.settings.map_frame),
                     **asdict(status))
        self.status.publish(msg)


class LingBotMapNode(Node):
    """See the module docstring. Raises StartupError when it cannot start.

    Spin ``service_node`` as well, on an executor of its own (``main`` does): it serves
    the node's services."""

    def __init__(self, node_name: str = NODE_NAME, **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        log = self.get_logger()
        self._log_handler = _ForwardToRos(log)
        logging.getLogger("lingbot_map_ros").addHandler(self._log_handler)
        logging.getLogger("lingbot_map_ros").setLevel(logging.INFO)
        self.settings = self._read_parameters()
        s = self.settings
        self.outputs = RosOutputs(self, s)
        self.outputs.publish_status(StatusFields(state=0, state_text="loading the model"), None)
        session = self._load_session()
        self.engine = InferenceEngine(session, s, self.outputs, log, now=self._now,
                                      odom_position=self.outputs.tf.camera_position)
        self.outputs.scale = lambda: self.engine.applied_scale
        if s.scale_source == "odometry":
            self.outputs.tf.start()  # its buffer serves the scale's odom -> camera look-ups

        self._input_group = MutuallyExclusiveCallbackGroup()
        self._timer_group = MutuallyExclusiveCallbackGroup()
        self.camera_info: CameraInfo | None = None
        self.camera_model: CameraModel | None = None
        self._arrival_age_s: deque[float] = deque(maxlen=ARRIVAL_WINDOW)  # executor thread only
        qos = qos_profile_sensor_data if s.input_qos == "sensor_data" else _qos(depth=5)
        if s.input_transport == "compressed":
            self.image_sub = self.create_subscription(CompressedImage, "image/compressed", self._on_compressed, qos,
                                                      callback_group=self._input_group)
        else:
            self.image_sub = self.create_subscription(Image, "image", self._on_image, qos,
                                                      callback_group=self._input_group)
        self.camera_info_sub = self.create_subscription(CameraInfo, "camera_info", self._on_camera_info,
                                                        qos_profile_sensor_data, callback_group=self._input_group)
        if s.scale_source == "depth":  # registered depth for the metric scale (latest few cached)
            self.depth_sub = self.create_subscription(Image, "depth", self._on_depth, qos_profile_sensor_data,
                                                      callback_group=self._input_group)
        self.diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", _qos())
        # The services live on a helper node that main() spins on its own executor thread: a
        # call waits for the inference thread (one step, or up to service_timeout while the
        # first frame compiles), and image intake, timers and diagnostics must not wait with it.
        # Their names are this node's (~/reset is <this node>/reset whatever the helper is called).
        self.service_node = Node(f"{self.get_name()}_services", namespace=self.get_namespace(),
                                 context=self.context, use_global_arguments=False,
                                 start_parameter_services=False)
        # reentrant: a call that writes files (a slow disk) never holds up another service
        self._service_group = ReentrantCallbackGroup()
        self._save_lock = threading.Lock()
        prefix = self.get_fully_qualified_name().rstrip("/")
        # Not `self._services` or `self._timers`: those are rclpy Node's own lists (the parameter
        # services live there; replacing them dropped them and made this executor serve the helper's).
        self._service_handles = [
            self.service_node.create_service(Trigger, f"{prefix}/reset", self._srv_reset,
                                             callback_group=self._service_group),
            self.service_node.create_service(SetBool, f"{prefix}/set_deferred_eviction", self._srv_set_deferred,
                                             callback_group=self._service_group),
            self.service_node.create_service(CommitEviction, f"{prefix}/commit_eviction", self._srv_commit,
                                             callback_group=self._service_group),
            self.service_node.create_service(RollbackFrame, f"{prefix}/rollback_last_frame", self._srv_rollback,
                                             callback_group=self._service_group),
            self.service_node.create_service(SaveMap, f"{prefix}/save_map", self._srv_save_map,
                                             callback_group=self._service_group),
        ]
        self._heartbeat: Command | None = None
        self._map_version = -1
        # Timers run on the steady clock: with use_sim_time and no /clock, /diagnostics and the
        # status heartbeat go on (and say so) instead of stopping without a word.
        self._steady = Clock(clock_type=ClockType.STEADY_TIME)
        self._sim_time_seen: tuple[int, float] | None = None  # (ROS time ns, steady s) when it last moved
        self._timer_handles = [self.create_timer(1.0, self._on_second, callback_group=self._timer_group,
                                                 clock=self._steady)]
        self._rate_timers: dict[str, Any] = {}
        self._set_rate_timer("path", s.path_publish_rate)
        self._set_rate_timer("map", s.map_publish_rate)
        self.add_on_set_parameters_callback(self._check_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)
        self.engine.start()
        if s.input_transport == "raw" and _fastdds_without_profile():
            log.warning("FASTDDS_DEFAULT_PROFILES_FILE is not set: with Fast DDS a raw image over 512 KB (518x378 "
                        "RGB and larger) travels as UDP fragments and is often lost on a best-effort subscription. "
                        "Start the camera driver (and this node) with FASTDDS_DEFAULT_PROFILES_FILE=<share>/"
                        "lingbot_map_ros/config/fastdds_large_messages.xml (the launch file sets it for the node), "
                        "or use compressed input")
        log.info(f"ready: listening on {self.image_sub.topic_name} ({s.input_transport}, {s.input_qos} QoS), "
                 f"device {s.stream.device}, backend {session.backend.name}, dtype {s.stream.dtype}")

    # ------------------------------------------------------------------ start-up
    def _read_parameters(self) -> NodeSettings:
        try:
            for p in PARAMETERS:
                self.declare_parameter(p.name, p.default, descriptor(p))
            values = {p.name: self.get_parameter(p.name).value for p in PARAMETERS}
            return resolve_settings(values, log=self.get_logger().info)
        except (ParameterException, ConfigError) as exc:
            raise StartupError(f"invalid parameters: {exc}") from None

    def _check_parameters(self, params) -> SetParametersResult:
        """on_set_parameters: refuse (with the reason) a value the node cannot take at run time."""
        settings = self.settings
        for p in params:
            if p.name not in _PARAMETER_TABLE:  # rclpy's own (use_sim_time, qos overrides)
                continue
            try:
                settings = apply_dynamic(settings, p.name, p.value)
            except ConfigError as exc:
                return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _apply_parameters(self, params) -> None:
        """post_set_parameters: the accepted values take effect (checked by ``_check_parameters``)."""
        s = self.settings
        for p in params:
            if p.name in _PARAMETER_TABLE:
                s = apply_dynamic(s, p.name, p.value)
        self.settings = self.outputs.settings = self.outputs.tf.settings = s
        if s.publish_tf:
            self.outputs.tf.start()  # the tf2 broadcaster/listener, made once, on this (executor) thread
        engine_deferred = self.engine.settings.deferred_eviction
        self.engine.settings = replace(s, deferred_eviction=engine_deferred)
        if s.deferred_eviction != engine_deferred:
            self.engine.submit("set_deferred_eviction", lambda: self.engine.set_deferred_eviction(s.deferred_eviction))
        names = {p.name for p in params}
        if "path_publish_rate" in names:
            self._set_rate_timer("path", s.path_publish_rate)
        if "map_publish_rate" in names:
            self._set_rate_timer("map", s.map_publish_rate)
        for p in params:
            self.get_logger().info(f"parameter {p.name} set to {p.value!r}")

    def _set_rate_timer(self, which: str, rate: float) -> None:
        """(Re)create the ~/path or ~/map_points timer at ``rate`` Hz (0 = none)."""
        old = self._rate_timers.pop(which, None)
        if old is not None:
            self.destroy_timer(old)
        publisher, callback = ((self.outputs.path, self.outputs.flush_path) if which == "path"
                               else (self.outputs.map_points, self._on_map_timer))
        if publisher is not None and rate > 0:
            self._rate_timers[which] = self.create_timer(1.0 / rate, callback, callback_group=self._timer_group,
                                                         clock=self._steady)

    def _load_session(self):
        """The one place the model is built: configs -> weights -> device -> session."""
        from ..stream import BackendUnavailable
        from ..io.checkpoint import CheckpointError, load_model
        from ..stream.long_stream import LongStreamSession
        from ..stream.session import StreamingSession

        s = self.settings
        if s.checkpoint is None:
            self.get_logger().warning("checkpoint is empty: the model has RANDOM weights (seed "
                                      f"{s.seed}); poses, depth and points are MEANINGLESS. Set the checkpoint "
                                      "parameter to a .pt/.safetensors file or a Hugging Face id.")
        t0 = time.perf_counter()
        try:
            model = load_model(s.model, s.checkpoint, s.stream.device, s.stream.dtype, seed=s.seed)
            session = LongStreamSession(StreamingSession(model, s.stream), s.long_stream)
        except (CheckpointError, BackendUnavailable, ConfigError) as exc:
            raise StartupError(str(exc)) from None
        self.get_logger().info(f"model loaded in {time.perf_counter() - t0:.1f} s "
                               f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
        return session

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    # ------------------------------------------------------------------ input
    def _camera_frame(self, header_frame: str) -> str:
        s = self.settings
        if s.camera_frame:
            return s.camera_frame
        if header_frame:
            return header_frame
        info = self.camera_info
        return info.header.frame_id if info is not None and info.header.frame_id else DEFAULT_CAMERA_FRAME

    def _on_image(self, msg: Image) -> None:
        self._accept(msg, image_to_rgb)

    def _on_compressed(self, msg: CompressedImage) -> None:
        self._accept(msg, compressed_to_rgb)

    def _accept(self, msg, convert) -> None:
        t0 = time.perf_counter()
        # age on arrival (publisher + transport + executor), reported in /diagnostics: a
        # transport problem (e.g. large raw images as UDP fragments) shows up here first
        self._arrival_age_s.append(self._now() - stamp_seconds(msg.header.stamp))
        try:
            rgb = convert(msg)
        except Exception as exc:  # ImageConversionError, and anything odd a decoder raises
            self.engine.reject_frame(msg.header.stamp, str(exc))
            return
        self.engine.submit_frame(InputFrame(rgb=rgb, stamp=msg.header.stamp, stamp_s=stamp_seconds(msg.header.stamp),
                                            camera_frame=self._camera_frame(msg.header.frame_id),
                                            convert_ms=(time.perf_counter() - t0) * 1e3,
                                            camera=self.camera_model))

    def _on_depth(self, msg: Image) -> None:
        """scale_source depth: cache the image (16UC1 millimetres or 32FC1 metres) by its stamp."""
        try:
            depth = sensor_depth_array(msg)
        except Exception as exc:  # ImageConversionError and odd buffers
            self.engine.throttle.emit(self.get_logger().warning, f"ignoring a depth image: {exc}", kind="depth msg")
            return
        self.engine.depth_cache.put(stamp_seconds(msg.header.stamp), depth)

    def _on_camera_info(self, msg: CameraInfo) -> None:
        """Keep the latest usable CameraInfo (for /diagnostics); warn (throttled) about unusable ones."""
        fx, fy = msg.k[0], msg.k[4]
        problem = ("an empty image size" if msg.width == 0 or msg.height == 0 else
                   "non-finite K" if not all(math.isfinite(v) for v in msg.k) else
                   "a focal length that is not positive" if not (fx > 0 and fy > 0) else None)
        if problem is not None:
            self.engine.throttle.emit(self.get_logger().warning,
                                      f"ignoring camera_info with {problem} (image size {msg.width}x{msg.height})")
            return
        try:  # the undistortion's camera (the engine thread builds and caches its remap grid)
            self.camera_model = CameraModel.from_camera_info(msg)
        except ValueError as exc:  # e.g. a distortion model it does not know
            self.camera_model = None
            self.engine.throttle.emit(self.get_logger().warning, f"camera_info cannot be used to undistort: {exc}",
                                      kind="camera_info model")
        self.camera_info = msg

    # ------------------------------------------------------------------ services
    def _run(self, name: str, fn) -> tuple[bool, Any, str]:
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
        ok, text, error = self._run("reset", self.engine.reset)
        response.success, response.message = ok, text if ok else error
        self.get_logger().info(f"~/reset: {response.message}")
        return response

    def _srv_set_deferred(self, request: SetBool.Request, response: SetBool.Response) -> SetBool.Response:
        ok, text, error = self._run("set_deferred_eviction", lambda: self.engine.set_deferred_eviction(request.data))
        response.success, response.message = ok, text if ok else error
        return response

    def _srv_commit(self, request, response):
        expected = int(request.expected_frame_index)
        ok, freed, error = self._run("commit_eviction", lambda: self.engine.commit_eviction(expected))
        response.success = ok
        response.pages_freed = int(freed or 0)
        response.message = (f"{freed} page(s) freed" if freed else "nothing was pending") if ok else error
        return response

    def _srv_rollback(self, request, response):
        expected = int(request.expected_frame_index)
        ok, index, error = self._run("rollback_last_frame", lambda: self.engine.rollback(expected))
        response.success = ok
        response.frame_index = int(index or 0)
        response.message = f"rolled back frame {index}" if ok else f"nothing rolled back: {error}"
        self.get_logger().info(f"~/rollback_last_frame({expected}): {response.message}")
        return response

    def _srv_save_map(self, request, response):
        # the inference thread only takes the snapshot; the files are written here, on a service
        # thread, so a slow disk holds up neither frames nor the other services
        ok, snapshot, error = self._run("save_map", self.engine.save_snapshot)
        paths = None
        if ok:
            ok, paths, error = self._write_map(snapshot, request.directory)
        response.success = ok
        if ok:
            ply, tum = paths
            response.ply_path, response.trajectory_path = str(ply), str(tum)
            response.message = f"wrote {ply} and {tum}"
        else:
            response.message = error
        self.get_logger().info(f"~/save_map: {response.message}")
        return response

    def _write_map(self, snapshot, directory: str) -> tuple[bool, Any, str]:
        timeout = self.settings.service_timeout
        if not self._save_lock.acquire(timeout=timeout):
            return False, None, f"another ~/save_map is still writing after {timeout:.1f} s; not saved"
        try:
            return True, write_map_files(snapshot, directory, self.settings.output_directory, timeout), ""
        except SaveError as exc:
            return False, None, str(exc)
        finally:
            self._save_lock.release()

    # ------------------------------------------------------------------ timers
    def _on_second(self) -> None:
        self.engine.clock_problem = self._clock_problem()
        if self._heartbeat is None or self._heartbeat.wait(0):
            self._heartbeat = self.engine.heartbeat()
        self.diagnostics.publish(self._diagnostics())

    def _clock_problem(self) -> str:
        """'no clock: ...' when use_sim_time is on and ROS time has not moved for 2 s, else ''."""
        if not self.get_parameter("use_sim_time").value:
            self._sim_time_seen = None
            return ""
        now_ns, steady = self.get_clock().now().nanoseconds, self._steady.now().nanoseconds * 1e-9
        if self._sim_time_seen is None or now_ns != self._sim_time_seen[0]:
            self._sim_time_seen = (now_ns, steady)
        stalled = steady - self._sim_time_seen[1]
        if now_ns == 0 or stalled >= 2.0:
            return ("no clock: use_sim_time is true and /clock " +
                    ("was never received" if now_ns == 0 else f"has not advanced for {stalled:.0f} s"))
        return ""

    def _on_map_timer(self) -> None:
        pub = self.outputs.map_points
        if pub.get_subscription_count() == 0 or self.engine.map.version == self._map_version:
            return
        points, colors, version = self.engine.map.snapshot()
        scale = self.engine.applied_scale  # the map is kept in model units
        if scale != 1.0:
            points = scale_points(points, scale).astype(np.float32)
        header = Header(stamp=self.outputs.latest_stamp, frame_id=self.settings.map_frame)
        pub.publish(make_pointcloud2(points, colors, None, header))
        self._map_version = version

    def _diagnostics(self) -> DiagnosticArray:
        s, e = self.settings, self.engine
        c = e.counters.snapshot()
        quiet = e.seconds_since_input()
        topic = self.image_sub.topic_name
        name = self.get_fully_qualified_name()
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
                      f"{1e3 * statistics.median(self._arrival_age_s):.1f}" if self._arrival_age_s else "n/a"}
        info = self.camera_info
        if info is not None and info.k[0] > 0 and e.last_intrinsics is not None:
            K, width, _ = e.last_intrinsics
            values["camera_info fx (input px)"] = f"{info.k[0]:.1f}"
            values["estimated fx (input px)"] = f"{K[0, 0] * info.width / width:.1f}" if info.width else "n/a"
        statuses = [_diag(f"{name}: input", level, message, values)]
        clock = e.clock_problem
        statuses.append(_diag(f"{name}: clock", DiagnosticStatus.WARN if clock else DiagnosticStatus.OK,
                              clock or "ok", {"use_sim_time": self.get_parameter("use_sim_time").value}))
        out_level = DiagnosticStatus.ERROR if int(e.state) == Status.STATE_ERROR else DiagnosticStatus.OK
        statuses.append(_diag(f"{name}: output", out_level, e.state_text, {
            "state": e.state.name, "output rate (Hz)": f"{e.output_rate.rate():.2f}",
            "frames processed": c.frames_processed, "frames dropped (stale)": c.frames_dropped_stale,
            "frames dropped (error)": c.frames_dropped_error, "clouds skipped (output thread behind)": e.clouds_skipped,
            "output thread queue": e.outputs.pending()}))
        statuses.append(_tracking_diag(name, e))
        statuses.append(_scale_diag(name, e))
        stats = e.last_stats
        if stats is None:
            statuses.append(_diag(f"{name}: cache", DiagnosticStatus.OK, "not allocated yet (no frame)", {}))
        else:
            used = stats.scale_pages + stats.window_pages
            total = used + stats.free_pages
            cache_level = DiagnosticStatus.WARN if stats.free_pages == 0 and stats.deferred else DiagnosticStatus.OK
            statuses.append(_diag(f"{name}: cache", cache_level, f"{used}/{total} pages in use", {
                "occupancy (%)": f"{100.0 * used / max(total, 1):.1f}", "stored frames": stats.resident_frames,
                "scale pages": stats.scale_pages, "window pages": stats.window_pages, "free pages": stats.free_pages,
                "pending evictions": stats.pending_evictions, "deferred eviction": stats.deferred}))
        return DiagnosticArray(header=Header(stamp=self.get_clock().now().to_msg()), status=statuses)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self.engine.stop()
        self.service_node.destroy_node()
        logging.getLogger("lingbot_map_ros").removeHandler(self._log_handler)


def _tracking_diag(name: str, engine: InferenceEngine) -> DiagnosticStatus:
    """/diagnostics "tracking": OK tracking/initializing, WARN degraded, ERROR lost."""
    state = engine.health.state.value
    level = {"degraded": DiagnosticStatus.WARN, "lost": DiagnosticStatus.ERROR}.get(state, DiagnosticStatus.OK)
    reasons = ", ".join(engine.tracking_reasons)
    return _diag(f"{name}: tracking", level, state + (f" ({reasons})" if reasons else ""), {
        "state": state, "reasons": reasons or "none", "on_lost": engine.settings.on_lost,
        "lost resets": engine.lost_resets})


def _scale_diag(name: str, engine: InferenceEngine) -> DiagnosticStatus:
    """/diagnostics "scale": OK when none/fixed/converged, WARN while an estimate has not converged."""
    kind, src = engine.settings.scale_source, engine.scale_source
    if src is None:
        return _diag(f"{name}: scale", DiagnosticStatus.OK, "model units (scale_source none)", {"source": kind})
    status = src.as_status()
    level = DiagnosticStatus.OK if src.converged else DiagnosticStatus.WARN
    message = f"{engine.applied_scale:.4f} m per model unit" if src.converged else "not converged: model units"
    return _diag(f"{name}: scale", level, message, {k: v for k, v in status.items()})


def _diag(name: str, level: bytes, message: str, values: dict) -> DiagnosticStatus:
    return DiagnosticStatus(level=level, name=name, message=message, hardware_id=NODE_NAME,
                            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])


def _fastdds_without_profile() -> bool:
    """True when the RMW is Fast DDS (the default) and no XML profile is configured."""
    rmw = os.environ.get("RMW_IMPLEMENTATION", "") or "rmw_fastrtps_cpp"
    profile = os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or os.environ.get("FASTRTPS_DEFAULT_PROFILES_FILE")
    return rmw.startswith("rmw_fastrtps") and not profile


def _spin_quietly(executor) -> None:
    """Spin until the context shuts down (the service thread: its end is not an error)."""
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass


SERVICE_THREADS = 4  # concurrent service calls (a slow ~/save_map does not block ~/reset)
SPIN_PERIOD = 0.2  # s; the main loop's longest wait, so SIGINT/SIGTERM are handled promptly
GIL_SWITCH_ENV = "LINGBOT_GIL_SWITCH_MS"
GIL_SWITCH_MS = 0.5


def set_gil_switch_interval(environ=os.environ) -> float:
    """Shorten CPython's GIL switch interval (5 ms by default) for this latency-bound process.

    A thread that wakes up (the inference thread handed a frame, or back from waiting for
    the GPU) must get the GIL from whichever thread runs Python (the executor after a
    callback, the output thread); it is only forced to let go after the switch interval,
    so each hand-over can cost up to 5 ms. ``LINGBOT_GIL_SWITCH_MS`` overrides the 0.5 ms
    used here (0 keeps Python's default). Returns the interval in force (s)."""
    raw = environ.get(GIL_SWITCH_ENV, "").strip()
    try:
        ms = GIL_SWITCH_MS if raw == "" else float(raw)
    except ValueError:
        ms = -1.0
    if not ms >= 0:  # not a number, negative, or NaN
        sys.stderr.write(f"lingbot_map_node: ignoring {GIL_SWITCH_ENV}={raw!r} (expected milliseconds >= 0); "
                         f"using {GIL_SWITCH_MS} ms\n")
        ms = GIL_SWITCH_MS
    if ms > 0:
        sys.setswitchinterval(ms / 1e3)
    return sys.getswitchinterval()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # while the model loads, SIGTERM ends the node the way SIGINT does


def main(args: list[str] | None = None) -> int:
    """Console entry point ``lingbot_map_node``: exit status 0 on shutdown (SIGINT, SIGTERM), 1 when
    it cannot start.

    rclpy's own signal handlers are off: they would shut the context down while the inference and
    output threads still publish ("publisher's context is invalid"). Here SIGINT/SIGTERM end the
    spin loop, the threads stop, and only then is the context shut down."""
    set_gil_switch_interval()
    rclpy.init(args=args if args is not None else sys.argv, signal_handler_options=SignalHandlerOptions.NO)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        node = LingBotMapNode()
    except StartupError as exc:
        rclpy.logging.get_logger(NODE_NAME).error(f"cannot start: {exc}")
        rclpy.try_shutdown()
        return 1
    except KeyboardInterrupt:  # stopped while loading the model
        rclpy.try_shutdown()
        return 0
    # One executor thread for the node's callbacks: they are short (an image is converted and
    # handed over), and a pool of executor threads only adds GIL hand-offs that delay the
    # inference thread (the multi-threaded executor measured 2x the tail latency of this one,
    # benchmarks/node_probe.py). The services, which wait for the inference thread or write
    # files, get executor threads of their own.
    # From here a signal only sets a flag that the loop reads: an exception raised by a handler in
    # the middle of rclpy's C++ calls (taking a message) would surface as an unrelated error.
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    executor = SingleThreadedExecutor()
    services = MultiThreadedExecutor(num_threads=SERVICE_THREADS)
    services.add_node(node.service_node)
    service_thread = threading.Thread(target=_spin_quietly, args=(services,), name="lingbot_map_services",
                                      daemon=True)
    service_thread.start()
    executor.add_node(node)
    try:
        while rclpy.ok() and not stop.is_set():
            executor.spin_once(timeout_sec=SPIN_PERIOD)  # returns now and then so a signal is seen
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        node.shutdown()  # inference and output threads stop first: nothing publishes after this
        services.shutdown(timeout_sec=1.0)
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
