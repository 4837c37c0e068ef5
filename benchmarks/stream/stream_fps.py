"""Streaming throughput of the released configuration (random weights) on one GPU.

    python benchmarks/stream/stream_fps.py --backend flashinfer-fa3 --dtype bf16 --frames 300

Streams ``--frames`` random frames (seeded) at the given resolution through a
StreamingSession with the camera head (``--camera-iterations``) and the depth
head, after a separate warm-up session that absorbs JIT compilation. Reports the
median and p95 wall time per frame once the window is full (steady state), twice:
frames queued (``StreamingSession.submit`` of frame t+1 before taking frame t's
results: the throughput of a stream that keeps up, e.g. a bag replay or a camera
faster than the model) and one frame at a time (``push``: each frame's results before
the next frame is given; its median is the step time a live frame waits for), the
phase-1 time, a per-stage GPU-time breakdown (CUDA events on module hooks, in a
separate short pass, always eager: module hooks cannot time inside a CUDA
graph), peak GPU memory, and the deviation of bf16 outputs from an
fp32 run on the same frames. Writes JSON to ``benchmarks/results/<gpu>.json``
(or ``--out``). A benchmark, not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record, write_result  # noqa: E402
from lingbot_map_ros.config import FA3_TILES, ModelConfig, StreamConfig, parse_fa3_tiles  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.stream.session import StreamingSession  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=300, help="frames streamed in the timed run")
    p.add_argument("--height", type=int, default=378)
    p.add_argument("--width", type=int, default=518)
    p.add_argument("--backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"], help="K/V cache storage")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8"], help="fp8: FP8 GEMMs in the aggregator")
    p.add_argument("--fa3-tiles", type=parse_fa3_tiles, default=FA3_TILES, metavar="QxKVxSTAGES",
                   help="tile shape of the project-built FA3 kernel (tuning runs)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--num-scale-frames", type=int, default=8)
    p.add_argument("--sliding-window", type=int, default=64)
    p.add_argument("--camera-iterations", type=int, default=4)
    p.add_argument("--keyframe-interval", type=int, default=1)
    p.add_argument("--no-depth", action="store_true")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the one-frame step eagerly (default: replay it from a CUDA graph)")
    p.add_argument("--kv-splits", type=int, default=0,
                   help="split each global-attention call over this many runs of pages (0 = automatic)")
    p.add_argument("--no-fused-kernels", action="store_true",
                   help="PyTorch ops instead of the Triton kernels (LayerNorm, q/k norm + RoPE)")
    p.add_argument("--fp32-depth-head", action="store_true",
                   help="keep the depth head in float32 (default: bf16 channels-last copy)")
    p.add_argument("--fp32-camera-head", action="store_true",
                   help="keep the camera head's weights float32 (default: bf16 weights, kernels.gemv)")
    p.add_argument("--no-parallel-heads", action="store_true",
                   help="run the camera head after the depth head on one stream")
    p.add_argument("--uint8-frames", action="store_true",
                   help="push uint8 [H, W, 3] frames from host memory, as the ROS node does (default: float "
                        "[3, H, W] tensors already on the GPU, which also travel back with the results)")
    p.add_argument("--one-at-a-time-frames", type=int, default=300,
                   help="frames of the second timed run, with push() (0: skip it)")
    p.add_argument("--compare-frames", type=int, default=12,
                   help="frames of the bf16-vs-fp32 comparison (0 = skip)")
    p.add_argument("--breakdown-frames", type=int, default=10, help="steady-state frames of the stage breakdown")
    p.add_argument("--preset", default="lingbot-map")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def frames_iter(n, h, w, seed, device, uint8=False):
    """n frames: float [3, H, W] in [0, 1] on ``device``, or (``uint8``) [H, W, 3] uint8 numpy
    arrays in host memory, as a camera driver hands them over."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    base = torch.rand(3, h, w, generator=gen)
    for i in range(n):
        # a smooth drift so frames differ but stay image-like
        shift = torch.roll(base, shifts=(i % h, (3 * i) % w), dims=(1, 2))
        frame = 0.7 * shift + 0.3 * torch.rand(3, h, w, generator=gen)
        if uint8:
            yield (frame * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
        else:
            yield frame.to(device)


def stream_config(args, dtype=None, backend=None, cuda_graphs=None):
    graphs = not args.no_cuda_graphs if cuda_graphs is None else cuda_graphs
    return StreamConfig(num_scale_frames=args.num_scale_frames, sliding_window=args.sliding_window,
                        keyframe_interval=args.keyframe_interval, camera_iterations=args.camera_iterations,
                        backend=backend or args.backend, dtype=dtype or args.dtype, device="cuda",
                        cuda_graphs=graphs, kv_splits=args.kv_splits, fused_kernels=not args.no_fused_kernels,
                        bf16_depth_head=not args.fp32_depth_head,
                        bf16_camera_head=not args.fp32_camera_head,
                        parallel_heads=not args.no_parallel_heads, fa3_tiles=args.fa3_tiles,
                        kv_cache_dtype=args.kv_cache_dtype, precision=args.precision)


class ReplayTimer:
    """CUDA events from the start of every trunk-graph replay to the end of its heads-graph
    replay: the GPU time of the step itself, without the host work of a push (planning,
    result conversion). Meaningful one frame at a time (queued, a step's heads share the
    GPU with the next trunk)."""

    def __init__(self):
        self.pairs = []

    def attach(self, session):
        graphed = session._runner.graphed
        if graphed is None or getattr(graphed, "_bench_timed", False) or graphed.graph is None:
            return
        trunk, heads = graphed.graph.replay, graphed.heads_graph.replay
        started = []

        def timed_trunk():  # on the caller's stream
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            started.append(start)
            trunk()

        def timed_heads():  # on the heads' stream, after the hand-over
            heads()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs.append((started.pop(), end))

        graphed.graph.replay, graphed.heads_graph.replay = timed_trunk, timed_heads
        graphed._bench_timed = True

    def median_ms(self, skip):
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in self.pairs[skip:]]
        return statistics.median(times) if times else None


