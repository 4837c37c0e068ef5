"""lingbot-map-replay: stream recorded frames through the model and save what it predicts.

    lingbot-map-replay --images DIR               --out predictions.npz [options]
    lingbot-map-replay --bag PATH --topic TOPIC   --out predictions.npz --out-bag results [options]
    lingbot-map-replay --video FILE               --trajectory traj.tum --ply cloud.ply [options]

Inputs: a folder of images (sorted by name); a rosbag2 (sqlite3 or MCAP storage) or
ROS 1 bag topic of sensor_msgs/Image or sensor_msgs/CompressedImage, read without a
ROS install; a video file (PyAV). Frames are decoded one at a time on a prefetch
thread, never all in memory; --start, --duration, --stride and --max-frames choose
which (see ``io.sources``).

Outputs, written as the frames come (each gets its final name only when complete;
until then, or after a failure, ``<name>.partial``). An output that exists already is
refused before the model loads, unless --overwrite (then it is replaced only when the
new one is complete); so is an output folder that cannot be written:

- --out: npz with pose_enc [S,9], pose_c2w [S,4,4] (camera-to-world, OpenCV axes,
  world = first camera, model units), intrinsics [S,3,3], is_keyframe [S],
  stamp_ns [S], window [S]; depth and depth_conf [D,H,W] for the frames --save-depth
  keeps (rows depth_frames [D]), in the npz for short runs and in one npz per
  --chunk-frames frames beside it for long ones (``io.results.load_predictions``);
- --trajectory (TUM) and --ply (points with confidence > --conf-threshold, every
  --point-stride-th), in the same OpenCV world;
- --out-bag: a rosbag2 (MCAP) of the node's outputs in the REP-103 map frame
  (``io.results_bag``).

By default the frames go through the long-stream session as in the node (window
restarts aligned by a Sim(3), so any length works); --no-long-stream runs the plain
session (up to the model's horizon). Either way frame t+1 is submitted before frame t's
results are taken (the GPU stays busy while the host writes). A progress bar (frames/s, ETA, window) and
one summary line go to stderr. Any input problem ends with one line
``lingbot-map-replay: error: ...`` and exit status 2; undecodable frames of a bag or
a video are skipped, counted and warned about (--bad-frames). So does an output that
cannot be written (a full or read-only disk, at any point up to the final rename): the
line names the outputs written, those not written and the ``.partial`` files kept
(``incomplete`` where even those could not be finished).
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import resource
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from ..config import ModelConfig, StreamConfig
    from ..io.results import DepthPolicy
    from ..io.sources import Selection
    from ..stream.long_stream import LongStreamConfig

PROG = "lingbot-map-replay"
MAX_SHOWN_BAD_FRAMES = 10  # warnings for the first bad frames; later ones are only counted
_LONG_STREAM_FLAGS = ("window_frames", "overlap_frames", "keyframe_policy", "motion_min_translation",
                      "motion_min_rotation_deg", "auto_restart")

log = logging.getLogger(__name__)


class UserError(Exception):
    """A problem with the user's input, reported as one line."""


def _node_default(name: str) -> Any:
    """The node's default of parameter ``name`` (one table for both: runtime/params.py, which imports no rclpy)."""
    from ..runtime.params import PARAMETERS

    return next(p.default for p in PARAMETERS if p.name == name)


def _default(value: Any, name: str) -> Any:
    """``value`` when the flag was given, else the node's default of parameter ``name``."""
    return _node_default(name) if value is None else value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
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
    conf = _default(args.conf_threshold, "conf_threshold")
    stride = _default(args.point_stride, "point_stride")
    bad = args.bad_frames or ("error" if args.images is not None else "skip")
    return Settings(model_cfg, stream_cfg, long_cfg, width, selection, depth, conf, stride, bad)


_PACKAGES = {"rosbags": "rosbags", "av": "av (PyAV)"}


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
    """(flag, path) of each output asked for, in the order they are written."""
    pairs = (("--out", args.out), ("--trajectory", args.trajectory), ("--ply", args.ply), ("--out-bag", args.out_bag))
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


