"""q/k LayerNorm + RoPE + cast + K/V store in one pass over a qkv projection.

The attention blocks of the aggregator compute, per head, ``LN(q)``, ``LN(k)`` in
float32 (the reference keeps these norms out of bf16), rotate both with RoPE in
float32, cast to bf16 and hand them to attention; global blocks also store k and v
in the paged pool. As PyTorch ops that is about fifteen kernels and several full
float32 round trips per block; ``qk_norm_rope`` does it in one kernel.

Both RoPE flavours are the same operation on a channel and its partner channel:

    out[d] = x[d] * cos[d] + x[d ^ xor] * sin_signed[d]

* 3D RoPE (global blocks), interleaved pairs (2k, 2k+1): ``xor = 1``, the sine of
  the even channel negated (``tables_interleaved``).
* 2D RoPE (frame blocks), rotate-half inside each 32-wide half: partner d ^ 16,
  the sine negated on the first quarter of each half (``tables_halves``).

Tables are ``[T, D]`` float32; token n uses row ``n % T`` (T = tokens per frame for
the frame blocks, all tokens of the step for the global blocks).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

XOR_INTERLEAVED = 1
XOR_HALVES = 16


def tables_interleaved(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Per-pair tables [..., D/2] (3D RoPE) -> per-channel cos, signed sin [..., D] float32."""
    c = cos.float().repeat_interleave(2, dim=-1)
    s = sin.float().repeat_interleave(2, dim=-1)
    sign = torch.ones(s.shape[-1], dtype=s.dtype, device=s.device)
    sign[0::2] = -1
    return c.contiguous(), (s * sign).contiguous()