def timed_stream(session, args, replay_timer=None, queued=False, frames=None):
    """Per-frame wall times (ms) once the window is full, the phase-1 time and the first
    phase-2 step's time (ms; it includes the CUDA-graph capture when graphs are on).

    One at a time (``queued`` False): each frame is pushed and its results taken before the
    next, a frame's time is that push. Queued: frame t+1 is submitted before frame t's
    results are taken; a frame's time is the interval between its results and the
    previous frame's (throughput)."""
    times, phase1_ms, first_ms = [], None, None
    full_from = args.num_scale_frames + args.sliding_window * args.keyframe_interval
    n = args.frames if frames is None else frames
    pending, last = None, None  # queued: (frame index, PendingResults) of the previous frame

    def record(i, out, ms):
        nonlocal phase1_ms, first_ms
        if len(out) > 1:
            phase1_ms = ms
        elif out and first_ms is None:
            first_ms = ms
        elif out and i >= full_from:
            times.append(ms)

    for i, frame in enumerate(frames_iter(n, args.height, args.width, args.seed, "cuda", uint8=args.uint8_frames)):
        if not queued:
            t = time.perf_counter()
            out = session.push(frame)
            torch.cuda.synchronize()
            record(i, out, (time.perf_counter() - t) * 1e3)
        else:
            t = time.perf_counter() if last is None else last
            submitted = session.submit(frame)
            if pending is not None:
                out = pending[1].result()
                last = time.perf_counter()
                record(pending[0], out, (last - t) * 1e3)
            pending = (i, submitted)
        if replay_timer is not None:
            replay_timer.attach(session)
    if pending is not None:
        out = pending[1].result()
        record(pending[0], out, (time.perf_counter() - last) * 1e3 if last is not None else 0.0)
    torch.cuda.synchronize()
    return times, phase1_ms, first_ms


