"""Rotary position embeddings of the aggregator (SPEC §3).

* Frame blocks: 2D RoPE, base 100, rotate-half convention inside each 32-wide
  half of the 64-dim head (first half by patch row, second by column). Patch
  (row, col) sits at (row+1, col+1); the 6 special tokens at (0, 0).
* Global blocks: 3D RoPE, theta 10000, interleaved channel pairs (2k, 2k+1):
  pairs 0..9 rotate by the temporal index t, 10..20 by h, 21..31 by w, each axis
  with its own width (20, 22, 22). Special token j of frame f sits at (f, j, j),
  patch (row, col) at (f, 6+row, 6+col).

Angles are computed in float64 and only cos/sin are rounded to float32: position
times frequency reaches tens of radians, which bf16 cannot hold. Tables depend
only on the patch grid and are built once per resolution; per step only a row of
the temporal table is looked up (on the device, no host sync).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import HEAD_DIM, SPECIAL_TOKENS

ROPE2D_BASE = 100.0
ROPE3D_THETA = 10000.0
ROPE3D_SPLIT = (10, 11, 11)  # complex pairs for t, h, w (widths 20, 22, 22)


def _grid_positions(grid_h: int, grid_w: int, offset: int) -> tuple[Tensor, Tensor]:
    """Row/col positions of the P = 6 + gh*gw tokens of a frame (float64)."""
    rows = torch.arange(grid_h, dtype=torch.float64).repeat_interleave(grid_w) + offset
    cols = torch.arange(grid_w, dtype=torch.float64).repeat(grid_h) + offset
    return rows, cols


def rope2d_tables(grid_h: int, grid_w: int, head_dim: int = HEAD_DIM) -> tuple[Tensor, Tensor]:
    """cos, sin [P, head_dim] float32 for the frame blocks' 2D RoPE."""
    half = head_dim // 2
    freqs = ROPE2D_BASE ** (-torch.arange(0, half, 2, dtype=torch.float64) / half)  # [half/2]
    rows, cols = _grid_positions(grid_h, grid_w, offset=1)
    zeros = torch.zeros(SPECIAL_TOKENS, dtype=torch.float64)
    rows, cols = torch.cat([zeros, rows]), torch.cat([zeros, cols])
    ang_y = rows[:, None] * freqs[None]
    ang_x = cols[:, None] * freqs[None]
    angles = torch.cat([ang_y, ang_y, ang_x, ang_x], dim=-1)  # [P, head_dim]
    return angles.cos().float(), angles.sin().float()


def apply_rope2d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., P, H, D] with tables [P, D]; returns float32."""
    x = x.float()
    quarter = x.shape[-1] // 4
    x = x.unflatten(-1, (2, 2, quarter))  # [..., half, (x1, x2), quarter]
    rotated = torch.stack([-x[..., 1, :], x[..., 0, :]], dim=-2).flatten(-3)
    x = x.flatten(-3)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope3d_frequencies(head_dim: int = HEAD_DIM) -> Tensor:
    """Per-pair angular frequencies [head_dim/2] (float64): t pairs, then h, then w."""
    parts = []
    for n_pairs in ROPE3D_SPLIT:
        width = 2 * n_pairs
        parts.append(ROPE3D_THETA ** (-torch.arange(0, width, 2, dtype=torch.float64) / width))
    freqs = torch.cat(parts)
    if freqs.numel() != head_dim // 2:
        raise ValueError(f"3D RoPE needs head_dim {2 * freqs.numel()}, got {head_dim}")
    return freqs


class Rope3DTables:
    """cos/sin tables of the global blocks' 3D RoPE for one patch grid.

    ``temporal_*`` [max_frames, 10] and ``spatial_*`` [P, 22]; ``lookup`` joins them
    for a run of consecutive frames.
    """

    def __init__(self, grid_h: int, grid_w: int, max_frames: int, device: torch.device | str = "cpu") -> None:
        freqs = rope3d_frequencies()
        n_t = ROPE3D_SPLIT[0]
        n_h = ROPE3D_SPLIT[1]
        t = torch.arange(max_frames, dtype=torch.float64)
        ang_t = t[:, None] * freqs[None, :n_t]
        rows, cols = _grid_positions(grid_h, grid_w, offset=SPECIAL_TOKENS)
        special = torch.arange(SPECIAL_TOKENS, dtype=torch.float64)
        h = torch.cat([special, rows])
        w = torch.cat([special, cols])
        ang_hw = torch.cat([h[:, None] * freqs[None, n_t:n_t + n_h], w[:, None] * freqs[None, n_t + n_h:]], dim=-1)
        self.max_frames = max_frames
        self.temporal_cos = ang_t.cos().float().to(device)
        self.temporal_sin = ang_t.sin().float().to(device)
        self.spatial_cos = ang_hw.cos().float().to(device)
        self.spatial_sin = ang_hw.sin().float().to(device)

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [S, P, 32] for frames at temporal ``positions`` [S] (long, on the tables' device)."""
        tokens = self.spatial_cos.shape[0]
        n = positions.shape[0]

        def join(temporal: Tensor, spatial: Tensor) -> Tensor:
            t = temporal.index_select(0, positions)[:, None, :].expand(n, tokens, -1)
            return torch.cat([t, spatial[None].expand(n, -1, -1)], dim=-1)

        return join(self.temporal_cos, self.spatial_cos), join(self.temporal_sin, self.spatial_sin)


def apply_rope3d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs of x [S, P, H, D] with tables [S, P, D/2]; returns float32."""
    x = x.float().unflatten(-1, (-1, 2))
    even, odd = x[..., 0], x[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)


def rope3d_rotation(cos: Tensor, sin: Tensor) -> Tensor:
    """The tables of ``lookup`` as unit complex numbers [S, P, 1, D/2] (complex64), for
    ``apply_rope3d_complex``; built once per step and shared by all layers."""
    return torch.complex(cos, sin)[:, :, None, :]


def apply_rope3d_complex(x: Tensor, rotation: Tensor) -> Tensor:
    """``apply_rope3d`` as one complex multiplication: pair (2k, 2k+1) is the complex number
    x_2k + i x_2k+1, rotated by ``rotation`` [S, P, 1, D/2]; returns float32 [S, P, H, D]."""
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2)
