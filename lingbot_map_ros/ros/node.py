"""``lingbot_map_node``: the ROS 2 shell around the streaming session.

    python -m lingbot_map_ros.ros.main --ros-args --params-file config/lingbot_map.yaml
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

Threads. One executor thread runs the callbacks (``ros.main``): image callbacks only
convert the message and put it in the camera's depth-1 latest-frame slot (a frame still
waiting is replaced and counted as stale); one inference thread
(``runtime.scheduler.CameraScheduler``) runs every camera's engine
(``runtime.engine.InferenceEngine``: the model step, poses and status); one output thread
per camera (``runtime.output_worker``) builds the clouds, depth images and the map. The
services are served by a helper node (``<name>_services``, same service names under this
node) on a second executor thread: a call queues a command for the inference thread and
waits for it with ``service_timeout`` without holding up image intake. Skipped when
nobody listens: per-frame clouds, depth; the map is still accumulated when
``accumulate_map`` (``~/save_map`` needs it).

Start-up. Parameters map onto ModelConfig/StreamConfig (``node_parameters``, each value
logged); the model is loaded once (``startup.load_sessions``). A bad parameter, checkpoint or
backend ends the process with exit status 1 and one error line. With ``managed`` the node is a
lifecycle node (``lifecycle``): the same phases run at its transitions, and a failing configure
leaves it unconfigured instead of ending the process.

Nav2. With ``grid`` every camera's sequence feeds one occupancy grid in ``map_frame``, published
on ``~/grid`` and written by ``~/save_map`` as map_server files (``grid_outputs``).

One camera is the case of many. The node's cameras are one ``camera_set.CameraSet``: without
the parameter ``cameras`` a set of one camera (named "", the names above); with ``cameras``
(e.g. ``[front, rear]``) camera ``c`` has the names above under ``c/`` and ``~/c/`` and
``camera.<c>.*`` parameters (``runtime.params.CAMERA_PARAMETERS``). Every camera is a
``camera_channel.CameraChannel`` (subscriptions, outputs, services, its engine) on one
``stream.multi.CameraSessions`` (one model; one K/V storage shared by several cameras), every
engine is driven by the one ``CameraScheduler`` (round-robin), and every camera's outputs are
placed by the set's ``MapAligner``: the first camera defines ``map_frame``, the others join it
through the TF extrinsics; a camera that cannot (no ``base_frame``, an extrinsic missing)
publishes in ``<map_frame>_<c>``. ``~/save_map`` and ``~/map_points`` cover every camera
(``map_outputs``). One TF broadcaster, buffer and listener (``tf_tools.SharedTf``) serve every
camera's TF output and the alignment.
"""
from __future__ import annotations

import logging
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.exceptions import ParameterException
from rclpy.lifecycle import LifecyclePublisher
from rclpy.node import Node

from lingbot_map_ros.srv import SaveMap

from ..config import ConfigError
from ..journal import JournalError
from ..runtime.frames import StatusFields
from ..runtime.journaling import SessionError, close_journals
from ..runtime.params import NodeSettings, check_value
from ..runtime.scheduler import CameraScheduler
from .camera_channel import CameraChannel
from .camera_set import CameraSet
from .common import NODE_NAME, SERVICE_QOS, qos_profile
from .conversions import compressed_to_rgb, image_to_rgb
from .diagnostics import ClockWatch, node_diagnostics
from .grid_outputs import GridOutput
from .lifecycle import ManagedNode
from .map_outputs import MapSaving, MapTopics
from .node_parameters import PARAMETER_TABLE, declare_parameters, read_parameters, settings_after
from .sessions import SessionServices, open_journals
from .startup import (FASTDDS_WARNING, ForwardToRos, StartupError, fastdds_without_profile, load_sessions,
                      release_memory)
from .tf_tools import SharedTf

JOURNAL_CLOSE_S = 10.0  # s; how long shutdown waits for the journal writer to write what is queued


