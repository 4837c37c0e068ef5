"""``lingbot-map-replay``'s command line: the flags (``build_parser``), and ``configure``,
which resolves and checks everything they decide before any file is read or written:
the model and stream configuration, the long-stream settings (the node's defaults for the
flags not given), the selection, the depth policy, numbers in range, the optional
packages an input or output needs, and the outputs (no two with one name, none that
exists already without --overwrite, every folder writable).

--loop-closure (off by default) needs --trajectory: that file is the optimised trajectory,
written when the run ends, and the raw one (the front end's poses as they came) goes beside it
as ``<stem>_raw<suffix>`` (``traj.tum`` -> ``traj_raw.tum``, ``raw_trajectory_path``), under the
same rules as every output. It needs depth (not with --no-depth) and the whole input in one run
(not with --resume: the journal holds the model's state, not the pose graph of the frames before).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .replay_console import PROG, UserError, describe_os_error

if TYPE_CHECKING:
    from ..config import ModelConfig, StreamConfig
    from ..io.results import DepthPolicy
    from ..io.sources import Selection
    from ..runtime.loop_closure import LoopConfig
    from ..stream.long_stream import LongStreamConfig

DESCRIPTION = f"{PROG}: stream recorded frames through the model and save what it predicts."
RAW_TRAJECTORY = "raw trajectory"  # how messages name --loop-closure's raw trajectory (it has no flag of its own)
_LONG_STREAM_FLAGS = ("window_frames", "overlap_frames", "keyframe_policy", "motion_min_translation",
                      "motion_min_rotation_deg", "auto_restart")


def node_default(name: str) -> Any:
    """The node's default of parameter ``name`` (one table for both: runtime/params.py, which imports no rclpy)."""
    from ..runtime.params import PARAMETERS

    return next(p.default for p in PARAMETERS if p.name == name)


