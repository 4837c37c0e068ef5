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
    from ._qk_rope_triton import qk_norm_rope_kernel

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
