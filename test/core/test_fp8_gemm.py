"""FP8 GEMMs (kernels.fp8_gemm, precision fp8) on the CPU: the twin's maths, the swap, a stream."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lingbot_map_ros.config import ConfigError, ModelConfig, StreamConfig
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.kernels.fp8_gemm import FP8, Fp8Linear, quantize_linears_, quantize_per_row
from lingbot_map_ros.stream.precision import deviation
from lingbot_map_ros.stream.session import SessionError, StreamingSession


def test_fp8_linear_is_close_to_the_linear():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(7, 3, 64) * torch.logspace(-2, 2, 7)[:, None, None]  # rows of different magnitudes
    f = Fp8Linear(lin)
    assert f.weight.dtype == FP8 and f.weight_scale.shape == (1, 48) and not f.native  # CPU: the twin
    with torch.no_grad():
        got, want = f(x), lin(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
    assert float(rel) < 0.06  # e4m3 on both operands, each row scaled on its own


def test_quantize_per_row_keeps_each_row_in_range():
    x = torch.randn(4, 32) * torch.tensor([1e-3, 1.0, 1e3, 0.0])[:, None]
    x8, s = quantize_per_row(x)
    assert x8.dtype == FP8 and s.shape == (4, 1)
    back = x8.float() * s
    torch.testing.assert_close(back[3], torch.zeros(32))
    assert float(((back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30))[:3].max()) <= 2 ** -4


def test_swap_counts_and_spares_other_modules():
    torch.manual_seed(0)
    model = load_model(ModelConfig.preset("tiny"))
    blocks = len(model.aggregator.frame_blocks) + len(model.aggregator.global_blocks)
    n = quantize_linears_(model.aggregator)
    assert n >= 4 * blocks  # + DINO's blocks
    assert not any(isinstance(m, Fp8Linear) for m in model.camera_head.modules())
    assert quantize_linears_(model.aggregator) == 0  # nothing left to swap


def test_precision_is_checked():
    with pytest.raises(ConfigError, match="precision must be one of"):
        StreamConfig(precision="int8")


@pytest.mark.slow
def test_fp8_stream_tracks_fp32(fixtures, fixture_config):
    """The tiny fixture on the CPU (fp32 activations, FP8 operands through the twin) against fp32.
    FP8 GEMMs move this small model's poses much more than bf16 does (seen, 12 frames: translation
    0.35 of the trajectory's extent, rotation 14.9 deg, depth 1.2 %, confidence 0.7 %; bf16's own:
    0.055, 2.1 deg, 0.17 %, 0.08 %), hence precision stays bf16 by default. Bounds: 1.5x seen."""
    images = torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])
    outs = {}
    for precision in ("bf16", "fp8"):
        model = load_model(ModelConfig.from_dict(fixture_config), fixtures / "weights.safetensors")
        cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", precision=precision)
        session = StreamingSession(model, cfg)
        res = []
        for f in images:
            res += session.push(f)
        outs[precision] = res
        if precision == "fp8":
            assert model.fp8_linears > 0
            with pytest.raises(SessionError, match="load the model again"):
                StreamingSession(model, cfg.with_overrides(precision="bf16"))
    d = deviation(outs["bf16"], outs["fp8"])
    assert all(np.isfinite(v) for v in d.values())
    bounds = {"translation_rel": 0.53, "rotation_deg": 22.5, "depth_rel": 0.018, "confidence_rel": 0.011}
    for key, bound in bounds.items():
        assert 0 < d[key] < bound, (key, d)
