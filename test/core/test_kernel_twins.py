"""The fused-kernel formulations, checked on CPU through their PyTorch twins.

The Triton kernels (GPU) are compared with these twins in test/gpu/test_kernels.py;
here the twins themselves are compared with the model's plain PyTorch path, and the
aggregator's fused plumbing runs end to end with the twins standing in for the
kernels. Also the split-KV arithmetic of the FlashInfer backend.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from random_norms import random_norms

from lingbot_map_ros.cache.flashinfer_backend import auto_kv_splits, split_pages
from lingbot_map_ros.config import SPECIAL_TOKENS, StreamConfig
from lingbot_map_ros.kernels import available, layer_norm, merge, qk_rope, residual
from lingbot_map_ros.kernels import mlp as mlp_kernels
from lingbot_map_ros.model.rope import (Rope3DTables, apply_rope2d, apply_rope3d_complex, rope2d_tables,
                                        rope3d_rotation)
from lingbot_map_ros.stream.session import StreamingSession

HEADS, DIM = 4, 64
GRID = (3, 5)  # patch grid of the tables
TOKENS = SPECIAL_TOKENS + GRID[0] * GRID[1]


def norms(seed: int) -> tuple[nn.LayerNorm, nn.LayerNorm]:
    return random_norms(DIM, seed)


def qkv_tensor(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(n, 3 * HEADS * DIM, generator=gen) + 0.5


def plain_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.float(), (DIM,), ln.weight, ln.bias, ln.eps)


def test_halves_tables_reproduce_rope2d():
    frames = 2
    qkv = qkv_tensor(frames * TOKENS, 0)
    qn, kn = norms(1)
    cos, sin = rope2d_tables(*GRID)
    c, s = qk_rope.tables_halves(cos, sin)
    q_out = torch.empty(frames * TOKENS, HEADS, DIM)
    k_out = torch.empty_like(q_out)
    qk_rope.qk_norm_rope_reference(qkv, HEADS, qn, kn, c, s, qk_rope.XOR_HALVES, q_out, k_out)
    q, k, _ = qkv.view(frames, TOKENS, 3, HEADS, DIM).unbind(2)
    torch.testing.assert_close(q_out.view(frames, TOKENS, HEADS, DIM), apply_rope2d(plain_norm(qn, q), cos, sin))
    torch.testing.assert_close(k_out.view(frames, TOKENS, HEADS, DIM), apply_rope2d(plain_norm(kn, k), cos, sin))


def test_interleaved_tables_reproduce_rope3d_with_slots_and_replicas():
    frames = 2
    n = frames * TOKENS
    qkv = qkv_tensor(n, 2)
    qn, kn = norms(3)
    positions = torch.tensor([5, 9])
    cos, sin = Rope3DTables(*GRID, max_frames=16).lookup(positions)  # [S, P, 32]
    c, s = (t.reshape(n, DIM) for t in qk_rope.tables_interleaved(cos, sin))
    q_out = torch.empty(3, n, HEADS, DIM)  # three identical copies
    k_rows = torch.full((4 * n, HEADS, DIM), 7.0)
    v_rows = torch.full((4 * n, HEADS, DIM), 7.0)
    slots = torch.randperm(4 * n)[:n]
    qk_rope.qk_norm_rope_reference(qkv, HEADS, qn, kn, c, s, qk_rope.XOR_INTERLEAVED, q_out, k_rows, v_rows, slots)

    q, k, v = qkv.view(frames, TOKENS, 3, HEADS, DIM).unbind(2)
    rot = rope3d_rotation(cos, sin)
    q_ref = apply_rope3d_complex(plain_norm(qn, q), rot).reshape(n, HEADS, DIM)
    k_ref = apply_rope3d_complex(plain_norm(kn, k), rot).reshape(n, HEADS, DIM)
    for r in range(3):
        torch.testing.assert_close(q_out[r], q_ref)
    torch.testing.assert_close(k_rows[slots], k_ref)
    torch.testing.assert_close(v_rows[slots], v.reshape(n, HEADS, DIM))
    untouched = torch.ones(4 * n, dtype=torch.bool)
    untouched[slots] = False
    assert bool((k_rows[untouched] == 7).all()) and bool((v_rows[untouched] == 7).all())


def test_layer_norm_twin_matches_the_module_and_rounds_once():
    ln = nn.LayerNorm(96, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(5, 7, 96) * 4 + 1
    torch.testing.assert_close(layer_norm.layer_norm_reference(x, ln, torch.float32), ln(x))
    out = layer_norm.layer_norm_reference(x, ln, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ln(x).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_residual_twin_is_addcmul_then_layer_norm(x_dtype):
    gen = torch.Generator().manual_seed(5)
    ln = nn.LayerNorm(48)
    with torch.no_grad():
        ln.weight.normal_(generator=gen)
        ln.bias.normal_(generator=gen)
    x = (3 * torch.randn(2, 7, 48, generator=gen)).to(x_dtype)
    branch = torch.randn(2, 7, 48, generator=gen).to(torch.bfloat16)
    gamma = torch.rand(48, generator=gen).to(torch.bfloat16)
    new, normed = residual.residual_add_reference(x, branch, gamma, ln, torch.bfloat16)
    # what autocast does with the addcmul: everything promoted to the widest dtype
    expected = torch.addcmul(x.to(new.dtype), branch.to(new.dtype), gamma.to(new.dtype))
    assert new.dtype == x_dtype
    torch.testing.assert_close(new, expected, rtol=0, atol=0)
    assert normed.dtype == torch.bfloat16
    torch.testing.assert_close(normed, ln(new.float()).to(torch.bfloat16), rtol=0, atol=0)
    only, none = residual.residual_add_reference(x, branch, gamma)
    assert none is None and torch.equal(only, new)


def partial_attention(q, k, v):
    """SDPA over one part of the keys, with its base-2 log-sum-exp (FlashInfer's convention)."""
    scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1).transpose(0, 1) / math.log(2)  # [N, H]
    out = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)
    return out, lse


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_merge_of_key_splits_equals_full_attention(splits):
    gen = torch.Generator().manual_seed(splits)
    q = torch.randn(11, 3, 16, generator=gen)
    k = torch.randn(40, 3, 16, generator=gen) * 2
    v = torch.randn(40, 3, 16, generator=gen)
    bounds = np.linspace(0, 40, splits + 1).astype(int)
    parts = [partial_attention(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    merged = merge.merge_reference(o, lse, torch.empty(11, 3, 16))
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)


def test_auto_kv_splits_fills_the_sms():
    # 518x378 one-frame step: 6 query tiles x 16 heads = 96 items on 132 SMs -> 10 (7 x 132 / 96 = 9.6)
    assert auto_kv_splits(1005, 16, 64, 74, 132, "fa3") == 12  # 518x378: 96 items
    assert auto_kv_splits(783, 16, 64, 74, 132, "fa3-paged") == 12  # 518x294: 80 items, capped
    assert auto_kv_splits(1005, 16, 64, 74, 264, "fa3", max_splits=64) == 24
    assert auto_kv_splits(1005, 16, 64, 3, 132, "fa3") <= 3  # never more splits than pages
    assert auto_kv_splits(1005, 16, 64, 74, 132, "fa2-paged") == 1  # the paged FA2 kernel splits keys itself
    assert auto_kv_splits(8 * 1005, 16, 64, 74, 132, "fa3") >= 1
    # a step that already fills the GPU many times over is not split
    assert auto_kv_splits(100_000, 16, 64, 74, 132, "fa3") == 1


@pytest.mark.parametrize("pages,splits", [(74, 4), (10, 4), (4, 4), (9, 1)])
def test_split_pages_cover_every_page_once(pages, splits):
    counts = split_pages(pages, splits)
    assert sum(counts) == pages and len(counts) == splits and min(counts) >= 1
    assert max(counts) - min(counts) <= 1


def test_kernels_unavailable_on_cpu():
    assert not available("cpu")


def test_fused_plumbing_with_twins_equals_plain_path(tiny_model, fixture_config, fixtures, monkeypatch):
    """The aggregator's fused path (norm hook, from_qkv, PoolAttention destinations) with the
    PyTorch twins standing in for the Triton kernels gives the plain path's outputs."""
    images = torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa")

    def run(fused: bool):
        session = StreamingSession(tiny_model, cfg, fused=fused)  # the kernel decision, forced
        out = []
        for f in images[:6]:
            out += session.push(f)
        return out

    plain = run(False)
    calls = {"qk": 0, "ln": 0, "mlp": 0, "res": 0, "res_norm": 0}

    def qk_twin(*a, **k):
        calls["qk"] += 1
        return qk_rope.qk_norm_rope_reference(*a, **k)

    def ln_twin(*a, **k):
        calls["ln"] += 1
        return layer_norm.layer_norm_reference(*a, **k)

    def mlp_exact(module, x):  # the GELU-epilogue stand-in, with the exact GELU to compare with
        calls["mlp"] += 1
        return module(x)

    def residual_twin(x, branch, gamma, norm=None, norm_dtype=torch.bfloat16):
        calls["res"] += 1
        calls["res_norm"] += norm is not None
        return residual.residual_add_reference(x, branch, gamma, norm, norm_dtype)

    monkeypatch.setattr(residual, "residual_add", residual_twin)
    monkeypatch.setattr(mlp_kernels, "gelu_epilogue_mlp", mlp_exact)
    monkeypatch.setattr(qk_rope, "qk_norm_rope", qk_twin)
    monkeypatch.setattr(layer_norm, "layer_norm", ln_twin)
    fused = run(True)
    cfg_model = tiny_model.cfg
    steps = 1 + 6 - cfg.num_scale_frames  # phase 1, then one step per frame
    assert calls["qk"] == steps * 2 * cfg_model.depth  # frame and global blocks
    blocks = cfg_model.depth * 2 + cfg_model.dino_depth
    assert calls["ln"] == steps * blocks  # norm1; norm2 comes with the first residual update
    assert calls["res"] == steps * 2 * blocks and calls["res_norm"] == steps * blocks
    assert calls["mlp"] == steps * blocks
    assert len(fused) == len(plain) == 6
    for a, b in zip(fused, plain):
        np.testing.assert_allclose(a.pose_enc, b.pose_enc, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(a.depth, b.depth, rtol=1e-4, atol=1e-5)


def test_bf16_depth_head_copy_is_close_and_leaves_the_model_alone(tiny_model, fixtures):
    """The depth head's bf16 channels-last copy (used on CUDA bf16 streams) against the
    float32 head on the same aggregator outputs."""
    head = tiny_model.depth_head
    copy = head.reduced_precision_copy()
    assert head.projects[0].weight.dtype == torch.float32  # the model keeps its float32 head
    assert copy.projects[0].weight.dtype == torch.bfloat16 and copy.norm.weight.dtype == torch.float32
    assert copy.projects[0].weight.is_contiguous(memory_format=torch.channels_last)
    images = torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])[:2]
    cfg = tiny_model.cfg
    gh, gw = images.shape[-2] // cfg.patch_size, images.shape[-1] // cfg.patch_size
    gen = torch.Generator().manual_seed(0)
    levels = [torch.randn(2, SPECIAL_TOKENS + gh * gw, 2 * cfg.embed_dim, generator=gen) for _ in range(4)]
    with torch.no_grad():
        d32, c32 = head(levels, *images.shape[-2:])
        d16, c16 = copy(levels, *images.shape[-2:])
    assert d16.dtype == torch.float32 and d16.shape == d32.shape
    for a, b in ((d16, d32), (c16, c32)):
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel < 3e-2, rel