def describe_os_error(exc: BaseException, name_file: bool = True) -> str:
    """``exc`` in a few words: an OSError's strerror with its errno name (``No space left on
    device (ENOSPC)``) and the file it names (``name_file``), else its text."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f": {exc.filename}" if exc.filename and name_file else ""
        return f"{exc.strerror} ({name}){where}"
    return " ".join(str(exc).split()) or type(exc).__name__


def _long_stream(args: argparse.Namespace, config_class):
    """LongStreamConfig from the flags (node defaults for those not given); None with --no-long-stream."""
    given = [name for name in _LONG_STREAM_FLAGS if getattr(args, name) is not None]
    if not args.long_stream:
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} needs the long-stream mode (drop --no-long-stream)")
        return None
    values = {name: _default(getattr(args, name), name) for name in _LONG_STREAM_FLAGS}
    values["overlap_frames"] = values["overlap_frames"] or None
    return config_class(**values)


def open_source(args: argparse.Namespace, settings: Settings):
    from ..io.sources import BagSource, ImageFolderSource, SourceError, VideoSource

    try:
        if args.images is not None:
            source = ImageFolderSource(args.images, settings.selection)
        elif args.bag is not None:
            source = BagSource(args.bag, args.topic, settings.selection, args.topic_type)
        else:
            source = VideoSource(args.video, settings.selection)
    except SourceError as exc:
        raise UserError(str(exc)) from None
    s0 = settings.stream.num_scale_frames
    if args.images is not None:
        n = source.expected_frames()
        n = min(n, args.max_frames) if args.max_frames else n
        if n < s0:
            raise UserError(f"{n} image(s) in {args.images}, fewer than the {s0} scale frames the model needs")
    return source


# ----------------------------------------------------------------------------- outputs

@dataclass(frozen=True)
class _Meta:
    """What the results of a pushed frame are written with."""

    stamp_ns: int
    camera_frame: str
    name: str
    window: int = 0  # the long-stream window it went into


class OutputError(Exception):
    """An output could not be written (``flag`` ``path``: ``cause``, an OSError)."""

    def __init__(self, flag: str, path: Path, cause: BaseException) -> None:
        super().__init__(f"cannot write {flag} {path}: {describe_os_error(cause)}")
        self.flag, self.path, self.cause = flag, path, cause


@dataclass
class Unfinished:
    """An output whose writer failed: what it was, why, and what of it is on disk."""

    flag: str
    path: Path
    reason: str
    kept: list[Path]  # complete .partial files
    incomplete: list[Path]  # what a failed abort() left on disk

    def note(self) -> str:
        if self.incomplete:
            return f"{', '.join(map(str, self.incomplete))} left incomplete"
        if self.kept:
            return f"kept as {', '.join(map(str, self.kept))}"
        return "nothing of it kept"


@dataclass
class Closed:
    """What ``Outputs.close`` did."""

    written: list[Path]
    failed: list[Unfinished]


class Outputs:
    """The requested writers, made when the first result arrives (a run that fails before
    writes nothing).

    A writer that cannot write (a full or read-only disk) takes no more frames: a warning says
    so and the others go on until the run ends (an ``OutputError`` naming it once no writer is
    left). ``close`` gives each writer its final name (a failed one is kept as ``.partial``
    where possible) and ``abort`` keeps each as ``.partial``; neither raises for a writer that
    fails: they say which did what."""

    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        self.args, self.settings = args, settings
        self.writers: list[tuple[str, Path, Any]] = []  # (flag, path, writer)
        self.store = self.tum = self.ply = self.bag = None
        self.broken: dict[str, str] = {}  # flag -> why its writer failed
        self._opened = False
        self.rows = 0

    def _open(self) -> None:
        """Make the writers, each listed as soon as it exists (so that ``abort`` finds it)."""
        from ..io.results import PlyStreamWriter, PredictionStore, TumStreamWriter
        from ..io.results_bag import ResultsBagWriter

        a, overwrite = self.args, self.args.overwrite
        self._opened = True
        if a.out:
            self.store = self._make("--out", a.out, lambda: PredictionStore(a.out, self.settings.depth, a.chunk_frames,
                                                                            overwrite=overwrite))
        if a.trajectory:
            self.tum = self._make("--trajectory", a.trajectory, lambda: TumStreamWriter(a.trajectory, overwrite))
        if a.ply:
            self.ply = self._make("--ply", a.ply, lambda: PlyStreamWriter(a.ply, overwrite))
        if a.out_bag:
            self.bag = self._make("--out-bag", a.out_bag, lambda: ResultsBagWriter(
                a.out_bag, namespace=a.bag_namespace, map_frame=a.map_frame or _node_default("map_frame"),
                path_rate=_default(a.bag_path_rate, "path_publish_rate"),
                path_max_length=_default(a.bag_path_length, "path_max_length"), overwrite=overwrite))

    def _make(self, flag: str, path: Path, make: Callable[[], Any]):
        try:
            writer = make()
        except OSError as exc:
            raise OutputError(flag, path, exc) from None
        self.writers.append((flag, path, writer))
        return writer

    def _call(self, flag: str, writer, method: str, *args) -> None:
        """``writer.method(*args)`` unless the writer failed before. An OSError marks it failed (one
        warning) and the run goes on for the other outputs; OutputError when none is left."""
        if writer is None or flag in self.broken:
            return
        try:
            getattr(writer, method)(*args)
        except OSError as exc:
            path = next(p for f, p, _ in self.writers if f == flag)
            self.broken[flag] = describe_os_error(exc)
            if len(self.broken) == len(self.writers):
                raise OutputError(flag, path, exc) from None
            log.warning("cannot write %s %s after %d frames: %s; the run goes on for the other outputs", flag, path,
                        self.rows - 1, self.broken[flag])

    def add(self, r, meta: _Meta) -> None:
        """One FrameResult ``r`` (model world, OpenCV axes) of the input frame ``meta``."""
        from ..geometry import unproject_pixels

        if not self._opened:
            self._open()
        row, self.rows = self.rows, self.rows + 1
        keep_depth = r.depth is not None and self.settings.depth.keeps(row)
        self._call("--out", self.store, "add", r.pose_enc, r.c2w, r.intrinsics, r.is_keyframe, meta.stamp_ns,
                   meta.window, r.depth, r.confidence)
        self._call("--trajectory", self.tum, "add", meta.stamp_ns / 1e9, r.c2w)
        points = colors = conf = None
        if r.depth is not None and (self.ply is not None or self.bag is not None):
            index = np.flatnonzero(r.confidence.reshape(-1) > self.settings.conf_threshold)
            index = index[::self.settings.point_stride]
            points = unproject_pixels(r.depth, r.intrinsics, r.c2w, index).astype(np.float32)
            finite = np.isfinite(points).all(axis=1)
            points, index = points[finite], index[finite]
            colors, conf = r.colors(index), r.confidence.reshape(-1)[index].astype(np.float32)
        self._call("--ply", self.ply, "add", points, colors)
        camera = self.args.camera_frame or meta.camera_frame
        self._call("--out-bag", self.bag, "add", meta.stamp_ns, camera, r.c2w, r.intrinsics, r.size, points, colors,
                   conf, r.depth if keep_depth else None)

    def close(self) -> Closed:
        """Give every writer its final name; one that cannot is kept as ``.partial`` where possible."""
        closed = Closed([], [])
        for flag, path, w in self.writers:
            if flag in self.broken:  # failed during the run (the run went on without it)
                closed.failed.append(self._abort_one(flag, path, w, self.broken[flag]))
                continue
            try:
                result = w.close()
            except OSError as exc:
                closed.failed.append(self._abort_one(flag, path, w, describe_os_error(exc)))
                continue
            closed.written += result if isinstance(result, list) else [result]
        return closed

    def abort(self) -> tuple[list[Path], list[Unfinished]]:
        """Finish every writer as a ``.partial`` file (never raises): the paths kept, and the writers
        that could not be finished (with what they left on disk)."""
        kept: list[Path] = []
        unfinished: list[Unfinished] = []
        for flag, path, w in self.writers:
            done = self._abort_one(flag, path, w, self.broken.get(flag, ""))
            if done.incomplete or not done.kept:
                unfinished.append(done)
            kept += done.kept
        return kept, unfinished

    @staticmethod
    def _abort_one(flag: str, path: Path, writer, reason: str) -> Unfinished:
        try:
            result = writer.abort()
        except Exception as exc:  # one broken writer must not hide the others' files
            reason = reason or describe_os_error(exc)
            return Unfinished(flag, path, reason, [], [p for p in writer.leftovers() if os.path.lexists(p)])
        return Unfinished(flag, path, reason, result if isinstance(result, list) else [result], [])


# ----------------------------------------------------------------------------- the run

class Replay:
    """Feeds the source's frames to the session and the results to the outputs."""

    def __init__(self, args: argparse.Namespace, settings: Settings, session, outputs: Outputs,
                 observer: Callable[[int], None] | None = None) -> None:
        self.args, self.settings, self.session, self.outputs = args, settings, session, outputs
        self.observer = observer
        self.pending: deque[_Meta] = deque()  # pushed frames whose results have not come yet
        self.pushed = self.done = self.dropped = 0
        self.first_problem: str | None = None
        self._waiting = None  # the pending results of the frame submitted last
        self.bar = None
        self._postfix: tuple[int, int] | None = None
        # journaled runs: the input's frames are numbered (tags); --resume skips those up to this one
        self.journaled = hasattr(session, "writer")
        self.skip_until = getattr(session, "resume_after", -1)
        self.ordinal = -1

    def run(self, source) -> None:
        from ..io.preprocess import model_input
        from ..io.sources import Prefetcher

        width = self.settings.width
        total = source.expected_frames()
        if total is not None and self.args.max_frames:
            total = min(total, self.args.max_frames)
        with progress_bar(total, self.args.quiet) as self.bar, \
                Prefetcher(source.frames, lambda rgb: model_input(rgb, width)) as frames:
            try:
                for frame, image in frames:
                    self.ordinal += 1
                    if self.ordinal <= self.skip_until:
                        continue  # in the resumed journal already
                    if image is None:
                        self._bad(frame.error or f"{frame.name}: no image")
                        continue
                    self._push(image, _Meta(frame.stamp_ns, frame.camera_frame, frame.name))
                    if self.args.max_frames and self.pushed >= self.args.max_frames:
                        break
            except BaseException:  # the frame submitted last is complete: it is written before the error
                self._drain_after_failure()
                raise
            self._drain()

    def _push(self, image, meta: _Meta) -> None:
        """Submit a frame, then take the previous one's results (the model runs this one meanwhile)."""
        from ..stream.errors import InvalidFrameError

        try:
            submitted = self.session.submit(image, stamp=meta.stamp_ns, tag={"n": self.ordinal}) if self.journaled \
                else self.session.submit(image)
        except InvalidFrameError as exc:  # size differs from the sequence's, too small: nothing changed
            self._bad(f"{meta.name}: {exc}")
            return
        self.pushed += 1
        # a restart happens inside submit, so the window is the frame's own
        self.pending.append(replace(meta, window=int(getattr(self.session, "window_index", 0))))
        previous, self._waiting = self._waiting, submitted
        if previous is not None:
            self._take(previous.result())

    def _drain(self) -> None:
        """Write the results of the frame submitted last, if any."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._take(waiting.result())

    def _drain_after_failure(self) -> None:
        try:
            self._drain()
        except OutputError:  # another output failed too (a full disk): its .partial says how far it got
            pass
        except Exception as exc:  # the first failure is the one reported
            log.warning("the results of the last submitted frame are lost: %s", exc)

    def _take(self, results) -> None:
        for r in results:
            meta = self.pending.popleft()
            self.outputs.add(r, meta)
            self.done += 1
            if self.observer is not None:
                self.observer(self.done)
            self.bar.update(1)
            self._show(meta.window)

    def _bad(self, reason: str) -> None:
        if self.settings.bad_frames == "error":
            raise UserError(reason)
        self.dropped += 1
        self.first_problem = self.first_problem or reason
        if self.dropped <= MAX_SHOWN_BAD_FRAMES:
            log.warning("skipped a frame: %s%s", reason, "; later bad frames are counted, not shown"
                        if self.dropped == MAX_SHOWN_BAD_FRAMES else "")
        self._show(int(getattr(self.session, "window_index", 0)))

    def _show(self, window: int) -> None:
        if self._postfix != (window, self.dropped):
            self._postfix = (window, self.dropped)
            self.bar.set_postfix(window=window, dropped=self.dropped, refresh=False)


class _NoBar:
    """Stands in for tqdm's bar when it is not installed or not wanted."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass


@contextmanager
def progress_bar(total: int | None, quiet: bool):
    """tqdm's bar on stderr (frames/s, ETA; log lines printed above it), or a silent stand-in
    with --quiet or without tqdm."""
    try:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError:
        quiet = True
    if quiet:
        yield _NoBar()
        return
    with tqdm(total=total, unit="frame", desc="replay", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
              smoothing=0.05) as bar, logging_redirect_tqdm():
        yield bar


def make_session(args: argparse.Namespace, settings: Settings):
    from ..cache.attention import BackendUnavailable
    from ..io.checkpoint import CheckpointError, load_model
    from ..stream.long_stream import LongStreamSession
    from ..stream.session import StreamingSession

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        t0 = time.perf_counter()
        model = load_model(settings.model, args.checkpoint, settings.stream.device, settings.stream.dtype,
                           seed=args.seed)
        session = StreamingSession(model, settings.stream, with_depth=not args.no_depth)
    except (CheckpointError, BackendUnavailable) as exc:
        raise UserError(str(exc)) from None
    mode = "plain session"
    if settings.long_stream is not None:
        session = LongStreamSession(session, settings.long_stream)
        mode = f"long stream, window {settings.long_stream.window_frames}"
    say(args, f"model ready in {time.perf_counter() - t0:.1f} s ({session.backend.name}, {settings.stream.dtype}, "
              f"{settings.stream.device}, {mode})")
    if args.save_session or args.resume:
        session = _journaled(args, session)
    return session