class LingBotMapNode(ManagedNode, Node):
    """See the module docstring. Raises StartupError when it cannot start.

    Spin ``service_node`` as well, on an executor of its own (``ros.main.main`` does): it serves
    the node's services.

    Phases (``ros.lifecycle``): ``configure_node`` (parameters, model, journals, engines, outputs,
    services, the inference thread), ``activate_node`` (subscriptions, timers), ``deactivate_node``,
    ``cleanup_node``. A plain node runs the first two at construction; a managed one
    (``managed:=true``) waits for its lifecycle transitions."""

    def __init__(self, node_name: str = NODE_NAME, **kwargs) -> None:
        Node.__init__(self, node_name, **kwargs)
        log = self.get_logger()
        self._log_handler = ForwardToRos(log)
        logging.getLogger("lingbot_map_ros").addHandler(self._log_handler)
        logging.getLogger("lingbot_map_ros").setLevel(logging.INFO)
        try:
            self.managed = declare_parameters(self)
        except ParameterException as exc:
            raise StartupError(f"invalid parameters: {exc}") from None
        self.settings: NodeSettings | None = None  # read at configure
        self.camera_settings: dict[str, NodeSettings] = {}
        self.channels: dict[str, CameraChannel] = {}
        self.scheduler: CameraScheduler | None = None
        self.grid: GridOutput | None = None
        # made at configure (``configure_node``), dropped at cleanup
        self.tf_shared = self.cameras = self.diagnostics = self.maps = self.map_saving = None
        self.session_services = self.sessions = None
        self._made: tuple[set, set, set] | None = None  # entities before configure (cleanup destroys the rest)
        # The services live on a helper node that ros.main spins on its own executor thread (see
        # ``_create_services``); made here so that an executor can take it before configure.
        self.service_node = Node(f"{self.get_name()}_services", namespace=self.get_namespace(),
                                 context=self.context, use_global_arguments=False,
                                 start_parameter_services=False)
        self._service_handles: list = []
        self._input_group = MutuallyExclusiveCallbackGroup()
        self._timer_group = MutuallyExclusiveCallbackGroup()
        # Timers run on the steady clock: with use_sim_time and no /clock, /diagnostics and the
        # status heartbeat go on (and say so) instead of stopping without a word.
        self._steady = Clock(clock_type=ClockType.STEADY_TIME)
        self._clock_watch = ClockWatch(self, self._steady)
        self._timer_handles: list = []
        self._rate_timers: dict[str, Any] = {}
        self.add_on_set_parameters_callback(self._check_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)
        if self.managed:
            self.start_lifecycle()
            log.info(f"managed node: unconfigured; waiting for the lifecycle transitions (configure, activate) on "
                     f"{self.get_fully_qualified_name()}/change_state")
            return
        self.configure_node()
        self.activate_node()

    # ------------------------------------------------------------------ phases (ros.lifecycle)
    def configure_node(self) -> None:
        """Parameters read and checked, the model loaded (the memory check first), the journals opened,
        a channel per camera (its engine and publishers), ~/grid, the services; the inference thread
        started (idle: nothing is subscribed). StartupError with the reason."""
        log = self.get_logger()
        self._made = (set(self.publishers), set(self.subscriptions), set(self.timers))
        try:
            self.settings, self.camera_settings = read_parameters(self)
        except (ParameterException, ConfigError) as exc:
            raise StartupError(f"invalid parameters: {exc}") from None
        s = self.settings
        # one TF broadcaster, buffer and listener for every camera and the alignment (started by its
        # first user: the alignment at once when base_frame is set, a camera that publishes TF)
        self.tf_shared = SharedTf(self)
        self.cameras = CameraSet(s, list(self.camera_settings), self.tf_shared, log)
        self._start_cameras()
        self.diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", qos_profile())
        self.maps = MapTopics(self, self.channels, s)  # ~/[<c>/]map_points (and listed cameras' ~/map_points)
        self.grid = GridOutput(self, self.channels, self.cameras.reference, s, self.tf_shared,
                               self.cameras.aligner) if s.grid else None
        self._create_services(log)
        self.scheduler.start()

    def activate_node(self) -> None:
        """Inputs subscribed, timers started: frames flow."""
        s, log = self.settings, self.get_logger()
        for channel in self.channels.values():  # converters named here so that a profiler may wrap them
            channel.subscribe(self._input_group, None, image_to_rgb, compressed_to_rgb)
        self._timer_handles = [self.create_timer(1.0, self._on_second, callback_group=self._timer_group,
                                                 clock=self._steady)]
        self._set_rate_timer("path", s.path_publish_rate)
        self._set_rate_timer("map", s.map_publish_rate)
        self._set_rate_timer("grid", s.grid_publish_rate)
        if "raw" in {c.settings.input_transport for c in self.channels.values()} and fastdds_without_profile():
            log.warning(FASTDDS_WARNING)
        for channel in self.channels.values():
            cs = channel.settings
            log.info(f"ready: listening on {channel.image_sub.topic_name} ({cs.input_transport}, {cs.input_qos} QoS), "
                     f"device {cs.stream.device}, backend {channel.engine.session.inner.backend.name}, "
                     f"dtype {cs.stream.dtype}")

    def deactivate_node(self) -> None:
        """Inputs unsubscribed and timers stopped, then each camera's frame in progress finished (a
        frame still waiting is dropped as stale); the engines keep their state."""
        for channel in self.channels.values():
            channel.unsubscribe()
        for timer in self._timer_handles + list(self._rate_timers.values()):
            self.destroy_timer(timer)
        self._timer_handles, self._rate_timers = [], {}
        timeout = self.settings.service_timeout if self.settings is not None else 5.0
        for name, channel in self.channels.items():
            if not channel.pause(timeout):
                self.get_logger().warning(f"deactivate: camera {name or '(one)'} did not finish its frame within "
                                          f"{timeout:.1f} s")

    def cleanup_node(self) -> None:
        """Threads stopped, journals closed, everything ``configure_node`` made destroyed, the model and
        sessions released (also after a configure that failed half way)."""
        self._stop_threads()
        for handle in self._service_handles:
            self.service_node.destroy_service(handle)
        self._service_handles = []
        if self._made is not None:
            publishers, subscriptions, timers = self._made
            for publisher in [p for p in self.publishers if p not in publishers]:
                if isinstance(publisher, LifecyclePublisher):
                    self.destroy_lifecycle_publisher(publisher)
                else:
                    self.destroy_publisher(publisher)
            for subscription in [x for x in self.subscriptions if x not in subscriptions]:
                self.destroy_subscription(subscription)
            for timer in [t for t in self.timers if t not in timers]:
                self.destroy_timer(timer)
            self._made = None
        self._timer_handles, self._rate_timers = [], {}
        for channel in self.channels.values():
            if channel.engine is not None:  # a job queued after the stop (a save, a timer) started its output
                channel.engine.stop(JOURNAL_CLOSE_S)  # thread again: stopped and joined before the model goes
            channel.detach()
        self.channels.clear()
        self.tf_shared = self.cameras = self.diagnostics = self.maps = self.map_saving = None
        self.session_services = self.sessions = self.grid = self.settings = None
        self.camera_settings = {}
        release_memory()

    # ------------------------------------------------------------------ start-up
    def _start_cameras(self) -> None:
        """A channel per camera of the set, the model and a session each, one ``CameraScheduler``
        driving them all."""
        s, cameras = self.settings, self.cameras
        for name, cs in self.camera_settings.items():
            channel = CameraChannel(self, name, cs, cameras.aligner, cameras.tf_settings(name, cs), self.tf_shared,
                                    cameras.pool.status)
            self.channels[name] = channel
            channel.outputs.publish_status(StatusFields(state=0, state_text="loading the model"), None)
        self.sessions = load_sessions(s, self.camera_settings, self.get_logger())
        cameras.pool.attach(self.sessions)  # read from here on (a resume's statuses show it)
        journals, resumed = self._open_journals(self.sessions.sessions)
        for name, channel in self.channels.items():
            channel.attach(self.sessions.sessions[name], journals[name], self._now)
            channel.engine.commands.resumed_from(resumed[name])
        batch = self.sessions.submit_many if s.camera_batching and len(self.channels) > 1 else None
        pipeline = s.camera_pipelining and len(self.channels) > 1  # one camera: nothing to overlap with
        self.scheduler = CameraScheduler({name: ch.engine for name, ch in self.channels.items()}, batch=batch,
                                         pipeline=pipeline)
        cameras.announce()

    def _open_journals(self, sessions: dict) -> tuple[dict, dict]:
        """state_directory / load_session: each camera's session journaled (and rebuilt from its
        journal or the saved session) before anything is subscribed (``ros.sessions``)."""
        try:
            return open_journals(self.channels, sessions, self.camera_settings)
        except (SessionError, JournalError, OSError) as exc:
            what = f"{exc.strerror or exc}: {exc.filename}" if isinstance(exc, OSError) and exc.filename else str(exc)
            raise StartupError(f"state_directory / load_session: {what}") from None

    def _create_services(self, log) -> None:
        """The services live on the helper node ``service_node`` that ros.main spins on its own executor
        thread: a call waits for the inference thread (one step, or up to service_timeout while the
        first frame compiles), and image intake, timers and diagnostics must not wait with it. Their
        names are this node's (~/reset is <this node>/reset whatever the helper is called)."""
        group = ReentrantCallbackGroup()  # a call that writes files (a slow disk) never holds up another
        self.map_saving = MapSaving(self.channels, lambda: self.settings, log, self.grid)
        prefix = self.get_fully_qualified_name().rstrip("/")
        # Not `self._services`: that is rclpy Node's own list (the parameter services live there;
        # replacing it dropped them and made this executor serve the helper's).
        self._service_handles = []
        for channel in self.channels.values():
            self._service_handles += channel.create_services(self.service_node, prefix, group)
        self._service_handles.append(self.service_node.create_service(
            SaveMap, f"{prefix}/save_map", self.map_saving.save, qos_profile=SERVICE_QOS, callback_group=group))
        self.session_services = SessionServices(self.channels, lambda: self.settings, log, self.service_node, prefix,
                                                group)
        self._service_handles += self.session_services.handles

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    # ------------------------------------------------------------------ parameters at run time
    def _settings_after(self, params):
        return settings_after(self.settings, {name: ch.settings for name, ch in self.channels.items()}, params)

    def _check_parameters(self, params) -> SetParametersResult:
        """on_set_parameters: refuse (with the reason) a value the node cannot take now. Unconfigured (a
        managed node before configure or after cleanup): any valid value, read at configure."""
        try:
            if self.settings is None:
                for p in params:
                    if p.name in PARAMETER_TABLE:
                        check_value(PARAMETER_TABLE[p.name], p.value)
                return SetParametersResult(successful=True)
            for p in params:  # a managed node's parameters are writable: only the dynamic ones while configured
                if self.managed and p.name in PARAMETER_TABLE and not PARAMETER_TABLE[p.name].dynamic:
                    raise ConfigError(f"parameter {p.name} is read at configure: set it while the node is "
                                      "unconfigured (cleanup first)")
            self._settings_after(params)
        except ConfigError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _apply_parameters(self, params) -> None:
        """post_set_parameters: the accepted values take effect (checked by ``_check_parameters``)."""
        if self.settings is None:  # unconfigured: configure reads them
            return
        self.settings, per_camera = self._settings_after(params)
        for name, channel in self.channels.items():
            channel.apply_settings(per_camera[name])
        names = {p.name for p in params}
        active = bool(self._timer_handles)  # rate timers run while the node is active
        for which in ("path", "map", "grid"):
            if f"{which}_publish_rate" in names and active:
                self._set_rate_timer(which, getattr(self.settings, f"{which}_publish_rate"))
        for p in params:
            self.get_logger().info(f"parameter {p.name} set to {p.value!r}")

    def _set_rate_timer(self, which: str, rate: float) -> None:
        """(Re)create the ~/path, ~/map_points or ~/grid timer at ``rate`` Hz (0 = none)."""
        old = self._rate_timers.pop(which, None)
        if old is not None:
            self.destroy_timer(old)
        if which == "path":
            publisher = any(c.outputs.path is not None for c in self.channels.values())
            callback = self._flush_paths
        elif which == "map":
            publisher = self.maps.any_published()
            callback = self.maps.publish
        else:
            publisher = self.grid is not None
            callback = self._publish_grid
        if publisher and rate > 0:
            self._rate_timers[which] = self.create_timer(1.0 / rate, callback, callback_group=self._timer_group,
                                                         clock=self._steady)

    # ------------------------------------------------------------------ timers
    def _on_second(self) -> None:
        clock = self._clock_watch.problem()
        for channel in self.channels.values():
            channel.beat(clock)
            channel.outputs.publish_loop_closures(channel.engine.loop, channel.engine.seq.anchor.output)
        self.diagnostics.publish(node_diagnostics(self, clock))

    def _flush_paths(self) -> None:
        for channel in self.channels.values():
            channel.outputs.flush_path()

    def _publish_grid(self) -> None:
        # through the node, not a bound method of the grid: an executor that still holds a destroyed
        # timer (until it wakes) must not keep the grid, and with it the engine and the model, alive
        if self.grid is not None:
            self.grid.publish()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """The end of the process (``ros.main``): the threads stopped and the journals closed (any
        state), the services' helper node destroyed."""
        self._stop_threads()
        self.service_node.destroy_node()
        logging.getLogger("lingbot_map_ros").removeHandler(self._log_handler)

    def _stop_threads(self) -> None:
        """The inference and output threads stopped, what was journaled on the disk (nothing to do
        when unconfigured)."""
        if self.scheduler is None:
            return
        self.scheduler.stop()
        for camera, channel in self.channels.items():  # what was journaled reaches the disk
            cost = close_journals(channel.engine, JOURNAL_CLOSE_S) if channel.engine is not None else ""
            if cost:
                self.get_logger().info(f"{camera or 'camera'}: {cost}")
        self.scheduler = None


__all__ = ["LingBotMapNode", "StartupError"]
