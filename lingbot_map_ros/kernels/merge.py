"""Merge attention results computed over disjoint parts of the keys (split-KV).

Part i gives ``o_i`` (softmax-weighted values over its keys) and ``lse_i``, the
log-sum-exp of its scaled scores in base 2 (FlashInfer's convention). The full
attention is ``sum_i w_i o_i / sum_i w_i`` with ``w_i = 2^(lse_i - max_j lse_j)``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def merge_reference(o: Tensor, lse: Tensor, out: Tensor) -> Tensor:
    """o [S, N, H, D], lse [S, N, H] (base 2) -> out [N, H, D] (PyTorch twin of ``merge_states``)."""
    m = lse.amax(dim=0, keepdim=True)
    w = torch.exp2(lse - m)
    merged = (o.float() * w[..., None]).sum(0) / w.sum(0)[..., None]
    return out.copy_(merged)


_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(o_ptr, lse_ptr, out_ptr, rows_total, states, D: tl.constexpr, BLOCK_R: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) pairs
        valid = rows < rows_total
        d = tl.arange(0, D)
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        for i in range(states):
            m = tl.maximum(m, tl.load(lse_ptr + i * rows_total + rows, mask=valid, other=0.0))
        acc = tl.zeros((BLOCK_R, D), tl.float32)
        den = tl.zeros((BLOCK_R,), tl.float32)
        offs = rows[:, None].to(tl.int64) * D + d[None, :]
        for i in range(states):
            w = tl.exp2(tl.load(lse_ptr + i * rows_total + rows, mask=valid, other=0.0) - m)
            den += w
            o = tl.load(o_ptr + i * rows_total * D + offs, mask=valid[:, None], other=0.0).to(tl.float32)
            acc += w[:, None] * o
        tl.store(out_ptr + offs, (acc / den[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None])

    return merge_kernel


def merge_states(o: Tensor, lse: Tensor, out: Tensor) -> Tensor:
    """o [S, N, H, D] (contiguous), lse [S, N, H] float32 (contiguous, base 2) -> out [N, H, D]."""
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    s, n, h, d = o.shape
    if not (o.is_contiguous() and lse.is_contiguous() and out.is_contiguous()) or lse.shape != (s, n, h):
        raise ValueError("merge_states: contiguous o [S,N,H,D], lse [S,N,H] and out [N,H,D] expected")
    block_r = 32
    _kernel[(-(-(n * h) // block_r),)](o, lse, out, n * h, s, D=d, BLOCK_R=block_r, num_warps=4)
    return out


__all__ = ["merge_states", "merge_reference"]
