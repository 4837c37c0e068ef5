"""The camera head's attention inside the CUDA graph: store one token, attend over the cache.

Each of the camera head's 16 attention calls per frame (4 iterations x 4 trunk blocks)
has one query per head and attends to the camera tokens of every stored frame: slots
[0, position] of a cache with room for ``max_frame_num`` frames. In the graph the
position comes from a device tensor, so the PyTorch path stores the token with two
``index_copy_`` launches and runs two batched matrix-vector products over all slots
with a mask (``CameraKVCache.attend_at``). ``camera_attention`` does all of it in one
launch, one program per head: it writes the new key and value into their slot, reads
only the visible slots (``position`` from the device, a loop bound the graph does not
fix) and keeps an online softmax in float32.

``camera_attention_reference`` is its PyTorch twin (same arguments, same maths).
"""
from __future__ import annotations

import torch
from torch import Tensor

_kernel = None


def visibility_bias(capacity: int, slot: Tensor, dtype: torch.dtype) -> Tensor:
    """The mask as an addend [1, 1, capacity]: 0 for slots <= slot [1] (long), -inf after."""
    slots = torch.arange(capacity, device=slot.device)
    return torch.zeros(capacity, dtype=dtype, device=slot.device).masked_fill(slots > slot, float("-inf")).view(
        1, 1, capacity)


def camera_attention_reference(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor,
                               bias: Tensor | None = None) -> Tensor:
    """q, k, v [1, H, D]; caches [capacity, H, D]; slot [1] long. Stores k, v at ``slot`` and
    returns softmax(q K^T / sqrt(D)) V over slots [0, slot] as [1, H, D] in q's dtype.
    ``bias``: the mask as an addend [1, 1, capacity] (0 up to the slot, -inf after), when the
    caller made it once for several calls.

    Two batched matrix-vector products over every slot, reading the cache where it lies
    (no copy), the mask riding on the first as its addend."""
    k_cache.index_copy_(0, slot, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot, v.to(v_cache.dtype))
    heads, dim, capacity = k_cache.shape[1], k_cache.shape[2], k_cache.shape[0]
    if bias is None:
        bias = visibility_bias(capacity, slot, k_cache.dtype)
    qh = q.to(k_cache.dtype).transpose(0, 1)  # [H, 1, D]
    scores = torch.baddbmm(bias.expand(heads, 1, capacity), qh, k_cache.permute(1, 2, 0),
                           alpha=dim ** -0.5)  # [H, 1, C]
    out = torch.bmm(torch.softmax(scores, dim=-1), v_cache.transpose(0, 1))  # [H, 1, D]
    return out.transpose(0, 1).to(q.dtype)


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def camera_attention_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, out_ptr, scale,
                                H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        h = tl.program_id(0)
        d = tl.arange(0, D)
        pos = tl.load(slot_ptr)
        q = tl.load(q_ptr + h * D + d) * scale
        k_new = tl.load(k_ptr + h * D + d)
        v_new = tl.load(v_ptr + h * D + d)
        row = pos * (H * D) + h * D
        tl.store(kc_ptr + row + d, k_new)
        tl.store(vc_ptr + row + d, v_new)
        # the step's own token (from registers: the stores above need not be visible yet)
        m = tl.sum(k_new * q, axis=0)
        denom = m * 0.0 + 1.0
        acc = v_new
        # earlier frames: slots [0, pos), BLOCK at a time
        offs = tl.arange(0, BLOCK)
        for start in range(0, pos, BLOCK):
            s = start + offs
            ok = s < pos
            rows = s.to(tl.int64)[:, None] * (H * D) + h * D + d[None, :]
            kb = tl.load(kc_ptr + rows, mask=ok[:, None], other=0.0)
            scores = tl.where(ok, tl.sum(kb * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new)
            vb = tl.load(vc_ptr + rows, mask=ok[:, None], other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
            denom = denom * alpha + tl.sum(p, axis=0)
            m = m_new
        tl.store(out_ptr + h * D + d, acc / denom)

    return camera_attention_kernel


def camera_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor) -> Tensor:
    """Triton version of ``camera_attention_reference`` (CUDA, float32 q/k/v and caches,
    contiguous; D a power of two)."""
    global _kernel
    heads, dim = k_cache.shape[1], k_cache.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape != (1, heads, dim) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"camera_attention: {name} must be contiguous float32 [1, {heads}, {dim}], got "
                             f"{tuple(t.shape)} {t.dtype}")
    if k_cache.dtype != torch.float32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("camera_attention: the caches must be contiguous float32")
    if dim & (dim - 1):
        raise ValueError(f"camera_attention: head_dim {dim} is not a power of two")
    if _kernel is None:
        _kernel = _build_kernel()
    out = torch.empty_like(q)
    _kernel[(heads,)](q, k, v, k_cache, v_cache, slot, out, dim ** -0.5, H=heads, D=dim, BLOCK=32, num_warps=4)
    return out


__all__ = ["camera_attention", "camera_attention_reference", "visibility_bias"]
