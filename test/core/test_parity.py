"""Numerical parity with the reference implementation's fixtures (fp32, CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lingbot_map_ros.config import StreamConfig
from lingbot_map_ros.stream.session import StreamingSession

RTOL = 1e-4


def run_stream(model, fixture_config, images, keyframe_interval):
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(keyframe_interval=keyframe_interval, backend="sdpa")
    session = StreamingSession(model, cfg)
    results = []
    for image in images:
        results += session.push(torch.from_numpy(image))
    return results


def rel_err(actual, expected):
    """Max error relative to the reference's magnitude (per frame for poses, elementwise otherwise)."""
    return float(np.max(np.abs(actual - expected) / np.maximum(np.abs(expected), 1e-6)))


@pytest.fixture(scope="module", params=[1, 2], ids=["kf1", "kf2"])
def streamed(request, tiny_model, fixtures, fixture_config):
    ref = dict(np.load(fixtures / f"reference_kf{request.param}.npz"))
    return ref, run_stream(tiny_model, fixture_config, ref["images"], request.param), request.param


def test_keyframe_pattern(streamed):
    ref, results, interval = streamed
    assert [r.frame_index for r in results] == list(range(12))
    expected = [i < 2 or (i - 2) % interval == 0 for i in range(12)]
    assert [r.is_keyframe for r in results] == expected


def test_pose_enc_parity(streamed):
    ref, results, _ = streamed
    pose = np.stack([r.pose_enc for r in results])
    scale = np.abs(ref["pose_enc"]).max(axis=1, keepdims=True)
    assert np.max(np.abs(pose - ref["pose_enc"]) / scale) < RTOL


def test_depth_and_confidence_parity(streamed):
    ref, results, _ = streamed
    assert rel_err(np.stack([r.depth for r in results]), ref["depth"]) < RTOL
    assert rel_err(np.stack([r.confidence for r in results]), ref["depth_conf"]) < RTOL


def test_decoded_pose_and_intrinsics(streamed):
    ref, results, _ = streamed
    c2w = np.stack([r.c2w for r in results])
    np.testing.assert_allclose(c2w[:, :3, :], ref["pose_3x4"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(c2w[:, 3], np.tile([0, 0, 0, 1.0], (12, 1)))
    K = np.stack([r.intrinsics for r in results])
    finite = np.isfinite(ref["intrinsics"])
    assert np.array_equal(finite, np.isfinite(K))
    np.testing.assert_allclose(K[finite], ref["intrinsics"][finite], rtol=1e-3)


def test_results_do_not_depend_on_the_fixture_images_array(tiny_model, fixtures, fixture_config):
    """Preprocessing the fixture frames ourselves gives the same first outputs as the fixture images."""
    from lingbot_map_ros.io.preprocess import load_sequence

    images = load_sequence(fixtures / "frames", width=fixture_config["preprocess_width"], max_frames=3)
    ref = np.load(fixtures / "reference_kf1.npz")
    results = run_stream(tiny_model, fixture_config, images, 1)
    pose = np.stack([r.pose_enc for r in results])
    np.testing.assert_allclose(pose, ref["pose_enc"][:3], rtol=RTOL, atol=RTOL)


def test_bf16_on_cpu_stays_within_bf16_tolerance(fixtures, fixture_config):
    """The bf16 path (aggregator weights and autocast in bf16, heads fp32) on CPU."""
    from lingbot_map_ros.config import ModelConfig
    from lingbot_map_ros.io.checkpoint import load_model

    model = load_model(ModelConfig.from_dict(fixture_config), fixtures / "weights.safetensors", dtype="bf16")
    ref = np.load(fixtures / "reference_kf1.npz")
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(dtype="bf16", backend="sdpa")
    session = StreamingSession(model, cfg)
    results = []
    for image in ref["images"][:8]:
        results += session.push(torch.from_numpy(image))
    for key, ref_key in (("pose_enc", "pose_enc"), ("depth", "depth"), ("confidence", "depth_conf")):
        got = np.stack([getattr(r, key) for r in results])
        expected = ref[ref_key][:8]
        assert np.abs(got - expected).max() / np.abs(expected).max() < 3e-2, key
