"""Time the two undistortion paths for one frame to the model input (issue 17).

    python benchmarks/undistort/undistort_paths.py [--device cpu|cuda] [--size 1280x720] [--frames 20]

host: numpy remap (``Undistorter.undistort``) + Pillow resize/crop (``preprocess_array``), what
the engine does when the session is on the CPU; device: ``model_input_torch`` on ``--device``
(bytes up, remap, two-pass antialiased resize, crop), what it does when the session is on a GPU.
Milliseconds per frame after 3 warm-up frames; CUDA timed with a synchronize after the loop.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from lingbot_map_ros.io.preprocess import preprocess_array
from lingbot_map_ros.robot.undistort import CameraModel, Undistorter


def frame(width: int, height: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    blocks = np.kron(rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3)).astype(np.float32),
                     np.ones((8, 8, 1)))[:height, :width]
    v, u = np.mgrid[0:height, 0:width]
    return np.clip(0.6 * blocks + 0.4 * (127 + 120 * (np.sin(u / 7.0) * np.cos(v / 11.0))[..., None]), 0,
                   255).astype(np.uint8)


def per_frame_ms(fn, frames: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(frames):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / frames


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--width", type=int, default=518)
    ap.add_argument("--frames", type=int, default=20)
    a = ap.parse_args()
    w, h = (int(v) for v in a.size.split("x"))
    cam = CameraModel(w, h, (0.8 * w, 0.0, w / 2, 0.0, 0.8 * w, h / 2, 0.0, 0.0, 1.0),
                      (-0.28, 0.09, 0.001, -0.001, 0.0), "plumb_bob")
    rgb, und = frame(w, h), Undistorter()
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"{w}x{h} plumb_bob -> width {a.width}, torch threads {torch.get_num_threads()}")
    print(f"host remap only:             {per_frame_ms(lambda: und.undistort(rgb, cam), a.frames, sync):.1f} ms")
    print(f"host remap + Pillow resize:  "
          f"{per_frame_ms(lambda: preprocess_array(und.undistort(rgb, cam), a.width), a.frames, sync):.1f} ms")
    print(f"model_input_torch on {device}: "
          f"{per_frame_ms(lambda: und.model_input_torch(rgb, cam, a.width, device), a.frames, sync):.1f} ms")


if __name__ == "__main__":
    main()