class StageTimer:
    """CUDA events around module forwards and backend.attend calls (benchmark only)."""

    def __init__(self, model, session):
        self.events = {}
        self.handles = []
        agg = model.aggregator
        self._wrap_modules("dino", [agg.patch_embed])
        self._wrap_modules("frame_blocks", list(agg.frame_blocks))
        self._wrap_modules("global_blocks", list(agg.global_blocks))
        self._wrap_modules("camera_head", [model.camera_head])
        # the session may run its own (bf16) copy of the depth head
        self._wrap_modules("depth_head", [session.depth_head if session.depth_head is not None else model.depth_head])
        backend = session.backend
        original = backend.attend
        self._restore = (backend, original)

        def attend(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(*a, **k)
            end.record()
            self.events.setdefault("global_attention_kernel", []).append((start, end))
            return out

        backend.attend = attend

    def _wrap_modules(self, name, modules):
        for m in modules:
            def pre(mod, inp, name=name):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                mod._bench_start = ev

            def post(mod, inp, out, name=name):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.events.setdefault(name, []).append((mod._bench_start, ev))

            self.handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]

    def reset(self):
        self.events = {}

    def summary(self, frames):
        torch.cuda.synchronize()
        return {k: sum(s.elapsed_time(e) for s, e in v) / frames for k, v in self.events.items()}

    def close(self):
        for h in self.handles:
            h.remove()
        backend, original = self._restore
        backend.attend = original


def breakdown(model, args):
    session = StreamingSession(model, stream_config(args, cuda_graphs=False), with_depth=not args.no_depth)
    full_from = args.num_scale_frames + args.sliding_window * args.keyframe_interval
    n = full_from + args.breakdown_frames
    timer = StageTimer(model, session)
    walls = []
    try:
        for i, frame in enumerate(frames_iter(n, args.height, args.width, args.seed + 1, "cuda")):
            if i == full_from:
                torch.cuda.synchronize()
                timer.reset()
            t = time.perf_counter()
            session.push(frame)
            if i >= full_from:
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 1e3)
        stages = timer.summary(args.breakdown_frames)
    finally:
        timer.close()
    gpu_total = sum(v for k, v in stages.items() if k != "global_attention_kernel")
    stages["wall_per_frame"] = statistics.median(walls)
    stages["host_overhead_estimate"] = max(0.0, stages["wall_per_frame"] - gpu_total)
    return {k: round(v, 3) for k, v in stages.items()}


