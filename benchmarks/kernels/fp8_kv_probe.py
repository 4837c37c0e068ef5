"""Can FlashInfer (as carried: 0.6.18) attend over FP8 K/V pages itself, and at what error and speed?

    python benchmarks/kernels/fp8_kv_probe.py [--pages 75]

One global-attention call of the released model at 518x378 (q = 1005 tokens, keys = ``--pages``
pages of 999, 16 heads x 64), random q/k/v: FlashInfer's paged prefill with bf16 queries and
float8_e4m3fn K/V (one scale per tensor, FlashInfer's only form: ``k_scale``/``v_scale`` of
``run``) for backends fa2 and fa3, against bf16 K/V and an fp32 reference; and the project's
route (``cache.fp8``: per-row scales, the layer dequantised into a bf16 buffer, then the bf16
kernel). Prints one JSON line per variant (a compile failure is recorded, not raised).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from lingbot_map_ros.cache.fp8 import FP8, dequantize, quantize_rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=75)
    args = p.parse_args(argv)
    import flashinfer

    dev = torch.device("cuda")
    ps, heads, dim, qo = 999, 16, 64, 1005
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(qo, heads, dim, device=dev, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(args.pages, ps, heads, dim, device=dev, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(args.pages, ps, heads, dim, device=dev, generator=gen, dtype=torch.bfloat16)
    kv_len = args.pages * ps
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.view(-1, heads, dim).float().transpose(0, 1)[None],
        v.view(-1, heads, dim).float().transpose(0, 1)[None])[0].transpose(0, 1)
    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)
    indptr = torch.tensor([0, qo], dtype=torch.int32)
    kv_indptr = torch.tensor([0, args.pages], dtype=torch.int32)
    indices = torch.arange(args.pages, dtype=torch.int32, device=dev)
    last = torch.tensor([ps], dtype=torch.int32)

    def timed(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / reps * 1e3

    def report(name, out, us, extra=None):
        err = float((out.float() - ref).abs().max())
        print(json.dumps({"variant": name, "us": round(us, 1), "max_abs_err": err,
                          "rel_to_max_out": err / float(ref.abs().max()), **(extra or {})}), flush=True)

    for backend in ("fa2", "fa3"):
        for kv_dtype in (torch.bfloat16, FP8):
            name = f"flashinfer {backend} paged, K/V {str(kv_dtype).split('.')[-1]}"
            try:
                t0 = time.perf_counter()
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend=backend)
                w.plan(indptr, kv_indptr, indices, last, heads, heads, dim, ps, causal=False,
                       q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
                if kv_dtype == FP8:  # one scale per tensor
                    ks, vs = float(k.abs().max()) / 448, float(v.abs().max()) / 448
                    k8, v8 = (k.float() / ks).to(FP8), (v.float() / vs).to(FP8)
                    fn = lambda: w.run(q, (k8, v8), k_scale=ks, v_scale=vs)  # noqa: E731
                else:
                    fn = lambda: w.run(q, (k, v))  # noqa: E731
                out = fn()
                torch.cuda.synchronize()
                report(name, out, timed(fn), {"first_call_s": round(time.perf_counter() - t0, 1)})
            except Exception as exc:  # noqa: BLE001 - a probe: record the failure
                print(json.dumps({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
    # the project's route: per-row scales, dequantise the pages into bf16, then the bf16 fa2 kernel
    try:
        k8, ksc = quantize_rows(k, torch.bfloat16)
        v8, vsc = quantize_rows(v, torch.bfloat16)
        rk, rv = torch.empty_like(k), torch.empty_like(v)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend="fa2")
        w.plan(indptr, kv_indptr, indices, last, heads, heads, dim, ps, causal=False,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

        def route():
            dequantize(k8, ksc, rk)
            dequantize(v8, vsc, rv)
            return w.run(q, (rk, rv))

        out = route()
        report("cache.fp8 route: per-row scales, dequantise + fa2 bf16", out, timed(route),
               {"dequantise_us": round(timed(lambda: (dequantize(k8, ksc, rk), dequantize(v8, vsc, rv))), 1),
                "kv_tokens": kv_len})
    except Exception as exc:  # noqa: BLE001
        print(json.dumps({"variant": "cache.fp8 route", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
