"""What loop closure costs on the GPU machine (issue 39), in one process, one run:

1. the camera's frame loop at ``--rate`` Hz with ``loop_closure`` off, then on (the node's own
   ``InferenceEngine`` and ``CameraScheduler`` on the released architecture with RANDOM weights,
   bf16, the node's default backend and CUDA graphs; no DDS: frames are handed to the engine as the
   image callback would, and the latency is image stamp -> the pose handed to the sink); the
   frames are ``--frames`` of a real camera loop (``--images``, cycled: the places come back, so
   candidates are found and verified in the inference thread's idle time);
   then with the occupancy grid on (issue 40: ``grid``, fixed scale, a base frame 0.3 m below);
2. one verification: the side session (``runtime.loop_verify.ModelSideRunner``) on two frames,
   twice as a candidate costs (kept + current, partner + current), CUDA-synchronised, median;
3. the loop thread's work per keyframe (JPEG, descriptor, place database, graph update), median.

Random weights: the verdicts themselves mean nothing (most candidates are refused); the costs
are what the released model pays. Writes ``loop_closure_gpu_<commit>.json`` (commit, device,
command, date) into ``--out``.

    python benchmarks/slam/loop_closure_gpu.py --images ../shared/data/loop --frames 300 --rate 15 \
        --out $OUT
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.io.preprocess import list_images, model_input  # noqa: E402
from lingbot_map_ros.runtime.engine import InferenceEngine  # noqa: E402
from lingbot_map_ros.runtime.frames import InputFrame  # noqa: E402
from lingbot_map_ros.runtime.params import resolve_settings  # noqa: E402
from lingbot_map_ros.runtime.scheduler import CameraScheduler  # noqa: E402
from lingbot_map_ros.stream.multi import CameraSessions  # noqa: E402


class TimingSink:
    """The engine's sink: records when each frame's pose is handed over."""

    def __init__(self) -> None:
        self.latency_ms: list[float] = []
        self.lock = threading.Lock()

    def wants(self, output):
        return False

    def publish_frame(self, out):
        with self.lock:
            self.latency_ms.append(1e3 * (time.time() - out.stamp_s))

    def publish_clouds(self, out):
        pass

    def publish_path(self, entries, transform=None, corrections=None):
        pass

    def publish_status(self, status, stamp):
        pass

    def publish_frame_info(self, info, out):
        pass

    def configure(self, settings):
        pass


class Log:
    def __init__(self) -> None:
        self.lines = []

    def debug(self, m):
        pass

    def info(self, m):
        self.lines.append(m)

    warning = error = info


def load_frames(folder: Path, width: int) -> list[np.ndarray]:
    from PIL import Image

    out = []
    for path in list_images(folder):
        rgb = np.asarray(Image.open(path).convert("RGB"))
        x = model_input(rgb, width)  # the model's size: uint8 when already there, else float [3, H, W]
        if x.dtype != np.uint8:
            x = np.clip(np.rint(np.moveaxis(x, 0, -1) * 255), 0, 255).astype(np.uint8)
        out.append(np.ascontiguousarray(x))
    return out


# the camera's pose in a robot base (z up, 0.3 m below it, looking along x): the grid's ground
T_CAM_BASE = np.array([[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.3], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])


def run_rate(model, params: dict, frames: list[np.ndarray], n: int, rate: float, warmup: int) -> dict:
    """The engine at ``rate`` Hz over ``n`` frames after ``warmup`` untimed ones (``grid`` in
    ``params``: the occupancy grid fed on the output thread, as ros/grid_outputs.py attaches it)."""
    settings = resolve_settings(params)
    sessions = CameraSessions(model, {"": (settings.stream, settings.long_stream)})
    session = sessions.sessions[""]
    sink, log = TimingSink(), Log()
    engine = InferenceEngine(session, settings, sink, log, now=time.time)
    grid = None
    if settings.grid:
        from lingbot_map_ros.runtime.grid import GroundFromBase, SequenceGrid, grid_config

        grid = SequenceGrid(grid_config(settings), GroundFromBase(settings.base_frame, 0.0, lambda cam: T_CAM_BASE),
                            settings.scale_source)
        engine.seq.attach_grid(grid)
    scheduler = CameraScheduler({"": engine})
    scheduler.start()
    try:
        period = 1.0 / rate
        start = time.monotonic()
        for i in range(warmup + n):
            if i == warmup:
                with sink.lock:
                    sink.latency_ms.clear()
                start = time.monotonic() - i * period
            target = start + i * period
            time.sleep(max(0.0, target - time.monotonic()))
            now = time.time()
            engine.submit_frame(InputFrame(rgb=frames[i % len(frames)], stamp=now, stamp_s=now, camera_frame="cam"))
        time.sleep(1.0)
        c = engine.seq.counter_values()
        lat = list(sink.latency_ms)
        out = {"frames_timed": n, "poses": len(lat), "frames_dropped_stale": c.frames_dropped_stale,
               "latency_ms_median": statistics.median(lat) if lat else None,
               "latency_ms_p95": float(np.percentile(lat, 95)) if lat else None,
               "window_restarts": session.window_index}
        if grid is not None:
            snap = grid.snapshot()
            out.update(grid_ready=bool(snap.ready), grid_cells=int(snap.width) * int(snap.height),
                       grid_reason=grid.state.reason)
        loop = engine.loop
        if loop is not None:
            loop.flush(30)
            st = loop.stats
            out.update(loop_keyframes=st.keyframes, loop_candidates=st.candidates, loop_accepted=st.accepted,
                       loop_rejected=st.rejected, loop_last_reason=st.last_reason)
        return out
    finally:
        scheduler.stop()


def verification_cost(model, params: dict, frames: list[np.ndarray], repeats: int) -> dict:
    import torch

    from lingbot_map_ros.runtime.loop_verify import ModelSideRunner

    sync = torch.cuda.synchronize if torch.cuda.is_available() and params["device"].startswith("cuda") else (lambda: None)

    settings = resolve_settings(params)
    sessions = CameraSessions(model, {"": (settings.stream, settings.long_stream)})
    inner = sessions.sessions[""].inner
    for f in frames[:4]:  # the camera's own session runs first (its buffers, kernels)
        inner.push(f)
    side = ModelSideRunner(inner)
    times = []
    for r in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        side.run([frames[0], frames[r % len(frames)]])
        side.run([frames[1], frames[r % len(frames)]])
        sync()
        if r >= 2:
            times.append(1e3 * (time.perf_counter() - t0))
    return {"candidate_ms_median": statistics.median(times), "candidate_ms_max": max(times), "repeats": repeats,
            "what": "two side-session runs of 2 frames (kept + current, partner + current), synchronised"}


def keyframe_cost(frames: list[np.ndarray], n: int) -> dict:
    """The loop thread's work per keyframe, without the model: JPEG, descriptor, database, graph."""
    from lingbot_map_ros.runtime.loop_closure import KeyframeIn, LoopCloser, LoopConfig

    class NoSide:
        def run(self, images):
            raise RuntimeError("not measured here")

    closer = LoopCloser(LoopConfig(min_separation=10 ** 9), NoSide(), lambda c: None)
    h, w = frames[0].shape[:2]
    depth = np.ones((h // 8, w // 8), np.float32)
    K = np.array([[w, 0, w / 2], [0, w, h / 2], [0, 0, 1.0]]) / 8
    times = []
    for i in range(n):
        T = np.eye(4)
        T[0, 3] = 0.05 * i
        t0 = time.perf_counter()
        closer.keyframe(KeyframeIn(i, float(i), T, frames[i % len(frames)], depth, K, 1.0))
        closer.flush(30)
        times.append(1e3 * (time.perf_counter() - t0))
    closer.stop()
    return {"keyframe_ms_median": statistics.median(times), "keyframe_ms_p95": float(np.percentile(times, 95)),
            "keyframes": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, required=True)
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--rate", type=float, default=15.0)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--width", type=int, default=518)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--runs", default="off,on,off_again,grid",
                   help="which rate runs, in this order (off, on, off_again, grid; comma-separated)")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--device", default="cuda", help="cpu + --model-config: a smoke run of this script")
    p.add_argument("--model-config", default="", help="architecture JSON (default: the released one)")
    p.add_argument("--commit", default="", help="the commit measured (default: git's HEAD; the device tool's copy "
                                                  "of the tree may carry an older .git)")
    args = p.parse_args(argv)
    import torch

    frames = load_frames(args.images, args.width)
    base = {"device": args.device, "image_width": args.width, "loop_min_separation": 40, "publish_map": False,
            "model_config": args.model_config}
    settings = resolve_settings(base)
    model = load_model(settings.model, None, args.device, settings.stream.dtype, seed=0)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip() or "unknown"
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu ({platform.processor()})"
    result = {"commit": commit, "device": device, "host": platform.node(),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "frames_in_loop": len(frames), "resolution": list(frames[0].shape[:2]), "weights": "random (seed 0)"}
    variants = {"off": base, "on": {**base, "loop_closure": True},
                "off_again": base,  # the noise between runs
                "grid": {**base, "grid": True, "scale_source": "fixed", "base_frame": "base_link"}}
    for name in args.runs.split(","):
        if name not in variants:
            p.error(f"--runs: unknown run {name!r} (one of {', '.join(variants)})")
        result[name] = run_rate(model, variants[name], frames, args.frames, args.rate, args.warmup)
    result["verification"] = verification_cost(model, base, frames, args.repeats)
    result["loop_thread_per_keyframe"] = keyframe_cost(frames, 200)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"loop_closure_gpu_{commit}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