def compare_dtypes(args, cfg):
    """Max deviation of bf16 (chosen backend) from fp32 (sdpa) on the same frames and weights."""
    n = args.compare_frames
    outs = {}
    for dtype, backend in (("fp32", "sdpa"), ("bf16", args.backend)):
        model = load_model(cfg, None, "cuda", dtype, seed=args.seed)
        session = StreamingSession(model, stream_config(args, dtype, backend), with_depth=not args.no_depth)
        res = []
        for frame in frames_iter(n, args.height, args.width, args.seed + 2, "cuda"):
            res += session.push(frame)
        outs[dtype] = res
        del session, model
        torch.cuda.empty_cache()

    def rel(key):
        a = np.stack([getattr(r, key) for r in outs["bf16"]])
        b = np.stack([getattr(r, key) for r in outs["fp32"]])
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))

    result = {"frames": n, "pose_enc_rel": rel("pose_enc")}
    if not args.no_depth:
        result.update(depth_rel=rel("depth"), depth_conf_rel=rel("confidence"))
    return result


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("stream_fps: a CUDA device is required", file=sys.stderr)
        return 2
    cfg = ModelConfig.preset(args.preset)
    gpu = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    model = load_model(cfg, None, "cuda", args.dtype, seed=args.seed)
    load_s = time.perf_counter() - t0

    # warm-up: JIT compilation of kernels, allocator growth
    t0 = time.perf_counter()
    warm = StreamingSession(model, stream_config(args), with_depth=not args.no_depth)
    for frame in frames_iter(args.num_scale_frames + 4, args.height, args.width, args.seed + 3, "cuda"):
        warm.push(frame)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    backend_name = warm.backend.name
    del warm
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    session = StreamingSession(model, stream_config(args), with_depth=not args.no_depth)
    times, phase1_ms, first_step_ms = timed_stream(session, args, queued=True)
    full_from = args.num_scale_frames + args.sliding_window * args.keyframe_interval
    one_at_a_time = graph_gpu_ms = None
    if args.one_at_a_time_frames:  # the same session, reset: graphs and buffers are reused
        session.reset()
        replay_timer = ReplayTimer()
        # phase 1 and the first (capturing) step are timed here, where a push is one step
        single, phase1_ms, first_step_ms = timed_stream(session, args, replay_timer, queued=False,
                                                        frames=args.one_at_a_time_frames)
        graph_gpu_ms = replay_timer.median_ms(skip=max(0, full_from - args.num_scale_frames - 1))
        if single:
            one_at_a_time = {"frames": len(single), "median_ms": round(statistics.median(single), 3),
                             "p95_ms": round(float(np.percentile(single, 95)), 3),
                             "fps": round(1e3 / statistics.median(single), 2)}
    attention = session._runner.graphed.backend if session._runner.graphed else session.backend
    kv_splits_used = getattr(attention, "splits", None)
    fa3_tiles = getattr(attention, "tiles", None)  # the project-built FA3 kernel's tile, None: FlashInfer's
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    stats = session.stats()
    graphed = session._runner.graphed
    graph_replays = 0 if graphed is None else graphed.replays
    session_fused = session.step_options.fused
    del session
    torch.cuda.empty_cache()

    stages = breakdown(model, args) if args.breakdown_frames else {}
    del model
    torch.cuda.empty_cache()
    deviation = compare_dtypes(args, cfg) if args.compare_frames and args.dtype == "bf16" else None

    median = statistics.median(times)
    result = {
        "gpu": gpu,
        "setting": {"resolution": [args.height, args.width], "frames": args.frames, "backend": backend_name,
                    "dtype": args.dtype, "num_scale_frames": args.num_scale_frames,
                    "sliding_window": args.sliding_window, "camera_iterations": args.camera_iterations,
                    "keyframe_interval": args.keyframe_interval, "depth_head": not args.no_depth,
                    "weights": f"random (seed {args.seed})", "preset": args.preset,
                    "cuda_graphs": not args.no_cuda_graphs, "kv_splits": kv_splits_used, "fa3_tiles": fa3_tiles,
                    "fused_kernels": session_fused, "bf16_depth_head": not args.fp32_depth_head,
                    "bf16_camera_head": not args.fp32_camera_head,
                    "input": "uint8 host frames" if args.uint8_frames else "float32 frames on the GPU",
                    "parallel_heads": not args.no_parallel_heads, "kv_cache_dtype": args.kv_cache_dtype,
                    "precision": args.precision},
        "cuda_graph_replays": graph_replays,
        "steady_state": {"frames": len(times), "median_ms": round(median, 3),
                         "p95_ms": round(float(np.percentile(times, 95)), 3), "fps": round(1e3 / median, 2),
                         "mode": "queued: submit(t+1) before frame t's results"},
        "one_at_a_time": one_at_a_time,
        "graph_gpu_median_ms": None if graph_gpu_ms is None else round(graph_gpu_ms, 3),
        "phase1_ms": None if phase1_ms is None else round(phase1_ms, 1),
        "first_phase2_step_ms": None if first_step_ms is None else round(first_step_ms, 1),
        "stage_breakdown_note": "eager step (module-hook CUDA events cannot time inside a graph); eager Python "
                                "launches of the Triton kernels inflate it: see benchmarks/stream/profile_step.py for "
                                "kernel times",
        "warmup_s": round(warmup_s, 1), "model_load_s": round(load_s, 1),
        "stage_ms_per_frame": stages,
        "peak_gpu_memory_gib": round(peak_gib, 2),
        "cache_at_end": None if stats is None else stats.__dict__,
        "bf16_vs_fp32": deviation,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                     "flashinfer": _flashinfer_version()},
        "command": "python benchmarks/stream/stream_fps.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "run": run_record([__file__] + list(sys.argv[1:] if argv is None else argv)),
    }
    write_result(result, args.out, gpu, args.tag)
    return 0


def _flashinfer_version():
    try:
        import flashinfer

        return getattr(flashinfer, "__version__", "unknown")
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
