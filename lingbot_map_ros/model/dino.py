"""DINOv2 ViT/14 with registers: the per-frame patch encoder (SPEC §2).

Parameter names follow the released checkpoints (``aggregator.patch_embed.*``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .layers import Block, MlpFn, NormFn, ResidualFn, apply_mlp, apply_norm


class PatchProjection(nn.Module):
    """14x14 stride-14 convolution, flattened row-major to tokens."""

    def __init__(self, patch_size: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, images: Tensor, norm: NormFn = apply_norm) -> Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # [S, gh*gw, C]


class DinoEncoder(nn.Module):
    """images [S,3,H,W] (ImageNet-normalised) -> patch tokens [S, (H/14)*(W/14), dino_dim]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.dino_dim
        self.patch_size = cfg.patch_size
        self.grid = cfg.pos_grid
        self.num_register_tokens = cfg.num_register_tokens
        self.patch_embed = PatchProjection(cfg.patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid + 1, dim))
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.num_register_tokens, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, dim))  # in the checkpoints, unused at inference
        self.blocks = nn.ModuleList(
            Block(dim, cfg.dino_heads, cfg.mlp_ratio, qk_norm=False, norm_eps=1e-6) for _ in range(cfg.dino_depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self._pos_cache: dict[tuple, Tensor] = {}

    def position_embedding(self, grid_h: int, grid_w: int) -> Tensor:
        """[1, 1 + gh*gw, C]: cls position, then the 37x37 grid resized (antialiased bicubic, fp32)."""
        pos = self.pos_embed
        key = (grid_h, grid_w, pos.device, pos.dtype, pos._version, id(pos))
        cached = self._pos_cache.get(key)
        if cached is not None:
            return cached
        cls_pos, grid_pos = pos[:, :1], pos[:, 1:]
        if (grid_h, grid_w) != (self.grid, self.grid):
            grid = grid_pos.float().reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
            grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bicubic", antialias=True, align_corners=False)
            grid_pos = grid.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, -1).to(pos.dtype)
        table = torch.cat([cls_pos, grid_pos], dim=1).detach()
        self._pos_cache.clear()
        self._pos_cache[key] = table
        return table

    def forward(self, images: Tensor, norm: NormFn = apply_norm, mlp: MlpFn = apply_mlp,
                residual: ResidualFn | None = None) -> Tensor:
        s, _, h, w = images.shape
        grid_h, grid_w = h // self.patch_size, w // self.patch_size
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(s, -1, -1).to(x.dtype), x], dim=1)
        x = x + self.position_embedding(grid_h, grid_w)
        regs = self.register_tokens.expand(s, -1, -1).to(x.dtype)
        x = torch.cat([x[:, :1], regs, x[:, 1:]], dim=1)
        for block in self.blocks:
            x = block(x, norm=norm, mlp=mlp, residual=residual)
        x = self.norm(x)
        return x[:, 1 + self.num_register_tokens:]
