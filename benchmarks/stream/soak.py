"""Soak test: a long stream through LongStreamSession with automatic restarts.

    python benchmarks/stream/soak.py                # CPU, tiny model, 10,000 frames of 56x98
    python benchmarks/stream/soak.py --device cuda --preset lingbot-map --height 378 --width 518 \\
        --dtype bf16 --frames 20000

Streams ``--frames`` generated frames (seeded, a drifting texture plus noise) and, every
``--every`` frames, records the process RSS (/proc/self/statm), the torch allocator's
allocated bytes on CUDA, the median per-frame wall time and CPU time (this thread's,
less sensitive to other load on the machine) of the last ``--every`` frames, the window
index and the cache's temporal index. Memory "start" is taken after ``--warmup`` frames
(by default more than one window, so the first restart has allocated what restarts
need). Per-frame time drift compares the median of the first and the last
``--drift-frames`` frames after warm-up; the default is three window periods
(``window_frames - overlap_frames`` new frames each), so both spans hold every temporal
index equally often (the time grows inside a window with the cached frames and drops at
each restart). The host is shared and its speed drifts by itself (±10% over a minute is
common on a virtual machine), so every sample also times a fixed matrix-product probe
(``reference_ms``) whose drift over the same spans is reported beside the frames' own;
the least-squares slope of all sampled medians (with its standard error, and as the
change it implies over the run) is the trend estimate least sensitive to that noise.

A failed push is counted by exception type and handled as the node does: the frame is
dropped and the session reset. Writes JSON to ``benchmarks/results/soak_<device>_<preset>.json``
(or ``--out``) and prints a summary. A benchmark, not a test: nothing here asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record  # noqa: E402
from lingbot_map_ros.config import ModelConfig, StreamConfig  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.stream.long_stream import LongStreamConfig, LongStreamSession  # noqa: E402
from lingbot_map_ros.stream.session import StreamingSession  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
FIXTURE_WEIGHTS = [REPO / ".." / "shared" / "fixtures" / "upstream_tiny" / "weights.safetensors",
                   REPO / ".fixtures" / "upstream_tiny" / "weights.safetensors"]
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=10_000)
    p.add_argument("--every", type=int, default=100, help="frames between samples")
    p.add_argument("--warmup", type=int, default=400, help="frames before the start sample")
    p.add_argument("--drift-frames", type=int, help="frames of the start/end time medians "
                                                      "(default: three window periods)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--weights", type=Path, help="checkpoint (default: the fixture weights for the tiny "
                                                 "preset when present, else random weights)")
    p.add_argument("--height", type=int, default=56)
    p.add_argument("--width", type=int, default=98)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--num-scale-frames", type=int, default=8)
    p.add_argument("--sliding-window", type=int, default=64)
    p.add_argument("--keyframe-interval", type=int, default=1)
    p.add_argument("--camera-iterations", type=int, default=4)
    p.add_argument("--window-frames", type=int, default=320)
    p.add_argument("--overlap-frames", type=int)
    p.add_argument("--keyframe-policy", default="interval", choices=["interval", "motion"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def cuda_mib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reference_ms() -> float:
    """CPU time (ms) of a fixed workload: a yardstick for the host's speed at this moment."""
    a = torch.full((256, 256), 0.5)
    best = float("inf")
    for _ in range(3):
        t = time.thread_time()
        for _ in range(8):
            a @ a
        best = min(best, time.thread_time() - t)
    return best * 1e3


