"""Kernel-time table of steady-state one-frame steps (torch.profiler, eager step).

    python benchmarks/profile_step.py --backend flashinfer-fa3 --frames 5

Streams until the window is full, then profiles ``--frames`` eager steps (graphs off,
so every kernel is attributed) and prints the CUDA kernels by total time per frame,
plus the sum of kernel time per frame (gap-free GPU work). A benchmark aid, not a test.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from stream_fps import frames_iter, stream_config  # noqa: E402

from lingbot_map_ros.config import ModelConfig  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.stream.session import StreamingSession  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="flashinfer-fa3")
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--height", type=int, default=378)
    p.add_argument("--width", type=int, default=518)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--kv-splits", type=int, default=0)
    p.add_argument("--no-fused-kernels", action="store_true")
    p.add_argument("--fp32-depth-head", action="store_true")
    p.add_argument("--no-parallel-heads", action="store_true")
    p.add_argument("--copies", action="store_true",
                   help="also list which Python lines launch copy/cast/cat kernels (with shapes)")
    a = p.parse_args(argv)
    args = argparse.Namespace(num_scale_frames=8, sliding_window=64, keyframe_interval=1, camera_iterations=4,
                              backend=a.backend, dtype="bf16", no_cuda_graphs=True, kv_splits=a.kv_splits,
                              no_fused_kernels=a.no_fused_kernels, fp32_depth_head=a.fp32_depth_head,
                              no_parallel_heads=a.no_parallel_heads)
    model = load_model(ModelConfig.preset("lingbot-map"), None, "cuda", "bf16", seed=0)
    session = StreamingSession(model, stream_config(args))
    full = 8 + 64
    frames = list(frames_iter(full + a.frames, a.height, a.width, 0, "cuda"))
    for f in frames[:full]:
        session.push(f)
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if a.copies else [])
    with profile(activities=activities, record_shapes=a.copies, with_stack=a.copies) as prof:
        for f in frames[full:]:
            session.push(f)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3 / a.frames
    print(f"kernel time per frame: {total:.2f} ms ({sum(e.count for e in events) / a.frames:.0f} kernels)")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:a.top]:
        print(f"{e.self_device_time_total / 1e3 / a.frames:8.3f} ms {e.count / a.frames:6.0f}x  {e.key[:110]}")
    if a.copies:
        print_copies(prof, a.frames)
    return 0


COPY_OPS = ("aten::copy_", "aten::cat", "aten::contiguous", "aten::clone", "aten::to", "aten::_to_copy",
            "aten::index_copy_", "aten::fill_", "aten::zero_")


def print_copies(prof, frames: int) -> None:
    """Copy-like aten ops with the device time they caused, by (op, shapes, innermost project frames)."""
    rows = {}
    for ev in prof.events():
        if ev.name not in COPY_OPS or ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        cuda_us = sum(k.duration for k in ev.kernels) if ev.kernels else 0.0
        if cuda_us <= 0:
            continue
        stack = [f for f in (ev.stack or []) if "lingbot_map_ros" in f or "benchmarks" in f][:3]
        key = (ev.name, str(ev.input_shapes)[:80], " < ".join(s.split("lingbot_map_ros/")[-1] for s in stack))
        t, n = rows.get(key, (0.0, 0))
        rows[key] = (t + cuda_us, n + 1)
    print("\ncopy-like ops by device time per frame (top 30):")
    for (name, shapes, where), (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"{t / 1e3 / frames:8.3f} ms {n / frames:5.0f}x  {name} {shapes}\n{'':22}{where}")


if __name__ == "__main__":
    sys.exit(main())
