"""LayerNorm computed in float32 and written straight in the consumer's dtype.

Under bf16 autocast PyTorch runs ``LayerNorm`` in float32 (a cast of the input, a
float32 kernel, a float32 output) and the next linear layer casts the result to
bf16 again. ``layer_norm`` reads the input in whatever dtype it has (the
aggregator's residual stream is float32), normalises in float32 and writes bf16
once: the same numbers as that chain, one kernel instead of two or three.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def layer_norm_reference(x: Tensor, norm: nn.LayerNorm, dtype: torch.dtype) -> Tensor:
    """PyTorch twin of ``layer_norm``."""
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(),
                        norm.eps).to(dtype)


_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, x_stride, eps, C: tl.constexpr,
                          BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK_C)
        cm = c < C
        m2 = (r < rows)[:, None] & cm[None, :]
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * x_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / C
        xc = tl.where(m2, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
        w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(out_ptr + r[:, None].to(tl.int64) * C + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m2)

    return layer_norm_kernel


def layer_norm(x: Tensor, norm: nn.LayerNorm, dtype: torch.dtype) -> Tensor:
    """LayerNorm of x [..., C] (rows may be strided, channels contiguous) with ``norm``'s
    affine parameters and eps, computed in float32, returned as a new contiguous tensor of
    ``dtype``."""
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    c = x.shape[-1]
    if norm.weight is None or norm.bias is None or tuple(norm.normalized_shape) != (c,):
        return layer_norm_reference(x, norm, dtype)
    x2 = x.reshape(-1, c)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, c), dtype=dtype, device=x.device)
    block_c = 1 << (c - 1).bit_length()
    rows_per_program = max(1, min(8, 4096 // block_c))
    _kernel[(-(-rows // rows_per_program),)](x2, norm.weight, norm.bias, out, rows, x2.stride(0), norm.eps, C=c,
                                             BLOCK_C=block_c, ROWS=rows_per_program,
                                             num_warps=4 if block_c <= 1024 else 8)
    return out.view(*x.shape[:-1], c)


__all__ = ["layer_norm", "layer_norm_reference"]
