"""Launch configurations of the camera head's matrix-vector kernel (kernels/gemv.py), timed.

    python benchmarks/kernels/gemv_configs.py [--replays 50]

For each weight shape of the camera head at the released width (qkv, proj, fc1, fc2 of
its trunk blocks, the pose modulation, the pose branch), a CUDA graph of 16 calls in a
row (so launch gaps do not dominate, as single launches would) is replayed for every
(BLOCK_N, BLOCK_K, num_warps, num_stages) candidate; prints microseconds per call and
the weight bandwidth, the current choice (``gemv.launch_config``) marked. Then the
whole camera head (4 iterations) in a graph, with the current and the best per-shape
configurations. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
from torch import nn

import lingbot_map_ros.kernels.gemv as gemv_mod
from lingbot_map_ros.config import ModelConfig

CALLS = 16


def graph_time_us(fn, replays: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replays", type=int, default=50)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_configs: a CUDA device is required", file=sys.stderr)
        return 2
    cfg = ModelConfig.preset("lingbot-map")
    c = cfg.camera_dim
    hidden = int(c * cfg.mlp_ratio)
    gen = torch.Generator().manual_seed(0)
    # (name, N, K, prologue/epilogue keywords)
    ln = nn.LayerNorm(c).cuda()
    shapes = [("qkv", 3 * c, c, {"norm": ln}), ("proj", c, c, {"residual": True}),
              ("fc1", hidden, c, {"norm": ln, "gelu": True}), ("fc2", c, hidden, {"residual": True}),
              ("modulation", 3 * c, c, {"silu": True}), ("pose_fc1", c // 2, c, {"norm": ln, "gelu": True})]
    current = gemv_mod.launch_config
    best: dict[tuple[int, int], tuple] = {}
    for name, n, k, kw in shapes:
        lin = nn.Linear(k, n).cuda()
        lin.weight.data = (torch.randn(n, k, generator=gen) * 0.02).cuda().to(torch.bfloat16)
        x = torch.randn(1, k, generator=gen).cuda()
        args = dict(kw)
        if args.pop("residual", False):
            args.update(residual=torch.randn(1, n, generator=gen).cuda(), gamma=torch.rand(n, generator=gen).cuda())
        mine = current(n, k)
        rows = []
        candidates = sorted({c_ for c_ in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (4, 8), (3,))
                             if c_[0] * c_[1] <= 16384 and c_[1] <= k} | {mine})
        for block_n, block_k, warps, stages in candidates:
            conf = (block_n, block_k, warps, stages)
            gemv_mod.launch_config = lambda n_, k_, conf=conf: conf
            try:
                us = graph_time_us(lambda: [gemv_mod.gemv(x, lin, **args) for _ in range(CALLS)], a.replays) / CALLS
            except Exception as exc:  # noqa: BLE001 - a candidate the compiler refuses
                print(f"{name} {conf}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            rows.append((us, conf))
        gemv_mod.launch_config = current
        rows.sort()
        gbytes = n * k * 2 / 1e9
        now = next((us for us, conf in rows if conf == mine), None)
        print(f"{name} [N {n}, K {k}], {gbytes * 1e3:.1f} MB of weights: current {mine} "
              f"{now:.2f} us ({gbytes / now * 1e6:.0f} GB/s)" if now else f"{name}: current config not timed")
        for us, conf in rows[:5]:
            print(f"   {conf}  {us:.2f} us  {gbytes / us * 1e6:.0f} GB/s")
        best[(n, k)] = rows[0][1]

    # the whole camera head (4 iterations x 4 blocks, with its cache attention) in one graph
    from lingbot_map_ros.cache.pool import CameraKVCache
    from lingbot_map_ros.kernels import available
    from lingbot_map_ros.model.heads import CameraHead

    head = CameraHead(cfg).cuda().eval().reduced_precision_copy(gemv=gemv_mod.gemv)
    cache = CameraKVCache(4, cfg.camera_trunk_depth, cfg.max_frame_num, cfg.camera_num_heads,
                          c // cfg.camera_num_heads, torch.float32, torch.device("cuda"))
    cache.fused = available("cuda")
    slot = torch.tensor([300], device="cuda")
    tokens = torch.randn(1, 6, c, generator=gen).cuda()

    def run_head():
        bias = cache.visible_bias(slot)
        with torch.no_grad():
            head(tokens, 4, lambda it, b, q, k, v: cache.attend_at(it, b, q, k, v, slot, bias))

    for label, chooser in (("current", current),
                           ("best per shape", lambda n, k: best.get((n, k)) or current(n, k))):
        gemv_mod.launch_config = chooser
        print(f"camera head (4 iterations), {label} configs: {graph_time_us(run_head, a.replays):.1f} us")
    gemv_mod.launch_config = current
    return 0


if __name__ == "__main__":
    sys.exit(main())
