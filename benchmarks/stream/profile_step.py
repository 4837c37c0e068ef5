"""Kernel-time table of steady-state one-frame steps (torch.profiler).

    python benchmarks/stream/profile_step.py --backend flashinfer-fa3 --frames 5
    python benchmarks/stream/profile_step.py --graphs [--queued] --frames 20

Streams until the window is full, then profiles ``--frames`` steps and prints the CUDA
kernels by total time per frame, plus the sum of kernel time per frame (gap-free GPU
work). By default the steps are eager (graphs off); ``--graphs`` profiles the CUDA-graph
replays as the session runs them (``--queued``: frame t+1 submitted before frame t's
results are taken) and adds the GPU's busy time per frame (the union of kernel
intervals; kernels of two streams at once count once) and its idle time. A benchmark
aid, not a test.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from stream_fps import frames_iter, stream_config  # noqa: E402

from lingbot_map_ros.config import FA3_TILES, ModelConfig  # noqa: E402
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
    p.add_argument("--fp32-camera-head", action="store_true")
    p.add_argument("--no-parallel-heads", action="store_true")
    p.add_argument("--graphs", action="store_true", help="profile the CUDA-graph replays (kernels inside graphs)")
    p.add_argument("--queued", action="store_true", help="with --graphs: submit frame t+1 before frame t's results")
    p.add_argument("--copies", action="store_true",
                   help="also list which Python lines launch copy/cast/cat kernels (with shapes)")
    a = p.parse_args(argv)
    args = argparse.Namespace(num_scale_frames=8, sliding_window=64, keyframe_interval=1, camera_iterations=4,
                              backend=a.backend, dtype="bf16", no_cuda_graphs=not a.graphs, kv_splits=a.kv_splits,
                              no_fused_kernels=a.no_fused_kernels, fp32_depth_head=a.fp32_depth_head,
                              fp32_camera_head=a.fp32_camera_head, no_parallel_heads=a.no_parallel_heads,
                              fa3_tiles=FA3_TILES)
    model = load_model(ModelConfig.preset("lingbot-map"), None, "cuda", "bf16", seed=0)
    session = StreamingSession(model, stream_config(args))
    full = 8 + 64
    frames = list(frames_iter(full + a.frames, a.height, a.width, 0, "cuda"))
    for f in frames[:full]:
        session.push(f)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if a.queued:
            pending = [session.submit(f) for f in frames[full:full + 1]]
            for f in frames[full + 1:]:
                pending.append(session.submit(f))
                pending[-2].result()
            pending[-1].result()
        else:
            for f in frames[full:]:
                session.push(f)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3 / a.frames
    print(f"kernel time per frame: {total:.2f} ms ({sum(e.count for e in events) / a.frames:.0f} kernels)")
    busy_window(prof, a.frames)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:a.top]:
        print(f"{e.self_device_time_total / 1e3 / a.frames:8.3f} ms {e.count / a.frames:6.0f}x  {e.key[:110]}")
    if a.copies:
        trace_copies(session, frames[-1])
        copy_kernel_sources(session, frames[-1])
    return 0


def busy_window(prof, frames: int) -> None:
    """GPU busy time (union of kernel and copy intervals) and the profiled window, per frame."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    for s0, s1 in spans[1:]:
        if s0 > end:
            busy += end - start
            start, end = s0, s1
        else:
            end = max(end, s1)
    busy += end - start
    window = spans[-1][1] - spans[0][0]
    print(f"GPU busy per frame: {busy / 1e3 / frames:.2f} ms of a {window / 1e3 / frames:.2f} ms window "
          f"(idle {(window - busy) / 1e3 / frames:.2f} ms)")


def copy_kernel_sources(session, frame) -> None:
    """One more step under the profiler with Python stacks: every copy kernel attributed to
    the chain of aten ops that launched it (this sees copies made inside ops too)."""
    from collections import Counter

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        session.push(frame)
        torch.cuda.synchronize()
    seen: Counter = Counter()
    for e in prof.events():
        kernels = [k for k in getattr(e, "kernels", []) if "copy" in k.name.lower()]
        if not kernels or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        chain, top = [], e
        while top is not None and top.name.startswith("aten::"):
            chain.append(top.name.removeprefix("aten::"))
            top = top.cpu_parent
        stack = next((x.stack for x in (e, *_parents(e)) if x.stack), [])
        where = " < ".join(s.split("lingbot_map_ros/")[-1].split("(")[0] + ":" + s.split("(")[-1].split(")")[0]
                           for s in stack if "lingbot_map_ros" in s)[:150]
        seen[(" < ".join(chain[:4]), where)] += len(kernels)
    print("\ncopy kernels of one eager step by launching op chain and source (count):")
    for (chain, where), n in seen.most_common(30):
        print(f"{n:5d}  {chain}\n       {where}")


def _parents(e):
    while e.cpu_parent is not None:
        e = e.cpu_parent
        yield e


COPY_OPS = {"aten.copy_.default", "aten._to_copy.default", "aten.clone.default", "aten.cat.default",
            "aten.index_copy_.default", "aten.contiguous.default"}


def trace_copies(session, frame) -> None:
    """One more step under a dispatch mode that records every copy-like aten call with its
    shapes and the innermost lines of this project that made it."""
    import traceback
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Tracer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name in COPY_OPS:
                shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
                frames = [f for f in traceback.extract_stack()[:-1] if "lingbot_map_ros" in f.filename]
                where = " < ".join(f"{f.filename.split('lingbot_map_ros/')[-1]}:{f.lineno}" for f in frames[::-1][:3])
                seen[(name, str(shapes)[:70], where)] += 1
            return func(*args, **(kwargs or {}))

    with Tracer():
        session.push(frame)
    torch.cuda.synchronize()
    print("\ncopy-like aten calls of one eager step (count, op, shapes, where):")
    for (name, shapes, where), n in seen.most_common(40):
        print(f"{n:5d}  {name} {shapes}\n       {where}")


if __name__ == "__main__":
    sys.exit(main())
