"""The Triton kernels (lingbot_map_ros.kernels) against their PyTorch twins, on the GPU.

The twins are checked against the model's plain PyTorch path on CPU
(test/core/test_kernel_twins.py); here each kernel must give the twin's numbers up to
the final bf16 rounding. Run on the GPU machine: ``pytest -m gpu test/gpu``.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from random_norms import random_norms

from lingbot_map_ros.kernels import available, layer_norm, merge, qk_rope
from lingbot_map_ros.model.rope import Rope3DTables, rope2d_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not available("cuda"),
                       reason="needs a CUDA device with Triton"),
]

BF16 = torch.bfloat16


def bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to one bf16 rounding step of either side."""
    torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-2)


def norms(dim: int, seed: int) -> tuple[nn.LayerNorm, nn.LayerNorm]:
    qn, kn = random_norms(dim, seed)
    return qn.to("cuda", BF16), kn.to("cuda", BF16)


@pytest.mark.parametrize("heads,grid,frames", [(16, (27, 37), 1), (16, (21, 37), 2), (2, (4, 7), 3)])
@pytest.mark.parametrize("flavour", ["halves", "interleaved"])
def test_qk_norm_rope_matches_twin(heads, grid, frames, flavour):
    tokens = 6 + grid[0] * grid[1]
    n = frames * tokens
    gen = torch.Generator().manual_seed(heads + n)
    qkv = (3 * torch.randn(n, 3 * heads * 64, generator=gen) + 0.5).to("cuda", BF16)
    qn, kn = norms(64, n)
    if flavour == "halves":
        c, s = qk_rope.tables_halves(*(t.cuda() for t in rope2d_tables(*grid)))
        xor = qk_rope.XOR_HALVES
    else:
        cos, sin = Rope3DTables(*grid, max_frames=64, device="cuda").lookup(torch.arange(frames, device="cuda") + 7)
        c, s = (t.reshape(n, 64) for t in qk_rope.tables_interleaved(cos, sin))
        xor = qk_rope.XOR_INTERLEAVED
    outs = {}
    slots = torch.randperm(2 * n + 5, generator=gen)[:n].cuda()  # the same slots for both
    for name, fn in (("kernel", qk_rope.qk_norm_rope), ("twin", qk_rope.qk_norm_rope_reference)):
        q = torch.zeros(n, heads, 64, dtype=BF16, device="cuda")
        k = torch.zeros_like(q)
        fn(qkv, heads, qn, kn, c, s, xor, q, k)
        # the global-block form: 3 query copies, K/V rows scattered to slots of a larger pool
        q3 = torch.zeros(3, n, heads, 64, dtype=BF16, device="cuda")
        kr = torch.full((2 * n + 5, heads, 64), 9.0, dtype=BF16, device="cuda")
        vr = kr.clone()
        fn(qkv, heads, qn, kn, c, s, xor, q3, kr, vr, slots)
        outs[name] = (q, k, q3, kr, vr)
    for a, b in zip(outs["kernel"], outs["twin"]):
        bf16_close(a, b)
    q, _, q3, kr, _ = outs["kernel"]
    assert torch.equal(q3[0], q) and torch.equal(q3[2], q)
    assert int((kr == 9).all(dim=(1, 2)).sum()) == n + 5  # rows off the slots untouched


@pytest.mark.parametrize("rows,channels,in_dtype", [(1005, 1024, torch.float32), (1005, 1024, BF16),
                                                    (8040, 1024, torch.float32), (34, 128, torch.float32),
                                                    (7, 96, BF16), (1005, 2048, torch.float32)])
def test_layer_norm_matches_twin(rows, channels, in_dtype):
    gen = torch.Generator().manual_seed(rows + channels)
    x = (4 * torch.randn(rows, channels, generator=gen) + 1).to("cuda", in_dtype)
    ln, _ = norms(channels, channels)
    out = layer_norm.layer_norm(x, ln, BF16)
    assert out.dtype == BF16 and out.shape == x.shape
    bf16_close(out, layer_norm.layer_norm_reference(x, ln, BF16))
    # strided rows (a view of every other row) are read in place
    bf16_close(layer_norm.layer_norm(x[::2], ln, BF16), layer_norm.layer_norm_reference(x[::2], ln, BF16))


