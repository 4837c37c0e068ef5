"""CPU cost of the robot helpers (median of 5 runs): building an undistortion map for a
1280x720 plumb_bob CameraInfo, undistorting one rgb8 frame with it (numpy), and one
``DepthScaleEstimator.update`` (518x392 model depth against a 640x480 16UC1 sensor image).

    .venv/bin/python benchmarks/undistort/robot_helpers_timing.py

Prints one line per figure and the run record (commit, device, command, date). A benchmark,
not a test.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record  # noqa: E402
from lingbot_map_ros.robot import CameraModel, DepthScaleEstimator, Undistorter  # noqa: E402


def median_ms(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    torch.set_num_threads(2)
    cam = CameraModel(1280, 720, (900., 0, 640, 0, 900, 360, 0, 0, 1), (-0.25, 0.08, 0.001, -0.0015, -0.01),
                      "plumb_bob")
    t = time.perf_counter()
    und = Undistorter()
    und.map_for(cam).apply(np.zeros((720, 1280, 3), np.uint8))
    print(f"map + bilinear plan build (once per CameraInfo): {(time.perf_counter() - t) * 1e3:.0f} ms")
    img = np.random.default_rng(0).integers(0, 255, (720, 1280, 3), dtype=np.uint8)
    print(f"undistort 1280x720 rgb8, numpy: {median_ms(lambda: und.undistort(img, cam)):.1f} ms")
    est = DepthScaleEstimator()
    rng = np.random.default_rng(1)
    model_depth = rng.uniform(1, 3, (392, 518)).astype(np.float32)
    conf = np.full_like(model_depth, 3.0)
    sensor = (rng.uniform(1, 3, (480, 640)) * 1000).astype(np.uint16)
    print(f"DepthScaleEstimator.update 518x392 model, 640x480 16UC1: "
          f"{median_ms(lambda: est.update(model_depth, conf, sensor)):.1f} ms")
    print(json.dumps(run_record([__file__])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
