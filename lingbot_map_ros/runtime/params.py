"""The node's parameters: one table, one function mapping them onto the typed configs.

Every parameter is declared from ``PARAMETERS`` (name, default, description, range
or choices); ``resolve_settings`` turns the values into ``NodeSettings`` (holding
``ModelConfig`` and ``StreamConfig``) and logs each resolved value once. Neither
imports rclpy, so the mapping is tested without a graph. Parameters marked
``dynamic`` may change while the node runs (``apply_dynamic`` checks a new value and
returns the new settings); the rest are read once at start (declared read-only).

Streaming parameters (num_scale_frames, sliding_window, ...) are authoritative;
``model_config`` only supplies the architecture. Streaming keys found in that JSON
are reported when they differ from the parameters, never silently applied.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from ..config import (BACKENDS, DTYPES, KEYFRAME_POLICIES, KV_CACHE_DTYPES, PRECISIONS, ConfigError, LongStreamConfig, ModelConfig, StreamConfig,
                      load_json)
from ..robot.health import HEALTH_PARAMETERS, HealthConfig, config_from_parameters as health_config_from

INPUT_TRANSPORTS = ("raw", "compressed")
INPUT_QOS = ("sensor_data", "reliable")
TF_MODES = ("auto", "map_to_odom", "map_to_base", "map_to_camera")
JOURNAL_COMPRESSIONS = ("lz4", "zlib", "none")  # journal.format.COMPRESSIONS (not imported: that pulls in torch)
DEVICES_HELP = "auto (CUDA when available, else CPU), cpu, cuda or cuda:N"
ON_TIME_JUMP = ("reset", "drop")
ON_LOST = ("continue", "reset")
SCALE_SOURCES = ("none", "fixed", "odometry", "depth")
DECISION_DEFAULTS = ("keep", "drop")
_HEALTH_DEFAULTS = HealthConfig()


def _health_default(name: str) -> float | int:
    """The default of parameter ``name`` (one of HEALTH_PARAMETERS): HealthConfig's, its one source."""
    return getattr(_HEALTH_DEFAULTS, HEALTH_PARAMETERS[name])


@dataclass(frozen=True)
class Param:
    """One declared parameter. ``limits`` = (from, to, step) for numbers (step 0 = any);
    ``choices`` for strings; ``dynamic`` ones may be set while the node runs."""

    name: str
    default: Any
    description: str
    limits: tuple[float, float, float] | None = None
    choices: tuple[str, ...] | None = None
    dynamic: bool = False  # may change while the node runs (ros2 param set); else read-only


# Parameters a camera of ``cameras`` may set for itself as ``camera.<name>.<parameter>`` (declared for
# the listed cameras only, each defaulting to the global value; the rest are shared by all cameras).
CAMERA_PARAMETERS: tuple[str, ...] = (
    "image_width", "keyframe_interval", "input_transport", "input_qos", "max_frame_age", "undistort",
    "camera_frame", "camera_tf_frame", "deferred_eviction", "deferred_eviction_timeout",
    "keyframe_decision_timeout", "keyframe_decision_default")
CAMERA_PREFIX = "camera."
_CAMERA_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