def or_node_default(value: Any, name: str) -> Any:
    """``value`` when the flag was given, else the node's default of parameter ``name``."""
    return node_default(name) if value is None else value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    src = p.add_argument_group("input (one of)").add_mutually_exclusive_group(required=True)
    src.add_argument("--images", type=Path, help="folder of images (sorted by name)")
    src.add_argument("--bag", type=Path, help="rosbag2 directory (sqlite3 or MCAP) or ROS 1 .bag file")
    src.add_argument("--video", type=Path, help="video file (any container/codec FFmpeg reads)")
    sel = p.add_argument_group("selection")
    sel.add_argument("--topic", help="image topic of --bag (sensor_msgs/Image or CompressedImage)")
    sel.add_argument("--topic-type", choices=["Image", "CompressedImage"], help="read only this message type of "
                     "--topic (for a topic that carries both)")
    sel.add_argument("--start", type=float, default=0.0, help="skip the first S seconds of the recording "
                     "(bag receive time, video time; a folder's frame i is at i s); default 0")
    sel.add_argument("--duration", type=float, help="replay D seconds from --start (default: to the end)")
    sel.add_argument("--stride", type=int, default=1, help="take every N-th frame (default 1)")
    sel.add_argument("--max-frames", type=int, help="stop after N frames reached the model")
    sel.add_argument("--bad-frames", choices=["skip", "error"], help="an undecodable frame is skipped (counted, "
                     "warned) or ends the run; default: skip for --bag/--video, error for --images")

    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", help="checkpoint .pt/.safetensors or Hugging Face id; omitted = random weights")
    m.add_argument("--model-config", type=Path,
                   help="model JSON (e.g. the fixture config.json); default: released configuration")
    m.add_argument("--width", type=int, default=None, help="model input width, multiple of 14 (default 518, "
                   "or preprocess_width of the model config)")
    m.add_argument("--num-scale-frames", type=int)
    m.add_argument("--sliding-window", type=int)
    m.add_argument("--keyframe-interval", type=int)
    m.add_argument("--camera-iterations", type=int)
    m.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    m.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flashinfer", "flashinfer-fa2",
                                                          "flashinfer-fa2-paged", "flashinfer-fa3"])
    m.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    m.add_argument("--threads", type=int, help="CPU threads of torch (default: torch's choice); 1 is often "
                   "fastest on a small shared machine")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights when no checkpoint is given")
    m.add_argument("--no-depth", action="store_true", help="skip the depth head (poses only)")

    ls = p.add_argument_group("long streams (the node's parameters of the same names; defaults as the node's)")
    ls.add_argument("--long-stream", action=argparse.BooleanOptionalAction, default=True,
                    help="window restarts aligned by Sim(3) (any length); --no-long-stream: the plain session, "
                    "up to the model's horizon")
    ls.add_argument("--window-frames", type=int, help="stored frames per cache window (node: 320)")
    ls.add_argument("--overlap-frames", type=int, help="keyframes re-fed into the next window; 0 = "
                    "num_scale_frames (node: 0)")
    ls.add_argument("--keyframe-policy", choices=["interval", "motion"], help="node: interval")
    ls.add_argument("--motion-min-translation", type=float, help="motion policy: model units (node: 0.05)")
    ls.add_argument("--motion-min-rotation-deg", type=float, help="motion policy: degrees (node: 5.0)")
    ls.add_argument("--auto-restart", action=argparse.BooleanOptionalAction, default=None,
                    help="restart when the window is full (node: on)")

    o = p.add_argument_group("outputs", "An output that exists already (for --out also its <name>.chunks "
                             "folder) is refused unless --overwrite is given. Each output gets its final name only "
                             "when complete (until then <name>.partial). An output that cannot be written ends the "
                             "run with one error line naming what was written, what was not, and the .partial "
                             "files kept; exit status 2.")
    o.add_argument("--overwrite", action="store_true", help="replace existing outputs (each only once its "
                   "replacement is complete); without it an existing output is refused before the model loads")
    o.add_argument("--out", type=Path, help="per-frame predictions (.npz)")
    o.add_argument("--save-depth", default="all", help="frames whose depth is kept in --out and "
                   "--out-bag: none, all (default) or every-K")
    o.add_argument("--chunk-frames", type=int, default=100,
                   help="depth frames per npz chunk once a run keeps more than this (default 100)")
    o.add_argument("--trajectory", type=Path, help="trajectory in TUM format")
    o.add_argument("--ply", type=Path, help="point cloud (binary PLY) of every frame's selected points")
    o.add_argument("--conf-threshold", type=float, default=None,
                   help="points need confidence above this (node: 1.5)")
    o.add_argument("--point-stride", type=int, default=None, help="keep every N-th point over the threshold "
                   "(node: 10)")
    o.add_argument("--out-bag", type=Path, help="results as a rosbag2 (MCAP): /tf, odometry, path, points, "
                   "depth, depth/camera_info, REP-103 map frame")
    o.add_argument("--bag-namespace", default="/lingbot_map", help="topic prefix in --out-bag (the node's: "
                   "/lingbot_map)")
    o.add_argument("--bag-path-rate", type=float, default=None, help="path messages a second of input time in "
                   "--out-bag, each with the last --bag-path-length poses; 0 = one at the end (node: 2.0)")
    o.add_argument("--bag-path-length", type=int, default=None, help="poses in a path message (node: 5000)")
    o.add_argument("--map-frame", default=None, help="map frame id in --out-bag (node: map)")
    o.add_argument("--camera-frame", default="", help="camera optical frame id in --out-bag; empty = the "
                   "image's frame_id (camera_optical_frame when it has none)")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c = p.add_argument_group("precision check (instead of a replay)")
    c.add_argument("--compare-precision", choices=["fp8", "fp8-kv", "fp8-gemm"], help="stream the frames (up "
                   "to --max-frames, default 300) in fp32, bf16 and bf16 with FP8 GEMMs + K/V (fp8), FP8 K/V or "
                   "FP8 GEMMs, and print each one's deviation per output (poses, depth, confidence); needs "
                   "--device cuda; writes no other output")
    c.add_argument("--compare-out", type=Path, help="--compare-precision: the table as JSON")
    j = p.add_argument_group("sessions (the keyframe journal)")
    j.add_argument("--save-session", type=Path, metavar="DIR",
                   help="journal the run into DIR as it goes (crash-safe): an interrupted run continues with "
                        "--resume DIR")
    j.add_argument("--resume", type=Path, metavar="DIR",
                   help="rebuild the model's state from DIR's journal and continue with the input after the last "
                        "frame it holds (same input, model and flags); journaling goes on in DIR, or in "
                        "--save-session's folder when given")
    lc = p.add_argument_group("loop closure (the node's loop_* parameters; defaults as the node's)")
    lc.add_argument("--loop-closure", action="store_true",
                    help="find places seen before, verify each with the model and correct the trajectory with a "
                    "pose graph; needs --trajectory, which then holds the optimised trajectory (written at the "
                    "end), and writes the raw one beside it as <stem>_raw<suffix> (traj.tum -> traj_raw.tum) for "
                    "evo_ape; needs depth, not with --resume")
    lc.add_argument("--loop-min-similarity", type=float, help="cosine similarity of two keyframes' place "
                    "descriptors that makes the older one a candidate, in (0, 1] (node: 0.85)")
    lc.add_argument("--loop-min-separation", type=int, help="frames a candidate is older than the keyframe at "
                    "least; keep it above the window (node: 100)")
    return p


