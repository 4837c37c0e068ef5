"""Shared by the kernel tests (CPU twins and GPU kernels): a pair of LayerNorms with
seeded, non-trivial weights and biases (q-norm and k-norm)."""
from __future__ import annotations

import torch
from torch import nn


def random_norms(dim: int, seed: int) -> tuple[nn.LayerNorm, nn.LayerNorm]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        ln = nn.LayerNorm(dim)
        with torch.no_grad():
            ln.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen))
            ln.bias.copy_(0.2 * torch.randn(dim, generator=gen))
        out.append(ln)
    return out[0], out[1]