PARAMETERS: tuple[Param, ...] = (
    # -- model and device
    Param("checkpoint", "", "Checkpoint .pt/.safetensors path or Hugging Face id (org/repo[/file]); "
          "empty = RANDOM weights (outputs meaningless, loud warning)"),
    Param("model_config", "", "Model architecture JSON (e.g. the tiny fixture's config.json); "
          "empty = the released LingBot-Map architecture"),
    Param("device", "auto", "Torch device: " + DEVICES_HELP),
    Param("backend", "auto", "Attention backend. auto: by the GPU's compute capability, logged at start: "
          "flashinfer-fa3 on Hopper (sm_90), flashinfer-fa2 on other GPUs of sm_80 or later (Ampere, Orin, Ada), "
          "sdpa without FlashInfer, on CPU or with fp32. flashinfer-fa2: FA2 over the pool's contiguous runs "
          "with split-KV; flashinfer-fa2-paged: FA2's paged kernel (slower); sdpa: PyTorch's kernels "
          "(FlashAttention-2 over the runs on sm_80+ GPUs with bf16, CUDA graphs; a gather elsewhere)",
          choices=BACKENDS),
    Param("dtype", "auto", "Aggregator dtype and K/V cache dtype (heads stay fp32); auto = bf16 on CUDA, fp32 "
          "on CPU", choices=("auto",) + DTYPES),
    Param("kv_cache_dtype", "auto", "Storage of the K/V cache: auto/bf16 = the dtype's; fp8 = float8 e4m3 with a "
          "scale per token and head, read through a dequantised one-layer buffer: ~55 % of the cache's memory, "
          "slightly slower, small deviation (single camera only)", choices=KV_CACHE_DTYPES),
    Param("precision", "bf16", "fp8: the aggregator's projections and MLPs run as FP8 GEMMs (e4m3, a scale per "
          "token and per output channel; Ada/Hopper GPUs natively, elsewhere emulated); bf16: as the dtype",
          choices=PRECISIONS),
    Param("gpu_memory_check", True, "Refuse to start when the GPU memory this configuration needs (estimated: "
          "weights, K/V cache, activations) exceeds the free memory of the device, naming the settings to lower"),
    Param("cuda_graphs", True, "Replay the one-frame step from a CUDA graph (CUDA with a FlashInfer backend, "
          "or sdpa on an sm_80+ GPU in bf16; ignored elsewhere)"),
    Param("kv_splits", 0, "Split each global-attention call over this many parts of the keys (FlashInfer "
          "FA3 and FA2, sdpa on a GPU) so that every SM has work; 0 = chosen from the SM count and the kernel's "
          "tile (8 at 518x378 on an H200)", limits=(0, 64, 1)),
    Param("fused_kernels", True, "Triton kernels for LayerNorm, residual update + LayerNorm, q/k norm + RoPE + "
          "K/V store (CUDA, bf16; ignored elsewhere)"),
    Param("bf16_depth_head", True, "Run the depth head's convolutions in bf16, channels-last (CUDA, bf16 "
          "only)"),
    Param("bf16_camera_head", True, "Give the camera head bf16 weights, activations and sums stay float32 "
          "(CUDA, bf16, with fused_kernels only)"),
    Param("parallel_heads", True, "Run the camera head on a second CUDA stream beside the depth head (CUDA "
          "only; same results)"),
    Param("seed", 0, "Seed of the random weights used when checkpoint is empty", limits=(0, 2**31 - 1, 1)),
    Param("image_width", 518, "Model input width in pixels (multiple of 14); height follows the aspect ratio",
          limits=(14, 4088, 14)),
    # -- streaming policy
    Param("num_scale_frames", 8, "Frames processed together first and pinned in the cache (scale anchor)",
          limits=(1, 64, 1)),
    Param("sliding_window", 64, "Keyframes kept in the FIFO window of the cache", limits=(1, 1024, 1)),
    Param("keyframe_interval", 1, "Every N-th frame after the scale frames is stored in the cache",
          limits=(1, 1000, 1)),
    Param("camera_iterations", 4, "Refinement iterations of the camera head", limits=(1, 16, 1)),
    Param("deferred_eviction", False, "Deferred eviction on (as ~/set_deferred_eviction; settable at run "
          "time)", dynamic=True),
    Param("deferred_eviction_timeout", 5.0, "Seconds a deferred eviction may wait for ~/commit_eviction; "
          "older ones are committed automatically (throttled warning, counted in ~/status), so tracking never "
          "stops for lack of a commit; 0 = wait forever", limits=(0.0, 3600.0, 0.0), dynamic=True),
    Param("keyframe_decision_timeout", 0.0, "Decision hold: > 0 = each stored frame waits up to this many "
          "seconds for ~/commit_eviction (keep) or ~/rollback_last_frame (drop) naming it before the next "
          "frame is stored; then keyframe_decision_default applies; 0 = off", limits=(0.0, 60.0, 0.0),
          dynamic=True),
    Param("keyframe_decision_default", "keep", "Decision applied when keyframe_decision_timeout passes "
          "without one", choices=DECISION_DEFAULTS, dynamic=True),
    Param("max_pending_evictions", 8, "Most evictions that may be deferred before commit (sizes the page pool)",
          limits=(0, 1024, 1)),
    # -- long streams (windowed restarts, keyframe selection)
    Param("window_frames", 320, "Stored frames per cache window; storing one more restarts the cache and "
          "aligns the new window to the map with a Sim(3) (must be < the model's max_frame_num)",
          limits=(2, 100_000, 1)),
    Param("overlap_frames", 0, "Keyframes carried into the next window and used for the alignment; "
          "0 = num_scale_frames", limits=(0, 2048, 1)),
    Param("keyframe_policy", "interval", "interval: every keyframe_interval-th frame is stored; motion: a frame "
          "is stored when the camera moved enough since the last keyframe", choices=KEYFRAME_POLICIES),
    Param("motion_min_translation", 0.05, "motion policy: camera-centre distance (model units) that makes a "
          "keyframe; 0 = off", limits=(0.0, 1000.0, 0.0)),
    Param("motion_min_rotation_deg", 5.0, "motion policy: rotation (degrees) that makes a keyframe; 0 = off",
          limits=(0.0, 180.0, 0.0)),
    Param("auto_restart", True, "Restart the cache window automatically when it is full (otherwise a full "
          "window only attends until ~/reset)"),
    # -- input
    Param("input_transport", "raw", "Subscribe to `image` (raw sensor_msgs/Image) or `image/compressed` "
          "(sensor_msgs/CompressedImage, JPEG/PNG)", choices=INPUT_TRANSPORTS),
    Param("input_qos", "sensor_data", "QoS of the image subscription: sensor_data (best effort, takes both "
          "best-effort and reliable publishers) or reliable", choices=INPUT_QOS),
    Param("max_frame_age", 0.0, "Drop frames whose stamp is older than this many seconds when inference "
          "reaches them (counted as stale); 0 = never", limits=(0.0, 3600.0, 0.0), dynamic=True),
    Param("time_jump_threshold", 1.0, "Seconds an image stamp may go back from the previous frame's before "
          "it counts as a time jump (a bag played in a loop, a clock reset)", limits=(0.0, 3600.0, 0.0),
          dynamic=True),
    Param("on_time_jump", "reset", "reset: a time jump starts a new sequence (logged, counted); drop: frames "
          "older than the last one are dropped until the stamps pass it again", choices=ON_TIME_JUMP,
          dynamic=True),
    Param("on_lost", "continue", "continue: keep the sequence when tracking health becomes lost (outputs carry a "
          "large covariance); reset: start a new sequence at once (logged, counted in lost_resets)",
          choices=ON_LOST, dynamic=True),
    # -- tracking health thresholds (robot/health.py; heuristics, see the README)
    Param("health_degraded_valid_fraction", _health_default("health_degraded_valid_fraction"), "Tracking health: a frame whose fraction of confident pixels "
          "(confidence above conf_threshold) is below this is suspect (low_confidence: tracking -> degraded)",
          limits=(0.0, 1.0, 0.0), dynamic=True),
    Param("health_lost_valid_fraction", _health_default("health_lost_valid_fraction"), "Tracking health: a fraction of confident pixels below this is a "
          "confidence collapse; health_lost_after of them in a row make tracking lost (must be <= "
          "health_degraded_valid_fraction)", limits=(0.0, 1.0, 0.0), dynamic=True),
    Param("health_lost_after", _health_default("health_lost_after"), "Tracking health: consecutive confidence collapses that make tracking lost "
          "(a non-finite output is lost at once)", limits=(1, 1000, 1), dynamic=True),
    Param("health_init_frames", _health_default("health_init_frames"), "Tracking health: good frames in a row that end initializing",
          limits=(1, 1000, 1), dynamic=True),
    Param("health_recover_after", _health_default("health_recover_after"), "Tracking health: good frames in a row that bring degraded or lost back "
          "to tracking", limits=(1, 1000, 1), dynamic=True),
    Param("health_jump_factor", _health_default("health_jump_factor"), "Tracking health: a camera-centre step larger than this times the median "
          "of the recent steps (and than health_jump_floor) is a translation_jump", limits=(0.001, 1e6, 0.0),
          dynamic=True),
    Param("health_jump_floor", _health_default("health_jump_floor"), "Tracking health: steps up to this length (model units) are never a "
          "translation_jump", limits=(0.0, 1e6, 0.0), dynamic=True),
    Param("health_max_rotation_deg", _health_default("health_max_rotation_deg"), "Tracking health: a rotation between consecutive frames above this "
          "many degrees is a rotation_jump; 180 = never", limits=(0.001, 180.0, 0.0), dynamic=True),
    Param("health_translation_std", _health_default("health_translation_std"), "~/odometry covariance: standard deviation of x, y, z while "
          "tracking (model units, times the metric scale when one is applied); the variances are x10 "
          "degraded, x100 initializing, x1000 lost", limits=(1e-6, 1000.0, 0.0), dynamic=True),
    Param("health_rotation_std_deg", _health_default("health_rotation_std_deg"), "~/odometry covariance: standard deviation of roll, pitch, yaw "
          "while tracking (degrees), scaled with the state like health_translation_std",
          limits=(1e-6, 180.0, 0.0), dynamic=True),
    Param("undistort", True, "Undistort each image with the latest camera_info when its distortion is "
          "non-zero (plumb_bob, rational_polynomial, equidistant); a camera_info of another size than the "
          "image then refuses the frame", dynamic=True),
    Param("scale_source", "none", "Metric scale of the published poses, points and depths: none (model units), "
          "fixed (metric_scale), odometry (estimated from odom_frame -> camera TF at the image stamps), depth (from a registered depth "
          "image on `depth`, 16UC1 mm or 32FC1 m, within 50 ms of the colour image)",
          choices=SCALE_SOURCES),
    Param("metric_scale", 1.0, "scale_source fixed: metres per model unit", limits=(1e-6, 1e6, 0.0)),
    Param("scale_wait_for_convergence", True, "tf_mode map_to_odom with an estimated scale: publish no TF "
          "until the scale has converged (outputs stay in model units until then)"),
    Param("input_timeout", 5.0, "Seconds without an image before /diagnostics warns and the state becomes "
          "WAITING_FOR_IMAGES", limits=(0.1, 3600.0, 0.0), dynamic=True),
    Param("service_timeout", 30.0, "Seconds a service call waits for the inference thread to run it",
          limits=(0.1, 3600.0, 0.0), dynamic=True),
    # -- outputs
    Param("conf_threshold", 1.5, "Points (per-frame cloud and map) need depth confidence above this",
          limits=(0.0, 1000.0, 0.0), dynamic=True),
    Param("point_stride", 10, "Keep every N-th point after the confidence threshold", limits=(1, 10000, 1),
          dynamic=True),
    Param("accumulate_map", True, "Accumulate the voxel-downsampled map (needed by ~/map_points and "
          "~/save_map) even when nobody subscribes"),
    Param("map_voxel_size", 0.01, "Voxel edge of the accumulated map, model units; 0 = no downsampling",
          limits=(0.0, 100.0, 0.0)),
    Param("map_max_points", 1_000_000, "Upper bound on the accumulated map's points (oldest part thinned "
          "beyond it)", limits=(1000, 100_000_000, 1)),
    Param("map_publish_rate", 1.0, "Rate (Hz) of ~/map_points while the map changes; 0 = never",
          limits=(0.0, 100.0, 0.0), dynamic=True),
    Param("path_max_length", 5000, "Poses kept in ~/path (and the saved trajectory)",
          limits=(1, 1_000_000, 1)),
    Param("path_publish_rate", 2.0, "Rate (Hz) of ~/path while it changes (a long path is costly to "
          "serialise); 0 = never", limits=(0.0, 100.0, 0.0), dynamic=True),
    Param("publish_odometry", True, "Publish ~/odometry"),
    Param("publish_pose", True, "Publish ~/pose"),
    Param("publish_path", True, "Publish ~/path"),
    Param("publish_points", True, "Publish ~/points (per-frame cloud)"),
    Param("publish_map", True, "Publish ~/map_points (accumulated cloud)"),
    Param("publish_depth", True, "Publish ~/depth and ~/depth/camera_info"),
    Param("output_directory", "lingbot_map_output", "Directory ~/save_map writes to when its request "
          "names none (relative to the node's working directory)"),
    # -- the map outlives the process (journal/, docs/sessions.md)
    Param("state_directory", "", "Folder of the keyframe journal: the frames the model stored and the state "
          "around them, written as the node runs (off the inference thread); a node started with a journal "
          "there of the same model, configuration and image_width resumes its map. Several cameras: "
          "<state_directory>/<camera>/. Empty = no journal (~/save_session refused)"),
    Param("journal_map", True, "With state_directory: also journal the accumulated map and the path "
          "(map.lbj beside the journal), so that they survive a restart and go into saved sessions; false "
          "saves the disk bandwidth of every frame's map points (the map and path then restart empty)"),
    Param("journal_compression", "lz4", "How the journals store frames and map points: lz4 (fast; camera "
          "images about a third smaller; without the lz4 module the node warns and stores them raw), zlib "
          "(camera images about half; about ten times lz4's CPU, on the writer thread), none (raw: the least "
          "CPU, the most disk). Journals of any kind are read back alike", choices=JOURNAL_COMPRESSIONS),
    Param("load_session", "", "A session saved with ~/save_session to start from (relative = under "
          "output_directory): the node localizes in that session's map. Replaces what state_directory "
          "holds (the journal found there is set aside as journal.replaced-<time>.lbj). Empty = none"),
    # -- frames and TF
    Param("publish_tf", True, "Broadcast the pose on TF (see tf_mode)", dynamic=True),
    Param("tf_mode", "auto", "map_to_odom: map -> odom_frame so that map -> base_frame equals the estimate "
          "(needs odom_frame -> base_frame from the robot's odometry); map_to_base: map -> base_frame; "
          "map_to_camera: no robot, map -> camera_tf_frame; auto: map_to_odom when base_frame is set and "
          "odom_frame -> base_frame is available, map_to_base when base_frame is set, else map_to_camera",
          choices=TF_MODES),
    Param("map_frame", "map", "Fixed frame of poses, path and clouds (REP 103 axes, origin = first camera)"),
    Param("odom_frame", "odom", "Odometry frame (tf_mode map_to_odom / auto)"),
    Param("base_frame", "", "Robot base frame (REP 105 base_link); the camera extrinsic base_frame -> the "
          "image's frame_id is read from TF (the URDF's static transforms); empty = no robot"),
    Param("camera_tf_frame", "", "tf_mode map_to_camera: child frame published under map_frame; empty = "
          "<camera optical frame>_lingbot (never the camera frame itself, which the URDF may parent)"),
    Param("camera_frame", "", "Optical frame of the camera; empty = the image header's frame_id "
          "(camera_optical_frame when that is empty too)"),
    # -- several cameras (one model, one K/V pool; see ros/camera_channel.py)
    Param("cameras", [], "Names of the cameras served by this node (string array); empty = one camera on "
          "`image`/`camera_info` with outputs directly under the node. Each name c subscribes c/image (or "
          "c/image/compressed) and c/camera_info, publishes under ~/c/ and takes camera.c.<name> parameters "
          "for the per-camera ones (" + ", ".join(CAMERA_PARAMETERS) + ")"),
    Param("camera_batching", False, "Several cameras: run the waiting frames of two or more cameras in one "
          "batched step (one trunk pass; each camera still attends over its own cache) instead of one after "
          "another. Needs CUDA graphs (bf16, FlashInfer); elsewhere the frames run in turn. More frames/s "
          "(+4 % on an H200), but a frame waits for the whole batch: off by default"),
    Param("camera_pipelining", True, "Several cameras: launch a camera's step before the previous camera's "
          "results are taken and published, so the GPU runs one step while the host finishes the previous "
          "one (a camera's own steps never overlap). More frames when the GPU is the bottleneck, one step "
          "more of latency then; false = each step's results before the next step"),
)