def _journaled(args: argparse.Namespace, session):
    """The session with a journal (--save-session, --resume); a resumed one rebuilt from it."""
    from ..journal import JOURNAL_NAME, JournaledSession, JournalError, JournalWriter, journal_identity, rebuild

    label = args.checkpoint or f"random seed {args.seed}"
    identity = journal_identity(session, label)
    folder = args.save_session or args.resume
    if args.save_session and not args.resume and (folder / JOURNAL_NAME).exists():
        raise UserError(f"{folder} already holds a session: continue it with --resume {folder}, or choose another "
                        "folder")
    rebuilt = None
    if args.resume:
        try:
            rebuilt = rebuild(session, args.resume / JOURNAL_NAME, identity, progress=None)
        except JournalError as exc:
            raise UserError(f"cannot resume from {args.resume}: {exc}") from None
        say(args, f"resumed {rebuilt.frames_replayed} stored frames from {args.resume} in {rebuilt.seconds:.1f} s; "
                  f"continuing at frame {rebuilt.next_frame}" + (f" ({rebuilt.stop})" if rebuilt.stop else ""))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the session folder {folder}: {exc.strerror or exc}") from None
    writer = JournalWriter(folder / JOURNAL_NAME)
    wrapped = JournaledSession(session, writer, identity, begin=rebuilt is None)
    if rebuilt is not None:
        wrapped.adopt(rebuilt.records, rebuilt.scale_count, rebuilt.state_records)
        wrapped.resume_after = -1 if rebuilt.last_tag is None else int(rebuilt.last_tag["n"])
    return wrapped


