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

Start-up. Parameters map onto ModelConfig/StreamConfig in ``runtime.params.resolve_settings``
(each value logged); the model is loaded in ``_load_sessions``. A bad parameter,
checkpoint or backend ends the process with exit status 1 and one error line.

One path for one camera and several. Every camera is a ``camera_channel.CameraChannel``
(subscriptions, outputs, services, its engine: sequence, trajectory, map, latest-frame
slot) and every camera's engine is driven by the one ``CameraScheduler``. Without the
parameter ``cameras`` the node has ONE unnamed camera with the names above. With
``cameras`` (e.g. ``[front, rear]``) one model and one K/V storage serve every camera
(``stream.multi.CameraSessions``); camera ``c`` has the names above under ``c/``
(subscriptions ``c/image`` or ``c/image/compressed``, ``c/camera_info``, ``c/depth``) and
``~/c/`` (outputs and the services reset, set_deferred_eviction, commit_eviction,
rollback_last_frame) and ``camera.<c>.*`` parameters (``runtime.params.CAMERA_PARAMETERS``);
the scheduler runs the cameras' frames and commands round-robin. ``~/save_map`` and
``~/map_points`` cover every camera (``map_outputs``): the first camera defines ``map_frame``
and the others join it through the TF extrinsics (``named_cameras``, ``runtime.multi_map``); a
camera that cannot (no ``base_frame``, an extrinsic missing) publishes in ``<map_frame>_<c>``.
/diagnostics gets the shared pool and every camera's entries. One TF broadcaster, buffer and listener
(``tf_tools.SharedTf``) serve every camera's TF output and the alignment.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.exceptions import ParameterException
from rclpy.node import Node
from rclpy.parameter import Parameter
from std_msgs.msg import Header

from lingbot_map_ros.srv import SaveMap

from ..config import ConfigError
from ..journal import JournalError
from ..runtime.frames import StatusFields
from ..runtime.journaling import SessionError
from ..runtime.params import (CAMERA_PARAMETERS, CAMERA_PREFIX, PARAMETERS, NodeSettings, Param, apply_camera_dynamic,
                              apply_dynamic, camera_param_name, camera_values, resolve_camera_settings,
                              resolve_settings)
from ..runtime.scheduler import CameraScheduler
from .camera_channel import NODE_NAME, SERVICE_QOS, CameraChannel, diag, qos_profile
from .conversions import compressed_to_rgb, image_to_rgb
from .map_outputs import MapSaving, MapTopics
from .named_cameras import NamedCameras
from .sessions import SessionServices, journal_diag, open_journals
from .tf_tools import SharedTf

_PARAMETER_TABLE = {p.name: p for p in PARAMETERS}
JOURNAL_CLOSE_S = 10.0  # s; how long shutdown waits for the journal writer to write what is queued


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


