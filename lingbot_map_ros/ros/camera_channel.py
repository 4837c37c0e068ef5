"""One camera of the node: its inputs, its engine, its outputs and its services.

The node serves one ``CameraChannel`` per camera of its camera set: the node's one camera
(named "", parameter ``cameras`` empty) uses ``image`` (or ``image/compressed``), ``camera_info``
(and ``depth`` for ``scale_source depth``), publishes under ``~/`` and serves ``~/reset``,
``~/set_deferred_eviction``, ``~/commit_eviction``, ``~/rollback_last_frame``; a listed camera
``c`` has the same names under ``c/`` and ``~/c/``.

Inputs (executor thread): an image callback converts the message and hands the frame to the
engine's latest-frame slot (``InferenceEngine.submit_frame``), then yields the interpreter so the
inference thread starts on it at once; camera_info is kept for /diagnostics and undistortion;
depth images are cached for the depth scale. Outputs: ``outputs.RosOutputs``. Services: each
call is a command for the inference thread, waited for at most ``service_timeout``.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable

from geometry_msgs.msg import PoseWithCovarianceStamped
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CameraInfo, CompressedImage, Image
from std_srvs.srv import SetBool, Trigger

from lingbot_map_ros.srv import CommitEviction, RollbackFrame, SetPose

from ..journal import JournalRecorder
from ..robot.undistort import CameraModel
from ..runtime.engine import InferenceEngine
from ..runtime.frames import InputFrame
from ..runtime.multi_map import MapAligner
from ..runtime.params import DEFAULT_CAMERA_FRAME, NodeSettings
from ..runtime.pose_inputs import PoseInput, PoseRefused
from ..runtime.worker import Command
from .common import SERVICE_QOS, qos_profile, stamp_of_ns, stamp_seconds
from .conversions import compressed_to_rgb, image_to_rgb, sensor_depth_array
from .outputs import RosOutputs
from .tf_tools import SharedTf

ARRIVAL_WINDOW = 64  # images whose age on arrival /diagnostics summarises
SETTINGS_WAIT_S = 0.5  # s; longest wait of a parameter set for the inference thread to take the new settings


class CameraChannel:
    """A camera's subscriptions, outputs (``RosOutputs``), engine and services on ``node``.

    ``name`` "" = the node's one camera. Build order: the channel (outputs), ``attach`` (the engine
    on its session), ``subscribe``, ``create_services``. ``aligner``, ``tf_settings``, ``tf_shared``
    and ``pool``: see ``RosOutputs``."""

    def __init__(self, node: Node, name: str, settings: NodeSettings, aligner: MapAligner,
                 tf_settings: NodeSettings, tf_shared: SharedTf, pool: Callable[[], Any]) -> None:
        self.node, self.name = node, name
        self.prefix = f"{name}/" if name else ""
        self.settings = settings
        self.log = node.get_logger().get_child(name) if name else node.get_logger()
        self.outputs = RosOutputs(node, settings, name, aligner, tf_settings, tf_shared, pool)
        self.engine: InferenceEngine | None = None
        self.camera_info: CameraInfo | None = None
        self.camera_model: CameraModel | None = None
        self.arrival_age_s: deque[float] = deque(maxlen=ARRIVAL_WINDOW)  # executor thread only
        self.image_sub = self.camera_info_sub = self.depth_sub = self.prior_sub = None
        self.service_handles: list = []
        self._heartbeat: Command | None = None

    # -------------------------------------------------------------- build
    def attach(self, session, journal: JournalRecorder | None, now: Callable[[], float]) -> InferenceEngine:
        """Create the camera's engine on ``session`` (journaled by ``journal``; ROS time ``now`` in s)."""
        s = self.settings
        tf = self.outputs.tf
        self.engine = InferenceEngine(session, s, self.outputs, self.log, now=now, odom_position=tf.camera_position,
                                      camera_pose=tf.camera_pose, make_stamp=stamp_of_ns, journal=journal)
        if s.scale_source == "odometry" or s.on_lost != "continue":
            tf.start()  # its buffer serves the odom -> camera look-ups (scale, lost-reset map)
        return self.engine

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
        if s.loop_closure:  # poses from outside (GNSS, fiducials) as priors of the pose graph
            self.prior_sub = node.create_subscription(PoseWithCovarianceStamped, f"~/{p}pose_prior",
                                                      self.on_pose_prior, qos_profile(depth=10), callback_group=group)

    def unsubscribe(self) -> None:
        """Destroy the input subscriptions (a managed node's deactivate): no frame comes in after this."""
        for sub in (self.image_sub, self.camera_info_sub, self.depth_sub, self.prior_sub):
            if sub is not None:
                self.node.destroy_subscription(sub)
        self.image_sub = self.camera_info_sub = self.depth_sub = self.prior_sub = None

    def pause(self, timeout: float) -> bool:
        """After ``unsubscribe``: wait until the inference thread has finished the frame it is on and
        dropped the one waiting (counted as stale), and the output thread what it has; the engine's
        state (cache, path, map) stays. False when that took longer than ``timeout`` s."""
        seq = self.engine.seq

        def drop_waiting() -> None:
            if self.engine.queue.discard_frame() is not None:
                seq.count("frames_dropped_stale")

        ok, _, _ = self.run("deactivate", drop_waiting)
        return ok and self.engine.outputs.flush(timeout)

    def detach(self) -> None:
        """A managed node's cleanup (after ``unsubscribe``, its services destroyed, the engine stopped):
        drop the engine and the outputs. An executor may hold a destroyed subscription or service of
        this channel until it next wakes; through the channel it must not keep the model alive."""
        self.engine = self.outputs = self._heartbeat = None  # the last heartbeat command holds the engine

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
        if self.settings.loop_closure:
            self.service_handles.append(service_node.create_service(SetPose, f"{base}set_pose", self._srv_set_pose,
                                                                    qos_profile=SERVICE_QOS, callback_group=group))
        return self.service_handles

    # -------------------------------------------------------------- settings
    def apply_settings(self, s: NodeSettings) -> None:
        """Run-time parameter changes (executor thread), checked by the node before: the channel's own
        copy here, the engine's and the outputs' as a value through the engine's queue (they take
        effect between two items). Waits up to SETTINGS_WAIT_S for the inference thread to take them
        (about one step), so that a read right after the set sees them; a longer step (the first
        frame's compilation) is not waited for."""
        self.settings = s
        if s.publish_tf or s.on_lost != "continue":
            self.outputs.tf.start()  # the tf2 broadcaster/listener, made once, on this (executor) thread
        self.engine.configure(s).wait(SETTINGS_WAIT_S)

    # -------------------------------------------------------------- inputs (executor thread)
    def camera_frame(self, header_frame: str) -> str:
        s = self.settings
        if s.camera_frame:
            return s.camera_frame
        if header_frame:
            return header_frame
        info = self.camera_info
        return info.header.frame_id if info is not None and info.header.frame_id else DEFAULT_CAMERA_FRAME

    def accept(self, msg, convert, now: float | None = None) -> None:
        """Convert an image message and hand it to the engine."""
        t0 = time.perf_counter()
        # age on arrival (publisher + transport + executor), reported in /diagnostics: a
        # transport problem (e.g. large raw images as UDP fragments) shows up here first
        now_s = now if now is not None else self.node.get_clock().now().nanoseconds * 1e-9
        self.arrival_age_s.append(now_s - stamp_seconds(msg.header.stamp))
        try:
            rgb = convert(msg)
        except Exception as exc:  # ImageDecodeError, and anything odd a decoder raises
            self.engine.reject_frame(msg.header.stamp, str(exc))
            return
        self.engine.submit_frame(InputFrame(rgb=rgb, stamp=msg.header.stamp, stamp_s=stamp_seconds(msg.header.stamp),
                                            camera_frame=self.camera_frame(msg.header.frame_id),
                                            convert_ms=(time.perf_counter() - t0) * 1e3,
                                            camera=self.camera_model))
        # The inference thread, woken by the frame, starts on it now instead of waiting until this
        # thread's own bookkeeping is done or the switch interval forces it off (about 1 ms a frame
        # on a shared CPU; benchmarks/results/notes/node_latency.md).
        time.sleep(0)

    def on_depth(self, msg: Image) -> None:
        """scale_source depth: cache the image (16UC1 millimetres or 32FC1 metres) by its stamp."""
        try:
            depth = sensor_depth_array(msg)
        except Exception as exc:  # ImageDecodeError and odd buffers
            self.engine.throttle.emit(self.log.warning, f"ignoring a depth image: {exc}", kind="depth msg")
            return
        self.engine.seq.anchor.depth_cache.put(stamp_seconds(msg.header.stamp), depth)

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

    def on_pose_prior(self, msg: PoseWithCovarianceStamped) -> None:
        """~/pose_prior: handed to the inference thread; a refusal is logged and said on ~/status."""
        try:
            p = PoseInput.of(msg)
        except (TypeError, ValueError) as exc:
            self.log.warning(f"~/{self.prefix}pose_prior refused: {exc}")
            return

        def take() -> None:
            try:
                text = self._pose_input("prior", p)
            except PoseRefused as exc:
                text = f"pose prior refused: {exc}"
                self.engine.throttle.emit(self.log.warning, f"~/{self.prefix}pose_prior refused: {exc}",
                                          kind="pose prior")
            self.engine.reporter.publish(text, None)
        self.engine.submit("pose prior", take)

    def _pose_input(self, kind: str, p: PoseInput) -> str:
        placed = self.outputs.placement()
        if placed.transform is not None:
            raise PoseRefused(f"camera {self.name!r} is placed in {placed.frame!r} through another camera's map: "
                              "give poses to the camera that holds the map frame")
        return self.engine.loop_link.pose_input(kind, p, placed.frame)

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
        ok, text, error = self.run("reset", self.engine.commands.reset)
        response.success, response.message = ok, text if ok else error
        self.log.info(f"~/{self.prefix}reset: {response.message}")
        return response

    def _srv_set_deferred(self, request: SetBool.Request, response: SetBool.Response) -> SetBool.Response:
        ok, text, error = self.run("set_deferred_eviction",
                                   lambda: self.engine.commands.set_deferred_eviction(request.data))
        response.success, response.message = ok, text if ok else error
        return response

    def _srv_commit(self, request, response):
        expected = int(request.expected_frame_index)
        ok, freed, error = self.run("commit_eviction", lambda: self.engine.keyframes.commit_eviction(expected))
        response.success = ok
        response.pages_freed = int(freed or 0)
        response.message = (f"{freed} page(s) freed" if freed else "nothing was pending") if ok else error
        return response

    def _srv_set_pose(self, request, response):
        def body() -> str:
            try:
                return self._pose_input("set_pose", PoseInput.of(request.pose))
            except PoseRefused as exc:
                raise PoseRefused(f"refused: {exc}") from None
        ok, text, error = self.run("set_pose", body)
        response.success, response.message = ok, text if ok else error
        self.log.info(f"~/{self.prefix}set_pose: {response.message}")
        return response

    def _srv_rollback(self, request, response):
        expected = int(request.expected_frame_index)
        ok, index, error = self.run("rollback_last_frame", lambda: self.engine.keyframes.rollback(expected))
        response.success = ok
        response.frame_index = int(index or 0)
        response.message = f"rolled back frame {index}" if ok else f"nothing rolled back: {error}"
        self.log.info(f"~/{self.prefix}rollback_last_frame({expected}): {response.message}")
        return response


__all__ = ["CameraChannel", "ARRIVAL_WINDOW"]
