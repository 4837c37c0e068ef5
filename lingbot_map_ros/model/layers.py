"""Transformer building blocks shared by DINO, the aggregator and the camera head.

A block is pre-norm with LayerScale on both residual branches. Attention is
computed by an ``attend`` callable supplied by the caller, so one block class
serves per-frame attention (2D RoPE), cross-frame attention over the paged cache
(3D RoPE) and the camera head's trunk. Tensors inside attention use the
``[tokens, heads, head_dim]`` layout (batch dimensions in front), which is also
the cache's layout.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# attend(q, k, v) -> out, all [..., N, H, D] (q/k already normalised, RoPE not yet applied).
# An attend object may also offer ``from_qkv(qkv, attention_module) -> out``: it then gets
# the raw qkv projection [..., N, 3*C] and does the q/k norms itself (fused kernels).
AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]
# norm(layer_norm_module, x) -> normalised x; lets a caller swap in a fused LayerNorm
NormFn = Callable[[nn.LayerNorm, Tensor], Tensor]
# mlp(mlp_module, x) -> mlp_module(x) or an equivalent (e.g. with the GELU fused into fc1)
MlpFn = Callable[[nn.Module, Tensor], Tensor]
# residual(x, branch, gamma, next_norm) -> (x + gamma * branch, next_norm(new x) or None): lets a
# caller fuse the LayerScale update with the LayerNorm that reads the new stream next
ResidualFn = Callable[[Tensor, Tensor, Tensor, "nn.LayerNorm | None"], "tuple[Tensor, Tensor | None]"]


def apply_norm(norm: nn.Module, x: Tensor) -> Tensor:
    return norm(x)


def apply_mlp(mlp: nn.Module, x: Tensor) -> Tensor:
    return mlp(x)


def sdpa_nhd(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Unmasked scaled dot-product attention on ``[..., N, H, D]`` tensors (scale 1/sqrt(D))."""
    out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2))
    return out.transpose(-3, -2)


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out_dim or dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Fused-qkv multi-head attention; optional per-head q/k LayerNorm shared by all heads."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, attend: AttendFn) -> Tensor:
        # x [..., N, C] -> q, k, v [..., N, H, D]; channel order q | k | v, each head-major
        fused = getattr(attend, "from_qkv", None)
        if fused is not None:
            return self.proj(fused(self.qkv(x), self).flatten(-2))
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))
        q, k, v = qkv.unbind(-3)
        out = attend(self.q_norm(q), self.k_norm(k), v)  # [..., N, H, D]
        return self.proj(out.flatten(-2))


class Block(nn.Module):
    """Pre-norm transformer block: x += ls1*attn(norm1 x); x += ls2*mlp(norm2 x)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qk_norm: bool = False,
                 norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qk_norm=qk_norm, norm_eps=1e-5)
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim)

    def forward(self, x: Tensor, attend: AttendFn = sdpa_nhd, norm: NormFn = apply_norm,
                mlp: MlpFn = apply_mlp, residual: ResidualFn | None = None) -> Tensor:
        if residual is not None:  # fused: the first update also writes norm2 of its result
            x, h = residual(x, self.attn(norm(self.norm1, x), attend), self.ls1.gamma, self.norm2)
            return residual(x, mlp(self.mlp, h), self.ls2.gamma, None)[0]
        # x + gamma * branch in one kernel (addcmul) instead of a multiply and an add
        x = torch.addcmul(x, self.attn(norm(self.norm1, x), attend), self.ls1.gamma)
        return torch.addcmul(x, mlp(self.mlp, norm(self.norm2, x)), self.ls2.gamma)
