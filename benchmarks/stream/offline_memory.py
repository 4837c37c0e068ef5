"""Memory of a long offline replay: ``lingbot-map-replay`` on a bag, every output on.

    python benchmarks/stream/offline_memory.py                   # 5,000 frames, tiny model, CPU
    python benchmarks/stream/offline_memory.py --frames 20000 --width 98 --out-json benchmarks/results/offline_memory.json

Writes a rosbag2 (MCAP) of ``--frames`` JPEG-compressed images (the frames of
``../shared/data/loop``, cycled, 10 Hz) into ``--workdir``, then replays it in this
process with the CLI's own ``main`` (long-stream mode; npz with all depth in chunks,
TUM, PLY, results bag), reading the resident set size (VmRSS, /proc/self/status)
every ``--every`` frames. Beside each sample it prints what the former replay would
have held at that point (every frame's depth and confidence and its float32 model
input, 20 bytes a pixel, kept until the end for one npz). A benchmark, not a test: nothing here asserts.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def write_bag(path: Path, frames: int, loop: Path) -> None:
    """``frames`` CompressedImage messages on /camera/image/compressed, 10 Hz, cycling the loop's JPEGs."""
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_HUMBLE)
    t = store.types
    jpegs = [np.frombuffer(p.read_bytes(), np.uint8) for p in sorted(loop.glob("*.jpg"))]
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conn = writer.add_connection("/camera/image/compressed", "sensor_msgs/msg/CompressedImage", typestore=store)
        for i in range(frames):
            stamp = 1_700_000_000 * 10**9 + i * 10**8
            header = t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=stamp // 10**9,
                                                                                      nanosec=stamp % 10**9),
                                              frame_id="camera_optical_frame")
            msg = t["sensor_msgs/msg/CompressedImage"](header=header, format="jpeg", data=jpegs[i % len(jpegs)])
            writer.write(conn, stamp, store.serialize_cdr(msg, "sensor_msgs/msg/CompressedImage"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=5000)
    p.add_argument("--every", type=int, default=500, help="RSS sample period (frames)")
    p.add_argument("--width", type=int, default=98, help="model input width (the loop frames are 518x294)")
    p.add_argument("--fixtures", type=Path, default=SHARED / "fixtures" / "upstream_tiny")
    p.add_argument("--loop", type=Path, default=SHARED / "data" / "loop")
    p.add_argument("--workdir", type=Path, help="where the bag and the outputs go (default: a temp folder, removed)")
    p.add_argument("--out-json", type=Path, help="also write the samples here")
    p.add_argument("replay_args", nargs="*", help="more replay flags, after --")
    args = p.parse_args()

    sys.path.insert(0, str(REPO))
    from lingbot_map_ros.cli.replay import main as replay

    work = args.workdir or Path(tempfile.mkdtemp(prefix="offline_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_bag(work / "in", args.frames, args.loop)
    print(f"bag of {args.frames} frames written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    argv = ["--bag", str(work / "in"), "--topic", "/camera/image/compressed",
            "--checkpoint", str(args.fixtures / "weights.safetensors"),
            "--model-config", str(args.fixtures / "config.json"), "--width", str(args.width), "--threads", "1",
            "--out", str(work / "p.npz"), "--trajectory", str(work / "t.tum"), "--ply", str(work / "c.ply"),
            "--out-bag", str(work / "res"), "-q", *args.replay_args]
    samples: list[tuple[int, float]] = []

    def observer(done: int) -> None:
        if done % args.every == 0:
            samples.append((done, rss_mib()))

    code = replay(argv, observer)
    from lingbot_map_ros.io.results import iter_depth

    h, w = next(iter(iter_depth(work / "p.npz")))[1].shape[1:]
    per_frame = h * w * (4 + 4 + 12)  # depth, confidence and the float32 input [3, H, W]: a former FrameResult
    print(f"command: python benchmarks/stream/offline_memory.py --frames {args.frames} --every {args.every} "
          f"--width {args.width}", file=sys.stderr)
    print(f"model input {w}x{h}; exit status {code}")
    print("| frames | RSS (MiB) | former replay would hold (MiB) |")
    print("|---|---|---|")
    for done, mib in samples:
        print(f"| {done} | {mib:.0f} | +{done * per_frame / 2**20:.0f} |")
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps({"frames": args.frames, "width": args.width, "input_hw": [h, w],
                                             "rss_mib": samples, "argv": argv[2:], "run": run_record()}, indent=1))
    if args.workdir is None:
        shutil.rmtree(work)
    return code


if __name__ == "__main__":
    sys.exit(main())
