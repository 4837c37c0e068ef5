"""Matrix-vector products of the camera head: float32 activations, bf16 weights.

The camera head refines one token per frame through 4 iterations x 4 trunk blocks
(width 2048): sixteen passes over ~50 M weights each, with a single row of
activations. That is pure weight streaming: in float32, cuBLAS's GEMV reads 3.2 GB
per frame (~1.2 ms on an H200) and the LayerNorms in between are separate launches.
``gemv`` reads bf16 weights (half the bytes) and folds the neighbours of each product
into the same kernel:

    y = epilogue(W @ prologue(x) + b)
    prologue: nothing, LayerNorm (float32 statistics, the module's affine) or SiLU
    epilogue: optional exact GELU, then optional LayerScale residual  r + gamma * y

Activations, statistics and accumulation stay float32; only the weights are rounded
(to bf16, once, by ``CameraHead.reduced_precision_copy``). ``gemv_reference`` is the
PyTorch twin with the same maths (it runs on CPU and is what the GPU tests compare
against).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_kernel = None


def gemv_reference(x: Tensor, linear: nn.Linear, *, norm: nn.LayerNorm | None = None, silu: bool = False,
                   gelu: bool = False, residual: Tensor | None = None, gamma: Tensor | None = None) -> Tensor:
    """x [M, K] -> [M, N] float32: ``linear`` (any weight dtype, computed in float32) of the
    prologue'd x, then the epilogue (see the module docstring)."""
    xf = x.float()
    if norm is not None:
        xf = F.layer_norm(xf, norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)
    if silu:
        xf = F.silu(xf)
    y = xf @ linear.weight.float().t()
    if linear.bias is not None:
        y = y + linear.bias.float()
    if gelu:
        y = F.gelu(y)
    if residual is not None:
        y = residual.float() + gamma.float() * y
    return y


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, x_stride, w_ptr, b_ptr, out_ptr, lnw_ptr, lnb_ptr, res_ptr, res_stride, gamma_ptr,
                    K, N, eps, PROLOGUE: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # PROLOGUE: 0 none, 1 LayerNorm, 2 SiLU. One program: BLOCK_N outputs of row m.
        pid = tl.program_id(0)
        m = tl.program_id(1)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        x_row = x_ptr + m.to(tl.int64) * x_stride
        mean = 0.0
        rstd = 1.0
        if PROLOGUE == 1:  # two passes over the row (it is short and cached): mean, then variance
            s = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                s += tl.load(x_row + k0 + kk, mask=k0 + kk < K, other=0.0)
            mean = tl.sum(s, axis=0) / K
            s = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xv = tl.load(x_row + k0 + kk, mask=k0 + kk < K, other=0.0)
                d = tl.where(k0 + kk < K, xv - mean, 0.0)
                s += d * d
            rstd = 1.0 / tl.sqrt(tl.sum(s, axis=0) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        w_rows = w_ptr + n[:, None].to(tl.int64) * K
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + kk < K
            xv = tl.load(x_row + k0 + kk, mask=k_ok, other=0.0)
            if PROLOGUE == 1:
                lw = tl.load(lnw_ptr + k0 + kk, mask=k_ok, other=0.0)
                lb = tl.load(lnb_ptr + k0 + kk, mask=k_ok, other=0.0)
                xv = tl.where(k_ok, (xv - mean) * rstd * lw + lb, 0.0)
            if PROLOGUE == 2:
                xv = xv / (1.0 + tl.exp(-xv))
            w = tl.load(w_rows + k0 + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_ok, other=0.0)
        if GELU:
            y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        if RESIDUAL:
            r = tl.load(res_ptr + m.to(tl.int64) * res_stride + n, mask=n_ok, other=0.0)
            g = tl.load(gamma_ptr + n, mask=n_ok, other=0.0)
            y = r + g * y
        tl.store(out_ptr + m.to(tl.int64) * N + n, y, mask=n_ok)

    return gemv_kernel


def launch_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [N, K] weight. Chosen with
    ``benchmarks/kernels/gemv_configs.py`` on an H200 at the camera head's shapes (the whole head in
    a CUDA graph: 1436 -> 1291 us against the first choice, 8-32 rows x 8 KB, 4 stages):
    16 rows x 256 for the wide products (qkv, fc1, the pose modulation), 8 rows x 1024 for
    the others (fc2's 8192-long rows gain most)."""
    if n > 2048:
        return 16, 256, 4, 3
    return 8, min(1024, max(16, 1 << (k - 1).bit_length())), 4, 3


def gemv(x: Tensor, linear: nn.Linear, *, norm: nn.LayerNorm | None = None, silu: bool = False,
         gelu: bool = False, residual: Tensor | None = None, gamma: Tensor | None = None) -> Tensor:
    """Triton version of ``gemv_reference`` (CUDA). x [M, K] float32 (rows may be strided);
    ``linear.weight`` [N, K] contiguous (bf16 in the camera head's copy), bias float32;
    ``norm``'s affine, ``residual`` [M, N] (rows may be strided) and ``gamma`` [N] float32."""
    global _kernel
    if norm is not None and silu:
        raise ValueError("gemv: one prologue at most (LayerNorm or SiLU)")
    if (residual is None) != (gamma is None):
        raise ValueError("gemv: residual and gamma go together")
    w = linear.weight
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or not w.is_contiguous() or x.stride(1) != 1 or x.dtype != torch.float32:
        raise ValueError(f"gemv: x [M, {w.shape[1]}] float32 with contiguous rows and a contiguous weight expected, "
                         f"got x {tuple(x.shape)} {x.dtype}")
    for t in (linear.bias, gamma, residual) + ((norm.weight, norm.bias) if norm is not None else ()):
        if t is not None and t.dtype != torch.float32:
            raise ValueError("gemv: bias, LayerNorm affine, residual and gamma must be float32")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"gemv: residual [{m}, {n}] with contiguous rows expected")
    if _kernel is None:
        _kernel = _build_kernel()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_n, block_k, warps, stages = launch_config(n, k)
    prologue = 1 if norm is not None else (2 if silu else 0)
    _kernel[(-(-n // block_n), m)](
        x, x.stride(0), w, linear.bias if linear.bias is not None else out, out,
        norm.weight if norm is not None else out, norm.bias if norm is not None else out,
        residual if residual is not None else out, residual.stride(0) if residual is not None else 0,
        gamma if gamma is not None else out, k, n, norm.eps if norm is not None else 0.0,
        PROLOGUE=prologue, GELU=gelu, RESIDUAL=residual is not None, HAS_BIAS=linear.bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


__all__ = ["gemv", "gemv_reference"]
