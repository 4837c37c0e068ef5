"""Global attention of one 518x378 frame over a full window, per call, on the non-Hopper kernels.

    python benchmarks/kernels/fa2_class_ab.py [--out result.json]

The pool and plan are those of a full-window step (73 patch pages of 999 tokens, one of
them free and in the middle, then the special stream's pages, the last partial: three
runs of visible keys, ~78k keys) and one frame's 1005 queries, 16 heads x 64, bf16.
Each variant is a backend as the step uses it, in CUDA-graph mode, its calls captured
in one graph (24 calls: a frame's global layers) and replayed; the table gives the
median time per call (CUDA events over the replays), the rate in TFLOP/s
(4 x q x k x heads x dim), and the largest difference from an fp32 reference. Variants:

* FlashInfer FA2 paged (``flashinfer-fa2``) with 1..16 KV splits merged by log-sum-exp;
* FlashInfer FA2 ragged over the runs (FlashInfer's ragged wrapper, ``backend="fa2"``);
* PyTorch's FlashAttention-2 varlen over the runs (backend ``sdpa`` on a GPU,
  ``cache.varlen``) with 1..32 requests;
* the gather + SDPA form of ``sdpa`` (what it did before, eager);
* with ``--fa3``, FlashInfer FA3 (the Hopper path, for scale).
A benchmark aid, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record, write_result  # noqa: E402

from lingbot_map_ros.cache.attention import SdpaBackend  # noqa: E402
from lingbot_map_ros.cache.flashinfer_backend import ragged_requests, visible_runs  # noqa: E402
from lingbot_map_ros.cache.pages import StepPlan  # noqa: E402
from lingbot_map_ros.cache.pool import DevicePlan  # noqa: E402
from lingbot_map_ros.cache.varlen import FlashVarlenBackend  # noqa: E402
from lingbot_map_ros.kernels.merge import merge_states  # noqa: E402

H, D, PS, QO = 16, 64, 999, 1005
LAYERS = 24


def make_plan(special_tokens: int, dev):
    patch = list(range(2, 2 + 73))
    free = patch.pop(40)  # the free page of a full window, somewhere in the middle
    first_special = 2 + 73
    n_special = -(-special_tokens // PS)
    read = patch + list(range(first_special, first_special + n_special))
    last = special_tokens - (n_special - 1) * PS
    num_pages = first_special + n_special + 2
    step = StepPlan(num_frames=1, store=True, phase1=False, first_position=1000, frame_pages=(free,),
                    special_slots=(), read_pages=tuple(read), last_page_len=last, new_pages=(), evict=1,
                    page_size=PS)
    dplan = DevicePlan(plan=step, write_slots=torch.empty(0, dtype=torch.long, device=dev),
                       read_pages=torch.tensor(read, dtype=torch.int32, device=dev), tokens_per_frame=QO)
    return dplan, num_pages


def graph_time(fn, reps=20):
    """Median ms of one call: LAYERS calls captured in one graph, replayed ``reps`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAYERS):
            out = fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(x.elapsed_time(y) for x, y in times) / LAYERS, out


def eager_time(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(x.elapsed_time(y) for x, y in times), out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--special", type=int, default=6000, help="special-stream tokens (6 per stored frame)")
    p.add_argument("--fa3", action="store_true", help="also FlashInfer FA3 (Hopper; ~90 s JIT on a fresh machine)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    dplan, num_pages = make_plan(a.special, dev)
    kv = dplan.plan.kv_len
    k = torch.randn(num_pages, PS, H, D, device=dev).to(torch.bfloat16)
    v = torch.randn(num_pages, PS, H, D, device=dev).to(torch.bfloat16)
    q = torch.randn(QO, H, D, device=dev).to(torch.bfloat16)
    ref_b = SdpaBackend()
    ref_b.begin_step(dplan)
    ref = ref_b.attend(q.float(), k.float(), v.float())
    flops = 4 * QO * kv * H * D
    rows = []

    def add(name, ms, out=None, graphed=True):
        if out is None:  # ms is a callable that times the variant
            try:
                ms, out = ms()
            except Exception as exc:  # a variant that fails is reported, the others still run
                print(f"{name:52s} FAILED: {type(exc).__name__}: {exc}", flush=True)
                rows.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"})
                return
        err = (out.float() - ref).abs().max().item()
        rows.append({"variant": name, "ms_per_call": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                     "max_abs_err_vs_fp32": err, "graphed": graphed})
        print(f"{name:52s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s  max|err| {err:.3g}", flush=True)

    print(f"kv_len {kv}, runs {visible_runs(dplan.plan.read_pages, dplan.plan.last_page_len, PS)}")
    def graphed(make):
        """Time a backend built by ``make()`` (graph mode), planned for the step."""
        def timing():
            be = make()
            be.begin_step(dplan)
            be.prepare(k)
            return graph_time(lambda: be.attend(q, k, v))
        return timing

    for s in (3, 4, 6, 8, 12, 16, 24, 32):
        add(f"torch FA2 varlen over runs, {s} splits", graphed(
            lambda s=s: FlashVarlenBackend(dev, torch.bfloat16, graph_pages=num_pages, kv_splits=s, min_graph_pages=72)))

    def varlen_eager():
        be = FlashVarlenBackend(dev, torch.bfloat16, kv_splits=8)  # eager: exact max_k
        return eager_time(lambda: (be.begin_step(dplan), be.attend(q, k, v))[1])

    add("torch FA2 varlen, 8 splits, eager (exact max_k)", varlen_eager, graphed=False)
    g = SdpaBackend()

    def gather():
        g.begin_step(dplan)
        return g.attend(q, k, v)

    add("sdpa gather (before), eager", lambda: eager_time(gather), graphed=False)
    try:
        import flashinfer  # noqa: F401

        from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend
    except ImportError:
        flashinfer = None
    if flashinfer is not None:
        for s in (1, 2, 4, 8, 16):
            add(f"flashinfer fa2 paged, {s} splits", graphed(
                lambda s=s: FlashInferBackend(dev, "fa2", torch.bfloat16, graph_pages=num_pages, kv_splits=s,
                                              min_graph_pages=72)))
        ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)
        runs = visible_runs(dplan.plan.read_pages, dplan.plan.last_page_len, PS)
        kf, vf = k.view(-1, H, D), v.view(-1, H, D)

        def ragged(s):
            def timing():
                qo, kvi = ragged_requests(runs, s, QO)
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend="fa2")
                w.plan(torch.tensor(qo, dtype=torch.int32), torch.tensor(kvi, dtype=torch.int32), H, H, D,
                       causal=False, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                q_rep = q.unsqueeze(0).expand(s, -1, -1, -1).contiguous()
                o = torch.empty(s, QO, H, D, device=dev, dtype=torch.bfloat16)
                lse = torch.empty(s, QO, H, device=dev)
                out = torch.empty(QO, H, D, device=dev, dtype=torch.bfloat16)

                def run():
                    w.run(q_rep.view(-1, H, D), kf, vf, out=o.view(-1, H, D), lse=lse.view(-1, H), return_lse=True)
                    return merge_states(o, lse, out)
                return graph_time(run)
            return timing

        for s in (3, 8, 16):
            add(f"flashinfer fa2 ragged over runs, {s} splits", ragged(s))
        if a.fa3 and torch.cuda.get_device_capability(dev)[0] == 9:
            add("flashinfer fa3 (Hopper path), auto splits", graphed(
                lambda: FlashInferBackend(dev, "fa3", torch.bfloat16, graph_pages=num_pages, min_graph_pages=10)))
    print(f"{'variant':52s} {'us/call':>8s}")
    for r in sorted((r for r in rows if "error" not in r), key=lambda r: r["ms_per_call"]):
        print(f"{r['variant']:52s} {r['ms_per_call'] * 1e3:8.1f}  {r['tflops']:6.1f} TFLOP/s  {r['max_abs_err_vs_fp32']:.3g}")
    argv = list(sys.argv[1:] if argv is None else argv)
    result = {"what": f"global attention per call, 518x378 full window (1005 q x {kv} kv, 16x64, bf16), "
                      "CUDA-graph replay of 24 calls", "rows": rows,
              "command": "python benchmarks/kernels/fa2_class_ab.py " + " ".join(argv),
              "run": run_record([__file__] + argv)}
    if a.out:
        write_result(result, a.out, torch.cuda.get_device_name(dev))
    return 0


if __name__ == "__main__":
    sys.exit(main())