PARAMETER_NAMES = tuple(p.name for p in PARAMETERS)
DEFAULT_CAMERA_FRAME = "camera_optical_frame"
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
    deferred_eviction_timeout: float = 5.0
    keyframe_decision_timeout: float = 0.0
    keyframe_decision_default: str = "keep"
    time_jump_threshold: float = 1.0
    on_time_jump: str = "reset"
    on_lost: str = "continue"
    undistort: bool = True
    scale_source: str = "none"
    metric_scale: float = 1.0
    scale_wait_for_convergence: bool = True
    deferred_eviction: bool = False  # the value in force (the session's own flag follows it)
    # tracking health thresholds (HEALTH_PARAMETERS of robot/health.py)
    health_degraded_valid_fraction: float = _health_default("health_degraded_valid_fraction")
    health_lost_valid_fraction: float = _health_default("health_lost_valid_fraction")
    health_lost_after: int = _health_default("health_lost_after")
    health_init_frames: int = _health_default("health_init_frames")
    health_recover_after: int = _health_default("health_recover_after")
    health_jump_factor: float = _health_default("health_jump_factor")
    health_jump_floor: float = _health_default("health_jump_floor")
    health_max_rotation_deg: float = _health_default("health_max_rotation_deg")
    health_translation_std: float = _health_default("health_translation_std")
    health_rotation_std_deg: float = _health_default("health_rotation_std_deg")
    cameras: tuple[str, ...] = ()  # empty = one camera, today's names
    camera_batching: bool = False  # several cameras: batched steps (runtime.scheduler)
    camera_pipelining: bool = True  # several cameras: pipelined steps (runtime.scheduler)

    def __post_init__(self) -> None:
        health_config_from(self)  # the health thresholds together (ConfigError names the parameters)