@pytest.mark.parametrize("states", [1, 2, 4, 11])
def test_merge_states_matches_twin(states):
    gen = torch.Generator().manual_seed(states)
    o = torch.randn(states, 1005, 16, 64, generator=gen).to("cuda", BF16)
    lse = (10 * torch.randn(states, 1005, 16, generator=gen)).cuda()
    out = merge.merge_states(o, lse, torch.empty(1005, 16, 64, dtype=BF16, device="cuda"))
    bf16_close(out, merge.merge_reference(o, lse, torch.empty_like(out)))


@pytest.mark.parametrize("rows", [1005, 8 * 1005, 7])
def test_gelu_epilogue_mlp_matches_twin_and_the_exact_gelu(rows):
    from lingbot_map_ros.kernels import mlp as mlp_kernels
    from lingbot_map_ros.model.layers import Mlp

    gen = torch.Generator().manual_seed(rows)
    module = Mlp(1024, 4096)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.03)
    module = module.to("cuda", BF16)
    x = torch.randn(rows, 1024, generator=gen).to("cuda", BF16)
    fused = mlp_kernels.gelu_epilogue_mlp(module, x).float()
    twin = mlp_kernels.gelu_epilogue_mlp_reference(module, x).float()
    exact32 = copy.deepcopy(module).float()(x.float())  # float32 MLP with the exact GELU
    scale = exact32.abs().max()
    # two bf16 GEMMs in a row: both bf16 forms sit within bf16 noise of the float32 result,
    # and the fused one (GELU on the float32 accumulator, one rounding) is no further from it
    err_fused = (fused - exact32).abs().max() / scale
    err_twin = (twin - exact32).abs().max() / scale
    assert err_fused < 1e-2 and err_twin < 1e-2, (err_fused, err_twin)
    assert err_fused <= 1.5 * err_twin, (err_fused, err_twin)
    assert (fused - twin).abs().max() / scale < 1e-2


@pytest.mark.parametrize("rows,channels,x_dtype", [(1005, 1024, torch.float32), (8 * 1005, 1024, torch.float32),
                                                   (1005, 1024, BF16), (7, 96, torch.float32), (34, 2048, BF16)])
def test_residual_add_matches_twin(rows, channels, x_dtype):
    from lingbot_map_ros.kernels import residual

    gen = torch.Generator().manual_seed(rows + channels)
    x = (4 * torch.randn(2 * rows, channels, generator=gen) + 1).to("cuda", x_dtype)[::2]  # strided rows
    branch = torch.randn(rows, channels, generator=gen).to("cuda", BF16)
    gamma = torch.rand(channels, generator=gen).to("cuda", BF16)
    ln, _ = norms(channels, channels)
    new, normed = residual.residual_add(x, branch, gamma, ln, BF16)
    want_new, want_normed = residual.residual_add_reference(x, branch, gamma, ln, BF16)
    assert new.dtype == x_dtype and normed.dtype == BF16 and new.shape == normed.shape == x.shape
    # float32 stream: the same sum up to an FMA's rounding; bf16 stream: one bf16 step
    if x_dtype == torch.float32:
        torch.testing.assert_close(new, want_new, rtol=1e-6, atol=1e-6)
    else:
        bf16_close(new, want_new)
    bf16_close(normed, want_normed)
    alone, nothing = residual.residual_add(x, branch, gamma)
    assert nothing is None and torch.equal(alone, new)