# ----------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class Settings:
    model: ModelConfig
    stream: StreamConfig
    long_stream: LongStreamConfig | None  # None: the plain session
    width: int  # model input width, pixels
    selection: Selection
    depth: DepthPolicy
    conf_threshold: float
    point_stride: int
    bad_frames: str
    loop: LoopConfig | None = None  # None: no loop closure


def configure(args: argparse.Namespace) -> Settings:
    """Resolve and check everything the flags decide, before any file is read or written."""
    from ..config import ConfigError, ModelConfig, StreamConfig, load_json
    from ..io.results import DepthPolicy
    from ..io.sources import Selection
    from ..stream.long_stream import LongStreamConfig

    if args.bag is not None and not args.topic:
        raise UserError("--bag needs --topic (the image topic to replay)")
    if (args.topic or args.topic_type) and args.bag is None:
        raise UserError(f"{'--topic' if args.topic else '--topic-type'} goes with --bag")
    if args.compare_precision and (args.save_session or args.resume):
        raise UserError("--compare-precision replays nothing: it does not go with --save-session or --resume")
    if not any((args.out, args.trajectory, args.ply, args.out_bag, args.compare_precision, args.save_session,
                args.resume)):
        raise UserError("nothing to write: give --out, --trajectory, --ply, --out-bag or --save-session")
    loop_cfg = _loop_closure(args)
    try:
        data = load_json(args.model_config) if args.model_config else {}
        model_cfg = ModelConfig.from_dict(data) if data else ModelConfig.preset("lingbot-map")
        stream_cfg = StreamConfig.from_dict(data).with_overrides(
            num_scale_frames=args.num_scale_frames, sliding_window=args.sliding_window,
            keyframe_interval=args.keyframe_interval, camera_iterations=args.camera_iterations,
            device=args.device, backend=args.backend, dtype=args.dtype)
        long_cfg = _long_stream(args, LongStreamConfig)
        if long_cfg is not None:
            long_cfg.check(stream_cfg, model_cfg.max_frame_num)
        selection = Selection(start=args.start, duration=args.duration, stride=args.stride)
        depth = DepthPolicy(0) if args.no_depth else DepthPolicy.parse(args.save_depth)
    except (ConfigError, TypeError, ValueError) as exc:
        raise UserError(str(exc)) from None
    width = args.width or int(data.get("preprocess_width", 518))
    if width <= 0 or width % model_cfg.patch_size:
        raise UserError(f"--width {width} is not a positive multiple of the patch size {model_cfg.patch_size}")
    _check_numbers_and_outputs(args)
    conf = or_node_default(args.conf_threshold, "conf_threshold")
    stride = or_node_default(args.point_stride, "point_stride")
    bad = args.bad_frames or ("error" if args.images is not None else "skip")
    return Settings(model_cfg, stream_cfg, long_cfg, width, selection, depth, conf, stride, bad, loop_cfg)


def _loop_closure(args: argparse.Namespace):
    """LoopConfig from the flags (the node's defaults for those not given); None without --loop-closure."""
    given = [flag for flag, value in (("--loop-min-similarity", args.loop_min_similarity),
                                      ("--loop-min-separation", args.loop_min_separation)) if value is not None]
    if not args.loop_closure:
        if given:
            raise UserError(f"{given[0]} goes with --loop-closure")
        return None
    if args.compare_precision:
        raise UserError("--compare-precision replays nothing: it does not go with --loop-closure")
    if args.trajectory is None:
        raise UserError("--loop-closure needs --trajectory: it writes the optimised trajectory there and the raw "
                        "one beside it (<stem>_raw<suffix>)")
    if args.no_depth:
        raise UserError("--loop-closure needs depth; drop --no-depth")
    if args.resume:
        raise UserError("--loop-closure does not go with --resume: the journal holds the model's state, not the pose "
                        "graph of the frames before; replay the whole input with --loop-closure")
    similarity = or_node_default(args.loop_min_similarity, "loop_min_similarity")
    separation = or_node_default(args.loop_min_separation, "loop_min_separation")
    if not 0.0 < similarity <= 1.0:
        raise UserError(f"--loop-min-similarity must be in (0, 1], got {similarity}")
    if separation < 1:
        raise UserError(f"--loop-min-separation must be at least 1, got {separation}")
    _require("gtsam", "--loop-closure")
    from ..runtime.loop_closure import LoopConfig

    return LoopConfig(min_similarity=similarity, min_separation=separation)