def frames_iter(n, h, w, seed):
    """Seeded image-like frames: a texture drifting one pixel per frame, plus fresh noise."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(3, h, w, generator=gen)
    for i in range(n):
        yield 0.8 * torch.roll(base, shifts=(i % h, i % w), dims=(1, 2)) + 0.2 * torch.rand(3, h, w, generator=gen)


def build(args) -> LongStreamSession:
    cfg = ModelConfig.preset(args.preset)
    weights = args.weights
    if weights is None and args.preset == "tiny":
        weights = next((p for p in FIXTURE_WEIGHTS if p.is_file()), None)
    model = load_model(cfg, weights, args.device, args.dtype, seed=args.seed)
    args.weights_used = os.path.relpath(weights, REPO) if weights else f"random (seed {args.seed})"
    stream = StreamConfig(num_scale_frames=args.num_scale_frames, sliding_window=args.sliding_window,
                          keyframe_interval=args.keyframe_interval, camera_iterations=args.camera_iterations,
                          backend=args.backend, dtype=args.dtype, device=args.device)
    long_cfg = LongStreamConfig(window_frames=args.window_frames, overlap_frames=args.overlap_frames,
                                keyframe_policy=args.keyframe_policy)
    return LongStreamSession(StreamingSession(model, stream), long_cfg)


def soak(session: LongStreamSession, args):
    device = session.device
    samples, times, cpu_times, errors = [], [], [], Counter()
    window_ms: list[float] = []
    window_cpu_ms: list[float] = []
    start = None
    t_run = time.perf_counter()
    for i, frame in enumerate(frames_iter(args.frames, args.height, args.width, args.seed)):
        t, c = time.perf_counter(), time.thread_time()
        try:
            session.push(frame)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # the node's policy: drop the frame, reset, go on
            errors[type(exc).__name__] += 1
            session.reset()
        ms, cpu_ms = (time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3
        window_ms.append(ms)
        window_cpu_ms.append(cpu_ms)
        if i >= args.warmup:
            times.append(ms)
            cpu_times.append(cpu_ms)
        if i + 1 == args.warmup:
            start = {"frame": i + 1, "rss_mib": rss_mib(), "cuda_allocated_mib": cuda_mib(device),
                     "load_avg_1min": os.getloadavg()[0]}
        if (i + 1) % args.every == 0:
            stats = session.stats()
            samples.append({"frame": i + 1, "rss_mib": round(rss_mib(), 2),
                            "cuda_allocated_mib": _round(cuda_mib(device)),
                            "median_ms": round(statistics.median(window_ms), 3),
                            "median_cpu_ms": round(statistics.median(window_cpu_ms), 3),
                            "reference_ms": round(reference_ms(), 3), "load_avg_1min": os.getloadavg()[0],
                            "window_index": session.window_index,
                            "temporal_index": stats.temporal_index if stats else 0})
            window_ms.clear()
            window_cpu_ms.clear()
            if (i + 1) % (10 * args.every) == 0:
                print(f"frame {i + 1}: rss {samples[-1]['rss_mib']:.1f} MiB, {samples[-1]['median_ms']:.1f} ms/frame, "
                      f"window {session.window_index}", flush=True)
    return samples, {"wall": times, "cpu": cpu_times}, errors, start, time.perf_counter() - t_run


def _round(x, n=2):
    return None if x is None else round(x, n)


def drift(times: list[float], k: int) -> dict:
    head, tail = statistics.median(times[:k]), statistics.median(times[-k:])
    return {"median_start": round(head, 3), "median_end": round(tail, 3),
            "drift_pct": round(100 * (tail / head - 1), 2), "median_all": round(statistics.median(times), 3),
            "p95_all": round(sorted(times)[int(0.95 * (len(times) - 1))], 3)}


def host_speed(after: list[dict], warmup: int, frames: int, k: int) -> dict:
    """The probe's drift over the drift spans and the slope of the sampled per-frame medians."""
    ref_drift = span_median(after, "reference_ms", frames - k, frames) / span_median(
        after, "reference_ms", warmup, warmup + k) - 1
    x = np.array([s["frame"] for s in after], dtype=np.float64) / 1000
    y = np.array([s["median_ms"] for s in after])
    (slope, icpt), cov = np.polyfit(x, y, 1, cov=True)
    change = slope * (x[-1] - x[0]) / (icpt + slope * x[0])
    return {"reference_drift_pct": round(100 * ref_drift, 2),
            "slope_ms_per_1000_frames": round(float(slope), 4),
            "slope_stderr": round(float(np.sqrt(cov[0, 0])), 4),
            "slope_change_over_run_pct": round(float(100 * change), 2),
            "sample_median_ms_range": [float(y.min()), float(y.max())]}


def span_median(samples: list[dict], key: str, first: int, last: int) -> float:
    return round(statistics.median(s[key] for s in samples if first < s["frame"] <= last), 2)


