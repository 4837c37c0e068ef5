"""LayerScale residual update, optionally followed by the next LayerNorm, in one pass.

A pre-norm block updates its residual stream twice: ``x + gamma * branch``. In the
aggregator the stream is float32 (autocast promotes the addcmul: PyTorch casts the
bf16 branch and gamma to float32 in two copy kernels, then runs the addcmul) and the
next thing read from the new stream is a LayerNorm. ``residual_add`` reads x, the
branch and gamma once, adds in float32, writes the new stream in the promoted dtype
and, given the LayerNorm that follows, also writes its output (float32 maths on the
stored stream, written in ``norm_dtype``, as ``kernels.layer_norm`` does): one kernel
for what were up to five.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .layer_norm import layer_norm_reference


def residual_add_reference(x: Tensor, branch: Tensor, gamma: Tensor, norm: nn.LayerNorm | None = None,
                           norm_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor | None]:
    """PyTorch twin of ``residual_add``."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, branch.dtype), gamma.dtype)
    new = torch.addcmul(x.to(dtype), branch.to(dtype), gamma.to(dtype))
    return new, (layer_norm_reference(new, norm, norm_dtype) if norm is not None else None)


_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def residual_kernel(x_ptr, y_ptr, g_ptr, out_ptr, w_ptr, b_ptr, normed_ptr, rows, x_stride, y_stride, eps,
                        C: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK_C)
        cm = c < C
        m2 = (r < rows)[:, None] & cm[None, :]
        r64 = r[:, None].to(tl.int64)
        x = tl.load(x_ptr + r64 * x_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + r64 * y_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + c, mask=cm, other=0.0).to(tl.float32)
        new = (x + y * g[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r64 * C + c[None, :], new, mask=m2)
        if NORM:
            v = new.to(tl.float32)
            mean = tl.sum(v, axis=1) / C
            vc = tl.where(m2, v - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(vc * vc, axis=1) / C + eps)
            w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
            yn = vc * rstd[:, None] * w[None, :] + b[None, :]
            tl.store(normed_ptr + r64 * C + c[None, :], yn.to(normed_ptr.dtype.element_ty), mask=m2)

    return residual_kernel


def residual_add(x: Tensor, branch: Tensor, gamma: Tensor, norm: nn.LayerNorm | None = None,
                 norm_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor | None]:
    """``x + gamma * branch`` (float32 maths, stored in the promoted dtype of the three) as a new
    contiguous tensor, and ``norm`` of it in ``norm_dtype`` when given (else None).

    x, branch: [..., C] of the same shape (rows may be strided, channels contiguous); gamma [C].
    """
    global _kernel
    c = x.shape[-1]
    if branch.shape != x.shape or gamma.shape != (c,) or (norm is not None and (
            norm.weight is None or norm.bias is None or tuple(norm.normalized_shape) != (c,))):
        return residual_add_reference(x, branch, gamma, norm, norm_dtype)
    if _kernel is None:
        _kernel = _build_kernel()
    x2, y2 = x.reshape(-1, c), branch.reshape(-1, c)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y2 = y2 if y2.stride(-1) == 1 else y2.contiguous()
    gamma = gamma if gamma.is_contiguous() else gamma.contiguous()
    rows = x2.shape[0]
    dtype = torch.promote_types(torch.promote_types(x.dtype, branch.dtype), gamma.dtype)
    out = torch.empty((rows, c), dtype=dtype, device=x.device)
    normed = torch.empty((rows, c), dtype=norm_dtype, device=x.device) if norm is not None else out
    block_c = 1 << (c - 1).bit_length()
    rows_per_program = max(1, min(8, 4096 // block_c))
    w, b = (norm.weight, norm.bias) if norm is not None else (gamma, gamma)
    _kernel[(-(-rows // rows_per_program),)](x2, y2, gamma, out, w, b, normed, rows, x2.stride(0), y2.stride(0),
                                             norm.eps if norm is not None else 0.0, C=c, BLOCK_C=block_c,
                                             ROWS=rows_per_program, NORM=norm is not None,
                                             num_warps=4 if block_c <= 1024 else 8)
    return out.view(x.shape), (normed.view(x.shape) if norm is not None else None)


__all__ = ["residual_add", "residual_add_reference"]
