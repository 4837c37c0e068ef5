"""The node's parameters mapped onto the typed configs, once and checked.

The parameters themselves (name, default, description, range or choices) are the table of
``runtime.param_table``, re-exported here; ``resolve_settings`` turns their values into
``NodeSettings`` (holding ``ModelConfig`` and ``StreamConfig``) and logs each resolved value
once. Neither imports rclpy, so the mapping is tested without a graph. Parameters marked
``dynamic`` may change while the node runs (``apply_dynamic`` checks a new value and returns
the new settings); the rest are read once at start (declared read-only).

Streaming parameters (num_scale_frames, sliding_window, ...) are authoritative;
``model_config`` only supplies the architecture. Streaming keys found in that JSON
are reported when they differ from the parameters, never silently applied.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from ..config import ConfigError, LongStreamConfig, ModelConfig, StreamConfig, load_json
from ..robot.health import HEALTH_PARAMETERS, config_from_parameters as health_config_from
from .param_table import (CAMERA_PARAMETERS, CAMERA_PREFIX, DEFAULTS, DEVICES_HELP, DYNAMIC_PARAMETERS, INPUT_QOS,
                          INPUT_TRANSPORTS, JOURNAL_COMPRESSIONS, PARAMETER_NAMES, PARAMETERS, TF_MODES, Param,
                          check_value, health_default, params_file_text, write_params_file)

DEFAULT_CAMERA_FRAME = "camera_optical_frame"
_CAMERA_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_STREAM_KEYS = {"num_scale_frames": "num_scale_frames", "sliding_window": "sliding_window",
                "keyframe_interval": "keyframe_interval", "camera_num_iterations": "camera_iterations",
                "camera_iterations": "camera_iterations", "preprocess_width": "image_width"}


@dataclass(frozen=True)
class NodeSettings:
    """Everything the node needs from its parameters, typed and validated."""

    model: ModelConfig
    stream: StreamConfig
    long_stream: LongStreamConfig
    checkpoint: str | None  # None = random weights
    seed: int
    image_width: int
    input_transport: str
    input_qos: str
    max_frame_age: float
    input_timeout: float
    service_timeout: float
    conf_threshold: float
    point_stride: int
    accumulate_map: bool
    map_voxel_size: float
    map_max_points: int
    map_publish_rate: float
    path_max_length: int
    path_publish_rate: float
    publish_odometry: bool
    publish_pose: bool
    publish_path: bool
    publish_points: bool
    publish_map: bool
    publish_depth: bool
    output_directory: str
    publish_tf: bool
    tf_mode: str
    map_frame: str
    odom_frame: str
    base_frame: str
    camera_frame: str
    camera_tf_frame: str = ""
    state_directory: str = ""
    load_session: str = ""
    journal_map: bool = True
    journal_compression: str = "lz4"
    gpu_memory_check: bool = True
    gpu_memory_budget_gib: float = 0.0  # 0 = the device's free memory
    deferred_eviction_timeout: float = 5.0
    keyframe_decision_timeout: float = 0.0
    keyframe_decision_default: str = "keep"
    time_jump_threshold: float = 1.0
    on_time_jump: str = "reset"
    on_lost: str = "continue"
    relocalize_timeout: float = 0.0  # on_lost relocalize (runtime/loop_link.py)
    undistort: bool = True
    scale_source: str = "none"
    metric_scale: float = 1.0
    scale_wait_for_convergence: bool = True
    deferred_eviction: bool = False  # the value in force (the session's own flag follows it)
    # tracking health thresholds (HEALTH_PARAMETERS of robot/health.py)
    health_degraded_valid_fraction: float = health_default("health_degraded_valid_fraction")
    health_lost_valid_fraction: float = health_default("health_lost_valid_fraction")
    health_lost_after: int = health_default("health_lost_after")
    health_init_frames: int = health_default("health_init_frames")
    health_recover_after: int = health_default("health_recover_after")
    health_jump_factor: float = health_default("health_jump_factor")
    health_jump_floor: float = health_default("health_jump_floor")
    health_max_rotation_deg: float = health_default("health_max_rotation_deg")
    health_translation_std: float = health_default("health_translation_std")
    health_rotation_std_deg: float = health_default("health_rotation_std_deg")
    loop_closure: bool = False  # runtime/loop_closure.py
    loop_min_similarity: float = 0.85
    loop_min_separation: int = 400
    loop_max_keyframes: int = 5000
    loop_min_inlier_ratio: float = 0.8
    loop_depth_tolerance: float = 0.05
    loop_min_overlap: float = 0.3
    loop_robust_kernel: str = "cauchy"
    loop_prior_max_dt: float = 0.5
    cameras: tuple[str, ...] = ()  # empty = one camera, today's names
    camera_batching: bool = False  # several cameras: batched steps (runtime.scheduler)
    camera_pipelining: bool = True  # several cameras: pipelined steps (runtime.scheduler)
    # Nav2: managed node and occupancy grid (runtime.grid, docs/nav2.md)
    managed: bool = False
    grid: bool = False
    grid_resolution: float = 0.05
    grid_min_height: float = 0.1
    grid_max_height: float = 1.5
    grid_max_range: float = 8.0
    grid_max_extent: float = 100.0
    grid_base_height: float = 0.0
    grid_publish_rate: float = 1.0

    def __post_init__(self) -> None:  # also for every run-time change (``dataclasses.replace``)
        health_config_from(self)  # the health thresholds together (ConfigError names the parameters)
        if self.on_lost == "relocalize" and not self.loop_closure:
            raise ConfigError("on_lost 'relocalize' looks for the camera in the keyframe map of loop closure: set "
                              "loop_closure true, or on_lost 'reset' or 'continue'")


def resolve_settings(values: Mapping[str, Any], log: Callable[[str], None] = lambda _m: None,
                     cuda_available: Callable[[], bool] | None = None) -> NodeSettings:
    """Map parameter values (every name of ``PARAMETERS``; missing ones take their default)
    onto ``NodeSettings``, logging one line per resolved value.

    Raises:
        ConfigError: a value is of the wrong type, out of range, or the configs reject it
            (the message names the parameter or the config field).
    """
    unknown = sorted(set(values) - set(PARAMETER_NAMES))
    if unknown:
        raise ConfigError(f"unknown parameter(s): {', '.join(unknown)}")
    v = {p.name: values.get(p.name, p.default) for p in PARAMETERS}
    for p in PARAMETERS:
        check_value(p, v[p.name])
    for p in PARAMETERS:
        if isinstance(p.default, float):
            v[p.name] = float(v[p.name])

    device_in = v["device"]
    if device_in != "auto" and not (isinstance(device_in, str) and device_in.split(":")[0] in ("cpu", "cuda")):
        raise ConfigError(f"parameter device must be {DEVICES_HELP}, got {device_in!r}")
    v["device"], v["dtype"], chosen = resolve_device(device_in, v["dtype"], cuda_available or cuda_is_available)
    if chosen:
        log(chosen)
    data = load_json(v["model_config"]) if v["model_config"] else {}
    model = ModelConfig.from_dict(data) if data else ModelConfig.preset("lingbot-map")
    if v["image_width"] % model.patch_size:
        raise ConfigError(f"parameter image_width {v['image_width']} is not a multiple of the patch size "
                          f"{model.patch_size}")
    for key, name in _STREAM_KEYS.items():
        if key in data and data[key] != v[name]:
            log(f"note: model_config {v['model_config']} has {key}={data[key]}; the parameter "
                f"{name}={v[name]} is used")
    try:
        stream = StreamConfig(num_scale_frames=v["num_scale_frames"], sliding_window=v["sliding_window"],
                              keyframe_interval=v["keyframe_interval"], camera_iterations=v["camera_iterations"],
                              deferred_eviction=v["deferred_eviction"],
                              max_pending_evictions=v["max_pending_evictions"], backend=v["backend"],
                              dtype=v["dtype"], device=v["device"], cuda_graphs=v["cuda_graphs"],
                              kv_splits=v["kv_splits"], fused_kernels=v["fused_kernels"],
                              bf16_depth_head=v["bf16_depth_head"], bf16_camera_head=v["bf16_camera_head"],
                              parallel_heads=v["parallel_heads"], kv_cache_dtype=v["kv_cache_dtype"],
                              precision=v["precision"])
        long_stream = LongStreamConfig(
            window_frames=v["window_frames"], overlap_frames=v["overlap_frames"] or None,
            keyframe_policy=v["keyframe_policy"], motion_min_translation=v["motion_min_translation"],
            motion_min_rotation_deg=v["motion_min_rotation_deg"], auto_restart=v["auto_restart"])
        long_stream.check(stream, model.max_frame_num)
    except TypeError as exc:  # pragma: no cover - types are checked above
        raise ConfigError(str(exc)) from None
    if not v["map_frame"]:
        raise ConfigError("parameter map_frame must not be empty")
    if v["tf_mode"] == "map_to_odom" and not (v["odom_frame"] and v["base_frame"]):
        raise ConfigError("tf_mode map_to_odom needs a non-empty odom_frame and base_frame (the robot frame that "
                          "odom_frame -> base_frame, published by the robot's odometry, ends in)")
    if v["tf_mode"] == "map_to_base" and not v["base_frame"]:
        raise ConfigError("tf_mode map_to_base needs a non-empty base_frame")

    cameras = check_camera_names(v["cameras"])
    if (v["state_directory"] or v["load_session"]) and v["camera_batching"] and cameras:
        raise ConfigError("state_directory and load_session journal each camera's own steps; camera_batching "
                          "runs them together: set camera_batching false to keep a journal")
    if cameras and v["kv_cache_dtype"] == "fp8":
        raise ConfigError("parameter kv_cache_dtype 'fp8' is for a single camera (several cameras share one bf16 "
                          "K/V storage); set kv_cache_dtype 'auto' or list no cameras")
    settings = NodeSettings(model=model, stream=stream, long_stream=long_stream, checkpoint=v["checkpoint"] or None,
                            cameras=cameras, **{k: v[k] for k in _PLAIN_FIELDS})
    check_grid(settings)
    for p in PARAMETERS:
        log(f"parameter {p.name} = {v[p.name]!r}")
    log(f"model: {'preset lingbot-map' if not data else v['model_config']} -> "
        f"{json.dumps(model.to_dict(), default=list)}")
    return settings


_PLAIN_FIELDS = ("gpu_memory_check", "gpu_memory_budget_gib", "camera_batching", "camera_pipelining", "seed", "image_width", "input_transport", "input_qos", "max_frame_age",
                 "input_timeout", "service_timeout", "conf_threshold", "point_stride", "accumulate_map", "map_voxel_size",
                 "map_max_points", "map_publish_rate", "path_max_length", "path_publish_rate",
                 "publish_odometry", "publish_pose", "publish_path", "publish_points", "publish_map",
                 "publish_depth", "output_directory", "state_directory", "journal_map", "journal_compression", "load_session", "publish_tf", "tf_mode", "map_frame", "odom_frame",
                 "base_frame", "camera_frame", "camera_tf_frame", "deferred_eviction_timeout",
                 "keyframe_decision_timeout", "keyframe_decision_default", "time_jump_threshold", "on_time_jump",
                 "on_lost", "relocalize_timeout", "undistort", "scale_source", "metric_scale", "scale_wait_for_convergence", "deferred_eviction",
                 "loop_closure", "loop_min_similarity", "loop_min_separation", "loop_max_keyframes",
                 "loop_min_inlier_ratio", "loop_depth_tolerance", "loop_min_overlap", "loop_robust_kernel", "loop_prior_max_dt") + tuple(HEALTH_PARAMETERS)
_PLAIN_FIELDS += ("managed", "grid", "grid_resolution", "grid_min_height", "grid_max_height", "grid_max_range",
                  "grid_max_extent", "grid_base_height", "grid_publish_rate")


def check_grid(settings: NodeSettings) -> None:
    """With ``grid`` on: the grid's parameters make a valid ``GridConfig`` and the map is accumulated
    (the grid is fed with the map's points); ConfigError naming the parameters otherwise."""
    from .grid import GRID_PARAMETER_NAMES, grid_config

    if not settings.grid:
        return
    if not settings.accumulate_map:
        raise ConfigError("parameter grid needs accumulate_map true (the grid is built from the map's points)")
    try:
        grid_config(settings)
    except ValueError as exc:
        text = str(exc).replace(" or raise max_cells", "")  # not a parameter
        for field, name in GRID_PARAMETER_NAMES.items():
            text = text.replace(f"GridConfig.{field}", f"parameter {name}").replace(field, name)
        raise ConfigError(text) from None


def cuda_is_available() -> bool:
    """Whether torch sees a CUDA device (imported lazily: the table itself needs no torch)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of the package
        return False
    return bool(torch.cuda.is_available())


def resolve_device(device: str, dtype: str, cuda_available: Callable[[], bool] = cuda_is_available
                   ) -> tuple[str, str, str]:
    """``device``/``dtype`` with ``auto`` resolved: (device, dtype, one line saying what was chosen and why).

    auto device = ``cuda`` when torch sees a CUDA device, else ``cpu``; auto dtype = bf16 on CUDA, fp32 on
    the CPU (bf16 matmuls on a CPU are slow and the reference numbers are fp32)."""
    notes = []
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
        notes.append(f"device auto -> {device} ({'CUDA is available' if device == 'cuda' else 'no CUDA device'})")
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
        notes.append(f"dtype auto -> {dtype} (on {device.split(':')[0]})")
    return device, dtype, "; ".join(notes)


def apply_dynamic(settings: NodeSettings, name: str, value: Any) -> NodeSettings:
    """``settings`` with the run-time parameter ``name`` set to ``value`` (checked: ConfigError names the
    problem; read-only parameters are refused)."""
    params = {p.name: p for p in PARAMETERS}
    if name not in params:
        raise ConfigError(f"unknown parameter {name}")
    if name not in DYNAMIC_PARAMETERS:
        raise ConfigError(f"parameter {name} is read-only: it is applied at start only; restart the node to "
                          "change it")
    p = params[name]
    check_value(p, value)
    if isinstance(p.default, float):
        value = float(value)
    return replace(settings, **{name: value})


# ------------------------------------------------------------------ several cameras
def check_camera_names(names: Any) -> tuple[str, ...]:
    """``cameras`` as a tuple; ConfigError for a name that is not a ROS name token (a letter, then
    letters, digits, underscores: it becomes a topic namespace and a parameter prefix) or a repeat."""
    names = tuple(names or ())
    for name in names:
        if not isinstance(name, str) or not _CAMERA_NAME.fullmatch(name):
            raise ConfigError(f"parameter cameras: {name!r} is not a valid camera name (a letter, then letters, "
                              "digits or underscores)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"parameter cameras names {', '.join(repeated)} more than once")
    return names


def camera_param_name(camera: str, name: str) -> str:
    """``camera.<camera>.<name>``: the parameter of ``name`` for one camera."""
    return f"{CAMERA_PREFIX}{camera}.{name}"


def split_camera_param(full_name: str, cameras: tuple[str, ...]) -> tuple[str, str]:
    """(camera, parameter) of ``camera.<camera>.<parameter>``; ConfigError naming the problem when the
    camera is not in ``cameras`` or the parameter is not per camera (see ``CAMERA_PARAMETERS``)."""
    parts = full_name.split(".")
    if len(parts) != 3 or parts[0] + "." != CAMERA_PREFIX:
        raise ConfigError(f"unknown parameter {full_name}: per-camera parameters are named "
                          f"camera.<camera>.<parameter>")
    _, camera, name = parts
    if camera not in cameras:
        listed = ", ".join(cameras) if cameras else "none (single-camera mode)"
        raise ConfigError(f"unknown parameter {full_name}: {camera!r} is not in cameras (listed: {listed})")
    if name not in CAMERA_PARAMETERS:
        raise ConfigError(f"unknown parameter {full_name}: {name} is not a per-camera parameter (per camera: "
                          f"{', '.join(CAMERA_PARAMETERS)})")
    return camera, name


def camera_values(cameras: tuple[str, ...], given: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-camera values in ``given`` (every ``camera.*`` name there) as {camera: {parameter:
    value}}, each checked against its parameter's type, range and choices; ConfigError naming
    ``camera.<camera>.<parameter>`` for an unknown camera or parameter or a bad value."""
    table = {p.name: p for p in PARAMETERS}
    out: dict[str, dict[str, Any]] = {c: {} for c in cameras}
    for full_name, value in given.items():
        camera, name = split_camera_param(full_name, cameras)
        check_value(replace(table[name], name=full_name), value)
        out[camera][name] = value
    return out


def resolve_camera_settings(values: Mapping[str, Any], per_camera: Mapping[str, Mapping[str, Any]],
                            log: Callable[[str], None] = lambda _m: None,
                            cuda_available: Callable[[], bool] | None = None) -> dict[str, NodeSettings]:
    """{camera: NodeSettings}: the global ``values`` with each camera's own (``camera_values``) on top,
    resolved like ``resolve_settings`` (quietly: one log line per camera value that differs from the
    global one). ConfigError names ``camera.<camera>.<parameter>`` (or the config rule broken for
    that camera, e.g. an image_width that is not a multiple of the patch size)."""
    out = {}
    base = {k: v for k, v in values.items() if k != "cameras"}
    for camera, own in per_camera.items():
        try:
            out[camera] = resolve_settings({**base, **own}, cuda_available=cuda_available)
        except ConfigError as exc:
            raise ConfigError(_name_camera(str(exc), camera, own)) from None
        for name, value in own.items():
            if value != base.get(name, DEFAULTS[name]):
                log(f"parameter {camera_param_name(camera, name)} = {value!r}")
    for name in ("camera_frame", "camera_tf_frame"):  # each camera needs frames of its own
        by_value: dict[str, list[str]] = {}
        for camera, settings in out.items():
            if getattr(settings, name):
                by_value.setdefault(getattr(settings, name), []).append(camera)
        for value, cameras in by_value.items():
            if len(cameras) > 1:
                raise ConfigError(f"parameter {name} {value!r} is shared by cameras {', '.join(cameras)}: each camera "
                                  f"needs its own (set " + ", ".join(camera_param_name(c, name) for c in cameras)
                                  + ")")
    return out


def _name_camera(text: str, camera: str, own: Mapping[str, Any]) -> str:
    """A ConfigError text about one camera's settings, naming ``camera.<camera>.<parameter>`` when the
    camera set that parameter itself, else prefixed with the camera."""
    for name in own:
        if f"parameter {name} " in text:
            return text.replace(f"parameter {name} ", f"parameter {camera_param_name(camera, name)} ", 1)
    return f"camera {camera}: {text}"


def apply_camera_dynamic(settings: Mapping[str, NodeSettings], name: str, value: Any) -> dict[str, NodeSettings]:
    """Every camera's settings after the run-time change ``name`` = ``value`` (ConfigError names the
    problem): ``camera.<c>.<p>`` changes camera c; a global parameter changes every camera, except
    the per-camera ones, which are refused (set ``camera.<c>.<p>`` for each camera instead)."""
    cameras = tuple(settings)
    if name.startswith(CAMERA_PREFIX):
        camera, param = split_camera_param(name, cameras)
        try:
            return {**settings, camera: apply_dynamic(settings[camera], param, value)}
        except ConfigError as exc:
            raise ConfigError(_name_camera(str(exc), camera, {param: value})) from None
    if name in CAMERA_PARAMETERS and name in DYNAMIC_PARAMETERS:
        raise ConfigError(f"parameter {name} is per camera when cameras are listed: set "
                          + ", ".join(camera_param_name(c, name) for c in cameras))
    return {c: apply_dynamic(s, name, value) for c, s in settings.items()}


__all__ = ["PARAMETERS", "PARAMETER_NAMES", "Param", "NodeSettings", "resolve_settings", "check_value",
           "params_file_text", "write_params_file", "INPUT_TRANSPORTS", "INPUT_QOS", "TF_MODES", "JOURNAL_COMPRESSIONS",
           "DYNAMIC_PARAMETERS", "apply_dynamic", "resolve_device", "cuda_is_available",
           "DEFAULT_CAMERA_FRAME", "CAMERA_PARAMETERS", "CAMERA_PREFIX", "check_camera_names",
           "camera_param_name", "split_camera_param", "camera_values", "resolve_camera_settings",
           "apply_camera_dynamic", "check_grid"]
