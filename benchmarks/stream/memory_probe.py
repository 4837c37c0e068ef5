"""Does GPU memory stay allocated after sessions are dropped or change resolution?

    python benchmarks/stream/memory_probe.py [--rounds 3]

Released configuration (518x378 and 518x294, bf16, FlashInfer FA3, CUDA graphs, random
weights). Three probes, each printing ``torch.cuda.memory_allocated()`` after every round
(after ``gc.collect()``), and at the end the live CUDA tensors that no probe should hold
(grouped by shape and dtype, largest first):

* ``cameras``: a two-camera ``CameraSessions`` filled, a few batched rounds, dropped;
* ``single``: a single-camera ``StreamingSession`` filled, a few steps, dropped (without
  and with CUDA graphs);
* ``resize``: one session alternating 518x378 and 518x294 (``reset`` between).

A diagnostic, not a test: nothing here asserts; it prints JSON lines.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record  # noqa: E402
from lingbot_map_ros.config import ModelConfig, StreamConfig  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.stream.multi import CameraSessions  # noqa: E402
from lingbot_map_ros.stream.session import StreamingSession  # noqa: E402


def live_cuda_tensors() -> dict[tuple, tuple[int, int]]:
    """(shape, dtype) -> (count, bytes) of the CUDA tensors the garbage collector can see."""
    out: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                key = (tuple(obj.shape), str(obj.dtype))
                out[key][0] += 1
                out[key][1] += obj.untyped_storage().nbytes()
        except Exception:
            continue
    return {k: tuple(v) for k, v in out.items()}


def allocated() -> float:
    gc.collect()
    torch.cuda.synchronize()
    return round(torch.cuda.memory_allocated() / 2**20, 1)


def frames(h: int, w: int, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8) for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only-single", action="store_true", help="the single-camera probe only (with and without graphs)")
    args = p.parse_args()
    model = load_model(ModelConfig.preset("lingbot-map"), None, "cuda", "bf16", seed=0)
    cfg = StreamConfig(num_scale_frames=8, sliding_window=16, backend="flashinfer-fa3", dtype="bf16", device="cuda")
    f378, f294 = frames(378, 518, 30, 0), frames(294, 518, 30, 1)
    print(json.dumps({"run": run_record([__file__] + sys.argv[1:])}), flush=True)
    before = live_cuda_tensors()
    print(json.dumps({"probe": "start", "allocated_mib": allocated()}), flush=True)
    for r in range(0 if args.only_single else args.rounds):
        cams = CameraSessions(model, {c: (cfg, None) for c in ("a", "b")})
        for i in range(28):
            for c in ("a", "b"):
                cams.sessions[c].push(f378[i])
        for i in range(4):
            for c, pending in cams.submit_many({"a": f378[i], "b": f378[i + 1]}).items():
                pending.result()
        held = allocated()
        del cams, pending
        print(json.dumps({"probe": "cameras", "round": r, "held_mib": held, "after_del_mib": allocated()}), flush=True)
    for graphs in (False, True):
        for r in range(args.rounds):
            s = StreamingSession(model, cfg.with_overrides(cuda_graphs=graphs))
            for i in range(28):
                s.push(f378[i])
            held = allocated()
            del s
            print(json.dumps({"probe": "single", "cuda_graphs": graphs, "round": r, "held_mib": held,
                              "after_del_mib": allocated()}), flush=True)
    if args.only_single:
        # cuBLAS keeps a workspace per (handle, stream) it ran on, in PyTorch's allocator, until
        # cleared; streams come from a recycled pool, so that map is bounded
        torch._C._cuda_clearCublasWorkspaces()
        print(json.dumps({"probe": "after clearing cuBLAS workspaces", "allocated_mib": allocated()}), flush=True)
        return 0
    s = StreamingSession(model, cfg)
    for r in range(2 * args.rounds):
        seq = f378 if r % 2 == 0 else f294
        s.reset()
        for i in range(28):
            s.push(seq[i])
        print(json.dumps({"probe": "resize", "round": r, "height": seq[0].shape[0], "allocated_mib": allocated()}),
              flush=True)
    del s
    print(json.dumps({"probe": "end", "allocated_mib": allocated()}), flush=True)
    after = live_cuda_tensors()
    grown = {k: (after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1])
             for k in after if after[k][1] > before.get(k, (0, 0))[1]}
    top = sorted(grown.items(), key=lambda kv: -kv[1][1])[:25]
    print(json.dumps({"live_cuda_tensors_gained": [[list(k[0]), k[1], n, round(b / 2**20, 2)] for k, (n, b) in top],
                      "gained_mib": round(sum(b for _, b in grown.values()) / 2**20, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
