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
until then, or after a failure, ``<name>.partial``):

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
a video are skipped, counted and warned about (--bad-frames).
"""
from __future__ import annotations

import argparse
import logging
import resource
import sys
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
                                                          "flashinfer-fa3"])
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

    o = p.add_argument_group("outputs")
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
    if args.topic and args.bag is None:
        raise UserError("--topic goes with --bag")
    if not any((args.out, args.trajectory, args.ply, args.out_bag)):
        raise UserError("nothing to write: give --out, --trajectory, --ply or --out-bag")
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
    for flag, path in (("--out", args.out), ("--trajectory", args.trajectory), ("--ply", args.ply)):
        if path is not None:
            try:
                check_destination(path)
            except OSError as exc:
                raise UserError(f"{flag}: {exc}") from None
    if args.out_bag is not None and args.out_bag.exists():
        raise UserError(f"--out-bag {args.out_bag} exists already (a bag is not overwritten)")


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
            source = BagSource(args.bag, args.topic, settings.selection)
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


class Outputs:
    """The requested writers, made when the first result arrives (a run that fails before
    writes nothing)."""

    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        self.args, self.settings = args, settings
        self.writers: list = []
        self.store = self.tum = self.ply = self.bag = None
        self._opened = False
        self.rows = 0

    def _open(self) -> None:
        """Make the writers, each listed as soon as it exists (so that ``abort`` finds it)."""
        from ..io.results import PlyStreamWriter, PredictionStore, TumStreamWriter
        from ..io.results_bag import ResultsBagWriter

        a = self.args
        if a.out:
            self.store = self._listed(PredictionStore(a.out, self.settings.depth, a.chunk_frames))
        if a.trajectory:
            self.tum = self._listed(TumStreamWriter(a.trajectory))
        if a.ply:
            self.ply = self._listed(PlyStreamWriter(a.ply))
        if a.out_bag:
            try:
                self.bag = self._listed(ResultsBagWriter(
                    a.out_bag, namespace=a.bag_namespace, map_frame=a.map_frame or _node_default("map_frame"),
                    path_rate=_default(a.bag_path_rate, "path_publish_rate"),
                    path_max_length=_default(a.bag_path_length, "path_max_length")))
            except FileExistsError as exc:
                raise UserError(str(exc)) from None
        self._opened = True

    def _listed(self, writer):
        self.writers.append(writer)
        return writer

    def add(self, r, meta: _Meta) -> None:
        """One FrameResult ``r`` (model world, OpenCV axes) of the input frame ``meta``."""
        from ..geometry import unproject_pixels

        if not self._opened:
            self._open()
        row, self.rows = self.rows, self.rows + 1
        keep_depth = r.depth is not None and self.settings.depth.keeps(row)
        if self.store is not None:
            self.store.add(r.pose_enc, r.c2w, r.intrinsics, r.is_keyframe, meta.stamp_ns, meta.window,
                           r.depth, r.confidence)
        if self.tum is not None:
            self.tum.add(meta.stamp_ns / 1e9, r.c2w)
        points = colors = conf = None
        if r.depth is not None and (self.ply is not None or self.bag is not None):
            index = np.flatnonzero(r.confidence.reshape(-1) > self.settings.conf_threshold)
            index = index[::self.settings.point_stride]
            points = unproject_pixels(r.depth, r.intrinsics, r.c2w, index).astype(np.float32)
            finite = np.isfinite(points).all(axis=1)
            points, index = points[finite], index[finite]
            colors, conf = r.colors(index), r.confidence.reshape(-1)[index].astype(np.float32)
        if self.ply is not None:
            self.ply.add(points, colors)
        if self.bag is not None:
            camera = self.args.camera_frame or meta.camera_frame
            self.bag.add(meta.stamp_ns, camera, r.c2w, r.intrinsics, r.size, points, colors, conf,
                         r.depth if keep_depth else None)

    def close(self) -> list[Path]:
        written: list[Path] = []
        for w in self.writers:
            result = w.close()
            written += result if isinstance(result, list) else [result]
        return written

    def abort(self) -> list[Path]:
        """Finish every writer as a ``.partial`` file; returns their paths (never raises)."""
        kept: list[Path] = []
        for w in self.writers:
            try:
                result = w.abort()
                kept += result if isinstance(result, list) else [result]
            except Exception as exc:  # one broken writer must not hide the others' files
                log.warning("could not finish %s: %s", type(w).__name__, exc)
        return kept


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
            submitted = self.session.submit(image)
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
    return session


def run(args: argparse.Namespace, observer: Callable[[int], None] | None = None) -> int:
    """The whole replay; ``observer(frames_done)`` is called after each frame's outputs are written."""
    from ..cache.pages import CacheError
    from ..io.sources import SourceError

    settings = configure(args)
    source = open_source(args, settings)
    say(args, f"input: {source.description}")
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
    except (UserError, SourceError, CacheError, OSError) as exc:  # OSError: a full disk, a folder not writable
        raise UserError(_with_partial(_explain(exc), outputs.abort())) from None
    except KeyboardInterrupt:
        kept = outputs.abort()
        print(_with_partial(f"{PROG}: interrupted after {replay.done} frames", kept), file=sys.stderr)
        return 130
    except BaseException:
        kept = outputs.abort()
        if kept:
            print(f"{PROG}: partial outputs kept: {', '.join(map(str, kept))}", file=sys.stderr)
        raise
    elapsed = time.perf_counter() - start
    written = outputs.close()
    windows = int(getattr(session, "window_index", 0)) + 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"{PROG}: {replay.done} frames in {elapsed:.1f} s ({replay.done / max(elapsed, 1e-9):.2f} FPS), "
          f"{replay.dropped} dropped, {windows} window(s), peak RSS {peak:.0f} MiB; wrote "
          f"{', '.join(map(str, written))}", file=sys.stderr, flush=True)
    return 0


def _explain(exc: BaseException) -> str:
    from ..cache.pages import CacheError

    if isinstance(exc, CacheError):
        return f"{exc} (the plain session ends at the model's horizon; drop --no-long-stream for long inputs)"
    return str(exc)


def _with_partial(message: str, kept: list[Path]) -> str:
    return f"{message}; partial outputs kept: {', '.join(map(str, kept))}" if kept else message


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