def test_depth_head_copy_routes_its_resizes_and_norms_through_the_stand_ins(tiny_model):
    """The session hands the bf16 depth head the upsampling and LayerNorm kernels; with their
    PyTorch twins standing in, the head computes exactly what it computes without them."""
    from lingbot_map_ros.kernels.upsample import upsample_bilinear_reference

    calls = {"up": 0, "norm": 0}

    def up(x, size):
        calls["up"] += 1
        return upsample_bilinear_reference(x, size)

    def norm_to(x, norm, dtype):
        calls["norm"] += 1
        return layer_norm.layer_norm_reference(x, norm, dtype)

    head = tiny_model.depth_head
    plain = head.reduced_precision_copy(torch.float32)
    routed = head.reduced_precision_copy(torch.float32, upsample=up, norm_to=norm_to)
    cfg = tiny_model.cfg
    gen = torch.Generator().manual_seed(1)
    levels = [torch.randn(1, SPECIAL_TOKENS + 2 * 3, 2 * cfg.embed_dim, generator=gen) for _ in range(4)]
    with torch.no_grad():
        a = plain(levels, 28, 42)
        b = routed(levels, 28, 42)
    assert calls == {"up": 5, "norm": 4}
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_self_check_reports_a_kernel_that_cannot_run():
    import importlib.util

    from lingbot_map_ros import kernels

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("Triton is installed here: the failure path is exercised on machines without it")
    problem = kernels.self_check("cpu", 2, 64, (128,))
    assert problem is not None and "triton" in problem.lower()