def summarize(args, session, samples, times, errors, start, run_s):
    after = [s for s in samples if s["frame"] >= args.warmup]
    rss = [s["rss_mib"] for s in after]
    period = args.window_frames - session.overlap_frames
    k = min(args.drift_frames or 3 * period, len(times["wall"]) // 2)
    device = session.device
    result = {
        "setting": {
            "device": str(device), "cpu": platform.processor() or platform.machine(), "torch_threads":
                torch.get_num_threads(), "preset": args.preset, "weights": args.weights_used,
            "resolution": [args.height, args.width], "dtype": args.dtype, "backend": session.backend.name,
            "num_scale_frames": args.num_scale_frames, "sliding_window": args.sliding_window,
            "keyframe_interval": args.keyframe_interval, "camera_iterations": args.camera_iterations,
            "window_frames": args.window_frames, "overlap_frames": session.overlap_frames,
            "keyframe_policy": args.keyframe_policy, "warmup_frames": args.warmup, "sample_every": args.every,
            "max_frame_num": session.inner.model.cfg.max_frame_num,
        },
        "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        "run": run_record(),
        "frames": args.frames,
        "restarts": session.window_index,
        "errors": dict(errors),
        "run_s": round(run_s, 1),
        "memory": {
            "rss_mib": {"start": round(start["rss_mib"], 2), "end": rss[-1], "max": max(rss), "min": min(rss),
                        # the allocator breathes by a few MiB: medians over the drift spans show the trend
                        "start_span_median": span_median(after, "rss_mib", args.warmup, args.warmup + k),
                        "end_span_median": span_median(after, "rss_mib", args.frames - k, args.frames)},
        },
        "drift_frames": k,
        "per_frame_ms": drift(times["wall"], k),
        "per_frame_cpu_ms": drift(times["cpu"], k),
        "host_speed": host_speed(after, args.warmup, args.frames, k),
        "load_avg_1min": {"start": start["load_avg_1min"], "end": os.getloadavg()[0]},
        "samples": samples,
    }
    if device.type == "cuda":
        alloc = [s["cuda_allocated_mib"] for s in after]
        result["memory"]["cuda_allocated_mib"] = {"start": _round(start["cuda_allocated_mib"]), "end": alloc[-1],
                                                  "max": max(alloc), "peak_allocator_mib":
                                                      _round(torch.cuda.max_memory_allocated(device) / 2**20)}
        result["setting"]["gpu"] = torch.cuda.get_device_name(device)
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.warmup >= args.frames or args.frames < args.every:
        raise SystemExit("--frames must exceed --warmup and --every")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    session = build(args)
    samples, times, errors, start, run_s = soak(session, args)
    result = summarize(args, session, samples, times, errors, start, run_s)
    out = args.out or RESULTS / f"soak_{session.device.type}_{args.preset.replace('-', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    mem = result["memory"]
    print(f"{args.frames} frames in {run_s:.0f} s, {result['restarts']} restarts, errors {dict(errors) or 0}")
    rss = mem["rss_mib"]
    print(f"RSS MiB: start {rss['start']} (after {args.warmup} frames), end {rss['end']}, min {rss['min']}, "
          f"max {rss['max']}; medians over the first/last {result['drift_frames']} frames "
          f"{rss['start_span_median']} / {rss['end_span_median']}")
    if "cuda_allocated_mib" in mem:
        c = mem["cuda_allocated_mib"]
        print(f"CUDA allocated MiB: start {c['start']}, end {c['end']}, max {c['max']}")
    for key, name in (("per_frame_ms", "wall"), ("per_frame_cpu_ms", "CPU")):
        ms = result[key]
        print(f"per-frame {name} ms (median of {result['drift_frames']}): start {ms['median_start']}, "
              f"end {ms['median_end']} (drift {ms['drift_pct']:+.1f}%)")
    host = result["host_speed"]
    print(f"host probe drift over the same spans {host['reference_drift_pct']:+.1f}%; trend of the sampled medians "
          f"{host['slope_ms_per_1000_frames']:+.3f} ± {host['slope_stderr']:.3f} ms per 1000 frames "
          f"({host['slope_change_over_run_pct']:+.1f}% over the run)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