def check_value(param: Param, value: Any) -> None:
    """Raise ConfigError naming the parameter when ``value`` breaks its type, range or choices."""
    expected = type(param.default)
    if expected is list:  # string arrays (cameras)
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"parameter {param.name} must be a list of strings, got {value!r}")
        return
    ok_type = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok_type = True
    if not ok_type:
        raise ConfigError(f"parameter {param.name} must be a {expected.__name__}, got {value!r}")
    if param.choices is not None and value not in param.choices:
        raise ConfigError(f"parameter {param.name} must be one of {list(param.choices)}, got {value!r}")
    if param.limits is not None:
        lo, hi, step = param.limits
        if not lo <= value <= hi or (step and (value - lo) % step):
            rule = f"in [{lo}, {hi}]" + (f" in steps of {step} from {lo}" if step and step != 1 else "")
            raise ConfigError(f"parameter {param.name} must be {rule}, got {value!r}")


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
    for p in PARAMETERS:
        log(f"parameter {p.name} = {v[p.name]!r}")
    log(f"model: {'preset lingbot-map' if not data else v['model_config']} -> "
        f"{json.dumps(model.to_dict(), default=list)}")
    return settings


_PLAIN_FIELDS = ("gpu_memory_check", "camera_batching", "camera_pipelining", "seed", "image_width", "input_transport", "input_qos", "max_frame_age",
                 "input_timeout", "service_timeout", "conf_threshold", "point_stride", "accumulate_map", "map_voxel_size",
                 "map_max_points", "map_publish_rate", "path_max_length", "path_publish_rate",
                 "publish_odometry", "publish_pose", "publish_path", "publish_points", "publish_map",
                 "publish_depth", "output_directory", "state_directory", "journal_map", "journal_compression", "load_session", "publish_tf", "tf_mode", "map_frame", "odom_frame",
                 "base_frame", "camera_frame", "camera_tf_frame", "deferred_eviction_timeout",
                 "keyframe_decision_timeout", "keyframe_decision_default", "time_jump_threshold", "on_time_jump",
                 "on_lost", "undistort", "scale_source", "metric_scale", "scale_wait_for_convergence", "deferred_eviction") + tuple(HEALTH_PARAMETERS)