@pytest.mark.parametrize("k,n", [(2048, 6144), (2048, 2048), (8192, 2048), (2048, 8192), (1024, 9), (100, 37)])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("extra", ["plain", "norm", "norm_gelu", "silu", "residual"])
def test_gemv_matches_twin(k, n, rows, extra):
    """bf16 weights, float32 activations: the kernel against the twin (same weights), for every
    prologue / epilogue the camera head uses, at its shapes and odd ones; strided input rows."""
    from lingbot_map_ros.kernels.gemv import gemv, gemv_reference

    gen = torch.Generator().manual_seed(k + n + rows)
    lin = nn.Linear(k, n)
    ln = nn.LayerNorm(k)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(k, generator=gen))
        ln.bias.copy_(0.2 * torch.randn(k, generator=gen))
    lin, ln = lin.cuda(), ln.cuda()
    lin.weight.data = lin.weight.data.to(BF16)
    x = (2 * torch.randn(rows, k + 5, generator=gen) + 0.5).cuda()[:, :k]  # rows strided by k + 5
    kw = {}
    if extra.startswith("norm"):
        kw["norm"] = ln
    if extra == "norm_gelu":
        kw["gelu"] = True
    if extra == "silu":
        kw["silu"] = True
    if extra == "residual":
        kw["residual"] = torch.randn(rows, n, generator=gen).cuda()
        kw["gamma"] = torch.rand(n, generator=gen).cuda()
    got, want = gemv(x, lin, **kw), gemv_reference(x, lin, **kw)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_camera_head_copy_with_the_kernel_matches_the_twin():
    """The released width (2048, 16 heads): the bf16 camera head with the Triton gemv against
    the same copy with the PyTorch twin, and both close to the float32 head."""
    from lingbot_map_ros.cache.pool import CameraKVCache
    from lingbot_map_ros.config import ModelConfig
    from lingbot_map_ros.kernels.gemv import gemv
    from lingbot_map_ros.model.heads import CameraHead

    cfg = ModelConfig.preset("lingbot-map")
    torch.manual_seed(0)
    head = CameraHead(cfg).cuda().eval()
    fast, twin = head.reduced_precision_copy(gemv=gemv), head.reduced_precision_copy()
    x = [torch.randn(1, 6, cfg.camera_dim, device="cuda") for _ in range(3)]

    def poses(h):
        cache = CameraKVCache(4, cfg.camera_trunk_depth, 3, cfg.camera_num_heads,
                              cfg.camera_dim // cfg.camera_num_heads, torch.float32, torch.device("cuda"))
        with torch.no_grad():
            return torch.cat([h(t, 4, lambda it, b, q, k, v, s=i: cache.attend(it, b, q, k, v, s))
                              for i, t in enumerate(x)])

    a, b, ref = poses(fast), poses(twin), poses(head)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert float((a - ref).abs().max() / ref.abs().max()) < 1e-2


@pytest.mark.parametrize("position", [0, 1, 31, 32, 33, 300, 1023])
def test_camera_attention_matches_twin(position):
    """The camera cache attention kernel (store at the slot, attend over slots <= slot)
    against its PyTorch twin at the released sizes (16 heads x 128, 1024 slots), with junk
    after the slot that only the mask keeps out; block edges (32) and both ends."""
    from lingbot_map_ros.kernels.camera_attention import camera_attention, camera_attention_reference

    gen = torch.Generator().manual_seed(position)
    heads, dim, capacity = 16, 128, 1024
    k_cache = torch.randn(capacity, heads, dim, generator=gen) * 2
    v_cache = torch.randn(capacity, heads, dim, generator=gen)
    k_cache[position + 1:] = 50.0  # would dominate the softmax if it were read
    k_cache, v_cache = k_cache.cuda(), v_cache.cuda()
    q, k, v = (torch.randn(1, heads, dim, generator=gen).cuda() for _ in range(3))
    caches = (k_cache.clone(), v_cache.clone())
    slot = torch.tensor([position], device="cuda")
    got = camera_attention(q, k, v, *caches, slot)
    want = camera_attention_reference(q, k, v, k_cache, v_cache, slot)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], k_cache)  # the token stored where the twin stores it
    torch.testing.assert_close(caches[1], v_cache)


def test_camera_attention_refuses_what_it_cannot_read():
    from lingbot_map_ros.kernels.camera_attention import camera_attention

    cache = torch.zeros(8, 2, 32, device="cuda")
    q = torch.zeros(1, 2, 32, device="cuda")
    with pytest.raises(ValueError, match="float32"):
        camera_attention(q.half(), q, q, cache, cache.clone(), torch.tensor([1], device="cuda"))
    with pytest.raises(ValueError, match="power of two"):
        c = torch.zeros(8, 2, 24, device="cuda")
        camera_attention(c[:1], c[:1], c[:1], c, c.clone(), torch.tensor([1], device="cuda"))
