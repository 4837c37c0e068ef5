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
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

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
    return p


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
        images, what = args.images, str(args.images)
    elif (SHARED / "data" / "loop").is_dir():
        images, what = SHARED / "data" / "loop", f"{SHARED / 'data' / 'loop'} (real frames)"
    else:
        images = synthetic_sequence(tmp / "frames", args.frames)
        what = f"a generated sequence of {args.frames} frames in {images}"

    fixture = SHARED / "fixtures" / "upstream_tiny"
    tiny = False
    if args.checkpoint:
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
    if args.model_config and not args.checkpoint:
        model["model_config"] = str(args.model_config)
    model["num_scale_frames"] = args.num_scale_frames or (2 if tiny else 8)
    model["sliding_window"] = args.sliding_window or (3 if tiny else 64)
    return images, what, model


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

        params = write_params_file(out / "params.yaml", {
            **model, "device": args.device, "image_width": args.width, "output_directory": str(out),
            "map_voxel_size": 0.005, "map_publish_rate": 1.0, "input_timeout": 5.0})
        print(f"{PROG}: images: {what}\n{PROG}: model: {model['checkpoint'] or 'random tiny weights'}; "
              f"ROS_DOMAIN_ID={domain} (localhost only); logs and outputs in {out}", flush=True)
        return _run_graph(args, images, params, out, env)


def _run_graph(args: argparse.Namespace, images: Path, params: Path, out: Path, env: dict) -> int:
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from lingbot_map_ros.srv import SaveMap

    from ..io.preprocess import list_images
    from ..ros.recorder import Recorder

    node_proc = pub_proc = None
    rclpy.init()
    recorder = Recorder("/lingbot_map")
    executor = SingleThreadedExecutor()
    executor.add_node(recorder)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        t_start = time.monotonic()
        node_proc = start([sys.executable, "-m", "lingbot_map_ros.ros.node", "--ros-args", "--params-file",
                           str(params)], env, out / "node.log")
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and recorder.count_publishers("/lingbot_map/pose") == 0:
            if node_proc.poll() is not None:
                raise DemoError(f"the node exited with status {node_proc.returncode}:\n{tail(out / 'node.log')}")
            time.sleep(0.1)
        if recorder.count_publishers("/lingbot_map/pose") == 0:
            raise DemoError(f"the node did not come up within {args.timeout} s:\n{tail(out / 'node.log')}")
        frames = min(args.frames, len(list_images(images)))
        print(f"{PROG}: node up after {time.monotonic() - t_start:.1f} s; publishing {frames} frames at "
              f"{args.rate} Hz", flush=True)
        pub_proc = start([sys.executable, "-m", "lingbot_map_ros.ros.image_folder_publisher", "--ros-args",
                          "-p", f"images:={images}", "-p", f"rate:={float(args.rate)}",
                          "-p", f"max_frames:={frames}"], env, out / "publisher.log")
        budget = frames / args.rate + args.timeout
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline and pub_proc.poll() is None:
            time.sleep(0.1)
        if pub_proc.poll() is None:
            raise DemoError(f"the publisher did not finish within {budget:.0f} s:\n{tail(out / 'publisher.log')}")
        if pub_proc.returncode != 0:
            raise DemoError(f"the publisher failed:\n{tail(out / 'publisher.log')}")
        _wait_until_idle(recorder, frames, deadline=time.monotonic() + args.timeout)

        response = recorder.call(SaveMap, "/lingbot_map/save_map", SaveMap.Request(directory=str(out)),
                                 timeout=args.timeout)
        if response is None or not response.success:
            raise DemoError(f"~/save_map failed: {'timed out' if response is None else response.message}")
        return _report(recorder, out, response)
    finally:
        stop(pub_proc)
        stop(node_proc)
        executor.shutdown(timeout_sec=1.0)
        recorder.destroy_node()
        rclpy.try_shutdown()


def _wait_until_idle(recorder, frames: int, deadline: float) -> None:
    """Wait until the node accounted for every published frame, or nothing changed for 3 s."""
    last_change, last_seen = time.monotonic(), None
    while time.monotonic() < deadline:
        _, status = recorder.snapshot()
        if status is not None:
            seen = (status.frames_processed, status.frames_dropped_stale, status.frames_dropped_invalid,
                    status.frames_dropped_error)
            if sum(seen) >= frames:
                return
            if seen != last_seen:
                last_seen, last_change = seen, time.monotonic()
        if time.monotonic() - last_change > 3.0:
            return
        time.sleep(0.1)


def _report(recorder, out: Path, response) -> int:
    from ..io.export import plot_trajectory_png, read_tum
    from ..ros.conversions import OPTICAL_TO_REP103

    summary = recorder.summary()
    _, status = recorder.snapshot()
    stamps, T_map_cam = read_tum(response.trajectory_path)
    png = out / "trajectory.png"
    if len(stamps):
        # The plot draws the ground plane of the model's OpenCV world: map -> optical axes first.
        c2w = np.linalg.inv(OPTICAL_TO_REP103) @ T_map_cam
        plot_trajectory_png(png, c2w, title=f"LingBot-Map demo: {len(stamps)} poses (top-down, first camera's x-z)")
    dropped = "n/a" if status is None else (f"{status.frames_dropped_stale} stale, {status.frames_dropped_invalid} "
                                             f"invalid, {status.frames_dropped_error} error")
    print(f"frames processed : {summary.frames} (dropped: {dropped})")
    print(f"throughput       : {summary.fps:.1f} FPS of poses received (input rate bound); model step "
          f"{summary.model_mean_ms:.1f} ms/frame = {1e3 / summary.model_mean_ms:.0f} FPS possible")
    print(f"latency          : median {summary.latency_median_ms:.1f} ms, p95 {summary.latency_p95_ms:.1f} ms "
          "(image stamp -> pose received; the scale frames wait for each other)")
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