def raw_trajectory_path(trajectory: Path) -> Path:
    """Where --loop-closure writes the raw trajectory: beside --trajectory, ``<stem>_raw<suffix>``."""
    return trajectory.with_name(f"{trajectory.stem}_raw{trajectory.suffix}")


_PACKAGES = {"rosbags": "rosbags", "av": "av (PyAV)", "gtsam": "gtsam (the pose graph)"}


def _require(module: str, flag: str) -> None:
    """A UserError naming the pip package when ``module`` (needed by ``flag``) is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"{flag} needs the Python package {_PACKAGES[module]}: pip install {module}")


def _check_numbers_and_outputs(args: argparse.Namespace) -> None:
    from ..io.atomic import check_destination

    if args.bag is not None or args.out_bag is not None:
        _require("rosbags", "--bag" if args.bag is not None else "--out-bag")
    if args.video is not None:
        _require("av", "--video")

    for flag, value, low in (("--max-frames", args.max_frames, 1), ("--chunk-frames", args.chunk_frames, 1),
                             ("--point-stride", args.point_stride, 1), ("--threads", args.threads, 1),
                             ("--bag-path-length", args.bag_path_length, 1),
                             ("--bag-path-rate", args.bag_path_rate, 0)):
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    if args.ply and args.no_depth:
        raise UserError("--ply needs depth; drop --no-depth")
    outputs = requested_outputs(args)
    seen: dict[Path, str] = {}
    for flag, path in outputs:
        for name in _names_of(flag, path):
            other = seen.setdefault(name.absolute(), flag)
            if other != flag:
                raise UserError(f"{other} and {flag} both write {name}; give them different names")
    for flag, path in outputs:
        if flag != "--out-bag":
            try:
                check_destination(path)
            except OSError as exc:
                raise UserError(f"{flag}: {exc}") from None
        elif os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
            raise UserError(f"--out-bag {path} exists and is not a folder; refusing to replace it")
        for name in _names_of(flag, path):
            if os.path.lexists(name) and not args.overwrite:
                what = f"{flag} {path}" if name == path else f"{flag} {path}: its {name}"
                raise UserError(f"{what} exists already; pass --overwrite to replace it (no output is replaced "
                                "without it)")
        _check_writable(flag, path)


def requested_outputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(flag, path) of each output asked for, in the order they are written; --loop-closure's raw
    trajectory is ``RAW_TRAJECTORY``."""
    raw = raw_trajectory_path(args.trajectory) if args.loop_closure and args.trajectory else None
    pairs = (("--out", args.out), ("--trajectory", args.trajectory), (RAW_TRAJECTORY, raw), ("--ply", args.ply),
             ("--out-bag", args.out_bag))
    return [(flag, path) for flag, path in pairs if path is not None]


def _names_of(flag: str, path: Path) -> list[Path]:
    """The names an output takes: --out's npz and its depth chunks' folder, else the path itself."""
    return [path, path.with_name(path.stem + ".chunks")] if flag == "--out" else [path]


def _check_writable(flag: str, path: Path) -> None:
    """A UserError when the folder ``path`` goes into (or the nearest existing folder above it,
    where the folders are still to be made) does not take a new file: read-only file system,
    no permission, immutable, no inode left. Probed with a hidden temp file, removed at once."""
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{PROG}-probe-", dir=folder)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write into {folder}: {describe_os_error(exc, name_file=False)}; "
                        "nothing was written") from None
    os.close(fd)
    os.unlink(probe)


def _long_stream(args: argparse.Namespace, config_class):
    """LongStreamConfig from the flags (node defaults for those not given); None with --no-long-stream."""
    given = [name for name in _LONG_STREAM_FLAGS if getattr(args, name) is not None]
    if not args.long_stream:
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} needs the long-stream mode (drop --no-long-stream)")
        return None
    values = {name: or_node_default(getattr(args, name), name) for name in _LONG_STREAM_FLAGS}
    values["overlap_frames"] = values["overlap_frames"] or None
    return config_class(**values)