def tables_halves(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel rotate-half tables [..., D] (2D RoPE) -> cos, signed sin [..., D] float32."""
    d = torch.arange(sin.shape[-1], device=sin.device)
    sign = torch.where((d & XOR_HALVES) == 0, -1.0, 1.0).to(torch.float32)
    return cos.float().contiguous(), (sin.float() * sign).contiguous()


def _norm_rotate_reference(x: Tensor, norm: nn.LayerNorm, cos: Tensor, sin_signed: Tensor, xor: int) -> Tensor:
    """x [N, H, D] -> float32 [N, H, D]: the maths of the kernel in PyTorch."""
    n, _, d = x.shape
    y = torch.nn.functional.layer_norm(x.float(), (d,), norm.weight.float(), norm.bias.float(), norm.eps)
    partner = torch.arange(d, device=x.device) ^ xor
    rows = torch.arange(n, device=x.device) % cos.shape[0]
    c, s = cos[rows][:, None, :], sin_signed[rows][:, None, :]
    return y * c + y[..., partner] * s


def qk_norm_rope_reference(qkv: Tensor, heads: int, q_norm: nn.LayerNorm, k_norm: nn.LayerNorm, cos: Tensor,
                           sin_signed: Tensor, xor: int, q_out: Tensor, k_out: Tensor, v_out: Tensor | None = None,
                           slots: Tensor | None = None) -> None:
    """PyTorch twin of ``qk_norm_rope`` (same arguments, same results up to rounding)."""
    n = qkv.shape[0]
    q, k, v = qkv.view(n, 3, heads, -1).unbind(1)
    qr = _norm_rotate_reference(q, q_norm, cos, sin_signed, xor).to(q_out.dtype)
    q_out.copy_(qr.unsqueeze(0).expand_as(q_out) if q_out.dim() == 4 else qr)
    kr = _norm_rotate_reference(k, k_norm, cos, sin_signed, xor).to(k_out.dtype)
    if slots is None:
        k_out.copy_(kr)
        if v_out is not None:
            v_out.copy_(v)
    else:
        k_out.index_copy_(0, slots, kr)
        if v_out is not None:
            v_out.index_copy_(0, slots, v.to(v_out.dtype))


_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(qkv_ptr, qkv_stride, qw_ptr, qb_ptr, kw_ptr, kb_ptr, cos_ptr, sin_ptr, table_rows,
                            slots_ptr, q_ptr, k_ptr, v_ptr, n_tokens, q_reps, q_rep_stride, q_eps, k_eps,
                            H: tl.constexpr, D: tl.constexpr, XOR: tl.constexpr, BLOCK_N: tl.constexpr,
                            HAS_SLOTS: tl.constexpr, STORE_V: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows < n_tokens
        m2 = valid[:, None]
        d = tl.arange(0, D)
        dp = d ^ XOR
        src = qkv_ptr + rows[:, None].to(tl.int64) * qkv_stride + h * D
        trow = (rows % table_rows).to(tl.int64)
        cos = tl.load(cos_ptr + trow[:, None] * D + d[None, :], mask=m2, other=0.0)
        sin = tl.load(sin_ptr + trow[:, None] * D + d[None, :], mask=m2, other=0.0)
        if HAS_SLOTS:
            dest = tl.load(slots_ptr + rows, mask=valid, other=0).to(tl.int64)
        else:
            dest = rows.to(tl.int64)
        dest_off = dest[:, None] * (H * D) + h * D + d[None, :]

        # q: normalise (float32), rotate, cast, store (q_reps copies)
        x = tl.load(src + d[None, :], mask=m2, other=0.0).to(tl.float32)
        xp = tl.load(src + dp[None, :], mask=m2, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / D
        xc = x - mean[:, None]
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + q_eps)
        w = tl.load(qw_ptr + d).to(tl.float32)
        b = tl.load(qb_ptr + d).to(tl.float32)
        wp = tl.load(qw_ptr + dp).to(tl.float32)
        bp = tl.load(qb_ptr + dp).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :] + b[None, :]
        yp = (xp - mean[:, None]) * rstd[:, None] * wp[None, :] + bp[None, :]
        out = (y * cos + yp * sin).to(q_ptr.dtype.element_ty)
        q_off = rows[:, None].to(tl.int64) * (H * D) + h * D + d[None, :]
        for r in range(q_reps):
            tl.store(q_ptr + r * q_rep_stride + q_off, out, mask=m2)

        # k: the same with its own norm, stored at the destination rows
        x = tl.load(src + H * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        xp = tl.load(src + H * D + dp[None, :], mask=m2, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / D
        xc = x - mean[:, None]
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + k_eps)
        w = tl.load(kw_ptr + d).to(tl.float32)
        b = tl.load(kb_ptr + d).to(tl.float32)
        wp = tl.load(kw_ptr + dp).to(tl.float32)
        bp = tl.load(kb_ptr + dp).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :] + b[None, :]
        yp = (xp - mean[:, None]) * rstd[:, None] * wp[None, :] + bp[None, :]
        tl.store(k_ptr + dest_off, (y * cos + yp * sin).to(k_ptr.dtype.element_ty), mask=m2)

        if STORE_V:
            v = tl.load(src + 2 * H * D + d[None, :], mask=m2, other=0.0)
            tl.store(v_ptr + dest_off, v.to(v_ptr.dtype.element_ty), mask=m2)

    return qk_norm_rope_kernel


def qk_norm_rope(qkv: Tensor, heads: int, q_norm: nn.LayerNorm, k_norm: nn.LayerNorm, cos: Tensor,
                 sin_signed: Tensor, xor: int, q_out: Tensor, k_out: Tensor, v_out: Tensor | None = None,
                 slots: Tensor | None = None) -> None:
    """One kernel: q/k LayerNorm (float32) + RoPE + cast, q -> ``q_out``, k (and v) -> ``k_out``
    (``v_out``), at ``slots`` when given.

    qkv: [N, 3*H*D] (rows may be strided, channels contiguous; order q | k | v, head-major).
    q_out: [N, H, D] or [R, N, H, D] (R identical copies, e.g. one per KV split).
    k_out, v_out: [N, H, D], or any [M, H, D] with ``slots`` [N] (long) naming the rows.
    cos, sin_signed: [T, D] float32 from ``tables_interleaved`` / ``tables_halves``.
    """
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    n, width = qkv.shape
    d = width // (3 * heads)
    if qkv.stride(1) != 1 or cos.shape[-1] != d or not (cos.is_contiguous() and sin_signed.is_contiguous()):
        raise ValueError("qk_norm_rope: qkv channels and the tables must be contiguous")
    for t in (q_out, k_out) + ((v_out,) if v_out is not None else ()):
        if not t.is_contiguous():
            raise ValueError("qk_norm_rope: outputs must be contiguous")
    reps = q_out.shape[0] if q_out.dim() == 4 else 1
    block_n = 32
    grid = (-(-n // block_n), heads)
    _kernel[grid](qkv, qkv.stride(0), q_norm.weight, q_norm.bias, k_norm.weight, k_norm.bias, cos, sin_signed,
                  cos.shape[0], slots if slots is not None else qkv, q_out, k_out,
                  v_out if v_out is not None else k_out, n, reps, n * heads * d, q_norm.eps, k_norm.eps,
                  H=heads, D=d, XOR=xor, BLOCK_N=block_n, HAS_SLOTS=slots is not None, STORE_V=v_out is not None,
                  num_warps=4)


__all__ = ["qk_norm_rope", "qk_norm_rope_reference", "tables_interleaved", "tables_halves", "XOR_INTERLEAVED",
           "XOR_HALVES"]
