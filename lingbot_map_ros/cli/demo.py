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

Benchmarking (``benchmarks/node_latency.sh``): ``--preset lingbot-map`` runs the
released architecture with RANDOM weights seeded by ``--seed`` (no checkpoint);
``--device``, ``--backend``, ``--dtype`` and ``--node-param NAME=VALUE`` set the node's
parameters; ``--height`` generates frames of exactly ``--width`` x ``--height``.
``--warmup-poses N`` first plays the images in a loop until N poses came back (model
load, JIT compilation, CUDA-graph capture, filling the window; bounded by
``--startup-timeout``), waits until the node is idle, then publishes the ``--frames``
timed frames: only poses of images stamped after that point are measured.
``--json PATH`` writes the measurement (latency image stamp -> pose received
median/p95/max, frames published/processed/dropped, output rate, the node's own
per-frame times from its status messages) and where it ran (commit, device, command, date).

Keyframe selector in the loop: ``--keyframe-selector`` also starts the reference keyframe
client (``lingbot_map_ros.ros.keyframe_selector``, parameters by ``--selector-param``) as a
third process against the node, before the warm-up, and turns on the node's decision hold
(``keyframe_decision_timeout`` = ``--decision-timeout``, default 0.5 s): each stored frame
waits for the selector's keep/drop before the next one is stored. The JSON then also holds
the node's decision counters over the timed part, the decision round trip and the frames
that waited behind a hold (definitions in ``lingbot_map_ros/cli/demo_selector.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ..config import BACKENDS, DTYPES
from ..io.atomic import atomic_write
from . import demo_selector

PROG = "lingbot-map-demo"
REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


class DemoError(RuntimeError):
    """Reported as one line, exit status 1."""


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
    p.add_argument("--warmup-poses", type=int, default=0,
                   help="before the timed frames, loop the images until this many poses came back (excluded)")
    p.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds allowed for the node to come up and for the warm-up (default: --timeout)")
    p.add_argument("--json", type=Path, default=None, help="write the measurement as JSON to this file")
    p.add_argument("--no-save-map", action="store_true", help="skip ~/save_map and the trajectory/map files")
    p.add_argument("--node-script", type=Path, default=None,
                   help="run the node from this Python script instead of lingbot_map_ros.ros.node (e.g. "
                        "benchmarks/node_probe.py: the real node under probes, optionally with a simulated model step)")
    p.add_argument("--keyframe-selector", action="store_true",
                   help="also run the reference keyframe client against the node, with the node's decision hold on")
    p.add_argument("--decision-timeout", type=float, default=None,
                   help="with --keyframe-selector: node parameter keyframe_decision_timeout in s "
                        f"(default {demo_selector.DEFAULT_DECISION_TIMEOUT})")
    p.add_argument("--selector-param", action="append", default=[], metavar="NAME=VALUE",
                   help="with --keyframe-selector: a parameter of the selector (e.g. min_translation=0.05); repeatable")
    return p


def decision_timeout(args: argparse.Namespace) -> float:
    """The node's keyframe_decision_timeout (s) with --keyframe-selector."""
    return args.decision_timeout if args.decision_timeout is not None else demo_selector.DEFAULT_DECISION_TIMEOUT


def check_selector_options(args: argparse.Namespace) -> None:
    """One-line DemoError for selector options that cannot work."""
    if not args.keyframe_selector:
        if args.decision_timeout is not None or args.selector_param:
            raise DemoError("--decision-timeout and --selector-param need --keyframe-selector")
        return
    if not 0.0 < decision_timeout(args) <= 60.0:
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
        values["keyframe_decision_timeout"] = decision_timeout(args)
    values.update(parse_node_params(args.node_param))
    return values


# ------------------------------------------------------------------ processes
def start(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        log.close()


def stop(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run(args: argparse.Namespace) -> int:
    if args.frames < 1 or args.rate <= 0 or args.width < 14 or args.width % 14:
        raise DemoError("need --frames >= 1, --rate > 0 and --width a positive multiple of 14")
    if args.height is not None and not (14 <= args.height <= args.width and args.height % 14 == 0):
        raise DemoError("need --height a positive multiple of 14, at most --width")
    if args.warmup_poses < 0:
        raise DemoError("need --warmup-poses >= 0")
    check_selector_options(args)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    domain = args.domain_id if args.domain_id is not None else 1 + os.getpid() % 100
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ["ROS_DOMAIN_ID"] = str(domain)
    env = dict(os.environ)

    with tempfile.TemporaryDirectory(prefix="lingbot_demo_") as tmp_name:
        tmp = Path(tmp_name)
        images, what, model = resolve_inputs(args, tmp)
        from ..ros.params import write_params_file

        values = node_parameters(args, model, out)
        params = write_params_file(out / "params.yaml", values)
        weights = model["checkpoint"] or f"random {args.preset or 'tiny'} weights (seed {args.seed})"
        print(f"{PROG}: images: {what}\n{PROG}: model: {weights}; "
              f"ROS_DOMAIN_ID={domain} (localhost only); logs and outputs in {out}", flush=True)
        return _run_graph(args, images, params, out, env, values)


COUNTERS = ("frames_received", "frames_processed", "frames_dropped_stale", "frames_dropped_invalid",
            "frames_dropped_error")


def _counters(status) -> dict[str, int]:
    return {name: int(getattr(status, name)) if status is not None else 0 for name in COUNTERS}


def _published(log_path: Path) -> int | None:
    """Frames the image publisher reported as published (its last 'published N frame(s)' line)."""
    count = None
    try:
        for line in log_path.read_text(errors="replace").splitlines():
            if "published " in line and " frame(s)" in line:
                word = line.rsplit("published ", 1)[1].split()[0]
                if word.isdigit():
                    count = int(word)
    except OSError:
        pass
    return count


def _publisher_cmd(images: Path, rate: float, max_frames: int, wait_timeout: float, loop: bool) -> list[str]:
    return [sys.executable, "-m", "lingbot_map_ros.ros.image_folder_publisher", "--ros-args",
            "-p", f"images:={images}", "-p", f"rate:={float(rate)}", "-p", f"max_frames:={max_frames}",
            "-p", f"wait_timeout:={float(wait_timeout)}", "-p", f"loop:={'true' if loop else 'false'}"]


def _run_graph(args: argparse.Namespace, images: Path, params: Path, out: Path, env: dict,
               values: dict | None = None) -> int:
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from lingbot_map_ros.srv import SaveMap

    from ..io.preprocess import list_images
    from ..ros.recorder import Recorder

    startup_timeout = args.startup_timeout if args.startup_timeout is not None else args.timeout
    node_proc = pub_proc = sel_proc = None
    rclpy.init()
    recorder = Recorder("/lingbot_map")
    status_log = demo_selector.StatusLog(recorder, "/lingbot_map") if args.keyframe_selector else None
    executor = SingleThreadedExecutor()
    executor.add_node(recorder)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        t_start = time.monotonic()
        node = [str(args.node_script)] if args.node_script else ["-m", "lingbot_map_ros.ros.node"]
        node_proc = start([sys.executable, *node, "--ros-args", "--params-file", str(params)], env,
                          out / "node.log")
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline and recorder.count_publishers("/lingbot_map/pose") == 0:
            if node_proc.poll() is not None:
                raise DemoError(f"the node exited with status {node_proc.returncode}:\n{tail(out / 'node.log')}")
            time.sleep(0.1)
        if recorder.count_publishers("/lingbot_map/pose") == 0:
            raise DemoError(f"the node did not come up within {startup_timeout} s:\n{tail(out / 'node.log')}")
        startup = {"node_up_s": round(time.monotonic() - t_start, 3)}
        if args.keyframe_selector:
            sel_proc = _start_selector(args, recorder, env, out)
        frames = min(args.frames, len(list_images(images)))
        since_s = None
        if args.warmup_poses:
            startup.update(_warm_up(args, recorder, node_proc, images, env, out, startup_timeout, t_start, sel_proc))
            since_s = time.time()  # poses of images stamped from here on are measured
        if sel_proc is not None:
            _wait_decided(recorder, deadline=time.monotonic() + decision_timeout(args) + 5.0)
        baseline = _counters(recorder.snapshot()[1])
        decisions_baseline = demo_selector.decision_counts(recorder.snapshot()[1])
        print(f"{PROG}: node up after {startup['node_up_s']:.1f} s"
              + (f", warmed up with {startup['warmup_poses']} poses in {startup['warmup_s']:.1f} s"
                 if args.warmup_poses else "")
              + f"; publishing {frames} frames at {args.rate} Hz", flush=True)
        # Without a warm-up the publisher also waits for the node to load (it subscribes after that).
        pub_proc = start(_publisher_cmd(images, args.rate, frames, startup_timeout, loop=False), env,
                         out / "publisher.log")
        budget = frames / args.rate + args.timeout + (0 if args.warmup_poses else startup_timeout)
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline and pub_proc.poll() is None:
            _check_alive(node_proc, sel_proc, out)
            time.sleep(0.1)
        if pub_proc.poll() is None:
            raise DemoError(f"the publisher did not finish within {budget:.0f} s:\n{tail(out / 'publisher.log')}")
        if pub_proc.returncode != 0:
            raise DemoError(f"the publisher failed:\n{tail(out / 'publisher.log')}")
        _wait_until_idle(recorder, frames, deadline=time.monotonic() + args.timeout,
                         baseline=sum(baseline[name] for name in COUNTERS[1:]))
        published = _published(out / "publisher.log")
        decisions = None
        if sel_proc is not None:
            _wait_decided(recorder, deadline=time.monotonic() + decision_timeout(args) + 5.0)
            _check_alive(node_proc, sel_proc, out)
            stop(sel_proc)  # it logs its final summary on the way out
            decisions = demo_selector.decision_measurement(
                status_log.events(), since_s, decisions_baseline, recorder.snapshot()[1], decision_timeout(args),
                demo_selector.selector_summary(out / "selector.log"))

        response = None
        if not args.no_save_map:
            response = recorder.call(SaveMap, "/lingbot_map/save_map", SaveMap.Request(directory=str(out)),
                                     timeout=args.timeout)
            if response is None or not response.success:
                raise DemoError(f"~/save_map failed: {'timed out' if response is None else response.message}")
        result = measurement(recorder, since_s, baseline, frames if published is None else published, startup,
                             args, values or {}, images, decisions)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(result, indent=2, default=_json_default) + "\n"
            atomic_write(args.json, lambda f: f.write(text.encode()))
        return _report(recorder, out, response, since_s, result)
    finally:
        stop(pub_proc)
        stop(sel_proc)
        stop(node_proc)
        executor.shutdown(timeout_sec=1.0)
        recorder.destroy_node()
        rclpy.try_shutdown()


def _check_alive(node_proc: subprocess.Popen, sel_proc: subprocess.Popen | None, out: Path, when: str = "") -> None:
    """DemoError (with the tail of its log) when the node or the selector has exited."""
    if node_proc.poll() is not None:
        raise DemoError(f"the node exited with status {node_proc.returncode}{when}:\n{tail(out / 'node.log')}")
    if sel_proc is not None and sel_proc.poll() is not None:
        raise DemoError(f"the keyframe selector exited with status {sel_proc.returncode}{when}:\n"
                        f"{tail(out / 'selector.log')}")


def _start_selector(args: argparse.Namespace, recorder, env: dict, out: Path) -> subprocess.Popen:
    """Start the keyframe selector and wait until it subscribes to the node's ~/frame
    (bounded by ``--timeout``)."""
    proc = start(demo_selector.selector_cmd(args.selector_param), env, out / "selector.log")
    deadline = time.monotonic() + args.timeout
    while recorder.count_subscribers("/lingbot_map/frame") == 0:
        if proc.poll() is not None:
            raise DemoError(f"the keyframe selector exited with status {proc.returncode}:\n"
                            f"{tail(out / 'selector.log')}")
        if time.monotonic() > deadline:
            stop(proc)
            raise DemoError(f"the keyframe selector did not subscribe to /lingbot_map/frame within {args.timeout} s:"
                            f"\n{tail(out / 'selector.log')}")
        time.sleep(0.1)
    print(f"{PROG}: keyframe selector up; node decision hold keyframe_decision_timeout={decision_timeout(args)} s",
          flush=True)
    return proc


def _wait_decided(recorder, deadline: float) -> None:
    """Wait until the node's latest status holds no frame for a decision (or the deadline)."""
    while time.monotonic() < deadline:
        _, status = recorder.snapshot()
        if status is not None and not status.decision_pending:
            return
        time.sleep(0.05)


def _warm_up(args: argparse.Namespace, recorder, node_proc, images: Path, env: dict, out: Path, timeout: float,
             t_start: float, sel_proc: subprocess.Popen | None = None) -> dict:
    """Loop the images until ``--warmup-poses`` poses came back, stop, wait until the node is idle."""
    t0 = time.monotonic()
    log = out / "warmup_publisher.log"
    proc = start(_publisher_cmd(images, args.rate, 0, timeout, loop=True), env, log)
    first_pose_s = None
    deadline = t0 + timeout
    try:
        while True:
            poses, _ = recorder.snapshot()
            if poses and first_pose_s is None:
                first_pose_s = round(time.monotonic() - t_start, 3)
            if len(poses) >= args.warmup_poses:
                break
            _check_alive(node_proc, sel_proc, out, " during the warm-up")
            if proc.poll() is not None:
                raise DemoError(f"the warm-up publisher exited with status {proc.returncode}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise DemoError(f"warm-up: {len(poses)} of {args.warmup_poses} poses after {timeout} s "
                                f"(--startup-timeout):\n{tail(out / 'node.log')}")
            time.sleep(0.05)
    finally:
        stop(proc)
    warmup_s = round(time.monotonic() - t0, 3)
    _wait_drained(recorder, deadline=time.monotonic() + args.timeout)
    poses, status = recorder.snapshot()
    return {"first_pose_s": first_pose_s, "warmup_s": warmup_s, "warmup_poses": len(poses),
            "warmup_frames_received": _counters(status)["frames_received"]}


def _wait_drained(recorder, deadline: float, settle: float = 0.5) -> None:
    """Wait until the node accounted for every frame it received (nothing queued or in flight)
    and its counters stayed put for ``settle`` s; or nothing changed for 3 s."""
    last_change, last_seen = time.monotonic(), None
    while time.monotonic() < deadline:
        _, status = recorder.snapshot()
        seen = tuple(_counters(status).values())
        if seen != last_seen:
            last_seen, last_change = seen, time.monotonic()
        quiet = time.monotonic() - last_change
        if status is not None and seen[0] == sum(seen[1:]) and quiet >= settle:
            return
        if quiet > 3.0:
            return
        time.sleep(0.05)


def _wait_until_idle(recorder, frames: int, deadline: float, baseline: int = 0) -> None:
    """Wait until the node accounted for every published frame, or nothing changed for 3 s.
    ``baseline``: frames it had accounted for before these were published."""
    last_change, last_seen = time.monotonic(), None
    while time.monotonic() < deadline:
        _, status = recorder.snapshot()
        if status is not None:
            seen = (status.frames_processed, status.frames_dropped_stale, status.frames_dropped_invalid,
                    status.frames_dropped_error)
            if sum(seen) - baseline >= frames:
                return
            if seen != last_seen:
                last_seen, last_change = seen, time.monotonic()
        if time.monotonic() - last_change > 3.0:
            return
        time.sleep(0.1)


_stats = demo_selector.stats


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _git(*argv: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _device_name(device: str | None) -> str:
    """What ``device`` (the node's parameter) is on this machine: the GPU's or the CPU's name."""
    if device and device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                                  capture_output=True, text=True, timeout=20)
            if done.returncode == 0 and done.stdout.strip():
                return f"{done.stdout.strip().splitlines()[0]} ({device})"
        except (OSError, subprocess.SubprocessError):
            pass
        return f"{device} (no name: nvidia-smi unavailable)"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs ({device or 'cpu'})"


def run_info(args: argparse.Namespace, values: dict) -> dict:
    """Where and how a measurement was made: commit (LINGBOT_COMMIT when set: the device tool's copy
    of the tree may carry stale git metadata; else git's HEAD; else "unknown"), whether tracked files
    differed from git's HEAD, device, command, date.
    LINGBOT_BENCH_COMMAND: the script command that ran the demo (benchmarks/node_latency.sh)."""
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    argv = getattr(args, "argv", None)
    return {
        "commit": os.environ.get("LINGBOT_COMMIT") or commit or "unknown",
        "tracked_files_modified": None if dirty is None else bool(dirty),
        "device": _device_name(values.get("device")),
        "host": platform.node(),
        "command": shlex.join(["python", "-m", "lingbot_map_ros.cli.demo", *(argv if argv is not None else [])])
        if argv is not None else None,
        "script_command": os.environ.get("LINGBOT_BENCH_COMMAND"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def measurement(recorder, since_s: float | None, baseline: dict, published: int, startup: dict,
                args: argparse.Namespace, values: dict, images: Path, decisions: dict | None = None) -> dict:
    """The run's numbers: poses of images stamped at or after ``since_s`` (all when None), the
    node's counters relative to ``baseline``, the node's own per-frame times, and with the
    keyframe selector ``decisions`` (demo_selector.decision_measurement)."""
    from ..io.preprocess import list_images, load_image

    poses, status = recorder.snapshot()
    if since_s is not None:
        poses = [p for p in poses if p.stamp_s >= since_s]
    frame_status = recorder.frame_statuses(since_s)
    final = _counters(status)
    delta = {name: final[name] - baseline[name] for name in COUNTERS}
    latencies = [p.latency_ms for p in poses]
    span_out = poses[-1].received_s - poses[0].received_s if len(poses) > 1 else 0.0
    span_in = poses[-1].stamp_s - poses[0].stamp_s if len(poses) > 1 else 0.0
    frame_size = list(load_image(list_images(images)[0]).size)
    windows = sorted({f.window_index for f in frame_status})
    return {
        "run": run_info(args, values),
        "setting": {
            "weights": values.get("checkpoint") or f"random {args.preset or 'tiny'} (seed {args.seed})",
            "preset": args.preset, "device": values.get("device"), "backend": values.get("backend", "auto"),
            "dtype": values.get("dtype", "fp32"), "cuda_graphs": values.get("cuda_graphs", True),
            "frame_size": frame_size, "image_width": values.get("image_width"), "rate_hz": args.rate,
            "frames": args.frames, "warmup_poses": args.warmup_poses, "node_parameters": values,
            "node_script": str(args.node_script) if args.node_script else None,
            "fastdds_profile": os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE"),
            "keyframe_selector": bool(getattr(args, "keyframe_selector", False)),
            "selector_parameters": list(getattr(args, "selector_param", [])),
        },
        "startup": startup,
        "frames": {"published": published, "received": delta["frames_received"],
                   "processed": delta["frames_processed"], "dropped_stale": delta["frames_dropped_stale"],
                   "dropped_invalid": delta["frames_dropped_invalid"], "dropped_error": delta["frames_dropped_error"],
                   "poses_received": len(poses)},
        "latency_ms": _stats(latencies),  # image header stamp -> pose received by the recorder
        "output_rate_hz": round((len(poses) - 1) / span_out, 3) if span_out > 0 else 0.0,
        "input_rate_of_poses_hz": round((len(poses) - 1) / span_in, 3) if span_in > 0 else 0.0,
        "node_ms": {  # the node's own per-frame times (Status), same frames
            "model": _stats([f.model_ms for f in frame_status]),
            "total_stamp_to_published": _stats([f.total_ms for f in frame_status]),
            "preprocess": _stats([f.preprocess_ms for f in frame_status]),
            "postprocess": _stats([f.postprocess_ms for f in frame_status]),
            "publish": _stats([f.publish_ms for f in frame_status]),
        },
        "window_restarts": max(len(windows) - 1, 0), "window_indices": windows,
        "gpu_memory_mb": {"allocated_max": round(max((f.gpu_allocated_mb for f in frame_status), default=0.0), 1),
                          "reserved_max": round(max((f.gpu_reserved_mb for f in frame_status), default=0.0), 1)},
        "decisions": decisions,  # None without the keyframe selector
    }


def _report(recorder, out: Path, response, since_s: float | None = None, result: dict | None = None) -> int:
    from ..io.export import plot_trajectory_png, read_tum
    from ..ros.conversions import OPTICAL_TO_REP103

    summary = recorder.summary(since_s)
    _, status = recorder.snapshot()
    if result is not None:
        f = result["frames"]
        dropped = f"{f['dropped_stale']} stale, {f['dropped_invalid']} invalid, {f['dropped_error']} error"
    else:
        dropped = "n/a" if status is None else (f"{status.frames_dropped_stale} stale, "
                                                 f"{status.frames_dropped_invalid} invalid, "
                                                 f"{status.frames_dropped_error} error")
    print(f"frames processed : {summary.frames} (dropped: {dropped})")
    print(f"throughput       : {summary.fps:.1f} FPS of poses received (input rate bound); model step "
          f"{summary.model_mean_ms:.1f} ms/frame = {1e3 / summary.model_mean_ms:.0f} FPS possible")
    print(f"latency          : median {summary.latency_median_ms:.1f} ms, p95 {summary.latency_p95_ms:.1f} ms, "
          f"max {summary.latency_max_ms:.1f} ms (image stamp -> pose received; the scale frames wait for each other)")
    decisions = (result or {}).get("decisions")
    if decisions:
        n, rt, waits = decisions["node"], decisions["round_trip_ms"], decisions["hold_waits"]
        print(f"decisions        : kept {n['kept']}, dropped {n['dropped']}, timed out {n['timed_out']}, refused "
              f"{n['refused']}; round trip median {rt.get('median')} ms, p95 {rt.get('p95')} ms, max {rt.get('max')} "
              f"ms; {waits['frames']} frame(s) waited behind a hold")
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
    args.argv = list(argv) if argv is not None else sys.argv[1:]
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