def test_session_falls_back_when_the_kernels_fail_their_self_check(fixture_config, fixtures, monkeypatch, caplog):
    """A machine where Triton imports but cannot compile: the session warns, runs the
    PyTorch path and tells its backend not to merge with Triton either. The decision is
    the session's value, not the process's: a later session whose check passes uses them."""
    import logging

    from lingbot_map_ros import kernels
    from lingbot_map_ros.config import ModelConfig
    from lingbot_map_ros.io.checkpoint import load_model
    from lingbot_map_ros.stream import session as session_module

    model = load_model(ModelConfig.from_dict(fixture_config), fixtures / "weights.safetensors", dtype="bf16")
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", dtype="bf16", fa3_tiles=(128, 256, 3))
    monkeypatch.setattr(kernels, "available", lambda device: True)  # "Triton is there" on this CPU machine
    checks, backends = [], []
    monkeypatch.setattr(kernels, "self_check", lambda *a: checks.append(a) or "RuntimeError: no C compiler")
    real_make_backend = session_module.make_backend

    def make_backend(*args, **kwargs):
        backends.append(kwargs)
        return real_make_backend(*args, **kwargs)

    monkeypatch.setattr(session_module, "make_backend", make_backend)
    with caplog.at_level(logging.WARNING, logger="lingbot_map_ros"):
        failed = StreamingSession(model, cfg)
    assert checks == [(failed.device, model.cfg.num_heads, model.cfg.head_dim,
                       (model.cfg.embed_dim, model.cfg.dino_dim))]
    assert not failed.step_options.fused and failed.step_options.camera_head is None and "no C compiler" in caplog.text
    assert backends[-1]["fused_merge"] is False and backends[-1]["fa3_tiles"] == (128, 256, 3)

    monkeypatch.setattr(kernels, "self_check", lambda *a: None)
    passed = StreamingSession(model, cfg)
    assert passed.step_options.fused and passed.step_options.camera_head is not None and backends[-1]["fused_merge"] is True
    assert not StreamingSession(model, cfg.with_overrides(fused_kernels=False)).step_options.fused
    monkeypatch.undo()
    images = torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])
    assert len(failed.push(images[0]) + failed.push(images[1])) == 2  # the PyTorch path runs


