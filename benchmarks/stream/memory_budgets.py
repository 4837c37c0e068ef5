"""Settings that fit a GPU memory budget, what they cost, and how cost grows with the work.

    python benchmarks/stream/memory_budgets.py --backend flashinfer-fa3 --budgets 8,12,16,24 \
        --windows 8,32,128 --resolutions 280x210,392x294,518x294 --fp8-windows 64,128 --out FILE.json
    python benchmarks/stream/memory_budgets.py --accuracy 120 --backend flashinfer-fa3 --out FILE.json

One process, one model (released architecture, random weights, bf16 aggregator). Every
run is a fresh ``StreamingSession`` streaming seeded frames one at a time (push, results,
next: the step time a live frame waits for) until its window is full, then
``--timed`` more; it records the median ms/frame of those, the caching allocator's peak
allocated and reserved memory over the whole run (phase 1 included), and the estimate of
``lingbot_map_ros.stream.memory`` for the same settings.

Budgets: for a budget of B GiB the allocator is capped at B - ``--context-gib`` GiB
(``torch.cuda.set_per_process_memory_fraction``; the rest stands for the CUDA context,
kernel images and libraries, which the allocator does not count), and candidate settings
are tried in order of preference (larger window, bf16 K/V, full resolution first; each
first checked with the estimate against the cap); the first that streams without running
out of memory is the budget's setting. Sweeps (``--windows``, ``--resolutions``,
``--fp8-windows``, ``--scale-frames``) run without a cap. Results are written after every
run (a run cut short by a time limit loses only itself).

``--accuracy N``: N frames through fp32 (SDPA), bf16 (the backend) and bf16 with FP8 K/V
on the same frames and weights; the deviation of each from fp32
(``stream.precision.deviation``).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import run_record  # noqa: E402
from stream_fps import frames_iter  # noqa: E402
from lingbot_map_ros.config import ModelConfig, StreamConfig  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.stream.memory import GIB, estimate_memory  # noqa: E402
from lingbot_map_ros.stream.precision import deviation  # noqa: E402
from lingbot_map_ros.stream.session import StreamingSession  # noqa: E402

# (width, height, kv_cache_dtype, sliding_window, keyframe_interval, num_scale_frames, max_pending_evictions)
# in order of preference: the released resolution and window first, K/V in fp8 before a shorter
# window, a shorter window (covering the same time with a keyframe every 2nd frame) before a lower resolution
CANDIDATES = (
    (518, 378, "auto", 64, 1, 8, 8),
    (518, 378, "fp8", 64, 1, 8, 8),
    (518, 378, "auto", 32, 2, 8, 8),
    (518, 378, "fp8", 32, 2, 8, 8),
    (518, 378, "fp8", 16, 4, 8, 0),
    (518, 294, "fp8", 16, 4, 8, 0),
    (392, 294, "fp8", 32, 2, 8, 0),
    (392, 294, "fp8", 16, 4, 4, 0),
    (280, 210, "fp8", 16, 4, 4, 0),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="flashinfer-fa3")
    p.add_argument("--budgets", default="", help="GiB, comma-separated (e.g. 8,12,16,24)")
    p.add_argument("--context-gib", type=float, default=1.0, help="of a budget, left outside the allocator's cap")
    p.add_argument("--windows", default="", help="sliding windows of the sweep at 518x378 (bf16 K/V)")
    p.add_argument("--fp8-windows", default="", help="sliding windows at 518x378 with FP8 K/V")
    p.add_argument("--resolutions", default="", help="WxH of the resolution sweep (window 64)")
    p.add_argument("--scale-frames", default="", help="num_scale_frames values at 518x378, window 64")
    p.add_argument("--timed", type=int, default=20, help="frames timed once the window is full")
    p.add_argument("--accuracy", type=int, default=0, help="frames of the precision comparison (0: none)")
    p.add_argument("--fixture", default="", help="accuracy on this fixture set (weights, config, frames)")
    p.add_argument("--fp8-gemm", action="store_true", help="last: convert the model to FP8 GEMMs and time "
                   "518x378, window 64, with bf16 and FP8 K/V")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def stream_cfg(args, w, h, kv, window, kf, scale, pending, dtype="bf16", backend=None):
    return StreamConfig(num_scale_frames=scale, sliding_window=window, keyframe_interval=kf,
                        max_pending_evictions=pending, backend=backend or args.backend, dtype=dtype, device="cuda",
                        cuda_graphs=not args.no_cuda_graphs, kv_cache_dtype=kv)


def run_one(model, args, cfg, w, h):
    """Stream until the window is full + ``args.timed`` frames; the run's figures."""
    est = estimate_memory(model.cfg, cfg, h, w)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fill = cfg.num_scale_frames + cfg.sliding_window * cfg.keyframe_interval
    n = fill + args.timed
    times = []
    record = {"width": w, "height": h, "sliding_window": cfg.sliding_window, "num_scale_frames": cfg.num_scale_frames,
              "keyframe_interval": cfg.keyframe_interval, "max_pending_evictions": cfg.max_pending_evictions,
              "kv_cache_dtype": cfg.kv_cache_dtype, "backend": cfg.backend,
              "estimate_gib": round(est.total / GIB, 3), "estimate_parts_gib": {
                  "weights": round(est.weights / GIB, 3), "kv_cache": round(est.kv_cache / GIB, 3),
                  "camera_cache": round(est.camera_cache / GIB, 3), "activations": round(est.activations / GIB, 3)}}
    session = None
    t_start = time.perf_counter()
    try:
        session = StreamingSession(model, cfg)
        for i, frame in enumerate(frames_iter(n, h, w, args.seed + 1, "cuda")):
            t = time.perf_counter()
            session.push(frame)
            torch.cuda.synchronize()
            if i >= fill:
                times.append((time.perf_counter() - t) * 1e3)
        record.update(ok=True, median_ms=round(statistics.median(times), 3),
                      fps=round(1e3 / statistics.median(times), 2), backend=session.backend.name,
                      graph_replays=0 if session._runner.graphed is None else session._runner.graphed.replays)
    except torch.OutOfMemoryError as exc:
        record.update(ok=False, error="out of memory: " + str(exc).split("\n")[0][:200])
    except Exception as exc:  # a benchmark: record and go on
        record.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    finally:
        del session
        gc.collect()
    record.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 3),
                  peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 3),
                  wall_s=round(time.perf_counter() - t_start, 1))
    torch.cuda.empty_cache()
    print(json.dumps(record), flush=True)
    return record


