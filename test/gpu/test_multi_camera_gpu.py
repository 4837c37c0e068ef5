"""Several cameras on one shared K/V storage, on CUDA with the released path (bf16, FlashInfer,
CUDA graphs, Triton kernels): each camera's outputs equal a single-camera session's on the
same frames, whatever the interleaving, including pipelined submits across cameras.

The cameras run in turn (one step per camera, ``stream.multi``), or several cameras' frames
together in one batched trunk (``CameraSessions.submit_many``): the batched step must equal the
per-camera steps (up to the rounding of bf16 matrix products of another row count: bounded
by what bf16 itself changes against float32).
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.attention import flashinfer_available
from lingbot_map_ros.config import ModelConfig, StreamConfig
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.stream.multi import CameraSessions
from lingbot_map_ros.stream.session import StreamingSession

from fixtures_path import fixture_dir  # test/ is on sys.path (test/conftest.py)

FIXTURES = fixture_dir()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(FIXTURES is None, reason="fixtures not found: set LINGBOT_FIXTURES, or copy "
                       "shared/fixtures/upstream_tiny to <repo>/.fixtures/upstream_tiny"),
]


@pytest.fixture(scope="module")
def setup():
    if not flashinfer_available():
        pytest.skip("flashinfer is not installed (carry its wheels to the GPU machine, see GPU.md)")
    config = json.loads((FIXTURES / "config.json").read_text())
    model = load_model(ModelConfig.from_dict(config), FIXTURES / "weights.safetensors", device="cuda", dtype="bf16")
    cfg = StreamConfig.from_dict(config).with_overrides(backend="flashinfer-fa3", dtype="bf16", device="cuda")
    images = torch.from_numpy(np.load(FIXTURES / "reference_kf1.npz")["images"])
    return model, cfg, images


def sequences(images, n):
    frames = list(images)
    return [frames, frames[::-1], frames[5:] + frames[:5]][:n]


@pytest.mark.parametrize("n,queued", [(2, False), (3, True)])
def test_cameras_on_one_storage_equal_single_camera_sessions(setup, n, queued):
    model, cfg, images = setup
    names = ["front", "rear", "left"][:n]
    seqs = dict(zip(names, sequences(images, n)))
    cams = CameraSessions(model, {c: (cfg, None) for c in names})
    order = [c for c in names for _ in range(len(images))]
    random.Random(n).shuffle(order)
    fed = {c: 0 for c in names}
    pending, results = [], {c: [] for c in names}
    for c in order:
        p = cams.sessions[c].submit(seqs[c][fed[c]].cuda())
        fed[c] += 1
        if queued:  # take a result only after the next camera's step was launched
            pending.append((c, p))
            if len(pending) > 1:
                name, older = pending.pop(0)
                results[name] += cams.sessions[name].results(older)
        else:
            results[c] += cams.sessions[c].results(p)
    for name, p in pending:
        results[name] += cams.sessions[name].results(p)
    assert all(s.graph_fallbacks == 0 for s in cams.inner.values())
    assert any(s._runner.graphed is not None and s._runner.graphed.replays > 0 for s in cams.inner.values())
    worst = 0.0
    for c in names:
        single = StreamingSession(model, cfg)
        ref = []
        for f in seqs[c]:
            ref += single.push(f.cuda())
        assert [r.frame_index for r in results[c]] == [r.frame_index for r in ref]
        for a, b in zip(results[c], ref):
            for field in ("pose_enc", "depth", "confidence"):
                diff = float(np.abs(getattr(a, field) - getattr(b, field)).max())
                worst = max(worst, diff)
    print(f"MULTI-CAMERA n={n} queued={queued}: max |multi - single| = {worst:.3e}")
    assert worst <= 1e-3, worst


def fp32_session(model_fp32, config):
    cfg = StreamConfig.from_dict(config).with_overrides(backend="sdpa", dtype="fp32", device="cuda")
    return StreamingSession(model_fp32, cfg)


def test_batched_cameras_equal_per_camera_steps(setup):
    """3 cameras, random subsets arriving together, batches pipelined (batch t's results taken
    after batch t+1 was launched): per camera the outputs of the per-camera graphed steps."""
    model, cfg, images = setup
    names = ["front", "rear", "left"]
    seqs = dict(zip(names, sequences(images, 3)))
    cams = CameraSessions(model, {c: (cfg, None) for c in names})
    nxt = {c: 0 for c in names}
    rng = random.Random(7)
    pending, results = [], {c: [] for c in names}
    while any(nxt[c] < len(seqs[c]) for c in names):
        left = [c for c in names if nxt[c] < len(seqs[c])]
        arriving = left if rng.random() < 0.6 else rng.sample(left, rng.randint(1, len(left)))
        out = cams.submit_many({c: seqs[c][nxt[c]].cuda() for c in arriving})
        for c in arriving:
            nxt[c] += 1
            assert not isinstance(out[c], Exception), out[c]
        if pending:
            for c, p in pending.pop(0).items():
                results[c] += cams.sessions[c].results(p)
        pending.append(out)
    for out in pending:
        for c, p in out.items():
            results[c] += cams.sessions[c].results(p)
    inner = list(cams.inner.values())
    assert all(s.graph_fallbacks == 0 for s in inner)
    assert all(s.batched_steps > 0 for s in inner), [s.batched_steps for s in inner]
    batches = inner[0].batch_group.batches
    assert batches and all(b.graph is not None and b.replays > 0 for b in batches.values() if b.steps)
    fused = inner[0].step_options.fused

    config = json.loads((FIXTURES / "config.json").read_text())
    model32 = load_model(ModelConfig.from_dict(config), FIXTURES / "weights.safetensors", device="cuda",
                         dtype="fp32")
    worst_batch = worst_bf16 = 0.0
    for c in names:
        single, exact = StreamingSession(model, cfg), fp32_session(model32, config)
        ref, ref32 = [], []
        for f in seqs[c]:
            ref += single.push(f.cuda())
            ref32 += exact.push(f.cuda())
        assert [r.frame_index for r in results[c]] == [r.frame_index for r in ref]
        for a, b, e in zip(results[c], ref, ref32):
            for field in ("pose_enc", "depth", "confidence"):
                worst_batch = max(worst_batch, float(np.abs(getattr(a, field) - getattr(b, field)).max()))
                worst_bf16 = max(worst_bf16, float(np.abs(getattr(b, field) - getattr(e, field)).max()))
    print(f"BATCHED 3 cameras (fused={fused}): max |batched - per-camera| = {worst_batch:.3e}; "
          f"max |bf16 per-camera - fp32| = {worst_bf16:.3e}; batched steps "
          f"{[s.batched_steps for s in inner]}, batch graphs {len(batches)}")
    assert worst_batch <= max(1e-3, worst_bf16), (worst_batch, worst_bf16)