def test_gelu_epilogue_mlp_twin_is_the_mlp_with_tanh_gelu_and_cpu_falls_back():
    from lingbot_map_ros.model.layers import Mlp

    torch.manual_seed(3)
    module = Mlp(16, 64)
    x = torch.randn(2, 5, 16)
    exact = module(x)
    twin = mlp_kernels.gelu_epilogue_mlp_reference(module, x)
    # the tanh form differs from the exact GELU, but by less than 5e-4 per activation
    assert not torch.equal(twin, exact)
    torch.testing.assert_close(twin, exact, rtol=0, atol=5e-4 * 64 * module.fc2.weight.abs().max().item())
    torch.testing.assert_close(mlp_kernels.gelu_epilogue_mlp(module, x), exact, rtol=0, atol=0)  # CPU: mlp(x)


def _camera_poses(head, cfg, head_inputs, iterations=3):
    """Pose encodings of a camera head over a few one-frame steps (its own camera cache)."""
    from lingbot_map_ros.cache.pool import CameraKVCache

    cache = CameraKVCache(iterations, cfg.camera_trunk_depth, len(head_inputs), cfg.camera_num_heads,
                          cfg.camera_dim // cfg.camera_num_heads, torch.float32, torch.device("cpu"))
    poses = []
    with torch.no_grad():
        for start, x in enumerate(head_inputs):
            poses.append(head(x, iterations, lambda it, b, q, k, v, s=start: cache.attend(it, b, q, k, v, s)))
    return torch.cat(poses)


def _trained_like(head, seed):
    """The tiny model's camera head with LayerScale, LayerNorm affines and pose tokens away
    from their identity initialisation, so every folded-in term matters."""
    head = __import__("copy").deepcopy(head)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "gamma" in name or "norm" in name or "empty_pose" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
    return head


def test_camera_head_copy_in_float32_computes_what_the_head_computes(tiny_model):
    """The copy's restructured forward (LayerNorm / SiLU folded before each product, GELU and
    the LayerScale residual after) with the PyTorch twin and float32 weights: the head's poses."""
    from lingbot_map_ros.kernels.gemv import gemv_reference

    calls = {"n": 0}

    def counting(*a, **k):
        calls["n"] += 1
        return gemv_reference(*a, **k)

    cfg = tiny_model.cfg
    head = _trained_like(tiny_model.camera_head, 0)
    copy = head.reduced_precision_copy(gemv=counting, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 7, cfg.camera_dim, generator=gen) for _ in range(4)]
    want, got = _camera_poses(head, cfg, inputs), _camera_poses(copy, cfg, inputs)
    assert got.shape == (4, 9)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # per iteration: the modulation, 4 per trunk block, the pose branch's two layers
    assert calls["n"] == 4 * 3 * (1 + 4 * cfg.camera_trunk_depth + 2)


