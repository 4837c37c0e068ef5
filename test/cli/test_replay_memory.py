"""A long replay keeps its memory flat: 600 small frames (ten 64-frame windows) from a bag through
the tiny model in long-stream mode, every output on (chunked npz with all depth, TUM, PLY, results
bag); the process's resident set size is read from /proc/self/status as the frames are written.

The frames are 84 x 56 px (6 x 4 patches): a frame costs about as much time as a 42 x 28 one
(per-frame overhead dominates), and holding its results costs four times the memory, so 400
frames between the marks show a leak of them as clearly as 1,500 frames of 42 x 28 did."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FRAMES = 600
WIDTH, HEIGHT = 84, 56  # the model input: 6 x 4 patches of 14 px
FIRST_MARK = 200  # RSS growth is measured from this frame (three windows in) to the last one
MARK_EVERY = 100
GROWTH_BOUND_KIB = 6 * 1024  # allowed RSS growth between frame FIRST_MARK and frame FRAMES

DRIVER = r"""
import json, sys
from pathlib import Path
import numpy as np
from replay_fixtures import write_image_bag
from lingbot_map_ros.cli.replay import main

root, frames, w, h, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
yy, xx = np.mgrid[0:h, 0:w]
images = [np.stack([(xx * 6 + 3 * i) % 256, (yy * 9 + 5 * i) % 256, (xx + yy + 7 * i) % 256], -1).astype(np.uint8)
          for i in range(100)]  # 100 distinct frames, cycled
write_image_bag(root / "in", [images[i % 100] for i in range(frames)], "mcap", "raw", "/cam")

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

marks = {}
def observer(done):
    if done % every == 0:
        marks[done] = rss_kib()

code = main(["--bag", str(root / "in"), "--topic", "/cam", *sys.argv[6:], "--out", str(root / "p.npz"),
             "--trajectory", str(root / "t.tum"), "--ply", str(root / "c.ply"), "--out-bag", str(root / "res")],
            observer)
print(json.dumps({"code": code, "rss_kib": marks}))
"""


@pytest.mark.slow
def test_long_run_memory_is_flat(fixtures, tmp_path):
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    flags = ["--checkpoint", str(fixtures / "weights.safetensors"), "--model-config", str(fixtures / "config.json"),
             "--backend", "sdpa", "--width", str(WIDTH), "--threads", "1", "--camera-iterations", "1",
             "--window-frames", "64", "--chunk-frames", "100", "-q"]
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(FRAMES), str(WIDTH), str(HEIGHT),
                           str(MARK_EVERY), *flags],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, proc.stderr
    rss = {int(k): v for k, v in report["rss_kib"].items()}
    growth = rss[FRAMES] - rss[FIRST_MARK]
    print(f"RSS KiB by frame: {rss}; growth {FIRST_MARK} -> {FRAMES}: {growth} KiB")
    # what holding the results would cost (the former replay kept every FrameResult until the end):
    # depth and confidence float32 and the float32 input [3, H, W], for the frames in between
    held = (FRAMES - FIRST_MARK) * WIDTH * HEIGHT * (4 + 4 + 12) // 1024
    assert GROWTH_BOUND_KIB < held / 2  # the bound could catch that
    assert growth < GROWTH_BOUND_KIB, f"RSS grew by {growth} KiB between frames {FIRST_MARK} and {FRAMES}: {rss}"

    # everything was written, in full
    summary = proc.stderr.strip().splitlines()[-1]
    windows = 1 + -(-(FRAMES - 64) // (64 - 2))  # the first window stores 64 frames, later ones 2 re-fed + 62
    assert f"{FRAMES} frames in" in summary and "0 dropped" in summary and f"{windows} window(s)" in summary, summary
    from lingbot_map_ros.io.results import load_predictions

    pred = load_predictions(tmp_path / "p.npz", depth=False)
    assert pred["pose_enc"].shape == (FRAMES, 9) and len(pred["depth_chunks"]) == FRAMES // 100
    assert np.isfinite(pred["pose_c2w"]).all()
    assert pred["window"].max() == windows - 1
    assert len((tmp_path / "t.tum").read_text().splitlines()) == FRAMES + 1
    from rosbags.highlevel import AnyReader

    with AnyReader([tmp_path / "res"]) as reader:
        counts = {name: info.msgcount for name, info in reader.topics.items()}
    assert counts["/tf"] == counts["/lingbot_map/points"] == counts["/lingbot_map/depth"] == FRAMES