def accuracy(args, cfg_model, result, save):
    """fp32 (SDPA) as the reference, then bf16, bf16 + FP8 K/V, FP8 GEMMs, FP8 GEMMs + FP8 K/V on the
    same frames and weights: the released architecture with random weights (``--accuracy`` frames
    at 518x378) or (``--fixture DIR``) the tiny fixture's weights on its frames, played forwards
    and backwards to ``--accuracy`` frames."""
    n = args.accuracy
    if args.fixture:
        import numpy as np

        fixture = Path(args.fixture)
        cfg_model = ModelConfig.from_dict(json.loads((fixture / "config.json").read_text()))
        base = StreamConfig.from_dict(json.loads((fixture / "config.json").read_text()))
        images = torch.from_numpy(np.load(fixture / "reference_kf1.npz")["images"])
        order = [i % len(images) if (i // len(images)) % 2 == 0 else len(images) - 1 - i % len(images)
                 for i in range(n)]
        frames = lambda: (images[i].cuda() for i in order)  # noqa: E731
        weights = fixture / "weights.safetensors"
        shape = tuple(images.shape[-2:])
    else:
        base = StreamConfig(num_scale_frames=8, sliding_window=64)
        frames = lambda: frames_iter(n, 378, 518, args.seed + 2, "cuda")  # noqa: E731
        weights = None
        shape = (378, 518)
    result["accuracy_setting"] = {"frames": n, "resolution": list(shape), "backend": args.backend,
                                  "num_scale_frames": base.num_scale_frames, "sliding_window": base.sliding_window,
                                  "weights": str(weights) if weights else f"random (seed {args.seed})"}
    variants = (("fp32", "fp32", "sdpa", "auto", "bf16"), ("bf16", "bf16", args.backend, "auto", "bf16"),
                ("bf16+fp8_kv", "bf16", args.backend, "fp8", "bf16"),
                ("fp8_gemm", "bf16", args.backend, "auto", "fp8"),
                ("fp8_gemm+fp8_kv", "bf16", args.backend, "fp8", "fp8"))
    outs, models = {}, {}
    for name, dtype, backend, kv, precision in variants:
        key = (dtype, precision)
        if key not in models:
            models.clear()
            gc.collect()
            torch.cuda.empty_cache()
            models[key] = load_model(cfg_model, weights, "cuda", dtype, seed=args.seed)
        cfg = base.with_overrides(backend=backend, dtype=dtype, device="cuda", kv_cache_dtype=kv, precision=precision,
                                  cuda_graphs=not args.no_cuda_graphs)
        session = StreamingSession(models[key], cfg)
        res = []
        t = time.perf_counter()
        for frame in frames():
            res += session.push(frame)
        print(f"accuracy: {name} {n} frames in {time.perf_counter() - t:.1f} s", flush=True)
        outs[name] = res
        del session
        if name != "fp32":
            result["accuracy"][name + "_vs_fp32"] = deviation(outs["fp32"], res)
            save()
    return result


def main(argv=None):
    args = parse_args(argv)
    total = torch.cuda.get_device_properties(0).total_memory
    cfg_model = ModelConfig()
    result = {"gpu": torch.cuda.get_device_name(), "total_gib": round(total / GIB, 2),
              "context_gib": args.context_gib, "model": "released architecture, random weights",
              "timing": "one frame at a time (push + synchronize), median over --timed frames once the window is full",
              "budgets": {}, "sweeps": [], "accuracy": {},
              "run": run_record([__file__] + list(sys.argv[1:] if argv is None else argv))}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)

    if args.accuracy:
        accuracy(args, cfg_model, result, save)
        save()
        return 0
    model = load_model(cfg_model, None, "cuda", "bf16", seed=args.seed)
    for budget in ints(args.budgets):
        cap = (budget - args.context_gib) * GIB
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        tried = []
        for w, h, kv, window, kf, scale, pending in CANDIDATES:
            cfg = stream_cfg(args, w, h, kv, window, kf, scale, pending)
            est = estimate_memory(cfg_model, cfg, h, w).total
            if est > cap:
                tried.append({"width": w, "height": h, "kv_cache_dtype": kv, "sliding_window": window,
                              "skipped": f"estimate {est / GIB:.2f} GiB > cap {cap / GIB:.2f} GiB"})
                continue
            rec = run_one(model, args, cfg, w, h)
            tried.append(rec)
            if rec["ok"]:
                break
        result["budgets"][str(budget)] = {"allocator_cap_gib": round(cap / GIB, 2), "tried": tried,
                                          "chosen": tried[-1] if tried and tried[-1].get("ok") else None}
        save()
    torch.cuda.set_per_process_memory_fraction(1.0)
    sweeps = [("window", (518, 378, "auto", wnd, 1, 8, 8)) for wnd in ints(args.windows)]
    sweeps += [("fp8_window", (518, 378, "fp8", wnd, 1, 8, 8)) for wnd in ints(args.fp8_windows)]
    for text in [t for t in args.resolutions.split(",") if t.strip()]:
        w, h = (int(x) for x in text.lower().split("x"))
        sweeps.append(("resolution", (w, h, "auto", 64, 1, 8, 8)))
    sweeps += [("scale_frames", (518, 378, "auto", 64, 1, s, 8)) for s in ints(args.scale_frames)]
    for kind, (w, h, kv, window, kf, scale, pending) in sweeps:
        rec = run_one(model, args, stream_cfg(args, w, h, kv, window, kf, scale, pending), w, h)
        rec["sweep"] = kind
        result["sweeps"].append(rec)
        save()
    if args.fp8_gemm:  # converts the model in place: last
        for kv in ("auto", "fp8"):
            cfg = replace(stream_cfg(args, 518, 378, kv, 64, 1, 8, 8), precision="fp8")
            rec = run_one(model, args, cfg, 518, 378)
            rec.update(sweep="fp8_gemm", precision="fp8")
            result["sweeps"].append(rec)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