def test_camera_head_bf16_copy_is_close_and_leaves_the_model_alone(tiny_model):
    cfg = tiny_model.cfg
    head = _trained_like(tiny_model.camera_head, 1)
    copy = head.reduced_precision_copy()
    assert head.trunk[0].attn.qkv.weight.dtype == torch.float32  # the model keeps its float32 head
    assert copy.trunk[0].attn.qkv.weight.dtype == torch.bfloat16
    assert copy.trunk[0].attn.qkv.bias.dtype == torch.float32 and copy.embed_pose.weight.dtype == torch.float32
    gen = torch.Generator().manual_seed(4)
    inputs = [torch.randn(1, 7, cfg.camera_dim, generator=gen) for _ in range(3)]
    want, got = _camera_poses(head, cfg, inputs), _camera_poses(copy, cfg, inputs)
    rel = float((got - want).abs().max() / want.abs().max())
    assert 0 < rel < 1e-2, rel  # rounded weights: close, not equal


def test_gemv_rejects_what_it_cannot_compute():
    """Argument checks come before any kernel is built (so they run on CPU)."""
    from lingbot_map_ros.kernels.gemv import gemv

    lin = nn.Linear(8, 4)
    ln = nn.LayerNorm(8)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="one prologue"):
        gemv(x, lin, norm=ln, silu=True)
    with pytest.raises(ValueError, match="go together"):
        gemv(x, lin, residual=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="float32"):
        gemv(x.double(), lin)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.randn(8, 2).t(), lin)
    with pytest.raises(ValueError, match="residual"):
        gemv(x, lin, residual=torch.zeros(3, 4), gamma=torch.ones(4))
