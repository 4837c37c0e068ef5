"""``lingbot-map-replay --compare-precision MODE``: how far a lower precision moves the outputs on
the user's own frames.

The selected frames (``--max-frames``, default ``DEFAULT_FRAMES``) are read once, then streamed
through three sessions on the same weights (``--checkpoint``): float32 (SDPA) as the reference,
bf16 (``--backend``), and bf16 with MODE:

* ``fp8``: FP8 GEMMs (``precision fp8``) and FP8 K/V (``kv_cache_dtype fp8``) together;
* ``fp8-kv``: FP8 K/V storage only;
* ``fp8-gemm``: FP8 GEMMs only.

Prints, per output, the deviation of bf16 and of MODE from float32 and of MODE from bf16
(``stream.precision.deviation``: camera-centre difference relative to the trajectory's extent,
rotation difference in degrees, depth and confidence mean absolute difference relative to the
reference's mean). Needs a CUDA device for the bf16 runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

MODES = {"fp8": ("fp8", "fp8"), "fp8-kv": ("fp8", "bf16"), "fp8-gemm": ("auto", "fp8")}  # kv_cache_dtype, precision
DEFAULT_FRAMES = 300
KEYS = ("translation_rel", "rotation_deg", "depth_rel", "confidence_rel")


def run_comparison(args: argparse.Namespace, settings, source, say) -> int:
    """Read the frames, run the three sessions, print the table (and ``--compare-out`` JSON if given)."""
    from dataclasses import replace

    from ..io.checkpoint import load_model
    from ..io.preprocess import model_input
    from ..stream.precision import deviation
    from ..stream.session import StreamingSession

    if not settings.stream.device.startswith("cuda"):
        raise ValueError("--compare-precision runs bf16 and FP8 sessions: give --device cuda")
    limit = args.max_frames or DEFAULT_FRAMES
    images = []
    for frame in source.frames():
        rgb = getattr(frame, "rgb", None)
        if rgb is None:
            continue
        images.append(model_input(rgb, settings.width))
        if len(images) >= limit:
            break
    if len(images) < settings.stream.num_scale_frames:
        raise ValueError(f"{len(images)} frame(s) read, fewer than the {settings.stream.num_scale_frames} scale "
                         "frames the model needs")
    kv, precision = MODES[args.compare_precision]
    runs = (("fp32", "fp32", "sdpa", "auto", "bf16"), ("bf16", "bf16", settings.stream.backend, "auto", "bf16"),
            (args.compare_precision, "bf16", settings.stream.backend, kv, precision))
    outs = {}
    for name, dtype, backend, kv_dtype, prec in runs:
        t0 = time.perf_counter()
        model = load_model(settings.model, args.checkpoint, settings.stream.device, dtype, seed=args.seed)
        cfg = replace(settings.stream, dtype=dtype, backend=backend, kv_cache_dtype=kv_dtype, precision=prec)
        session = StreamingSession(model, cfg, with_depth=not args.no_depth)
        results = []
        for image in images:
            results += session.push(image)
        outs[name] = results
        say(args, f"{name}: {len(images)} frames in {time.perf_counter() - t0:.1f} s")
        del session, model
    table = {"bf16 vs fp32": deviation(outs["fp32"], outs["bf16"]),
             f"{args.compare_precision} vs fp32": deviation(outs["fp32"], outs[args.compare_precision]),
             f"{args.compare_precision} vs bf16": deviation(outs["bf16"], outs[args.compare_precision])}
    print(f"{'comparison':<18}" + "".join(f"{k:>17}" for k in KEYS))
    for name, d in table.items():
        print(f"{name:<18}" + "".join(f"{d[k]:>17.4g}" if k in d else f"{'-':>17}" for k in KEYS))
    worst = max((table[f"{args.compare_precision} vs fp32"][k] / max(table["bf16 vs fp32"][k], 1e-12), k)
                for k in KEYS if k in table["bf16 vs fp32"])
    print(f"{args.compare_precision} deviates from fp32 at most {worst[0]:.2f}x as much as bf16 does ({worst[1]})")
    if getattr(args, "compare_out", None):
        args.compare_out.write_text(json.dumps({"frames": len(images), "mode": args.compare_precision, **table},
                                               indent=1))
    sys.stdout.flush()
    return 0


__all__ = ["run_comparison", "MODES", "DEFAULT_FRAMES"]
