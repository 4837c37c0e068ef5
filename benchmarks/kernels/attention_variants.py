"""Attention kernels at the released model's shapes (518x378: 1005 tokens per frame, 16 heads x 64).

    python benchmarks/kernels/attention_variants.py [--kv-frames 73] [--special 1800]

Global attention (one frame's queries over the window's keys) as:
  * FlashInfer FA3 over the paged pool (what the step runs now; pages of 999 tokens),
  * FlashInfer FA3 over contiguous ("ragged") keys, which loads K/V with TMA,
  * cuDNN through PyTorch's SDPA on contiguous keys,
each with 1..N key splits merged by log-sum-exp; and per-frame attention
(1005 x 1005, q/k/v as the frame and DINO blocks hold them) as PyTorch SDPA on the
strided views (what runs now, layout copies included), on contiguous tensors, and as
FlashInfer FA3 ragged on the strided views. CUDA-event medians; the largest difference
from an fp32 reference. A benchmark aid for deciding what to build; nothing is asserted.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from lingbot_map_ros.kernels.merge import merge_states
from micro_levers import timed  # benchmarks/kernels/ is the script's directory

H, D, PS = 16, 64, 999


def reference(q, k, v):
    """fp32 attention, chunked over the keys (q [N,H,D], k/v [M,H,D])."""
    qf = q.float().transpose(0, 1)
    m = torch.full((H, q.shape[0], 1), float("-inf"), device=q.device)
    den = torch.zeros(H, q.shape[0], 1, device=q.device)
    acc = torch.zeros(H, q.shape[0], D, device=q.device)
    for c in range(0, k.shape[0], 8192):
        kc, vc = k[c:c + 8192].float().transpose(0, 1), v[c:c + 8192].float().transpose(0, 1)
        s = qf @ kc.transpose(1, 2) / D ** 0.5
        mn = torch.maximum(m, s.amax(-1, keepdim=True))
        scale = torch.exp(m - mn)
        p = torch.exp(s - mn)
        den = den * scale + p.sum(-1, keepdim=True)
        acc = acc * scale + p @ vc
        m = mn
    return (acc / den).transpose(0, 1)


def report(name, us, out, ref):
    err = (out.float() - ref).abs().max().item()
    print(f"{name:64s} {us:8.1f} us   max |diff| vs fp32 {err:.3g}", flush=True)


def splits_of(total, s):
    base, extra = divmod(total, s)
    return [base + (1 if i < extra else 0) for i in range(s)]


def quantize_per_head(x):
    """bf16 [N, H, D] -> (e4m3 [N, H, D], float32 scale [H]) with amax / 448 per head."""
    scale = (x.float().abs().amax(dim=(0, 2)) / 448.0).clamp_min(1e-12)
    return (x.float() / scale[None, :, None]).to(torch.float8_e4m3fn), scale


def tail_rows(flashinfer, ws, q, k_pool, v_pool, kv, pages, last, ref, split_list):
    """FA3 computes whole 192-query tiles: 1005 queries cost 6 tiles (1152 rows). Here the
    first 960 (5 tiles) go to FA3 ragged with S key splits and the last 45 to FlashInfer's
    FA2 kernel (16/64-query tiles, its own key splits), each writing its rows of one output."""
    bf16, dev = torch.bfloat16, q.device
    qo = q.shape[0]
    main = qo // 192 * 192
    t = qo - main
    kc, vc = k_pool[:kv], v_pool[:kv]
    k_pages, v_pages = k_pool.view(pages, PS, H, D), v_pool.view(pages, PS, H, D)
    ws2 = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
    out = torch.empty(qo, H, D, device=dev, dtype=bf16)
    q_tail = q[main:].contiguous()
    fa2 = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws2, kv_layout="NHD", backend="fa2")
    fa2.plan(torch.tensor([0, t], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
             torch.arange(pages, dtype=torch.int32, device=dev), torch.tensor([last], dtype=torch.int32), H, H, D,
             PS, causal=False, q_data_type=bf16, kv_data_type=bf16)

    def run_fa2_paged():
        return fa2.run(q_tail, (k_pages, v_pages), out=out[main:])

    report(f"FA2 paged, the {t} tail queries alone", timed(run_fa2_paged), run_fa2_paged(), ref[main:])
    fa2r = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws2, kv_layout="NHD", backend="fa2")
    fa2r.plan(torch.tensor([0, t], dtype=torch.int32), torch.tensor([0, kv], dtype=torch.int32), H, H, D,
              causal=False, q_data_type=bf16, kv_data_type=bf16)

    def run_fa2_ragged():
        return fa2r.run(q_tail, kc, vc, out=out[main:])

    report(f"FA2 ragged, the {t} tail queries alone", timed(run_fa2_ragged), run_fa2_ragged(), ref[main:])
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend="fa3")
    for s in split_list:
        counts = splits_of(kv, s)
        kv_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        o = torch.empty(s, qo, H, D, device=dev, dtype=bf16)
        lse = torch.empty(s, qo, H, device=dev)
        q_rep = q.unsqueeze(0).expand(s, -1, -1, -1).contiguous()
        # (a) now: all qo queries per split
        ragged.plan(torch.arange(s + 1, dtype=torch.int32) * qo, kv_indptr, H, H, D, causal=False,
                    q_data_type=bf16, kv_data_type=bf16)

        def run_all():
            ragged.run(q_rep.view(-1, H, D), kc, vc, out=o.view(-1, H, D), lse=lse.view(-1, H), return_lse=True)
            return merge_states(o, lse, out)

        report(f"FA3 ragged, {qo} queries, {s} splits + merge (now)", timed(run_all), run_all(), ref)
        # main queries only (contiguous copies), FA2 tail
        qm = q[:main].unsqueeze(0).expand(s, -1, -1, -1).contiguous()
        om = torch.empty(s, main, H, D, device=dev, dtype=bf16)
        lm = torch.empty(s, main, H, device=dev)
        ragged.plan(torch.arange(s + 1, dtype=torch.int32) * main, kv_indptr, H, H, D, causal=False,
                    q_data_type=bf16, kv_data_type=bf16)

        def run_main_only():
            ragged.run(qm.view(-1, H, D), kc, vc, out=om.view(-1, H, D), lse=lm.view(-1, H), return_lse=True)
            return merge_states(om, lm, out[:main])

        report(f"FA3 ragged, {main} queries only, {s} splits + merge", timed(run_main_only), run_main_only(),
               ref[:main])

        def run_main_fa2():
            run_main_only()
            fa2.run(q_tail, (k_pages, v_pages), out=out[main:])
            return out

        report("  + FA2 paged tail (same stream)", timed(run_main_fa2), run_main_fa2(), ref)


def fp8_rows(flashinfer, ws, q, k, v, ref, split_list):
    """FA3 ragged with e4m3 q/k/v (P quantised in the kernel too); errors against the fp32
    attention of the unquantised bf16 inputs, also relative to the output's largest value.
    Then the same with 4x sharper attention logits (q x 4), where quantisation bites more."""
    bf16 = torch.bfloat16
    qo, kv = q.shape[0], k.shape[0]
    kq, sk = quantize_per_head(k)
    vq, sv = quantize_per_head(v)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend="fa3")
    for sharp in (1.0, 4.0):
        qs = (q.float() * sharp).to(bf16)
        qq, sq = quantize_per_head(qs)
        ref_s = ref if sharp == 1.0 else reference(qs, k, v)
        top = ref_s.abs().max().item()
        for s in split_list:
            counts = splits_of(kv, s)
            qo_indptr = torch.arange(s + 1, dtype=torch.int32) * qo
            kv_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            try:
                ragged.plan(qo_indptr, kv_indptr, H, H, D, causal=False, q_data_type=torch.float8_e4m3fn,
                            kv_data_type=torch.float8_e4m3fn, o_data_type=bf16)
            except Exception as exc:  # noqa: BLE001 - a probe
                print(f"FP8 ragged plan: {type(exc).__name__}: {exc}")
                return
            q_rep = qq.unsqueeze(0).expand(s, -1, -1, -1).contiguous()
            o = torch.empty(s, qo, H, D, device=q.device, dtype=bf16)
            lse = torch.empty(s, qo, H, device=q.device)
            out = torch.empty(qo, H, D, device=q.device, dtype=bf16)

            def run_fp8():
                ragged.run(q_rep.view(-1, H, D), kq, vq, sq, sk, sv, out=o.view(-1, H, D), lse=lse.view(-1, H),
                           return_lse=True)
                return merge_states(o, lse, out) if s > 1 else o[0]

            try:
                res = run_fp8()
            except Exception as exc:  # noqa: BLE001 - a probe
                print(f"FP8 ragged run: {type(exc).__name__}: {exc}")
                return
            err = (res.float() - ref_s).abs().max().item()
            print(f"{f'FP8 FA3 ragged, q x{sharp:g}, {s} splits + merge':64s} {timed(run_fp8):8.1f} us   "
                  f"max |diff| vs fp32 {err:.3g} ({err / top:.3g} of max |out| {top:.3g})", flush=True)
        # the bf16 kernel on the same inputs, for the relative error
        ragged.plan(torch.tensor([0, qo], dtype=torch.int32), torch.tensor([0, kv], dtype=torch.int32), H, H, D,
                    causal=False, q_data_type=bf16, kv_data_type=bf16)
        ob = ragged.run(qs, k, v)
        err = (ob.float() - ref_s).abs().max().item()
        print(f"{f'bf16 FA3 ragged, q x{sharp:g}, 1 split':64s} {timed(lambda: ragged.run(qs, k, v)):8.1f} us   "
              f"max |diff| vs fp32 {err:.3g} ({err / top:.3g} of max |out| {top:.3g})", flush=True)


def main() -> int:
    global PS
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-frames", type=int, default=73)
    ap.add_argument("--special", type=int, default=1800)
    ap.add_argument("--splits", default="1,4,6,8,11,12,16")
    ap.add_argument("--skip-ragged", action="store_true")
    ap.add_argument("--page", type=int, default=PS, help="tokens per frame (999 at 518x378, 777 at 518x294)")
    ap.add_argument("--tail-only", action="store_true",
                    help="only the query-tail rows: FA3 on whole 192-query tiles, FA2 on the rest")
    ap.add_argument("--fp8-only", action="store_true",
                    help="only the FP8 (e4m3) ragged FA3 rows: q/k/v quantised with per-head scales")
    args = ap.parse_args()
    PS = args.page
    if not torch.cuda.is_available():
        print("attention_variants: CUDA required", file=sys.stderr)
        return 2
    import flashinfer

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    qo = PS + 6
    kv = args.kv_frames * PS + args.special
    pages = -(-kv // PS)
    last = kv - (pages - 1) * PS
    k_pool = torch.randn(pages * PS, H, D, device=dev, dtype=bf16)
    v_pool = torch.randn(pages * PS, H, D, device=dev, dtype=bf16)
    q = torch.randn(qo, H, D, device=dev, dtype=bf16)
    ref = reference(q, k_pool[:kv], v_pool[:kv])
    split_list = [int(x) for x in args.splits.split(",")]
    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)
    busy = torch.randn(8192, 8192, device=dev, dtype=bf16)
    for _ in range(400):  # bring the clocks up before the first timing
        busy @ busy
    torch.cuda.synchronize()
    print(f"global attention: q {qo} tokens, kv {kv} tokens ({pages} pages of {PS}), {H} heads x {D}")

    # ---- FA3 paged (now)
    def paged_set(splits):
        k_pages, v_pages = k_pool.view(pages, PS, H, D), v_pool.view(pages, PS, H, D)
        paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend="fa3")
        for s in splits:
            if s > pages:
                continue
            counts = splits_of(pages, s)
            qo_indptr = torch.arange(s + 1, dtype=torch.int32) * qo
            kv_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            last_len = torch.full((s,), PS, dtype=torch.int32)
            last_len[-1] = last
            paged.plan(qo_indptr, kv_indptr, torch.arange(pages, dtype=torch.int32, device=dev), last_len, H, H, D,
                       PS, causal=False, q_data_type=bf16, kv_data_type=bf16)
            q_rep = q.unsqueeze(0).expand(s, -1, -1, -1).contiguous()
            o = torch.empty(s, qo, H, D, device=dev, dtype=bf16)
            lse = torch.empty(s, qo, H, device=dev)
            out = torch.empty(qo, H, D, device=dev, dtype=bf16)

            def run_paged():
                paged.run(q_rep.view(-1, H, D), (k_pages, v_pages), out=o.view(-1, H, D), lse=lse.view(-1, H),
                          return_lse=True)
                return merge_states(o, lse, out) if s > 1 else o[0]

            report(f"FA3 paged (page 999), {s} splits + merge", timed(run_paged), run_paged(), ref)

    if args.tail_only:
        tail_rows(flashinfer, ws, q, k_pool, v_pool, kv, pages, last, ref, split_list)
        return 0
    if args.fp8_only:
        fp8_rows(flashinfer, ws, q, k_pool[:kv], v_pool[:kv], ref, split_list)
        return 0
    paged_set(split_list)

    # ---- FA3 ragged (contiguous K/V, TMA loads)
    if not args.skip_ragged:
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend="fa3")
        kc, vc = k_pool[:kv], v_pool[:kv]
        for s in split_list:
            counts = splits_of(kv, s)
            qo_indptr = torch.arange(s + 1, dtype=torch.int32) * qo
            kv_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            ragged.plan(qo_indptr, kv_indptr, H, H, D, causal=False, q_data_type=bf16, kv_data_type=bf16)
            q_rep = q.unsqueeze(0).expand(s, -1, -1, -1).contiguous()
            o = torch.empty(s, qo, H, D, device=dev, dtype=bf16)
            lse = torch.empty(s, qo, H, device=dev)
            out = torch.empty(qo, H, D, device=dev, dtype=bf16)

            def run_ragged():
                ragged.run(q_rep.view(-1, H, D), kc, vc, out=o.view(-1, H, D), lse=lse.view(-1, H), return_lse=True)
                return merge_states(o, lse, out) if s > 1 else o[0]

            report(f"FA3 ragged (contiguous), {s} splits + merge", timed(run_ragged), run_ragged(), ref)
        # gaps: a zero-query request over keys that must be skipped
        try:
            gap = 5000
            qo_indptr = torch.tensor([0, qo, qo, 2 * qo], dtype=torch.int32)
            kv_indptr = torch.tensor([0, kv // 2, kv // 2 + gap, kv + gap], dtype=torch.int32)
            kg = torch.cat([k_pool[:kv // 2], torch.full((gap, H, D), 30.0, device=dev, dtype=bf16),
                            k_pool[kv // 2:kv]])
            vg = torch.cat([v_pool[:kv // 2], torch.full((gap, H, D), 30.0, device=dev, dtype=bf16),
                            v_pool[kv // 2:kv]])
            ragged.plan(qo_indptr, kv_indptr, H, H, D, causal=False, q_data_type=bf16, kv_data_type=bf16)
            q_rep = q.unsqueeze(0).expand(2, -1, -1, -1).contiguous()
            o = torch.empty(2, qo, H, D, device=dev, dtype=bf16)
            lse = torch.empty(2, qo, H, device=dev)
            out = torch.empty(qo, H, D, device=dev, dtype=bf16)

            def run_gap():
                ragged.run(q_rep.view(-1, H, D), kg, vg, out=o.view(-1, H, D), lse=lse.view(-1, H), return_lse=True)
                return merge_states(o, lse, out)

            report("FA3 ragged, 2 runs around a 5000-key gap (0-query request)", timed(run_gap), run_gap(), ref)
            # the same plus two empty requests (0 queries, 0 keys) as padding to a fixed count
            ragged.plan(torch.tensor([0, qo, qo, 2 * qo, 2 * qo, 2 * qo], dtype=torch.int32),
                        torch.tensor([0, kv // 2, kv // 2 + gap, kv + gap, kv + gap, kv + gap], dtype=torch.int32),
                        H, H, D, causal=False, q_data_type=bf16, kv_data_type=bf16)
            report("FA3 ragged, gap + 2 empty padding requests", timed(run_gap), run_gap(), ref)
        except Exception as exc:  # noqa: BLE001 - a probe
            print(f"FA3 ragged with a 0-query request: {type(exc).__name__}: {exc}")

    # ---- cuDNN SDPA on contiguous keys (batch = splits)
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    for s in split_list:
        chunk = kv // s
        kk = k_pool[:chunk * s].view(s, chunk, H, D).transpose(1, 2)
        vv = v_pool[:chunk * s].view(s, chunk, H, D).transpose(1, 2)
        qq = q.unsqueeze(0).expand(s, -1, -1, -1).contiguous().transpose(1, 2)
        o_m = torch.empty(s, qo, H, D, device=dev, dtype=bf16)
        out = torch.empty(qo, H, D, device=dev, dtype=bf16)
        ref_s = ref if chunk * s == kv else reference(q, k_pool[:chunk * s], v_pool[:chunk * s])

        def run_cudnn():
            res = cudnn(qq, kk, vv, None, s > 1, 0.0, False, False)
            o_b, lse_b = res[0], res[1]  # [s, H, qo, D], [s, H, qo] (natural log)
            if s == 1:
                return o_b[0].transpose(0, 1)
            o_m.copy_(o_b.transpose(1, 2))
            lse2 = (lse_b.reshape(s, H, qo).float() * 1.4426950408889634).transpose(1, 2).contiguous()
            return merge_states(o_m, lse2, out)

        try:
            report(f"cuDNN SDPA (contiguous), {s} splits (+ layout copy, merge)", timed(run_cudnn), run_cudnn(),
                   ref_s)
        except Exception as exc:  # noqa: BLE001 - a probe
            print(f"cuDNN SDPA {s} splits: {type(exc).__name__}: {exc}")

    print("again, after the others (clock drift check):")
    paged_set([4, 8])

    # ---- per-frame attention (1005 x 1005)
    print(f"frame attention: {qo} x {qo} tokens, {H} heads x {D}")
    qkv = torch.randn(qo, 3 * H * D, device=dev, dtype=bf16)
    qv, kv_, vv = qkv.view(qo, 3, H, D).unbind(1)
    qc, kc, vc = qv.contiguous(), kv_.contiguous(), vv.contiguous()
    ref_f = reference(qv, kv_, vv)

    def sdpa_nhd(a, b, c):
        return F.scaled_dot_product_attention(a.transpose(-3, -2), b.transpose(-3, -2),
                                              c.transpose(-3, -2)).transpose(-3, -2)

    report("SDPA, q/k/v strided views of qkv (DINO now), + flatten",
           timed(lambda: sdpa_nhd(qv[None], kv_[None], vv[None]).flatten(-2)),
           sdpa_nhd(qv[None], kv_[None], vv[None])[0], ref_f)
    report("SDPA, q/k contiguous, v strided (frame blocks now), + flatten",
           timed(lambda: sdpa_nhd(qc[None], kc[None], vv[None]).flatten(-2)),
           sdpa_nhd(qc[None], kc[None], vv[None])[0], ref_f)
    report("SDPA, q/k/v contiguous NHD, + flatten",
           timed(lambda: sdpa_nhd(qc[None], kc[None], vc[None]).flatten(-2)),
           sdpa_nhd(qc[None], kc[None], vc[None])[0], ref_f)
    qh, kh, vh = (t.transpose(0, 1).contiguous()[None] for t in (qv, kv_, vv))
    report("SDPA, q/k/v contiguous BHND (kernel alone, no flatten)",
           timed(lambda: F.scaled_dot_product_attention(qh, kh, vh)),
           F.scaled_dot_product_attention(qh, kh, vh)[0].transpose(0, 1), ref_f)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        sdpa_nhd(qv[None], kv_[None], vv[None]).flatten(-2)
        torch.cuda.synchronize()
    names = [e.name[:70] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"  kernels of one strided-view SDPA + flatten: {len(names)}: {names}")
    if not args.skip_ragged:
        fr = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend="fa3")
        fr.plan(torch.tensor([0, qo], dtype=torch.int32), torch.tensor([0, qo], dtype=torch.int32), H, H, D,
                causal=False, q_data_type=bf16, kv_data_type=bf16)
        of = torch.empty(qo, H, D, device=dev, dtype=bf16)
        try:
            report("FA3 ragged on the strided qkv views (out contiguous)",
                   timed(lambda: fr.run(qv, kv_, vv, out=of)), fr.run(qv, kv_, vv, out=of), ref_f)
        except Exception as exc:  # noqa: BLE001
            print(f"FA3 ragged strided: {type(exc).__name__}: {exc}")
        report("FA3 ragged on contiguous q/k/v", timed(lambda: fr.run(qc, kc, vc, out=of)), fr.run(qc, kc, vc, out=of),
               ref_f)
        # 8 frames at once (phase 1): batch of 8 requests
        q8 = torch.randn(8 * qo, 3 * H * D, device=dev, dtype=bf16).view(8 * qo, 3, H, D)
        ind = torch.arange(9, dtype=torch.int32) * qo
        fr.plan(ind, ind, H, H, D, causal=False, q_data_type=bf16, kv_data_type=bf16)
        o8 = torch.empty(8 * qo, H, D, device=dev, dtype=bf16)
        us8 = timed(lambda: fr.run(q8[:, 0], q8[:, 1], q8[:, 2], out=o8))
        r8 = sdpa_nhd(q8[:, 0].view(8, qo, H, D), q8[:, 1].view(8, qo, H, D), q8[:, 2].view(8, qo, H, D))
        print(f"{'FA3 ragged, 8 frames strided (phase 1)':64s} {us8:8.1f} us   max |diff| vs SDPA "
              f"{(fr.run(q8[:, 0], q8[:, 1], q8[:, 2], out=o8).view(8, qo, H, D).float() - r8.float()).abs().max():.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
