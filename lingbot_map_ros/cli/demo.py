"""lingbot-map-demo: the whole ROS pipeline on one machine, end to end.

    lingbot-map-demo [--images DIR] [--checkpoint PATH --model-config JSON] [--out DIR]

Starts the LingBot-Map node and the image folder publisher as two processes on a
private ROS 2 domain restricted to this machine, records the node's poses in this
process, then prints frames processed, FPS and latency (image stamp -> pose
received), and writes into ``--out``: ``trajectory.tum`` and ``map.ply`` (through
the node's ``~/save_map`` service: map frame, REP 103), ``trajectory.png`` (top-down
plot), ``params.yaml`` and the two processes' logs.

Defaults: the images are ``<repo>/../shared/data/loop`` when present, else a
generated sequence; the model is the tiny reference fixture
(``<repo>/../shared/fixtures/upstream_tiny``) when present, else tiny RANDOM
weights (meaningless output, a loud warning). The run is bounded: it ends after the
publisher's last frame plus ``--timeout`` seconds at most.

Random weights of a named architecture: ``--preset lingbot-map`` (the released one) or
``--preset tiny``, seeded by ``--seed``; ``--device``, ``--backend``, ``--dtype`` and
``--node-param NAME=VALUE`` set the node's parameters; ``--height`` generates frames of
exactly ``--width`` x ``--height``.

Keyframe selector in the loop: ``--keyframe-selector`` also starts the reference keyframe
client (``lingbot_map_ros.ros.keyframe_selector``, parameters by ``--selector-param``) as a
third process against the node and turns on the node's decision hold
(``keyframe_decision_timeout`` = ``--decision-timeout``, default 0.5 s): each stored frame
waits for the selector's keep/drop before the next one is stored; the node's decision
counters are printed at the end.

Measuring is not the demo's job: ``benchmarks/node/node_latency.py`` runs this same graph
(``Graph`` below) with a warm-up, a probe script in place of the node and a JSON of the
measurement, and ``benchmarks/node/node_latency.sh`` drives it on the GPU machine.
The graph and its processes are ``demo_graph``; this module is the command (options, inputs,
the node's parameters, the report).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import BACKENDS, DTYPES
from . import demo_selector
from .demo_graph import DemoError, Graph

PROG = "lingbot-map-demo"
REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, help="folder of images (default: ../shared/data/loop, else generated)")
    p.add_argument("--checkpoint", help="checkpoint file or Hugging Face id (default: the tiny fixture weights)")
    p.add_argument("--model-config", type=Path, help="model JSON (default: the checkpoint's fixture config)")
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory (default ./demo_out)")
    p.add_argument("--frames", type=int, default=40, help="frames to publish (default 40)")
    p.add_argument("--rate", type=float, default=5.0, help="publishing rate in Hz (default 5)")
    p.add_argument("--width", type=int, default=98, help="model input width, multiple of 14 (default 98)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--num-scale-frames", type=int, default=None, help="default: 2 with the tiny model, else 8")
    p.add_argument("--sliding-window", type=int, default=None, help="default: 3 with the tiny model, else 64")
    p.add_argument("--domain-id", type=int, default=None, help="ROS_DOMAIN_ID (default: derived from the pid)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds allowed after the last frame / for start")
    p.add_argument("--preset", choices=("tiny", "lingbot-map"), default=None,
                   help="RANDOM weights of this architecture (seeded by --seed) instead of the fixture/checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights (default 0)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="attention backend (default: the node's, auto)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="aggregator/cache dtype (default: the node's, fp32)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="node parameter cuda_graphs:=false")
    p.add_argument("--height", type=int, default=None,
                   help="generate frames of exactly --width x HEIGHT (multiple of 14, <= width) instead of the "
                        "default images")
    p.add_argument("--node-param", action="append", default=[], metavar="NAME=VALUE",
                   help="extra node parameter (VALUE parsed as JSON, else a string); repeatable")
    p.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds allowed for the node to come up and load its model (default: --timeout)")
    p.add_argument("--no-save-map", action="store_true", help="skip ~/save_map and the trajectory/map files")
    p.add_argument("--keyframe-selector", action="store_true",
                   help="also run the reference keyframe client against the node, with the node's decision hold on")
    p.add_argument("--decision-timeout", type=float, default=None,
                   help="with --keyframe-selector: node parameter keyframe_decision_timeout in s "
                        f"(default {demo_selector.DEFAULT_DECISION_TIMEOUT})")
    p.add_argument("--selector-param", action="append", default=[], metavar="NAME=VALUE",
                   help="with --keyframe-selector: a parameter of the selector (e.g. min_translation=0.05); repeatable")
    return p


def check_selector_options(args: argparse.Namespace) -> None:
    """One-line DemoError for selector options that cannot work."""
    if not args.keyframe_selector:
        if args.decision_timeout is not None or args.selector_param:
            raise DemoError("--decision-timeout and --selector-param need --keyframe-selector")
        return
    if not 0.0 < demo_selector.decision_timeout(args) <= 60.0:
        raise DemoError(f"need 0 < --decision-timeout <= 60 s (the node's limit), got {args.decision_timeout}")
    try:
        demo_selector.selector_cmd(args.selector_param)
    except ValueError as exc:
        raise DemoError(str(exc)) from None


def parse_node_params(items: list[str]) -> dict:
    """``NAME=VALUE`` strings -> {name: value}; VALUE is JSON when it parses, else a string."""
    values = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise DemoError(f"--node-param needs NAME=VALUE, got {item!r}")
        try:
            values[name] = json.loads(text)
        except json.JSONDecodeError:
            values[name] = text
    return values


# ------------------------------------------------------------------ inputs
def synthetic_sequence(directory: Path, frames: int, size: tuple[int, int] = (518, 294), seed: int = 0) -> Path:
    """Write ``frames`` JPEGs of a camera sliding and zooming over a random textured scene."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    width, height = size
    scene_w, scene_h = width * 3, height * 3
    noise = (rng.random((scene_h // 8, scene_w // 8, 3)) * 255).astype(np.uint8)
    scene = Image.fromarray(noise).resize((scene_w, scene_h), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(scene)
    for _ in range(120):
        x, y = rng.integers(0, scene_w), rng.integers(0, scene_h)
        r = int(rng.integers(10, 60))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=color)
    scene = scene.filter(ImageFilter.GaussianBlur(1.5))
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(frames):
        t = i / max(frames - 1, 1)
        zoom = 1.0 + 0.4 * t  # moving forward
        cw, ch = width * 1.6 / zoom, height * 1.6 / zoom
        cx = scene_w / 2 + (t - 0.5) * width * 0.8
        cy = scene_h / 2 + 0.1 * height * np.sin(2 * np.pi * t)
        box = (cx - cw / 2, cy - ch / 2, cx + cw / 2, cy + ch / 2)
        frame = scene.resize((width, height), Image.Resampling.BILINEAR, box=box)
        frame.save(directory / f"{i:06d}.jpg", quality=92)
    return directory


def resolve_inputs(args: argparse.Namespace, tmp: Path) -> tuple[Path, str, dict]:
    """(images dir, a one-line description, model parameters for the node)."""
    if args.images is not None:
        if not args.images.is_dir():
            raise DemoError(f"--images {args.images} is not a directory")
        if args.height is not None:
            raise DemoError("--height generates frames; it cannot be combined with --images")
        images, what = args.images, str(args.images)
    elif args.height is not None:
        images = synthetic_sequence(tmp / "frames", args.frames, size=(args.width, args.height))
        what = f"a generated sequence of {args.frames} frames of {args.width}x{args.height} in {images}"
    elif (SHARED / "data" / "loop").is_dir():
        images, what = SHARED / "data" / "loop", f"{SHARED / 'data' / 'loop'} (real frames)"
    else:
        images = synthetic_sequence(tmp / "frames", args.frames)
        what = f"a generated sequence of {args.frames} frames in {images}"

    fixture = SHARED / "fixtures" / "upstream_tiny"
    tiny = False
    if args.preset is not None:
        if args.checkpoint:
            raise DemoError("--preset means random weights; it cannot be combined with --checkpoint")
        from ..config import ModelConfig

        if args.preset == "lingbot-map":
            model = {"checkpoint": "", "model_config": ""}  # the node's own default: the released architecture
        else:
            config = tmp / "tiny_config.json"
            config.write_text(json.dumps(ModelConfig.preset("tiny").to_dict()))
            model = {"checkpoint": "", "model_config": str(config)}
        tiny = args.preset == "tiny"
        print(f"{PROG}: note: --preset {args.preset}: RANDOM weights (seed {args.seed}) of that architecture; "
              "outputs are meaningless, timings are real", file=sys.stderr, flush=True)
    elif args.checkpoint:
        model = {"checkpoint": str(args.checkpoint), "model_config": str(args.model_config or "")}
    elif (fixture / "weights.safetensors").is_file():
        model = {"checkpoint": str(fixture / "weights.safetensors"), "model_config": str(fixture / "config.json")}
        tiny = True
    else:
        from ..config import ModelConfig

        config = tmp / "tiny_config.json"
        config.write_text(json.dumps(ModelConfig.preset("tiny").to_dict()))
        model = {"checkpoint": "", "model_config": str(config)}
        tiny = True
        banner = "!" * 78
        print(f"{banner}\n{PROG}: WARNING: no checkpoint and no fixture weights found: the model has RANDOM tiny "
              f"weights.\nPoses, depth and points are MEANINGLESS; this only exercises the pipeline.\n"
              f"Pass --checkpoint (and --model-config) for real output.\n{banner}", file=sys.stderr, flush=True)
    if args.model_config and not args.checkpoint and args.preset is None:
        model["model_config"] = str(args.model_config)
    model["num_scale_frames"] = args.num_scale_frames or (2 if tiny else 8)
    model["sliding_window"] = args.sliding_window or (3 if tiny else 64)
    model["seed"] = args.seed
    return images, what, model


def node_parameters(args: argparse.Namespace, model: dict, out: Path) -> dict:
    """The node's parameters for this run: the model, the demo's defaults, then the options."""
    values = {**model, "device": args.device, "image_width": args.width, "output_directory": str(out),
              "map_voxel_size": 0.005, "map_publish_rate": 1.0, "input_timeout": 5.0}
    if args.backend is not None:
        values["backend"] = args.backend
    if args.dtype is not None:
        values["dtype"] = args.dtype
    if args.no_cuda_graphs:
        values["cuda_graphs"] = False
    if args.keyframe_selector:
        values["keyframe_decision_timeout"] = demo_selector.decision_timeout(args)
    values.update(parse_node_params(args.node_param))
    return values


# ------------------------------------------------------------------ processes
def check_options(args: argparse.Namespace) -> None:
    """One-line DemoError for options that cannot work."""
    if args.frames < 1 or args.rate <= 0 or args.width < 14 or args.width % 14:
        raise DemoError("need --frames >= 1, --rate > 0 and --width a positive multiple of 14")
    if args.height is not None and not (14 <= args.height <= args.width and args.height % 14 == 0):
        raise DemoError("need --height a positive multiple of 14, at most --width")
    check_selector_options(args)


@dataclass
class Setup:
    """What a run of the graph needs: output folder, environment (private ROS domain on this
    machine), images, the node's parameters and their file."""

    out: Path
    env: dict
    domain: int
    images: Path
    what: str  # one line about the images
    values: dict  # the node's parameters
    params: Path  # params.yaml in ``out``


def prepare(args: argparse.Namespace, tmp: Path) -> Setup:
    """Output folder, ROS environment (ROS_DOMAIN_ID, LOCALHOST discovery, also set in this
    process), images (generated into ``tmp`` when needed) and the node's parameters file."""
    from ..runtime.params import write_params_file

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    domain = args.domain_id if args.domain_id is not None else 1 + os.getpid() % 100
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ["ROS_DOMAIN_ID"] = str(domain)
    images, what, model = resolve_inputs(args, tmp)
    values = node_parameters(args, model, out)
    params = write_params_file(out / "params.yaml", values)
    return Setup(out, dict(os.environ), domain, images, what, values, params)


def run(args: argparse.Namespace) -> int:
    check_options(args)
    with tempfile.TemporaryDirectory(prefix="lingbot_demo_") as tmp_name:
        setup = prepare(args, Path(tmp_name))
        announce(args, setup)
        with Graph(args, setup.out, setup.env, PROG) as graph:
            node_up_s = graph.start_node(setup.params)
            if args.keyframe_selector:
                graph.start_selector()
            from ..io.preprocess import list_images

            frames = min(args.frames, len(list_images(setup.images)))
            print(f"{PROG}: node up after {node_up_s:.1f} s; publishing {frames} frames at {args.rate} Hz",
                  flush=True)
            graph.play(setup.images, frames)
            graph.stop_selector()
            response = None if args.no_save_map else graph.save_map()
            extra = [decisions_line(graph.recorder.snapshot()[1])] if args.keyframe_selector else []
            return report(graph.recorder, setup.out, response, extra=extra)


def announce(args: argparse.Namespace, setup: Setup, prog: str = PROG) -> None:
    """Print the images, the model and where the logs and outputs go."""
    model = setup.values
    weights = model.get("checkpoint") or f"random {args.preset or 'tiny'} weights (seed {args.seed})"
    print(f"{prog}: images: {setup.what}\n{prog}: model: {weights}; ROS_DOMAIN_ID={setup.domain} (localhost only); "
          f"logs and outputs in {setup.out}", flush=True)


def decisions_line(status) -> str:
    """The node's keyframe decision counters since it started, one report line."""
    n = demo_selector.decision_counts(status)
    return (f"decisions        : kept {n['kept']}, dropped {n['dropped']}, timed out {n['timed_out']}, "
            f"refused {n['refused']} (the node's counters, whole run)")


def report(recorder, out: Path, response, since_s: float | None = None, dropped: str | None = None,
           extra: list[str] = ()) -> int:
    """Print frames, throughput and latency (image stamp -> pose received) of the poses of
    images stamped at or after ``since_s`` (all when None), then ``extra`` lines, then plot
    the saved trajectory (``response`` of ~/save_map, None: no files). ``dropped`` replaces
    the node's drop counters (e.g. those of a timed part only). 0 when poses came back."""
    from ..io.export import plot_trajectory_png, read_tum
    from ..ros.conversions import OPTICAL_TO_REP103

    summary = recorder.summary(since_s)
    _, status = recorder.snapshot()
    if dropped is None:
        dropped = "n/a" if status is None else (f"{status.frames_dropped_stale} stale, "
                                                 f"{status.frames_dropped_invalid} invalid, "
                                                 f"{status.frames_dropped_error} error")
    print(f"frames processed : {summary.frames} (dropped: {dropped})")
    print(f"throughput       : {summary.fps:.1f} FPS of poses received (input rate bound); model step "
          f"{summary.model_mean_ms:.1f} ms/frame = {1e3 / summary.model_mean_ms:.0f} FPS possible")
    print(f"latency          : median {summary.latency_median_ms:.1f} ms, p95 {summary.latency_p95_ms:.1f} ms, "
          f"max {summary.latency_max_ms:.1f} ms (image stamp -> pose received; the scale frames wait for each other)")
    for line in extra:
        print(line)
    if response is not None:
        stamps, T_map_cam = read_tum(response.trajectory_path)
        png = out / "trajectory.png"
        if len(stamps):
            # The plot draws the ground plane of the model's OpenCV world: map -> optical axes first.
            c2w = np.linalg.inv(OPTICAL_TO_REP103) @ T_map_cam
            plot_trajectory_png(png, c2w,
                                title=f"LingBot-Map demo: {len(stamps)} poses (top-down, first camera's x-z)")
        print(f"trajectory (TUM) : {response.trajectory_path}")
        print(f"map (PLY)        : {response.ply_path}")
        if len(stamps):
            print(f"plot (PNG)       : {png}")
    return 0 if summary.frames > 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except DemoError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
