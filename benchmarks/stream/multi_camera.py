"""Several cameras on one GPU, one model, one K/V storage (``stream.multi.CameraSessions``).

    python benchmarks/stream/multi_camera.py --cameras 1 2 3 4 --rate 15 --seconds 20

For each camera count N (released configuration: 518x378, bf16, FlashInfer FA3, CUDA
graphs, full window, random weights):

* saturated: every camera always has a frame; cameras are served in turn and one
  camera's step is submitted before the previous camera's results are taken (the GPU
  never waits for the host). Aggregate frames/s over the steady state (windows full).
* real time: each camera delivers a uint8 host frame at ``--rate`` Hz (cameras offset by
  1/(rate*N) s); each camera has a latest-frame slot (a frame that arrives while the
  previous one still waits replaces it: counted as dropped); the loop serves ready
  cameras round-robin, each step's results taken before the next step (as the node's
  inference thread does). Latency = results on the host minus the frame's arrival; per
  camera median/p95, processed, dropped. ``real_time_pipelined`` (N > 1): the same, but
  the next camera's step is submitted before the previous step's results are taken.
* schedules: ``turn`` (one camera's step at a time) and ``batch`` (the ready cameras' frames
  in one batched trunk, ``CameraSessions.submit_many``), each on fresh sessions.
* memory: peak GPU memory allocated from building the sessions to the end, above the run's
  baseline (the weights, and what the process holds from earlier runs: ``base_gib``), and
  what one camera's cache is (its extent of the shared K/V storage + its camera-head
  cache), so that peak(N) can be compared with peak(1) + (N-1) x one camera's cache; where
  the memory is held (after the windows filled, at the end).

A benchmark, not a test: nothing here asserts a speed. Writes JSON (``--out``, default
``benchmarks/results/<gpu>_multi_camera.json``) with a ``run`` block (commit, device,
command, date).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record, write_result  # noqa: E402
from lingbot_map_ros.config import ModelConfig, StreamConfig  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.stream.multi import CameraSessions  # noqa: E402

NAMES = ("cam0", "cam1", "cam2", "cam3", "cam4", "cam5", "cam6", "cam7")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cameras", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--height", type=int, default=378)
    p.add_argument("--width", type=int, default=518)
    p.add_argument("--backend", default="flashinfer-fa3")
    p.add_argument("--num-scale-frames", type=int, default=8)
    p.add_argument("--sliding-window", type=int, default=64)
    p.add_argument("--saturated-rounds", type=int, default=120, help="timed rounds (one frame per camera each)")
    p.add_argument("--rate", type=float, default=15.0, help="frames per second of each camera (real-time part)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the real-time part per camera count")
    p.add_argument("--preset", default="lingbot-map")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", nargs="+", choices=("turn", "batch"), default=["turn", "batch"],
                   help="turn: one camera's step at a time; batch: the ready cameras' frames in one batched "
                        "trunk (CameraSessions.submit_many); each on fresh sessions")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def camera_frames(n: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    """n distinct uint8 [H, W, 3] host frames (a drifting random texture), cycled by the caller."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(3, h, w, generator=gen)
    out = []
    for i in range(n):
        frame = 0.7 * torch.roll(base, shifts=(i % h, (3 * i) % w), dims=(1, 2)) + 0.3 * torch.rand(3, h, w, generator=gen)
        out.append((frame * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy())
    return out


def stream_config(args) -> StreamConfig:
    return StreamConfig(num_scale_frames=args.num_scale_frames, sliding_window=args.sliding_window,
                        backend=args.backend, dtype="bf16", device="cuda")


def fill_windows(cams: CameraSessions, frames: dict, args) -> int:
    """Feed every camera until its window is full (untimed); returns frames fed per camera."""
    n = args.num_scale_frames + args.sliding_window + 2
    for i in range(n):
        for c, session in cams.sessions.items():
            session.push(frames[c][i % len(frames[c])])
    return n


def saturated(cams: CameraSessions, frames: dict, start: int, rounds: int, batch: bool = False,
              warm_rounds: int = 3) -> dict:
    """Cameras in turn, each submit before the previous camera's results are taken; or, ``batch``,
    every camera's frame in one ``submit_many`` per round, a round's results taken after the
    next round was launched. ``warm_rounds`` untimed rounds first (the batched trunk's CUDA
    graph is captured at its first round, ~0.2 s once)."""
    names = list(cams.sessions)
    pending: list = []
    per_round = []
    for r in range(warm_rounds):
        k = start + r
        if batch:
            outs = cams.submit_many({c: frames[c][k % len(frames[c])] for c in names}).values()
        else:
            outs = [cams.sessions[c].submit(frames[c][k % len(frames[c])]) for c in names]
        for p in outs:
            if isinstance(p, Exception):
                raise p
            p.result()
    start += warm_rounds

    def take(launched: list) -> None:
        for p in pending:
            if isinstance(p, Exception):  # submit_many hands a camera's failure back
                raise p
            p.result()
        pending[:] = launched

    torch.cuda.synchronize()
    t_all = time.perf_counter()
    for r in range(rounds):
        t0 = time.perf_counter()
        k = start + r
        if batch:
            take(list(cams.submit_many({c: frames[c][k % len(frames[c])] for c in names}).values()))
        else:
            for c in names:
                take([cams.sessions[c].submit(frames[c][k % len(frames[c])])])
        per_round.append((time.perf_counter() - t0) * 1e3)
    take([])
    total = time.perf_counter() - t_all
    frames_done = rounds * len(names)
    return {"frames": frames_done, "aggregate_fps": round(frames_done / total, 2),
            "ms_per_frame": round(total * 1e3 / frames_done, 3),
            "round_median_ms": round(statistics.median(per_round), 3),
            "round_p90_ms": round(float(np.percentile(per_round, 90)), 3),
            "round_max_ms": round(max(per_round), 3)}


def real_time(cams: CameraSessions, frames: dict, start: int, rate: float, seconds: float,
              batch: bool = False, pipelined: bool = False) -> dict:
    """Cameras deliver at ``rate`` Hz; latest-frame slot per camera; ready cameras served
    round-robin, one step at a time (or, ``batch``, every ready camera's frame in one
    ``submit_many``). Synchronous (the node's inference thread today): a step's results are
    taken before the next step is submitted. ``pipelined``: the next step (another camera's)
    is submitted first and the previous step's results taken after it (a camera never has
    two steps in flight), as a scheduler that overlaps one camera's host work with another's
    GPU work would."""
    names = list(cams.sessions)
    n = len(names)
    period = 1.0 / rate
    t0 = time.perf_counter() + 0.05
    next_k = {c: 0 for c in names}  # next frame number of each camera
    slot: dict[str, tuple[float, int] | None] = {c: None for c in names}  # (arrival, k)
    lat = {c: [] for c in names}
    dropped = {c: 0 for c in names}
    total_per_camera = int(seconds * rate)
    turn = 0
    in_flight: dict[str, tuple[float, object]] = {}  # camera -> (arrival, pending results)

    def deliver(now: float) -> None:
        for i, c in enumerate(names):
            while next_k[c] < total_per_camera:
                arrival = t0 + next_k[c] * period + i * period / n
                if arrival > now:
                    break
                if slot[c] is not None:
                    dropped[c] += 1
                slot[c] = (arrival, next_k[c])
                next_k[c] += 1

    def take(flight: dict) -> None:
        for c, (arrival, p) in flight.items():
            if isinstance(p, Exception):
                raise p
            p.result()
            lat[c].append((time.perf_counter() - arrival) * 1e3)
        flight.clear()

    while True:
        now = time.perf_counter()
        deliver(now)
        ready = [names[(turn + j) % n] for j in range(n) if slot[names[(turn + j) % n]] is not None]
        if not ready:
            if in_flight:  # nothing to overlap with: take the results now
                take(in_flight)
                continue
            if all(next_k[c] >= total_per_camera for c in names):
                break
            nxt = min(t0 + next_k[c] * period + i * period / n for i, c in enumerate(names)
                      if next_k[c] < total_per_camera)
            time.sleep(max(0.0, min(nxt - time.perf_counter(), 0.005)))
            continue
        serve = ready if batch else ready[:1]
        if any(c in in_flight for c in serve):  # one step per camera in flight
            take(in_flight)
        taken = {c: slot[c] for c in serve}
        for c in serve:
            slot[c] = None
        turn = (names.index(serve[-1]) + 1) % n
        if batch:
            out = cams.submit_many({c: frames[c][(start + k) % len(frames[c])] for c, (_, k) in taken.items()})
        else:
            (c, (_, k)), = taken.items()
            out = {c: cams.sessions[c].submit(frames[c][(start + k) % len(frames[c])])}
        launched = {c: (taken[c][0], out[c]) for c in serve}
        if pipelined:
            take(in_flight)  # the previous step's, now that this one runs
            in_flight.update(launched)
        else:
            take(launched)
    take(in_flight)
    out = {}
    for c in names:
        v = lat[c]
        out[c] = {"processed": len(v), "dropped": dropped[c], "delivered": total_per_camera,
                  "median_ms": round(statistics.median(v), 2) if v else None,
                  "p95_ms": round(float(np.percentile(v, 95)), 2) if v else None,
                  "max_ms": round(max(v), 2) if v else None}
    return out


def camera_cache_bytes(cams: CameraSessions, name: str) -> int:
    lease = cams.storage.lease_of(name)
    storage = cams.storage
    kv = 2 * storage.num_layers * lease.tokens * storage.num_heads * storage.head_dim * storage.k.element_size()
    cam = cams.inner[name]._runner.camera
    return kv + 2 * cam.k.numel() * cam.k.element_size()


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("multi_camera: a CUDA device is required", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    model = load_model(ModelConfig.preset(args.preset), None, "cuda", "bf16", seed=args.seed)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    cfg = stream_config(args)
    pool = {NAMES[i]: camera_frames(24, args.height, args.width, args.seed + i) for i in range(max(args.cameras))}

    # warm-up: JIT compilation, allocator growth (not counted)
    warm = CameraSessions(model, {"warm": (cfg, None)})
    fill_windows(warm, {"warm": pool[NAMES[0]]}, args)
    del warm
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    runs = []
    for n in args.cameras:
        for schedule in args.schedule:
            if schedule == "batch" and n == 1:
                continue  # one camera: nothing to batch
            names = NAMES[:n]
            gc.collect()  # the previous run's sessions (reference cycles) before the baseline
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            cams = CameraSessions(model, {c: (cfg, None) for c in names})
            frames = {c: pool[c] for c in names}
            start = fill_windows(cams, frames, args)
            torch.cuda.synchronize()
            filled_peak, filled = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            batch = schedule == "batch"
            sat = saturated(cams, frames, start, args.saturated_rounds, batch=batch)
            at = start + args.saturated_rounds + 3
            rt = real_time(cams, frames, at, args.rate, args.seconds, batch=batch)
            rt_pipe = real_time(cams, frames, at + int(args.seconds * args.rate), args.rate, args.seconds,
                                batch=batch, pipelined=True) if n > 1 else None
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            status = cams.pool_status()
            run = {"cameras": n, "schedule": schedule, "saturated": sat, "real_time": rt, "real_time_pipelined": rt_pipe,
                   "peak_gpu_memory_gib": round(peak / 2**30, 3),
                   "peak_above_base_gib": round((peak - base) / 2**30, 3),
                   "base_gib": round(base / 2**30, 3),
                   "one_camera_cache_gib": round(camera_cache_bytes(cams, names[0]) / 2**30, 3),
                   # where the memory is: held after the windows filled (K/V storage, camera
                   # caches, step buffers, graph pools' live outputs), the peak up to then (the
                   # scale frames' eager steps) and at the end (batched graphs captured later)
                   "memory": {"held_after_fill_gib": round((filled - base) / 2**30, 3),
                              "held_at_end_gib": round((torch.cuda.memory_allocated() - base) / 2**30, 3),
                              "peak_until_filled_gib": round((filled_peak - base) / 2**30, 3),
                              "camera_head_caches_gib": round(sum(
                                  2 * s._runner.camera.k.numel() * s._runner.camera.k.element_size()
                                  for s in cams.inner.values()) / 2**30, 3)},
                   "storage": {"capacity_tokens": status.capacity_tokens, "leased_tokens": status.leased_tokens,
                               "gib": round(status.nbytes / 2**30, 3), "generation": cams.storage.generation},
                   "graph_fallbacks": sum(s.graph_fallbacks for s in cams.inner.values()),
                   "batched_steps": sum(s.batched_steps for s in cams.inner.values())}
            runs.append(run)
            print(json.dumps(run), flush=True)
            del cams
    single = next((r for r in runs if r["cameras"] == 1), None)
    for r in runs:
        if single is not None:
            # the target: peak(N) <= peak(1) + (N-1) x one camera's cache. Each run's peak is taken
            # above its own baseline (the weights and whatever the process still holds from
            # earlier runs), so that runs in one process compare like with like
            bound = single["peak_above_base_gib"] + (r["cameras"] - 1) * single["one_camera_cache_gib"]
            r["memory_bound_above_base_gib"] = round(bound, 3)
            r["memory_within_bound"] = r["peak_above_base_gib"] <= bound + 0.0005  # the figures' rounding
            r["throughput_vs_single"] = round(r["saturated"]["aggregate_fps"] / single["saturated"]["aggregate_fps"], 3)
    result = {"gpu": gpu, "weights_gib": round(weights_gib, 3),
              "setting": {"resolution": [args.height, args.width], "backend": args.backend, "dtype": "bf16",
                          "num_scale_frames": args.num_scale_frames, "sliding_window": args.sliding_window,
                          "rate_hz": args.rate, "seconds": args.seconds, "saturated_rounds": args.saturated_rounds,
                          "input": "uint8 host frames", "schedules": args.schedule,
                          "weights": f"random (seed {args.seed})"},
              "runs": runs,
              "run": run_record([__file__] + list(sys.argv[1:] if argv is None else argv))}
    write_result(result, args.out, gpu, "_multi_camera")
    return 0


if __name__ == "__main__":
    sys.exit(main())