def run(args: argparse.Namespace, observer: Callable[[int], None] | None = None) -> int:
    """The whole replay; ``observer(frames_done)`` is called after each frame's outputs are written."""
    from ..cache.pages import CacheError
    from ..io.sources import SourceError

    settings = configure(args)
    source = open_source(args, settings)
    say(args, f"input: {source.description}")
    if args.compare_precision:  # a precision check instead of a replay (cli.compare_precision)
        from .compare_precision import run_comparison

        try:
            return run_comparison(args, settings, source, say)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    session = make_session(args, settings)
    outputs = Outputs(args, settings)
    replay = Replay(args, settings, session, outputs, observer)
    start = time.perf_counter()
    try:
        replay.run(source)
        s0 = settings.stream.num_scale_frames
        if replay.done == 0:
            detail = f"; {replay.dropped} dropped, the first: {replay.first_problem}" if replay.dropped else ""
            raise UserError(f"only {replay.pushed} frame(s) reached the model, fewer than the {s0} scale frames "
                            f"it needs{detail}")
    except (UserError, SourceError, CacheError, OutputError, OSError) as exc:  # OSError: a source's file system
        raise UserError(_with_partial(_explain(exc), *outputs.abort())) from None
    except KeyboardInterrupt:
        print(f"{PROG}: {_with_partial(f'interrupted after {replay.done} frames', *outputs.abort())}",
              file=sys.stderr)
        return 130
    except BaseException:
        kept, unfinished = outputs.abort()
        if kept or unfinished:
            print(f"{PROG}: {_with_partial('unexpected error', kept, unfinished)}", file=sys.stderr)
        raise
    finally:
        if getattr(session, "writer", None) is not None:
            session.writer.close()  # what was journaled is on disk: --resume continues from it
    elapsed = time.perf_counter() - start
    closed = outputs.close()
    if closed.failed:
        raise UserError(_close_failure(replay.done, closed))
    windows = int(getattr(session, "window_index", 0)) + 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"{PROG}: {replay.done} frames in {elapsed:.1f} s ({replay.done / max(elapsed, 1e-9):.2f} FPS), "
          f"{replay.dropped} dropped, {windows} window(s), peak RSS {peak:.0f} MiB; wrote "
          f"{', '.join(map(str, closed.written))}", file=sys.stderr, flush=True)
    return 0