class LingBotMapNode(Node):
    """See the module docstring. Raises StartupError when it cannot start.

    Spin ``service_node`` as well, on an executor of its own (``ros.main.main`` does): it serves
    the node's services."""

    def __init__(self, node_name: str = NODE_NAME, **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        log = self.get_logger()
        self._log_handler = _ForwardToRos(log)
        logging.getLogger("lingbot_map_ros").addHandler(self._log_handler)
        logging.getLogger("lingbot_map_ros").setLevel(logging.INFO)
        self.settings = self._read_parameters()
        s = self.settings
        # one TF broadcaster, buffer and listener for every camera and the alignment (started by its
        # first user: the alignment at once when base_frame is set, a camera that publishes TF)
        self.tf_shared = SharedTf(self)
        self.sessions = None  # CameraSessions of the named cameras (one K/V storage); None for the unnamed one
        self.channels: dict[str, CameraChannel] = {}
        # named cameras: one map (the alignment, started at once when base_frame is set) and one pool
        self.named = NamedCameras(s, self.tf_shared, self.channels, log) if s.cameras else None
        self._start_cameras()

        self._input_group = MutuallyExclusiveCallbackGroup()
        self._timer_group = MutuallyExclusiveCallbackGroup()
        for channel in self.channels.values():  # converters named here so that a profiler may wrap them
            channel.subscribe(self._input_group, None, image_to_rgb, compressed_to_rgb)
        self.diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", qos_profile())
        self.maps = MapTopics(self, self.channels, s)  # ~/[<c>/]map_points (and named cameras' ~/map_points)
        # The services live on a helper node that ros.main spins on its own executor thread: a
        # call waits for the inference thread (one step, or up to service_timeout while the
        # first frame compiles), and image intake, timers and diagnostics must not wait with it.
        # Their names are this node's (~/reset is <this node>/reset whatever the helper is called).
        self.service_node = Node(f"{self.get_name()}_services", namespace=self.get_namespace(),
                                 context=self.context, use_global_arguments=False,
                                 start_parameter_services=False)
        # reentrant: a call that writes files (a slow disk) never holds up another service
        self._service_group = ReentrantCallbackGroup()
        self.map_saving = MapSaving(self.channels, lambda: self.settings, log)
        prefix = self.get_fully_qualified_name().rstrip("/")
        # Not `self._services` or `self._timers`: those are rclpy Node's own lists (the parameter
        # services live there; replacing them dropped them and made this executor serve the helper's).
        self._service_handles = []
        for channel in self.channels.values():
            self._service_handles += channel.create_services(self.service_node, prefix, self._service_group)
        self._service_handles.append(self.service_node.create_service(
            SaveMap, f"{prefix}/save_map", self.map_saving.save, qos_profile=SERVICE_QOS,
            callback_group=self._service_group))
        self.session_services = SessionServices(self.channels, lambda: self.settings, log, self.service_node, prefix,
                                                self._service_group)
        self._service_handles += self.session_services.handles
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
        self.scheduler.start()
        transports = {c.settings.input_transport for c in self.channels.values()}
        if "raw" in transports and _fastdds_without_profile():
            log.warning("FASTDDS_DEFAULT_PROFILES_FILE is not set: with Fast DDS a raw image over 512 KB (518x378 "
                        "RGB and larger) travels as UDP fragments and is often lost on a best-effort subscription. "
                        "Start the camera driver (and this node) with FASTDDS_DEFAULT_PROFILES_FILE=<share>/"
                        "lingbot_map_ros/config/fastdds_large_messages.xml (the launch file sets it for the node), "
                        "or use compressed input")
        for channel in self.channels.values():
            cs = channel.settings
            log.info(f"ready: listening on {channel.image_sub.topic_name} ({cs.input_transport}, {cs.input_qos} QoS), "
                     f"device {cs.stream.device}, backend {channel.engine.session.backend.name}, "
                     f"dtype {cs.stream.dtype}")

    # ------------------------------------------------------------------ start-up
    def _start_cameras(self) -> None:
        """A channel per camera (the unnamed one when ``cameras`` is empty: today's names), the
        model and a session each, one ``CameraScheduler`` driving them all."""
        s = self.settings
        names = list(self.camera_settings)
        reference = names[0]
        for name in names:
            cs = self.camera_settings[name]
            placer = tf_settings = pool = None
            if self.named is not None:  # placed in one map, TF of the others to the first
                placer, pool = self.named.placer(name), self.named.pool.status
                tf_settings = self.named.tf_settings(name, cs)
            channel = CameraChannel(self, name, cs, placer, tf_settings=tf_settings, tf_shared=self.tf_shared,
                                    pool=pool)
            self.channels[name] = channel
            channel.outputs.publish_status(StatusFields(state=0, state_text="loading the model"), None)
        sessions = self._load_sessions()
        if self.named is not None:
            self.named.pool.attach(self.sessions)  # read from here on (a resume's statuses show it)
        resumed = self._open_journals(sessions)
        for name, channel in self.channels.items():
            channel.attach(sessions[name], self._now)
            channel.engine.resumed_from(resumed[name])
        self.engine = self.channels[reference].engine  # the first camera's (in-process use, tests)
        self.outputs = self.channels[reference].outputs
        batch = self.sessions.submit_many if s.camera_batching and self.sessions is not None else None
        pipeline = s.camera_pipelining and len(names) > 1  # one camera: nothing to overlap with
        self.scheduler = CameraScheduler({name: ch.engine for name, ch in self.channels.items()}, batch=batch,
                                         pipeline=pipeline)
        if self.named is not None:
            self.named.announce()
        elif s.camera_batching:
            self.get_logger().warning("camera_batching is true but cameras is empty: with one camera there "
                                      "is nothing to batch (the parameter has no effect)")

    def _read_parameters(self) -> NodeSettings:
        """The node's settings; ``camera_settings`` = each camera's ({"": the node's} without ``cameras``)."""
        try:
            for p in PARAMETERS:
                if p.name == "cameras":
                    self._declare_string_array(p)
                else:
                    self.declare_parameter(p.name, p.default, descriptor(p))
            values = {p.name: self.get_parameter(p.name).value for p in PARAMETERS}
            settings = resolve_settings(values, log=self.get_logger().info)
            self.camera_settings = self._read_camera_parameters(values, settings.cameras) or {"": settings}
            return settings
        except (ParameterException, ConfigError) as exc:
            raise StartupError(f"invalid parameters: {exc}") from None

    def _declare_string_array(self, p: Param) -> None:
        """Declare ``p`` as a string array holding [] when not given: a default [] would type it as a
        byte array (a YAML list of names would then be refused), and a params file's ``[]`` has no
        type at all (the parameter would stay uninitialized, and ``ros2 param get`` fail)."""
        final = descriptor(p)
        final.type = ParameterType.PARAMETER_STRING_ARRAY
        writable = descriptor(p)
        writable.read_only = False  # until it has a value (below); set_descriptor then makes it read-only
        self.declare_parameter(p.name, Parameter.Type.STRING_ARRAY, writable)
        if self.get_parameter_or(p.name).type_ == Parameter.Type.NOT_SET:  # not given, or given as []
            self.set_parameters([Parameter(p.name, Parameter.Type.STRING_ARRAY, list(p.default))])
        self.set_descriptor(p.name, final)

    def _read_camera_parameters(self, values: dict, cameras: tuple[str, ...]) -> dict[str, NodeSettings]:
        """Declare camera.<c>.<p> for each listed camera and per-camera parameter (default: the global
        value) and resolve each camera's settings; ConfigError for a camera.* override naming an
        unknown camera or parameter, or a bad value."""
        overrides = {name: p.value for name, p in self._parameter_overrides.items() if name.startswith(CAMERA_PREFIX)}
        camera_values(cameras, overrides)  # refuses unknown cameras/parameters and bad values, naming them
        if not cameras:
            return {}
        per_camera = {}
        for camera in cameras:
            per_camera[camera] = {}
            for name in CAMERA_PARAMETERS:
                p = _PARAMETER_TABLE[name]
                full = camera_param_name(camera, name)
                own = replace(p, name=full, description=f"camera {camera}: {p.description}")
                self.declare_parameter(full, values[name], descriptor(own))
                per_camera[camera][name] = self.get_parameter(full).value
        return resolve_camera_settings(values, per_camera, log=self.get_logger().info)

    def _settings_after(self, params) -> tuple[NodeSettings, dict[str, NodeSettings]]:
        """(the node's settings, each camera's) after ``params``; ConfigError for a value the node
        cannot take at run time. Parameters that are not ours (use_sim_time, QoS overrides) pass."""
        settings = self.settings
        per_camera = {name: channel.settings for name, channel in self.channels.items()}
        named = bool(settings.cameras)
        for p in params:
            if named and (p.name in _PARAMETER_TABLE or p.name.startswith(CAMERA_PREFIX)):
                per_camera = apply_camera_dynamic(per_camera, p.name, p.value)
            if p.name in _PARAMETER_TABLE:
                settings = apply_dynamic(settings, p.name, p.value)
        return settings, per_camera if named else {"": settings}

    def _check_parameters(self, params) -> SetParametersResult:
        """on_set_parameters: refuse (with the reason) a value the node cannot take at run time."""
        try:
            self._settings_after(params)
        except ConfigError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _apply_parameters(self, params) -> None:
        """post_set_parameters: the accepted values take effect (checked by ``_check_parameters``)."""
        self.settings, per_camera = self._settings_after(params)
        for name, channel in self.channels.items():
            channel.apply_settings(per_camera[name])
        names = {p.name for p in params}
        if "path_publish_rate" in names:
            self._set_rate_timer("path", self.settings.path_publish_rate)
        if "map_publish_rate" in names:
            self._set_rate_timer("map", self.settings.map_publish_rate)
        for p in params:
            self.get_logger().info(f"parameter {p.name} set to {p.value!r}")

    def _set_rate_timer(self, which: str, rate: float) -> None:
        """(Re)create the ~/path or ~/map_points timer at ``rate`` Hz (0 = none)."""
        old = self._rate_timers.pop(which, None)
        if old is not None:
            self.destroy_timer(old)
        if which == "path":
            publisher = any(c.outputs.path is not None for c in self.channels.values())
            callback = self._flush_paths
        else:
            publisher = self.maps.any_published()
            callback = self.maps.publish
        if publisher and rate > 0:
            self._rate_timers[which] = self.create_timer(1.0 / rate, callback, callback_group=self._timer_group,
                                                         clock=self._steady)

    def _load_model(self):
        from ..io.checkpoint import load_model

        s = self.settings
        if s.checkpoint is None:
            self.get_logger().warning("checkpoint is empty: the model has RANDOM weights (seed "
                                      f"{s.seed}); poses, depth and points are MEANINGLESS. Set the checkpoint "
                                      "parameter to a .pt/.safetensors file or a Hugging Face id.")
        return load_model(s.model, s.checkpoint, s.stream.device, s.stream.dtype, seed=s.seed)

    def _check_memory(self, cameras: list) -> None:
        """Refuse (MemoryBudgetError, a ConfigError) a configuration whose estimated GPU memory exceeds
        the device's free memory (``stream.memory``); the largest camera's settings stand for all."""
        from ..stream.memory import check_fits

        s = max(cameras, key=lambda c: (c.image_width, c.stream.sliding_window + c.stream.num_scale_frames))
        if not self.settings.gpu_memory_check:
            return
        est = check_fits(s.model, s.stream, s.image_width, cameras=len(cameras),
                         budget_gib=self.settings.gpu_memory_budget_gib)
        if est is not None:
            self.get_logger().info(f"GPU memory estimate: {est.describe()}" + (
                f" per camera's K/V, {len(cameras)} cameras" if len(cameras) > 1 else ""))

    def _load_sessions(self) -> dict:
        """The one place the model is built: configs -> weights -> device -> a session per camera.
        The unnamed camera gets a session with its own cache; named cameras one ``CameraSessions``
        (``self.sessions``: a session each on one K/V storage)."""
        from ..io.checkpoint import CheckpointError
        from ..stream import BackendUnavailable
        from ..stream.long_stream import LongStreamSession
        from ..stream.multi import CameraSessions
        from ..stream.session import StreamingSession

        s = self.settings
        t0 = time.perf_counter()
        try:
            self._check_memory(list(self.camera_settings.values()) if s.cameras else [s])
            model = self._load_model()
            if s.cameras:
                self.sessions = CameraSessions(model, {name: (cs.stream, cs.long_stream)
                                                       for name, cs in self.camera_settings.items()})
                sessions = dict(self.sessions.sessions)
            else:
                sessions = {"": LongStreamSession(StreamingSession(model, s.stream), s.long_stream)}
        except (CheckpointError, BackendUnavailable, ConfigError, ValueError) as exc:
            raise StartupError(str(exc)) from None
        cameras = f" for {len(s.cameras)} cameras: {', '.join(s.cameras)}" if s.cameras else ""
        self.get_logger().info(f"model loaded in {time.perf_counter() - t0:.1f} s "
                               f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters){cameras}")
        return sessions

    def _open_journals(self, sessions: dict) -> dict:
        """state_directory / load_session: each camera's session journaled (and rebuilt from its
        journal or the saved session) before anything is subscribed (``ros.sessions``)."""
        try:
            return open_journals(self.channels, sessions, self.camera_settings)
        except (SessionError, JournalError, OSError) as exc:
            what = f"{exc.strerror or exc}: {exc.filename}" if isinstance(exc, OSError) and exc.filename else str(exc)
            raise StartupError(f"state_directory / load_session: {what}") from None

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    # ------------------------------------------------------------------ timers
    def _on_second(self) -> None:
        clock = self._clock_problem()
        for channel in self.channels.values():
            channel.beat(clock)
        self.diagnostics.publish(self._diagnostics(clock))

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

    def _flush_paths(self) -> None:
        for channel in self.channels.values():
            channel.outputs.flush_path()

    def _diagnostics(self, clock: str) -> DiagnosticArray:
        """/diagnostics: the clock, the shared pool (named cameras) and every camera's entries (the
        unnamed camera's under the node's name, a named camera's under "<node>: <camera>")."""
        name = self.get_fully_qualified_name()
        statuses = [diag(f"{name}: clock", DiagnosticStatus.WARN if clock else DiagnosticStatus.OK,
                         clock or "ok", {"use_sim_time": self.get_parameter("use_sim_time").value})]
        if self.named is not None:
            statuses.append(self.named.pool_diag(name, self.scheduler))
        for camera, channel in self.channels.items():
            label = f"{name}: {camera}" if camera else name
            statuses.append(channel.input_diag(label))
            statuses += channel.state_diags(label)
            journal = journal_diag(label, channel.engine)
            if journal is not None:
                statuses.append(journal)
            if self.named is not None:
                statuses.append(self.named.map_frame_diag(label, camera, channel.outputs.placement().frame,
                                                          self.scheduler.served.get(camera, 0)))
        return DiagnosticArray(header=Header(stamp=self.get_clock().now().to_msg()), status=statuses)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self.scheduler.stop()
        for camera, channel in self.channels.items():  # what was journaled reaches the disk
            journal = channel.engine.journal
            written = []
            if journal is not None and journal.writer is not None:
                journal.writer.close(timeout=JOURNAL_CLOSE_S)
                written.append(("journal", journal.writer.status()))
            if channel.engine.map_journal is not None:
                channel.engine.map_journal.close(timeout=JOURNAL_CLOSE_S)
                written.append(("map journal", channel.engine.map_journal.status()))
            if written:  # what journaling cost the disk (docs/sessions.md)
                self.get_logger().info(f"{camera or 'camera'}: " + "; ".join(
                    f"{what} {st.bytes_written / 1e6:.1f} MB written in {st.seconds:.1f} s"
                    f" ({st.bytes_written / 1e6 / max(st.seconds, 1e-9):.2f} MB/s, {st.rewrites} rewrites)"
                    for what, st in written))
        self.service_node.destroy_node()
        logging.getLogger("lingbot_map_ros").removeHandler(self._log_handler)


def _fastdds_without_profile() -> bool:
    """True when the RMW is Fast DDS (the default) and no XML profile is configured."""
    rmw = os.environ.get("RMW_IMPLEMENTATION", "") or "rmw_fastrtps_cpp"
    profile = os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or os.environ.get("FASTRTPS_DEFAULT_PROFILES_FILE")
    return rmw.startswith("rmw_fastrtps") and not profile

