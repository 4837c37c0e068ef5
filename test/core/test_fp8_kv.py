"""FP8 K/V storage (cache.fp8, kv_cache_dtype fp8) on the CPU: quantisation, the pool, a stream."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.fp8 import FP8, FP8_MAX, Fp8KVPool, dequantize_reference, kv_pool_bytes, quantize_rows
from lingbot_map_ros.cache.pool import KVPool
from lingbot_map_ros.config import ConfigError, StreamConfig
from lingbot_map_ros.stream.session import SessionError, StreamingSession


def test_quantize_rows_error_is_relative_to_each_row():
    gen = torch.Generator().manual_seed(1)
    # rows of very different magnitudes: a per-tensor scale would flush the small ones to zero
    x = torch.randn(50, 4, 64, generator=gen) * torch.logspace(-4, 3, 50)[:, None, None]
    q, s = quantize_rows(x, torch.float32)
    assert q.dtype == FP8 and s.shape == (50, 4)
    back = dequantize_reference(q, s, torch.empty_like(x))
    rel = (back - x).abs().amax(-1) / x.abs().amax(-1)
    assert float(rel.max()) <= 2.0 ** -4  # e4m3: 3 mantissa bits, half an ulp at the row's top
    assert float(q.float().abs().amax()) == FP8_MAX  # each row's largest value lands on the range's top


def test_quantize_zero_and_bf16_scales():
    q, s = quantize_rows(torch.zeros(3, 2, 64), torch.bfloat16)
    assert s.dtype == torch.bfloat16 and torch.isfinite(s.float()).all()
    assert torch.equal(dequantize_reference(q, s, torch.empty(3, 2, 64)), torch.zeros(3, 2, 64))
    x = torch.randn(5, 2, 64)
    q, s = quantize_rows(x, torch.bfloat16)  # the rounded scale is the one divided by: no error added
    back = dequantize_reference(q, s, torch.empty_like(x))
    assert float(((back - x).abs().amax(-1) / x.abs().amax(-1)).max()) <= 2.0 ** -4


def test_pool_write_load_and_kernel_rows():
    gen = torch.Generator().manual_seed(2)
    pool = Fp8KVPool(2, 5, 7, 3, 64, torch.float32, torch.device("cpu"))
    ref = KVPool(2, 5, 7, 3, 64, torch.float32, torch.device("cpu"))
    slots = torch.tensor([3, 9, 21, 34])
    k, v = torch.randn(4, 3, 64, generator=gen), torch.randn(4, 3, 64, generator=gen)
    pool.write(1, slots, k, v)
    ref.write(1, slots, k, v)
    rk, rv = pool.load(1)
    assert rk.shape == ref.k[1].shape and rk.dtype == torch.float32
    torch.testing.assert_close(rk, ref.k[1], atol=0.07 * float(k.abs().max()), rtol=0)
    torch.testing.assert_close(rv, ref.v[1], atol=0.07 * float(v.abs().max()), rtol=0)
    assert float(pool.load(0)[0].abs().max()) == 0.0  # the other layer is untouched
    # the fused path: a kernel writes rows into the read buffer, store_written keeps them
    kv_rows, vv_rows = pool.layer_view(0)
    kv_rows.view(-1, 3, 64)[slots] = k
    vv_rows.view(-1, 3, 64)[slots] = v
    pool.store_written(0, slots)
    kv_rows.zero_()
    torch.testing.assert_close(pool.load(0)[0].view(-1, 3, 64)[slots], k, atol=0.07 * float(k.abs().max()), rtol=0)


def test_pool_bytes_match_the_formula_and_halve_bf16():
    pool = Fp8KVPool(3, 6, 10, 4, 64, torch.bfloat16, torch.device("cpu"))
    assert pool.nbytes == kv_pool_bytes(3, 6, 10, 4, 64, 2, fp8=True)
    bf16 = kv_pool_bytes(24, 90, 999, 16, 64, 2, fp8=False)
    fp8 = kv_pool_bytes(24, 90, 999, 16, 64, 2, fp8=True)
    assert 0.5 < fp8 / bf16 < 0.6


def test_config_checks_the_kv_cache_dtype():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        StreamConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="needs dtype 'bf16'"):
        StreamConfig(dtype="fp32", kv_cache_dtype="bf16")
    assert StreamConfig(dtype="fp32", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_fp8_stream_tracks_the_fp32_stream(tiny_model, fixture_config, fixtures):
    """The tiny model, fp32, SDPA: the same frames with the cache in fp8 stay close to the
    fp32 cache (seen on the CPU: pose 0.012, depth 0.0028 of the fp32 range; bound 0.05)."""
    images = torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])
    outs = {}
    for kv in ("auto", "fp8"):
        cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", kv_cache_dtype=kv)
        session = StreamingSession(tiny_model, cfg)
        res = []
        for f in images:
            res += session.push(f)
        outs[kv] = res
        if kv == "fp8":
            assert isinstance(session._runner.pool, Fp8KVPool)
    assert len(outs["fp8"]) == len(outs["auto"]) == len(images)
    for key in ("pose_enc", "depth"):
        a = np.stack([getattr(r, key) for r in outs["fp8"]])
        b = np.stack([getattr(r, key) for r in outs["auto"]])
        assert np.isfinite(a).all()
        dev = float(np.abs(a - b).max() / np.abs(b).max())
        assert 0 < dev < 0.05, (key, dev)


def test_fp8_refused_with_a_shared_storage(tiny_model, fixture_config):
    from lingbot_map_ros.cache.pool import SharedKVStorage

    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", kv_cache_dtype="fp8")
    storage = SharedKVStorage(2, 2, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(SessionError, match="single camera"):
        StreamingSession(tiny_model, cfg, storage=storage, owner="a")


def test_fp8_fused_and_static_paths_equal_the_plain_path(tiny_model, fixture_config, fixtures, monkeypatch):
    """With FP8 K/V, the fused plumbing (the kernel writes K/V rows into the read buffer,
    ``store_written`` quantises them; twins stand in for the Triton kernels) and the CUDA-graph
    step's static path (run eagerly on the CPU) give the plain path's outputs."""

    from lingbot_map_ros.kernels import layer_norm, mlp as mlp_kernels, qk_rope, residual
    from multi_camera_helpers import EagerStaticSteps

    images = torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", kv_cache_dtype="fp8")

    def run(fused: bool = False, static: bool = False):
        session = StreamingSession(tiny_model, cfg, steps=EagerStaticSteps() if static else None, fused=fused)
        out = []
        for f in images[:7]:
            out += session.push(f)
        assert isinstance(session._runner.pool, Fp8KVPool)
        return out, session

    plain, _ = run()
    static, session = run(static=True)
    assert session._runner.graphed is not None
    monkeypatch.setattr(residual, "residual_add", lambda x, b, g, norm=None, norm_dtype=torch.bfloat16:
                        residual.residual_add_reference(x, b, g, norm, norm_dtype))
    monkeypatch.setattr(mlp_kernels, "gelu_epilogue_mlp", lambda module, x: module(x))
    monkeypatch.setattr(qk_rope, "qk_norm_rope", qk_rope.qk_norm_rope_reference)
    monkeypatch.setattr(layer_norm, "layer_norm", layer_norm.layer_norm_reference)
    fused, _ = run(fused=True)
    for other in (static, fused):
        assert len(other) == len(plain) == 7
        for a, b in zip(other, plain):
            np.testing.assert_allclose(a.pose_enc, b.pose_enc, rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(a.depth, b.depth, rtol=1e-3, atol=1e-4)
