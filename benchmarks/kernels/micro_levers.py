"""Micro-benchmarks of candidate speed levers at the released model's shapes (518x378).

    python benchmarks/kernels/micro_levers.py

Each line: a PyTorch op as the step runs it now against an alternative, CUDA-event
median over 200 calls, and the largest difference of the outputs. A benchmark aid for
deciding what to build, not a test; nothing is asserted.
"""
from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from lingbot_map_ros.kernels.upsample import upsample_bilinear


def timed(fn, reps=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times) * 1e3  # us


def line(name, base_fn, alt_fn):
    tb, ta = timed(base_fn), timed(alt_fn)
    diff = (base_fn().float() - alt_fn().float()).abs().max().item()
    print(f"{name:58s} now {tb:8.1f} us   alt {ta:8.1f} us   max |diff| {diff:.3g}")


def main() -> int:
    if not torch.cuda.is_available():
        print("micro_levers: CUDA required", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    # fc1 + exact GELU (two kernels) vs cuBLASLt's GELU epilogue (tanh approximation)
    x = torch.randn(1005, 1024, device=dev, dtype=bf16)
    w = torch.randn(4096, 1024, device=dev, dtype=bf16) * 0.03
    b = torch.randn(4096, device=dev, dtype=bf16) * 0.1
    line("fc1+gelu: linear, gelu  |  _addmm_activation(gelu)",
         lambda: F.gelu(F.linear(x, w, b)), lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
    # bilinear upsampling (align_corners) in channels-last bf16 vs contiguous NCHW
    for c, hw, size in ((256, (108, 148), (216, 296)), (128, (216, 296), (378, 518))):
        t = torch.randn(1, c, *hw, device=dev, dtype=bf16).contiguous(memory_format=torch.channels_last)
        tc = t.contiguous()
        line(f"upsample {c}x{hw}->{size}: NHWC  |  NCHW",
             lambda: F.interpolate(t, size=size, mode="bilinear", align_corners=True),
             lambda: F.interpolate(tc, size=size, mode="bilinear", align_corners=True))
        line(f"upsample {c}x{hw}->{size}: NHWC  |  NCHW incl. both layout copies",
             lambda: F.interpolate(t, size=size, mode="bilinear", align_corners=True),
             lambda: F.interpolate(t.contiguous(), size=size, mode="bilinear", align_corners=True).contiguous(
                 memory_format=torch.channels_last))
        line(f"upsample {c}x{hw}->{size}: NHWC  |  Triton NHWC kernel",
             lambda: F.interpolate(t, size=size, mode="bilinear", align_corners=True),
             lambda: upsample_bilinear(t, size))
    # camera-head matrix-vector products: float32 weights vs bf16 weights
    v = torch.randn(1, 2048, device=dev)
    w32 = torch.randn(6144, 2048, device=dev) * 0.02
    w16 = w32.to(bf16)
    line("camera qkv gemv 2048->6144: fp32 weights  |  bf16 weights",
         lambda: F.linear(v, w32), lambda: F.linear(v.to(bf16), w16))
    return 0


if __name__ == "__main__":
    sys.exit(main())
