"""The keyframe journal's cost: bytes written per second, per-frame latency with and without
journaling, and the time to rebuild a full window from a journal.

    python benchmarks/stream/journal_bench.py [--frames 300] [--images DIR] [--out FILE]   # H200: released config
    python benchmarks/stream/journal_bench.py --cpu-smoke                   # tiny model, CPU, seconds

GPU: the released architecture with random weights, bf16, FlashInfer FA3, CUDA graphs,
518x378 uint8 frames (what the node pushes at that size), 8 scale frames, sliding window
64, keyframe interval 1 (every frame stored: the journal's worst case), long stream with
its node defaults (window 320). Frames are made from ``--images`` (default
../shared/data/loop) when present (resized to 518x378), else a smooth synthetic scene with
sensor noise.

1. ``journal``: the same frames through a ``LongStreamSession`` without and with a
   ``JournaledSession`` with each ``journal_compression`` (none, lz4: the default, zlib
   level 1); per frame the submit-to-results latency;
   journal bytes written (appends and compactions) / frames x 15 = bytes/s at 15 Hz.
2. ``map``: the map journal (``runtime.map_journal``, ``map.lbj``) fed as the node feeds it:
   each frame's results through ``runtime.clouds.frame_clouds`` (point_stride 10) into a
   ``MapAccumulator`` (voxel 0.01, 1M points: node defaults) and the path; bytes written
   (chunks, path entries, compactions) / frames x 15 = bytes/s at 15 Hz, points per frame and
   the output thread's time per frame for map add + journal append, at the node's
   conf_threshold (1.5) and at 0 (every pixel above it: the bound); LZ4, the default.
3. ``rebuild``: a journal of exactly 8 scale frames + 64 keyframes replayed into a fresh
   session (``journal.resume.rebuild``), cold (the fresh session captures its CUDA graphs)
   and warm (the same session again).

Prints and writes one JSON result (``provenance.write_result``); asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record, write_result  # noqa: E402
from lingbot_map_ros.config import LongStreamConfig, ModelConfig, StreamConfig  # noqa: E402
from lingbot_map_ros.io.checkpoint import load_model  # noqa: E402
from lingbot_map_ros.journal import JOURNAL_NAME, JournaledSession, JournalWriter, journal_identity  # noqa: E402
from lingbot_map_ros.journal.resume import rebuild  # noqa: E402
from lingbot_map_ros.stream.long_stream import LongStreamSession  # noqa: E402
from lingbot_map_ros.stream.session import StreamingSession  # noqa: E402

LOOP = Path(__file__).resolve().parents[3] / "shared" / "data" / "loop"
RATE_HZ = 15.0


CODECS = ("none", "lz4", "zlib")


def frames(n: int, h: int, w: int, folder: Path = LOOP) -> list[np.ndarray]:
    """n uint8 [h, w, 3] frames: the loop data set resized, or a synthetic moving scene."""
    paths = sorted(folder.glob("*.jpg")) if folder.is_dir() else []
    out = []
    if paths:
        from PIL import Image

        for i in range(n):
            with Image.open(paths[i % len(paths)]) as im:
                out.append(np.asarray(im.convert("RGB").resize((w, h), Image.BICUBIC), dtype=np.uint8).copy())
        return out
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(n):
        base = np.stack([np.sin((xx + 3 * i) / 17.0), np.cos((yy - 2 * i) / 23.0), np.sin((xx + yy + i) / 31.0)], -1)
        noisy = 127.5 + 100 * base + rng.normal(0, 4, base.shape)
        out.append(np.clip(noisy, 0, 255).astype(np.uint8))
    return out


def make(model, cfg: StreamConfig, long_cfg: LongStreamConfig):
    return LongStreamSession(StreamingSession(model, cfg), long_cfg)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_frames(session, images, device) -> list[float]:
    """Per-frame latency (ms) of submit + results, pipelined one deep like the node."""
    lat, pending, t_sub = [], None, None
    for im in images:
        t0 = time.perf_counter()
        nxt = session.submit(im)
        if pending is not None:
            pending.result()
            lat.append((time.perf_counter() - t_sub) * 1e3)
        pending, t_sub = nxt, t0
    pending.result()
    lat.append((time.perf_counter() - t_sub) * 1e3)
    sync(device)
    return lat


def summary(lat: list[float], skip: int) -> dict:
    a = np.asarray(lat[skip:])
    return {"frames": int(a.size), "mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99))}


def journal_cost(model, cfg, long_cfg, images, device, warm: int) -> dict:
    out = {}
    plain = make(model, cfg, long_cfg)
    run_frames(plain, images[:warm], device)  # graphs captured, kernels compiled
    plain.reset()
    out["off"] = summary(run_frames(plain, images, device), cfg.num_scale_frames)
    for codec in CODECS:
        with tempfile.TemporaryDirectory() as folder:
            session = make(model, cfg, long_cfg)
            writer = JournalWriter(Path(folder) / JOURNAL_NAME, compression=codec)
            journaled = JournaledSession(session, writer, journal_identity(session, "random seed 0"))
            run_frames(journaled, images[:warm], device)
            journaled.reset()
            writer.flush(600)
            before = writer.status().bytes_written
            t0 = time.perf_counter()
            lat = run_frames(journaled, images, device)
            writer.flush(600)
            wall = time.perf_counter() - t0
            st = writer.status()
            written = st.bytes_written - before
            writer.close()
        out[f"on_{codec}"] = {**summary(lat, cfg.num_scale_frames), "bytes_written": written,
                                  "bytes_per_frame": written / len(images),
                                  "mb_per_s_at_15hz": written / len(images) * RATE_HZ / 1e6,
                                  "writer_kept_up_s": wall, "pauses": st.pauses, "rewrites": st.rewrites}
    return out


def map_journal_cost(model, cfg, long_cfg, images, device) -> dict:
    from lingbot_map_ros.geometry import optical_pose_to_map
    from lingbot_map_ros.runtime.clouds import frame_clouds
    from lingbot_map_ros.runtime.frames import FrameOutput
    from lingbot_map_ros.runtime.map_journal import MAP_JOURNAL_NAME, MapJournal
    from lingbot_map_ros.runtime.mapping import MapAccumulator, PoseEntry, Trajectory

    session = make(model, cfg, long_cfg)
    results = [r for im in images for r in session.push(im)]
    out = {}
    for threshold in (1.5, 0.0):
        with tempfile.TemporaryDirectory() as folder:
            acc, path = MapAccumulator(0.01, 1_000_000), Trajectory(5000)
            journal = MapJournal(Path(folder) / MAP_JOURNAL_NAME, {"bench": 1}, compression="lz4")
            journal.attach(acc, path)
            points, add_ms = [], []
            for r in results:
                T = optical_pose_to_map(r.c2w)
                path.append(PoseEntry(r.frame_index, r.frame_index, float(r.frame_index) / RATE_HZ, T))
                pose = FrameOutput(r.frame_index + 1, 0, 0.0, "cam", r.is_keyframe, T, r.intrinsics, None, None, None,
                                   None)
                _, for_map = frame_clouds(r, pose, True, False, threshold, 10)
                t0 = time.perf_counter()
                acc.add(r.frame_index, *for_map)
                add_ms.append((time.perf_counter() - t0) * 1e3)
                points.append(for_map[0].shape[0])
            journal.writer.flush(600)
            st = journal.status()
            journal.close()
        out[f"conf_threshold_{threshold:g}"] = {
            "frames": len(results), "points_per_frame_selected": float(np.mean(points)),
            "map_points_at_end": len(acc), "bytes_written": st.bytes_written,
            "bytes_per_frame": st.bytes_written / len(results),
            "mb_per_s_at_15hz": st.bytes_written / len(results) * RATE_HZ / 1e6, "rewrites": st.rewrites,
            "map_add_and_append_ms_p50": float(np.percentile(add_ms, 50)),
            "map_add_and_append_ms_p99": float(np.percentile(add_ms, 99))}
    return out


def rebuild_time(model, cfg, long_cfg, images, device) -> dict:
    n = cfg.num_scale_frames + cfg.sliding_window
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / JOURNAL_NAME
        session = make(model, cfg, long_cfg)
        writer = JournalWriter(path, compression="lz4")
        journaled = JournaledSession(session, writer, journal_identity(session, "random seed 0"))
        for i in range(n):
            journaled.push(images[i % len(images)], keyframe=True)
        writer.close()
        size = path.stat().st_size
        out = {"stored_frames": n, "journal_bytes": size}
        fresh = make(model, cfg, long_cfg)
        ident = journal_identity(fresh, "random seed 0")
        for name in ("cold", "warm"):
            sync(device)
            t0 = time.perf_counter()
            rebuilt = rebuild(fresh, path, ident)
            sync(device)
            out[f"{name}_s"] = time.perf_counter() - t0
            out[f"{name}_max_pose_error"] = rebuilt.max_pose_error
            assert rebuilt.frames_replayed == n, rebuilt
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model, CPU, fp32, a few frames (checks the script)")
    p.add_argument("--images", type=Path, default=LOOP, help="folder of .jpg frames (default ../shared/data/loop)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.cpu_smoke:
        mcfg = ModelConfig.preset("tiny")
        model = load_model(mcfg, None, "cpu", "fp32", seed=0)
        cfg = StreamConfig(num_scale_frames=2, sliding_window=3, keyframe_interval=1, backend="sdpa", dtype="fp32",
                           device="cpu")
        h, w, n, warm = 56, 98, min(args.frames, 12), 3
    else:
        model = load_model(ModelConfig.preset("lingbot-map"), None, "cuda", "bf16", seed=0)
        cfg = StreamConfig(num_scale_frames=8, sliding_window=64, keyframe_interval=1, backend="flashinfer-fa3",
                           dtype="bf16", device="cuda")
        h, w, n, warm = 378, 518, args.frames, 12
    long_cfg = LongStreamConfig()
    device = next(model.parameters()).device
    images = frames(n, h, w, args.images)
    result = {"run": run_record([__file__] + sys.argv[1:]), "resolution": [h, w], "frames": n,
              "keyframe_interval": cfg.keyframe_interval, "window_frames": long_cfg.window_frames,
              "images": str(args.images) if any(args.images.glob("*.jpg")) else "synthetic",
              "compression": {"map": "lz4", "rebuild": "lz4"}}
    result["journal"] = journal_cost(model, cfg, long_cfg, images, device, warm)
    result["map"] = map_journal_cost(model, cfg, long_cfg, images, device)
    result["rebuild"] = rebuild_time(model, cfg, long_cfg, images, device)
    name = "cpu_smoke" if args.cpu_smoke else result["run"]["device"]
    out = args.out or (Path(tempfile.gettempdir()) / "journal_bench_smoke.json" if args.cpu_smoke else None)
    write_result(result, out, name, "_journal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
