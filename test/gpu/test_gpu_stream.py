"""Streaming the tiny fixture on CUDA: bf16 agreement with the fp32 reference for each
attention backend, and no host synchronisation inside a steady-state step.

bf16 follows the reference demo (SPEC 8b): aggregator weights bf16 under bf16
autocast, bf16 K/V pages, heads float32 (``load_model(dtype="bf16")``).
Agreement is measured per output as max |ours - reference| / max |reference| over all
12 frames. Run on the GPU machine: ``pytest -m gpu test/gpu -s`` prints the figures.
"""
from __future__ import annotations

import json
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.attention import flashinfer_available
from lingbot_map_ros.config import ModelConfig, StreamConfig
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.stream.session import StreamingSession

from fixtures_path import fixture_dir  # test/ is on sys.path (test/conftest.py)

FIXTURES = fixture_dir()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(FIXTURES is None, reason="fixtures not found: set LINGBOT_FIXTURES, or copy "
                       "shared/fixtures/upstream_tiny to <repo>/.fixtures/upstream_tiny"),
]

BF16_REL_TOL = 3e-2
OUTPUTS = {"pose_enc": "pose_enc", "depth": "depth", "depth_conf": "confidence"}  # reference key -> FrameResult field
RUNS = [("sdpa", "fp32"), ("sdpa", "bf16"), ("flashinfer-fa2", "bf16"), ("flashinfer-fa3", "bf16")]


def require(backend: str) -> None:
    if backend.startswith("flashinfer") and not flashinfer_available():
        pytest.skip("flashinfer is not installed (carry its wheels to the GPU machine, see GPU.md)")


def make_session(backend: str, dtype: str, keyframe_interval: int, fused: bool | None = None,
                 **overrides) -> StreamingSession:
    config = json.loads((FIXTURES / "config.json").read_text())
    model = load_model(ModelConfig.from_dict(config), FIXTURES / "weights.safetensors", device="cuda", dtype=dtype)
    cfg = StreamConfig.from_dict(config).with_overrides(keyframe_interval=keyframe_interval, backend=backend,
                                                        dtype=dtype, device="cuda", **overrides)
    return StreamingSession(model, cfg, fused=fused)


def reference(keyframe_interval: int) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / f"reference_kf{keyframe_interval}.npz"))


