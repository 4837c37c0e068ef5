"""Where the host time of a steady-state push goes (cProfile), next to its GPU time.

    python benchmarks/stream/host_profile.py --frames 60

Streams until the window is full (released configuration, random weights, bf16,
default backend, CUDA graphs), then profiles ``--frames`` pushes with cProfile and
prints the functions by own time and by cumulative time. The GPU time of the
graph replays (CUDA events) is printed for comparison: wall - GPU is the time the
GPU waits for the host. A benchmark aid, not a test.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from stream_fps import ReplayTimer, frames_iter, parse_args, stream_config  # noqa: E402

from lingbot_map_ros.config import ModelConfig  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.stream.session import StreamingSession  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=60)
    p.add_argument("--host-frames", action="store_true", help="feed frames from host memory (as the node does)")
    a, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    model = load_model(ModelConfig.preset(args.preset), None, "cuda", args.dtype, seed=args.seed)
    session = StreamingSession(model, stream_config(args))
    full = args.num_scale_frames + args.sliding_window * args.keyframe_interval
    device = "cpu" if a.host_frames else "cuda"
    frames = list(frames_iter(full + a.frames, args.height, args.width, 0, device))
    timer = ReplayTimer()
    for f in frames[:full]:
        session.push(f)
        timer.attach(session)
    torch.cuda.synchronize()
    timer.pairs.clear()
    walls = []
    prof = cProfile.Profile()
    for f in frames[full:]:
        t = time.perf_counter()
        prof.enable()
        session.push(f)
        prof.disable()
        walls.append((time.perf_counter() - t) * 1e3)
    gpu = timer.median_ms(0)
    print(f"push wall median {statistics.median(walls):.3f} ms, graph GPU median {gpu:.3f} ms "
          f"(host frames: {a.host_frames})")
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(22)
        print(buf.getvalue()[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
