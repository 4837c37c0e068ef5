"""Undistortion on the GPU (``robot/undistort.model_input_torch`` on CUDA) against the host path
(numpy remap, Pillow resize and crop), and the engine choosing it for a CUDA session.

Run on the GPU machine: ``pytest -m gpu test/gpu/test_undistort_gpu.py -s`` (prints the time
of both paths for a 1280x720 frame)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from lingbot_map_ros.config import ModelConfig
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.io.preprocess import preprocess_array
from lingbot_map_ros.robot.undistort import CameraModel, Undistorter
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.stream.long_stream import LongStreamSession
from lingbot_map_ros.stream.session import StreamingSession

from engine_fakes import Log, Sink  # test/ is on sys.path (conftest.py)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def textured(width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 RGB [height, width, 3]: 8-pixel blocks plus a smooth wave."""
    rng = np.random.default_rng(seed)
    blocks = np.kron(rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3)).astype(np.float32),
                     np.ones((8, 8, 1)))[:height, :width]
    v, u = np.mgrid[0:height, 0:width]
    wave = 127 + 120 * (np.sin(u / 7.0) * np.cos(v / 11.0))[..., None]
    return np.clip(0.6 * blocks + 0.4 * wave, 0, 255).astype(np.uint8)


def camera(width: int, height: int, model: str = "plumb_bob") -> CameraModel:
    K = (0.8 * width, 0.0, width / 2 + 1.3, 0.0, 0.8 * width + 4, height / 2 - 2.1, 0.0, 0.0, 1.0)
    D = (-0.28, 0.09, 0.001, -0.001, 0.0) if model == "plumb_bob" else (-0.02, 0.005, -0.001, 0.0004)
    return CameraModel(width, height, K, D, model)


@pytest.mark.parametrize("size, model, width", [((1280, 720), "plumb_bob", 518), ((640, 480), "equidistant", 518),
                                                ((518, 294), "plumb_bob", 518)])
def test_gpu_model_input_matches_the_host_path(size, model, width):
    """Same shape; every value within two 8-bit counts of the host path and fewer than 1 % off
    (the CPU measurement of the same maths: 0.2 %)."""
    w, h = size
    cam, rgb, und = camera(w, h, model), textured(w, h), Undistorter()
    host = preprocess_array(und.undistort(rgb, cam), width)
    got = und.model_input_torch(rgb, cam, width, "cuda")
    assert got.device.type == "cuda" and got.dtype == torch.float32 and tuple(got.shape) == host.shape
    diff = np.abs(got.cpu().numpy() - host) * 255
    assert diff.max() <= 2.0 + 1e-3 and (diff > 0.5).mean() < 0.01, (diff.max(), (diff > 0.5).mean())


def test_gpu_path_time_at_1280x720():
    """Reports (does not judge) the time of both paths for one 1280x720 frame to the model input."""
    cam, rgb, und = camera(1280, 720), textured(1280, 720), Undistorter()
    for _ in range(3):  # grids and kernels built, caches warm
        und.model_input_torch(rgb, cam, 518, "cuda")
        preprocess_array(und.undistort(rgb, cam), 518)
    torch.cuda.synchronize()
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        out = und.model_input_torch(rgb, cam, 518, "cuda")
    torch.cuda.synchronize()
    gpu_ms = (time.perf_counter() - t0) * 1e3 / n
    t0 = time.perf_counter()
    for _ in range(n):
        preprocess_array(und.undistort(rgb, cam), 518)
    host_ms = (time.perf_counter() - t0) * 1e3 / n
    print(f"\n1280x720 plumb_bob -> 518x294: GPU path {gpu_ms:.2f} ms (bytes up, remap, resize, crop), "
          f"host path {host_ms:.2f} ms (numpy remap + Pillow resize)")
    assert out.shape == (3, 294, 518)


class Recording:
    def __init__(self, session) -> None:
        self._s = session
        self.pushed = []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def submit(self, image, keyframe=None, stamp=None, tag=None):
        self.pushed.append(image)
        return self._s.submit(image, keyframe, stamp, tag)


def test_engine_undistorts_on_the_cuda_session_device():
    """A CUDA session: distorted frames are pushed as float tensors already on the GPU, the poses
    are finite and equal the same session type's on those tensors."""
    settings = resolve_settings({"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cuda",
                                 "dtype": "fp32", "backend": "sdpa", "cuda_graphs": False, "accumulate_map": False})
    model = load_model(ModelConfig.preset("tiny"), None, device="cuda", seed=3)
    session = Recording(LongStreamSession(StreamingSession(model, settings.stream)))  # one window
    sink = Sink(wants=())
    engine = InferenceEngine(session, settings, sink, Log(), now=lambda: 1000.0)
    cam = camera(640, 360)
    for i in range(4):
        engine.submit_frame(InputFrame(rgb=textured(640, 360, seed=i), stamp=float(i), stamp_s=float(i),
                                       camera_frame="cam", camera=cam))
        while engine.run_once(0):
            pass
    assert engine.inputs.frames_undistorted == 4 and len(sink.frames) == 4
    assert all(isinstance(im, torch.Tensor) and im.device.type == "cuda" for im in session.pushed)
    check = StreamingSession(model, settings.stream)
    expected = [r for im in session.pushed for r in check.push(im.clone())]
    np.testing.assert_allclose(sink.frames[-1].T_map_cam[:3, :3].T @ sink.frames[-1].T_map_cam[:3, :3], np.eye(3),
                               atol=1e-5)
    from lingbot_map_ros.geometry import optical_pose_to_map

    np.testing.assert_allclose(sink.frames[-1].T_map_cam, optical_pose_to_map(expected[-1].c2w), atol=1e-4)