def _explain(exc: BaseException) -> str:
    from ..cache.pages import CacheError

    if isinstance(exc, CacheError):
        return f"{exc} (the plain session ends at the model's horizon; drop --no-long-stream for long inputs)"
    if isinstance(exc, OSError):
        return describe_os_error(exc)
    return str(exc)


def _with_partial(message: str, kept: list[Path], unfinished: list[Unfinished] = ()) -> str:
    """``message``, then the ``.partial`` files kept and the outputs that could not even be kept so."""
    parts = [message]
    if kept:
        parts.append(f"partial outputs kept: {', '.join(map(str, kept))}")
    lost = [u for u in unfinished if not u.kept]
    if lost:
        parts.append("not kept: " + ", ".join(f"{u.flag} {u.path} ({u.reason + '; ' if u.reason else ''}{u.note()})"
                                              for u in lost))
    return "; ".join(parts)


def _close_failure(frames: int, closed: Closed) -> str:
    """The error line of a run whose outputs could not all be written at the end."""
    causes = ", ".join(f"{u.flag} {u.path} ({u.reason})" for u in closed.failed)
    written = ", ".join(map(str, closed.written)) or "nothing"
    not_written = ", ".join(f"{u.path} ({u.note()})" for u in closed.failed)
    return (f"{frames} frames replayed, but not every output could be written: {causes}; written: {written}; "
            f"not written: {not_written}")


def say(args: argparse.Namespace, message: str) -> None:
    """An informational line on stderr (not with --quiet)."""
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


class _StderrHandler(logging.Handler):
    """Writes this CLI's log records to the current ``sys.stderr``, above the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            try:
                from tqdm import tqdm

                tqdm.write(message, file=sys.stderr)
            except ImportError:
                print(message, file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


def main(argv: list[str] | None = None, observer: Callable[[int], None] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt = f"{PROG}: %(levelname)s: %(message)s"
    logging.basicConfig(level=logging.WARNING, format=fmt)  # the library's own warnings
    handler = _StderrHandler(logging.WARNING)
    handler.setFormatter(logging.Formatter(fmt))
    log.addHandler(handler)  # this CLI's warnings (skipped frames): always on stderr, once
    log.propagate = False
    try:
        return run(args, observer)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)
        log.propagate = True


if __name__ == "__main__":
    sys.exit(main())