@pytest.mark.parametrize("keyframe_interval", [1, 2], ids=["kf1", "kf2"])
@pytest.mark.parametrize("backend,dtype", RUNS, ids=[f"{b}-{d}" for b, d in RUNS])
def test_stream_matches_fp32_reference(backend, dtype, keyframe_interval):
    require(backend)
    ref = reference(keyframe_interval)
    session = make_session(backend, dtype, keyframe_interval)
    assert session.backend.name.startswith(backend)
    results = []
    for image in ref["images"]:
        results += session.push(image)
    assert [r.frame_index for r in results] == list(range(len(ref["images"])))
    assert [r.is_keyframe for r in results] == [session.is_keyframe_index(i) for i in range(len(results))]
    errors = {}
    for key, field in OUTPUTS.items():
        ours = np.stack([getattr(r, field) for r in results])
        errors[key] = float(np.abs(ours - ref[key]).max() / np.abs(ref[key]).max())
    print(f"STREAM {backend} {dtype} kf{keyframe_interval}: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert all(v < BF16_REL_TOL for v in errors.values()), errors


def sync_sites(fn) -> list[str]:
    """Run fn under sync debug mode "warn"; return the call chain of every synchronising op."""
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # not torch's "prototype" notice
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            sites.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


@pytest.mark.parametrize("backend", ["sdpa", "flashinfer-fa2", "flashinfer-fa3"])
def test_steady_state_step_does_not_sync(backend, monkeypatch):
    """Everything of a phase-2 push up to the conversion of its results (plan, copies of the
    plan to the device, the model step with both heads, the page-table update) runs without
    a host synchronisation; only ``_results`` (the ``.cpu()`` of the outputs) may sync."""
    require(backend)
    images = reference(2)["images"]
    session = make_session(backend, "bf16", keyframe_interval=2)
    for image in images[:6]:  # phase 1, keyframes and non-keyframes: compiles, tables, caches warmed
        session.push(image)

    whole = sync_sites(lambda: session.push(images[6]))
    print(f"SYNC {backend} whole push (informational): {len(whole)} sites")
    for site in whole:
        print(f"SYNC   {site}")

    convert = session._runner._results

    def convert_unchecked(*args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        return convert(*args, **kwargs)

    monkeypatch.setattr(session._runner, "_results", convert_unchecked)
    for image in images[7:9]:  # a non-keyframe, then a keyframe that evicts
        sites = sync_sites(lambda: session.push(image))
        assert not sites, "host syncs in the step:\n" + "\n".join(sites)
    for image in images[9:11]:  # the same under "error": any synchronising call raises
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert len(session.push(image)) == 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(f"SYNC {backend} step (push without result conversion): none")


@pytest.mark.parametrize("backend", ["sdpa", "flashinfer-fa3"])
def test_fused_kernels_match_the_pytorch_path(backend):
    """The same bf16 stream with the Triton kernels (default on CUDA) and without: the
    kernels compute the PyTorch path's maths, so only bf16 rounding may differ."""
    require(backend)
    from lingbot_map_ros.kernels import available

    if not available("cuda"):
        pytest.skip("Triton is not importable")
    images = reference(2)["images"]
    runs = {}
    for fused in (True, False):
        # float32 depth head: its bf16 copy amplifies bf16 rounding differences on this tiny model
        session = make_session(backend, "bf16", keyframe_interval=2, fused=fused, bf16_depth_head=False)
        out = []
        for image in images:
            out += session.push(image)
        runs[fused] = out
    errors = {}
    for field in OUTPUTS.values():
        a = np.stack([getattr(r, field) for r in runs[True]])
        b = np.stack([getattr(r, field) for r in runs[False]])
        errors[field] = float(np.abs(a - b).max() / np.abs(b).max())
    print(f"FUSED {backend} vs PyTorch path: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert all(v < 1e-2 for v in errors.values()), errors


def test_uint8_frames_become_the_float_frames_on_the_gpu():
    """A uint8 camera frame is copied as bytes and divided by 255 on the GPU: bit-identical to
    the host's float32 preprocessing (a reciprocal multiplication would miss by an ulp)."""
    from lingbot_map_ros.config import ModelConfig, StreamConfig
    from lingbot_map_ros.io.checkpoint import load_model
    from lingbot_map_ros.io.preprocess import uint8_to_image
    from lingbot_map_ros.stream.session import StreamingSession

    model = load_model(ModelConfig.preset("tiny"), None, device="cuda", dtype="fp32", seed=0)
    session = StreamingSession(model, StreamConfig(backend="sdpa", device="cuda"))
    rgb = np.random.default_rng(1).integers(0, 256, (378, 518, 3), dtype=np.uint8)
    rgb[0, :256, 0] = np.arange(256)  # every byte value
    on_gpu = session._runner.device_frame(session.check_frame(rgb)).cpu().numpy()
    np.testing.assert_array_equal(on_gpu, uint8_to_image(rgb))


def test_float32_heads_wait_in_host_memory_while_sessions_run_their_copies():
    """A bf16 session runs the heads' bf16 copies: the model's float32 heads leave the GPU (the
    camera head alone is 0.8 GiB at the released size) and come back for a session that runs
    them; the outputs, the weights and the journal's fingerprint of the weights do not change."""
    from lingbot_map_ros.journal.identity import weights_fingerprint

    config = json.loads((FIXTURES / "config.json").read_text())
    model = load_model(ModelConfig.from_dict(config), FIXTURES / "weights.safetensors", device="cuda", dtype="bf16")
    fingerprint = weights_fingerprint(model)
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    base = StreamConfig.from_dict(config).with_overrides(backend="sdpa", dtype="bf16", device="cuda")
    images = torch.from_numpy(np.load(FIXTURES / "reference_kf1.npz")["images"])

    def run(cfg):
        session = StreamingSession(model, cfg)
        out = []
        for image in images:
            out += session.push(image.cuda())
        return session, out

    with_copies, first = run(base)
    assert with_copies.step_options.depth_head is not None
    assert next(model.depth_head.parameters()).device.type == "cpu"
    if with_copies.step_options.camera_head is not None:  # the Triton kernels run here
        assert next(model.camera_head.parameters()).device.type == "cpu"
    assert weights_fingerprint(model) == fingerprint
    own, plain = run(base.with_overrides(bf16_depth_head=False, bf16_camera_head=False))
    assert own.step_options.depth_head is None and own.step_options.camera_head is None
    assert next(model.depth_head.parameters()).device.type == "cuda"
    assert next(model.camera_head.parameters()).device.type == "cuda"
    again, second = run(base)  # the float32 heads stay for `own`, which still lives
    assert next(model.camera_head.parameters()).device.type == "cuda"
    for a, b in zip(first, second):
        assert np.array_equal(a.depth, b.depth) and np.array_equal(a.pose_enc, b.pose_enc)
    for a, b in zip(first, plain):  # the copies' rounding only
        assert np.allclose(a.depth, b.depth, rtol=5e-2, atol=5e-2 * float(np.abs(b.depth).max()))
    assert all(torch.equal(weights[k], v.detach().cpu()) for k, v in model.state_dict().items())
    assert weights_fingerprint(model) == fingerprint
