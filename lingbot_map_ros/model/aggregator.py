"""The aggregator: DINO patch tokens + 6 special tokens, then alternating frame and
global blocks (SPEC §2-3).

The aggregator knows nothing about the cache: global attention is delegated to a
``GlobalAttend`` callable that receives RoPE-rotated q/k and v of all tokens of
the step and returns the attention output (it writes K/V into the paged cache
and reads the visible set, or anything equivalent).
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor, nn

from ..config import SPECIAL_TOKENS, ModelConfig
from .dino import DinoEncoder
from .layers import Block, apply_mlp, apply_norm, sdpa_nhd
from .rope import Rope3DTables, apply_rope2d, apply_rope3d_complex, rope2d_tables, rope3d_rotation

class GlobalAttend(Protocol):
    """Cross-frame attention of one step over the cache (``cache.pool.PoolAttention``,
    ``cache.pool.FramewiseAttention``); the aggregator picks its path from the two flags.

    ``attend(layer, q, k, v) -> out``, each [S*P, H, D]; q/k rotated (float32), v as computed.
    ``fusable``: it also offers, for the fused kernels, ``destinations(layer, n, heads, dim) ->
    (q_out, k_rows, v_rows, slots)`` (where the kernel writes rotated q and the K/V rows) and
    ``attend_written(layer, q_out) -> out``. ``framewise``: None, or one such attention per frame
    of the step (each frame attends over its own cache: several cameras' frames in one step)."""

    fusable: bool
    framewise: Sequence["GlobalAttend"] | None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class _Attend:
    """An attend callable for ``Attention``; with ``fused`` it also offers ``from_qkv``."""

    def __init__(self, plain: Callable[[Tensor, Tensor, Tensor], Tensor],
                 fused: Callable[[Tensor, nn.Module], Tensor] | None = None) -> None:
        self._plain = plain
        if fused is not None:
            self.from_qkv = fused

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self._plain(q, k, v)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class _RopeSet:
    """2D and 3D RoPE tables of one patch grid on one device."""

    def __init__(self, grid_h: int, grid_w: int, max_frames: int, device: torch.device) -> None:
        cos2, sin2 = rope2d_tables(grid_h, grid_w)
        self.cos2d, self.sin2d = cos2.to(device), sin2.to(device)
        self.rope3d = Rope3DTables(grid_h, grid_w, max_frames, device)
        self._halves: tuple[Tensor, Tensor] | None = None

    def halves(self) -> tuple[Tensor, Tensor]:
        """The 2D tables in the fused kernel's form (``kernels.qk_rope.tables_halves``)."""
        if self._halves is None:
            from ..kernels.qk_rope import tables_halves

            self._halves = tables_halves(self.cos2d, self.sin2d)
        return self._halves


class Aggregator(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.embed_dim
        self.patch_embed = DinoEncoder(cfg)
        self.camera_token = nn.Parameter(torch.zeros(1, 2, 1, dim))
        self.register_token = nn.Parameter(torch.zeros(1, 2, cfg.num_register_tokens, dim))
        self.scale_token = nn.Parameter(torch.zeros(1, 2, 1, dim))
        self.frame_blocks = nn.ModuleList(
            Block(dim, cfg.num_heads, cfg.mlp_ratio, qk_norm=True) for _ in range(cfg.depth))
        self.global_blocks = nn.ModuleList(
            Block(dim, cfg.num_heads, cfg.mlp_ratio, qk_norm=True) for _ in range(cfg.depth))
        # Not persistent: the checkpoints carry no buffers. They follow the module's dtype
        # (the reference rounds them to bf16 together with the aggregator).
        self.register_buffer("_mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("_std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        self._ropes: dict[tuple, _RopeSet] = {}

    def rope_set(self, grid_h: int, grid_w: int, device: torch.device) -> _RopeSet:
        key = (grid_h, grid_w, device)
        if key not in self._ropes:
            self._ropes[key] = _RopeSet(grid_h, grid_w, self.cfg.max_frame_num, device)
        return self._ropes[key]

    def special_tokens(self, num_frames: int, phase1: bool, sequence_start: bool) -> Tensor:
        """[S, 6, C]: camera, registers, scale. Variant 0 of camera/register for the first frame
        of a sequence, variant 1 otherwise; scale variant 0 in phase 1, 1 afterwards."""
        variant = torch.ones(num_frames, dtype=torch.long, device=self.camera_token.device)
        if phase1 and sequence_start:
            variant[0] = 0
        camera = self.camera_token[0].index_select(0, variant)  # [S, 1, C]
        registers = self.register_token[0].index_select(0, variant)  # [S, 4, C]
        scale = self.scale_token[0, 0 if phase1 else 1].expand(num_frames, 1, -1)
        return torch.cat([camera, registers, scale], dim=1)

    def forward(self, images: Tensor, positions: Tensor, global_attend: GlobalAttend, *,
                phase1: bool, sequence_start: bool, fused: bool = False) -> list[Tensor]:
        """Run one streaming step.

        Args:
            images: [S, 3, H, W] RGB in [0, 1], H and W multiples of the patch size.
            positions: [S] long temporal index of each frame (on the images' device).
            global_attend: cross-frame attention over the cache for one layer.
            phase1: the step is the first ``num_scale_frames`` frames of a sequence.
            sequence_start: the first frame of the step is the first of a sequence.
            fused: use the Triton kernels of ``lingbot_map_ros.kernels`` (CUDA, bf16
                weights): LayerNorms written in bf16, q/k norm + RoPE (+ K/V store) in one
                kernel, the MLP's GELU in fc1's epilogue, each LayerScale residual update
                together with the LayerNorm that reads its result (``kernels.residual``;
                no float32 copies of the bf16 branch). Same maths as the PyTorch path
                but for that GELU (tanh form, below bf16 resolution; ``kernels.mlp``).
        Returns:
            4 tensors [S, P, 2*embed_dim] (frame output | global output of the
            selected block pairs), P = 6 + (H/14)(W/14).
        """
        s, _, h, w = images.shape
        grid_h, grid_w = h // self.cfg.patch_size, w // self.cfg.patch_size
        ropes = self.rope_set(grid_h, grid_w, images.device)
        cos3, sin3 = ropes.rope3d.lookup(positions)  # [S, P, 32]
        heads, head_dim = self.cfg.num_heads, self.cfg.embed_dim // self.cfg.num_heads
        norm, mlp, residual = apply_norm, apply_mlp, None
        if fused:
            from ..kernels.layer_norm import layer_norm
            from ..kernels.qk_rope import XOR_HALVES, XOR_INTERLEAVED, qk_norm_rope, tables_interleaved

            act_dtype = self.camera_token.dtype

            def fused_norm(module: nn.Module, x: Tensor) -> Tensor:
                return layer_norm(x, module, act_dtype)

            norm = fused_norm
            from ..kernels.mlp import gelu_epilogue_mlp as mlp
            from ..kernels.residual import residual_add

            def fused_residual(x: Tensor, branch: Tensor, gamma: Tensor, next_norm: nn.LayerNorm | None):
                return residual_add(x, branch, gamma, next_norm, act_dtype)

            residual = fused_residual

            cos2h, sin2h = ropes.halves()
        # a FramewiseAttention: frame i attends over its own cache through ``framewise[i]``
        framewise = global_attend.framewise
        if framewise is not None and len(framewise) != s:
            raise ValueError(f"{len(framewise)} per-frame attentions for a step of {s} frames")
        global_fusable = fused and global_attend.fusable
        if global_fusable:
            cos3i, sin3i = (t.reshape(-1, t.shape[-1]) for t in tables_interleaved(cos3, sin3))
        else:
            rotation3 = rope3d_rotation(cos3, sin3)  # [S, P, 1, 32] complex

        x = (images - self._mean) / self._std
        patches = self.patch_embed(x.to(self._mean.dtype), norm=norm, mlp=mlp, residual=residual)  # [S, gh*gw, C]
        x = torch.cat([self.special_tokens(s, phase1, sequence_start).to(patches.dtype), patches], dim=1)
        tokens = x.shape[1]

        def frame_plain(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q = apply_rope2d(q, ropes.cos2d, ropes.sin2d)
            k = apply_rope2d(k, ropes.cos2d, ropes.sin2d)
            # attention in v's dtype (bf16 under autocast, which would cast q/k/v to it anyway)
            return sdpa_nhd(q.to(v.dtype), k.to(v.dtype), v)

        def frame_fused(qkv: Tensor, attn: nn.Module) -> Tensor:
            n = s * tokens
            q = torch.empty(n, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
            k = torch.empty_like(q)
            qk_norm_rope(qkv.reshape(n, -1), heads, attn.q_norm, attn.k_norm, cos2h, sin2h, XOR_HALVES, q, k)
            v = qkv.view(s, tokens, 3, heads, head_dim)[:, :, 2]
            return sdpa_nhd(q.view(s, tokens, heads, head_dim), k.view(s, tokens, heads, head_dim), v)

        frame_attend = _Attend(frame_plain, frame_fused if fused else None)

        outputs = []
        selected = set(self.cfg.intermediate_layer_idx)
        for layer, (frame_block, global_block) in enumerate(zip(self.frame_blocks, self.global_blocks)):
            x = frame_block(x, frame_attend, norm, mlp, residual)
            frame_out = x

            def global_plain(q: Tensor, k: Tensor, v: Tensor, layer: int = layer) -> Tensor:
                q = apply_rope3d_complex(q.view(s, tokens, *q.shape[-2:]), rotation3)
                k = apply_rope3d_complex(k.view(s, tokens, *k.shape[-2:]), rotation3)
                out = global_attend(layer, q.flatten(0, 1), k.flatten(0, 1), v.reshape(s * tokens, *v.shape[-2:]))
                return out.unsqueeze(0)  # [1, S*P, H, D]

            def global_fused(qkv: Tensor, attn: nn.Module, layer: int = layer) -> Tensor:
                n = s * tokens
                if framewise is not None:  # each frame over its own cache (several cameras in one step)
                    rows_of = qkv.reshape(n, -1)
                    outs = []
                    for i, part in enumerate(framewise):
                        rows = slice(i * tokens, (i + 1) * tokens)
                        q, k_rows, v_rows, slots = part.destinations(layer, tokens, heads, head_dim)
                        qk_norm_rope(rows_of[rows], heads, attn.q_norm, attn.k_norm, cos3i[rows], sin3i[rows],
                                     XOR_INTERLEAVED, q, k_rows, v_rows, slots)
                        outs.append(part.attend_written(layer, q))
                    return torch.cat(outs).unsqueeze(0)
                q, k_rows, v_rows, slots = global_attend.destinations(layer, n, heads, head_dim)
                qk_norm_rope(qkv.reshape(n, -1), heads, attn.q_norm, attn.k_norm, cos3i, sin3i, XOR_INTERLEAVED,
                             q, k_rows, v_rows, slots)
                return global_attend.attend_written(layer, q).unsqueeze(0)

            attend = _Attend(global_plain, global_fused if global_fusable else None)
            x = global_block(x.reshape(1, s * tokens, -1), attend, norm, mlp, residual).view(s, tokens, -1)
            if layer in selected:
                outputs.append(torch.cat([frame_out, x], dim=-1))
        return outputs


__all__ = ["Aggregator", "GlobalAttend", "SPECIAL_TOKENS"]