DYNAMIC_PARAMETERS = frozenset(p.name for p in PARAMETERS if p.dynamic)
_DEFAULTS = {p.name: p.default for p in PARAMETERS}


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
            if value != base.get(name, _DEFAULTS[name]):
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


def params_file_text(values: Mapping[str, Any], node: str = "/**") -> str:
    """A ROS 2 parameters YAML file (``node: ros__parameters: ...``) for ``values``.

    Scalars are written as JSON, which is valid YAML, so no YAML library is needed.
    """
    lines = [f"{node}:", "  ros__parameters:"]
    for name, value in values.items():
        lines.append(f"    {name}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def write_params_file(path: str | Path, values: Mapping[str, Any], node: str = "/**") -> Path:
    path = Path(path)
    path.write_text(params_file_text(values, node))
    return path


__all__ = ["PARAMETERS", "PARAMETER_NAMES", "Param", "NodeSettings", "resolve_settings", "check_value",
           "params_file_text", "write_params_file", "INPUT_TRANSPORTS", "INPUT_QOS", "TF_MODES",
           "DYNAMIC_PARAMETERS", "apply_dynamic", "resolve_device", "cuda_is_available",
           "DEFAULT_CAMERA_FRAME", "CAMERA_PARAMETERS", "CAMERA_PREFIX", "check_camera_names",
           "camera_param_name", "split_camera_param", "camera_values", "resolve_camera_settings",
           "apply_camera_dynamic"]
