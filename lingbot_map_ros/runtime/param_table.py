"""The node's parameters as data: one ``Param`` per parameter (name, default, description, range
or choices, whether it may change at run time), the per-camera ones, and the value check.

``scripts/gen_reference.py`` writes docs/reference.md from this table, its sections from the
``# -- title`` comments above the entries; ``config/lingbot_map.yaml`` lists the same parameters
(``test/ros/test_ros_tf_and_files.py`` keeps them equal). ``runtime.params`` maps the values onto
``NodeSettings``. Nothing here imports torch or rclpy.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..config import BACKENDS, DTYPES, KEYFRAME_POLICIES, KV_CACHE_DTYPES, PRECISIONS, ConfigError
from ..robot.health import HEALTH_PARAMETERS, HealthConfig

INPUT_TRANSPORTS = ("raw", "compressed")
INPUT_QOS = ("sensor_data", "reliable")
TF_MODES = ("auto", "map_to_odom", "map_to_base", "map_to_camera")
JOURNAL_COMPRESSIONS = ("lz4", "zlib", "none")  # journal.format.COMPRESSIONS (not imported: that pulls in torch)
DEVICES_HELP = "auto (CUDA when available, else CPU), cpu, cuda or cuda:N"
ON_TIME_JUMP = ("reset", "drop")
ON_LOST = ("continue", "reset", "relocalize")
SCALE_SOURCES = ("none", "fixed", "odometry", "depth")
DECISION_DEFAULTS = ("keep", "drop")
_HEALTH_DEFAULTS = HealthConfig()


def health_default(name: str) -> float | int:
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
    Param("gpu_memory_budget_gib", 0.0, "Size (GiB) of the GPU the start-up check (gpu_memory_check) assumes, "
          "all of it free, on any device, the CPU included: whether this configuration would fit a smaller card "
          "(8 = an 8 GiB card); 0 = the device's own free memory (no check on the CPU)", limits=(0.0, 1024.0, 0.0)),
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
          "large covariance); reset: start a new sequence at once (logged, counted in lost_resets); relocalize "
          "(needs loop_closure): look for the camera in the whole keyframe map, no pose until it is found, then "
          "go on in the same map (counted in lost_resets; see relocalize_timeout)",
          choices=ON_LOST, dynamic=True),
    Param("relocalize_timeout", 0.0, "on_lost relocalize: seconds of image stamps after the loss without finding "
          "the camera before it gives up and starts a new sequence as on_lost reset does (the keyframe map is "
          "dropped with it); 0 = keep looking", limits=(0.0, 86400.0, 0.0), dynamic=True),
    # -- tracking health thresholds (robot/health.py; heuristics, see the README)
    Param("health_degraded_valid_fraction", health_default("health_degraded_valid_fraction"), "Tracking health: a frame whose fraction of confident pixels "
          "(confidence above conf_threshold) is below this is suspect (low_confidence: tracking -> degraded)",
          limits=(0.0, 1.0, 0.0), dynamic=True),
    Param("health_lost_valid_fraction", health_default("health_lost_valid_fraction"), "Tracking health: a fraction of confident pixels below this is a "
          "confidence collapse; health_lost_after of them in a row make tracking lost (must be <= "
          "health_degraded_valid_fraction)", limits=(0.0, 1.0, 0.0), dynamic=True),
    Param("health_lost_after", health_default("health_lost_after"), "Tracking health: consecutive confidence collapses that make tracking lost "
          "(a non-finite output is lost at once)", limits=(1, 1000, 1), dynamic=True),
    Param("health_init_frames", health_default("health_init_frames"), "Tracking health: good frames in a row that end initializing",
          limits=(1, 1000, 1), dynamic=True),
    Param("health_recover_after", health_default("health_recover_after"), "Tracking health: good frames in a row that bring degraded or lost back "
          "to tracking", limits=(1, 1000, 1), dynamic=True),
    Param("health_jump_factor", health_default("health_jump_factor"), "Tracking health: a camera-centre step larger than this times the median "
          "of the recent steps (and than health_jump_floor) is a translation_jump", limits=(0.001, 1e6, 0.0),
          dynamic=True),
    Param("health_jump_floor", health_default("health_jump_floor"), "Tracking health: steps up to this length (model units) are never a "
          "translation_jump", limits=(0.0, 1e6, 0.0), dynamic=True),
    Param("health_max_rotation_deg", health_default("health_max_rotation_deg"), "Tracking health: a rotation between consecutive frames above this "
          "many degrees is a rotation_jump; 180 = never", limits=(0.001, 180.0, 0.0), dynamic=True),
    Param("health_translation_std", health_default("health_translation_std"), "~/odometry covariance: standard deviation of x, y, z while "
          "tracking (model units, times the metric scale when one is applied); the variances are x10 "
          "degraded, x100 initializing, x1000 lost", limits=(1e-6, 1000.0, 0.0), dynamic=True),
    Param("health_rotation_std_deg", health_default("health_rotation_std_deg"), "~/odometry covariance: standard deviation of roll, pitch, yaw "
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
    # -- loop closure (runtime/loop_closure.py, docs/loop_closure.md)
    Param("loop_closure", False, "Find places seen before (outside the model's window), verify each with the "
          "model, and correct the path, the map and map -> odom with a pose graph (GTSAM). Off by default: its "
          "accuracy with the released weights is not measured yet (docs/loop_closure.md)"),
    Param("loop_min_similarity", 0.85, "Loop closure: cosine similarity of two keyframes' place descriptors "
          "that makes the older one a candidate", limits=(0.5, 1.0, 0.0)),
    Param("loop_min_separation", 400, "Loop closure: a candidate is at least this many frames older than the "
          "keyframe (keep it above window_frames x keyframe_interval: the model's window closes its own loops)",
          limits=(1, 10_000_000, 1)),
    Param("loop_max_keyframes", 5000, "Loop closure: keyframes kept for places, verification and the map (about "
          "60 KB each in memory; the oldest goes first)", limits=(10, 10_000_000, 1)),
    Param("loop_min_inlier_ratio", 0.8, "Loop closure: share of the candidate's depth that must reproject "
          "onto the current keyframe's within loop_depth_tolerance", limits=(0.0, 1.0, 0.0)),
    Param("loop_depth_tolerance", 0.05, "Loop closure: relative depth error of a reprojected point that still "
          "counts as an inlier", limits=(0.001, 1.0, 0.0)),
    Param("loop_min_overlap", 0.3, "Loop closure: share of the candidate's confident points that must land in "
          "the current keyframe's view", limits=(0.0, 1.0, 0.0)),
    Param("loop_robust_kernel", "cauchy", "Loop closure: robust kernel of loop edges (one false loop must not "
          "bend the map)", choices=("cauchy", "huber", "dcs", "none")),
    Param("loop_prior_max_dt", 0.5, "Loop closure: ~/set_pose and ~/pose_prior take a pose whose stamp is at most "
          "this far (s) from a frame the path holds (a set_pose with a zero stamp is for the latest frame)",
          limits=(0.001, 3600.0, 0.0)),
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
    # -- Nav2: managed node and occupancy grid (docs/nav2.md)
    Param("managed", False, "Run as a managed (lifecycle) node: the parameters are read, the model loaded and "
          "the services created at configure, the inputs subscribed and the outputs published while active "
          "(lifecycle services under the node's name, e.g. for Nav2's lifecycle_manager); false = start at once"),
    Param("grid", False, "Build and publish ~/grid (nav_msgs/OccupancyGrid, map_frame) from the cameras' points "
          "and poses (every camera whose map is joined to map_frame); ~/save_map then also writes map.yaml + "
          "image for map_server. Needs a metric scale "
          "(scale_source), base_frame in TF (the ground plane, REP 103 z up) and accumulate_map"),
    Param("grid_resolution", 0.05, "Occupancy grid cell side (m)", limits=(0.01, 1.0, 0.0)),
    Param("grid_min_height", 0.1, "Points at least this high above the floor (m) are obstacles; lower ones "
          "(down to 0.15 m below the floor) are floor, seen free", limits=(0.0, 5.0, 0.0)),
    Param("grid_max_height", 1.5, "Points higher than this above the floor (m) are ignored (ceilings, "
          "overhangs the robot passes under)", limits=(0.05, 10.0, 0.0)),
    Param("grid_max_range", 8.0, "Points further than this from the camera (m, horizontally) are ignored "
          "(far depth is noisy)", limits=(0.1, 100.0, 0.0)),
    Param("grid_max_extent", 100.0, "Most metres the grid covers per axis: it grows with what is seen up to "
          "this (a maximum extent, not a rolling window: what was mapped stays)", limits=(1.0, 2000.0, 0.0)),
    Param("grid_base_height", 0.0, "Height (m) of base_frame's origin above the floor (0 for base_footprint)",
          limits=(-10.0, 10.0, 0.0)),
    Param("grid_publish_rate", 1.0, "Rate (Hz) of ~/grid while it changes and someone listens; 0 = never",
          limits=(0.0, 100.0, 0.0), dynamic=True),
)

PARAMETER_NAMES = tuple(p.name for p in PARAMETERS)
DYNAMIC_PARAMETERS = frozenset(p.name for p in PARAMETERS if p.dynamic)
DEFAULTS = {p.name: p.default for p in PARAMETERS}


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


__all__ = ["Param", "PARAMETERS", "PARAMETER_NAMES", "DYNAMIC_PARAMETERS", "DEFAULTS", "CAMERA_PARAMETERS",
           "CAMERA_PREFIX", "INPUT_TRANSPORTS", "INPUT_QOS", "TF_MODES", "JOURNAL_COMPRESSIONS", "DEVICES_HELP",
           "ON_TIME_JUMP", "ON_LOST", "SCALE_SOURCES", "DECISION_DEFAULTS", "health_default", "check_value",
           "params_file_text", "write_params_file"]
