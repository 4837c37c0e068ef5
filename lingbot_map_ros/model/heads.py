"""Prediction heads (SPEC §4): the iterative camera head and the DPT depth head.

Both run in float32, as in the reference. Each offers ``reduced_precision_copy``: a
copy with bf16 weights that bf16 streams on CUDA use instead (the depth head's
convolutions in bf16; the camera head's matrix-vector products reading bf16 weights
with float32 activations).
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import SPECIAL_TOKENS, ModelConfig
from .layers import Block, Mlp

# camera_attend(iteration, block, q, k, v) -> out; q/k/v [S, H, D], one camera token per frame
CameraAttend = Callable[[int, int, Tensor, Tensor, Tensor], Tensor]


class CameraHead(nn.Module):
    """Camera token of the last selected layer -> pose encoding [S, 9]
    (translation 3, quaternion xyzw 4, fov_h, fov_w), refined over iterations."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.camera_dim
        self.token_norm = nn.LayerNorm(dim)
        self.trunk = nn.ModuleList(
            Block(dim, cfg.camera_num_heads, cfg.mlp_ratio, qk_norm=False) for _ in range(cfg.camera_trunk_depth))
        self.trunk_norm = nn.LayerNorm(dim)
        self.empty_pose_tokens = nn.Parameter(torch.zeros(1, 1, 9))
        self.embed_pose = nn.Linear(9, dim)
        self.poseLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 3 * dim))
        self.adaln_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.pose_branch = Mlp(dim, dim // 2, 9)

    _gemv: "Gemv | None" = None  # set on the reduced-precision copy only

    def reduced_precision_copy(self, gemv: "Gemv | None" = None, dtype: torch.dtype = torch.bfloat16) -> "CameraHead":
        """A copy whose large matrix-vector products read ``dtype`` weights (the trunk's qkv,
        proj, fc1, fc2, the pose modulation and the pose branch: 99.9% of the head's weights)
        through ``gemv`` (``kernels.gemv.gemv``, or its PyTorch twin by default), with the
        LayerNorm / SiLU before and the GELU / LayerScale residual after each product folded
        in. Activations, LayerNorm statistics and sums stay float32; only the weights are
        rounded. Not the reference's precision: the session uses it where the stream already
        runs in bf16. The model's own head is left as it is."""
        from ..kernels.gemv import gemv_reference

        head = copy.deepcopy(self)
        linears = [head.poseLN_modulation[1], head.pose_branch.fc1, head.pose_branch.fc2]
        for block in head.trunk:
            linears += [block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2]
        for linear in linears:
            linear.weight.data = linear.weight.data.to(dtype).contiguous()
        head._gemv = gemv or gemv_reference
        return head

    def forward(self, head_input: Tensor, iterations: int, attend: CameraAttend) -> Tensor:
        """head_input [S, P, camera_dim] -> pose_enc [S, 9] (last iteration, FoVs through ReLU)."""
        if self._gemv is not None:
            return self._forward_gemv(head_input, iterations, attend)
        c = self.token_norm(head_input[:, 0])  # [S, C]
        raw = torch.zeros(c.shape[0], 9, dtype=c.dtype, device=c.device)
        normed = self.adaln_norm(c)
        pose = raw
        for it in range(iterations):
            embed_in = self.empty_pose_tokens[0].expand(c.shape[0], -1) if it == 0 else raw.detach()
            shift, scale, gate = self.poseLN_modulation(self.embed_pose(embed_in)).chunk(3, dim=-1)
            x = gate * (normed * (1 + scale) + shift) + c
            for b, block in enumerate(self.trunk):
                x = block(x, lambda q, k, v, it=it, b=b: attend(it, b, q, k, v))
            raw = raw + self.pose_branch(self.trunk_norm(x))
            pose = torch.cat([raw[:, :7], F.relu(raw[:, 7:])], dim=-1)
        return pose

    def _forward_gemv(self, head_input: Tensor, iterations: int, attend: CameraAttend) -> Tensor:
        """``forward`` with the products through ``self._gemv`` (same maths, other rounding)."""
        g = self._gemv
        c = self.token_norm(head_input[:, 0].float())  # [S, C]
        s = c.shape[0]
        raw = torch.zeros(s, 9, dtype=c.dtype, device=c.device)
        normed = self.adaln_norm(c)
        pose = raw
        for it in range(iterations):
            embed_in = self.empty_pose_tokens[0].expand(s, -1) if it == 0 else raw
            shift, scale, gate = g(self.embed_pose(embed_in), self.poseLN_modulation[1], silu=True).chunk(3, dim=-1)
            x = gate * (normed * (1 + scale) + shift) + c
            for b, block in enumerate(self.trunk):
                x = self._block_gemv(block, x, it, b, attend)
            raw = raw + g(g(x, self.pose_branch.fc1, norm=self.trunk_norm, gelu=True), self.pose_branch.fc2)
            pose = torch.cat([raw[:, :7], F.relu(raw[:, 7:])], dim=-1)
        return pose

    def _block_gemv(self, block: Block, x: Tensor, it: int, b: int, attend: CameraAttend) -> Tensor:
        g, attn = self._gemv, block.attn
        s, width = x.shape
        q, k, v = g(x, attn.qkv, norm=block.norm1).view(s, 3, attn.num_heads, attn.head_dim).unbind(1)
        a = attend(it, b, q, k, v).reshape(s, width)  # the trunk has no q/k norms
        x = g(a, attn.proj, residual=x, gamma=block.ls1.gamma)
        return g(g(x, block.mlp.fc1, norm=block.norm2, gelu=True), block.mlp.fc2, residual=x, gamma=block.ls2.gamma)


# gemv(x, linear, *, norm=None, silu=False, gelu=False, residual=None, gamma=None) -> [M, N] float32
Gemv = Callable[..., Tensor]


def uv_embedding(channels: int, rows: int, cols: int, aspect: float) -> Tensor:
    """Sin/cos embedding of normalised UV coordinates [channels, rows, cols] (float32, not yet x0.1).

    aspect = W/H of the image. u spans the columns, v the rows, both symmetric around 0.
    """
    diag = math.sqrt(aspect * aspect + 1.0)
    span_x, span_y = aspect / diag, 1.0 / diag
    u = torch.linspace(-span_x * (cols - 1) / cols, span_x * (cols - 1) / cols, cols, dtype=torch.float64)
    v = torch.linspace(-span_y * (rows - 1) / rows, span_y * (rows - 1) / rows, rows, dtype=torch.float64)
    quarter = channels // 4
    omega = 100.0 ** (-torch.arange(quarter, dtype=torch.float64) / quarter)
    uu = u[None, None, :] * omega[:, None, None]  # [K, 1, cols]
    vv = v[None, :, None] * omega[:, None, None]  # [K, rows, 1]
    full = (quarter, rows, cols)
    emb = torch.cat([uu.sin().expand(full), uu.cos().expand(full), vv.sin().expand(full), vv.cos().expand(full)])
    return emb.float()


# upsample(x [N, C, H, W], (H', W')) -> bilinear resize with align_corners=True
Upsample = Callable[[Tensor, tuple[int, int]], Tensor]


def _interpolate(x: Tensor, size: tuple[int, int]) -> Tensor:
    return F.interpolate(x, size=size, mode="bilinear", align_corners=True)


# norm_to(x, layer_norm, dtype) -> layer_norm(x) (float32 maths) returned in dtype
NormTo = Callable[[Tensor, nn.LayerNorm, torch.dtype], Tensor]


def _norm_then_cast(x: Tensor, norm: nn.LayerNorm, dtype: torch.dtype) -> Tensor:
    return norm(x).to(dtype)


class ResidualConvUnit(nn.Module):
    """u(x) = conv2(relu(conv1(relu(x)))) + relu(x): the skip carries the rectified input,
    as the checkpoints were trained (the reference's in-place ReLU)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(features, features, 3, padding=1)
        self.conv2 = nn.Conv2d(features, features, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(x)
        return self.conv2(F.relu(self.conv1(x))) + x


class FusionBlock(nn.Module):
    def __init__(self, features: int, has_skip_unit: bool = True) -> None:
        super().__init__()
        if has_skip_unit:
            self.resConfUnit1 = ResidualConvUnit(features)
        self.resConfUnit2 = ResidualConvUnit(features)
        self.out_conv = nn.Conv2d(features, features, 1)

    def forward(self, path: Tensor, skip: Tensor | None, size: tuple[int, int],
                upsample: Upsample = _interpolate) -> Tensor:
        if skip is not None:
            path = path + self.resConfUnit1(skip)
        path = self.resConfUnit2(path)
        return self.out_conv(upsample(path, size))


class Scratch(nn.Module):
    def __init__(self, in_channels: tuple[int, ...], features: int) -> None:
        super().__init__()
        for i, ch in enumerate(in_channels, start=1):
            setattr(self, f"layer{i}_rn", nn.Conv2d(ch, features, 3, padding=1, bias=False))
        self.refinenet1 = FusionBlock(features)
        self.refinenet2 = FusionBlock(features)
        self.refinenet3 = FusionBlock(features)
        self.refinenet4 = FusionBlock(features, has_skip_unit=False)
        half = features // 2
        self.output_conv1 = nn.Conv2d(features, half, 3, padding=1)
        self.output_conv2 = nn.Sequential(nn.Conv2d(half, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 2, 1))


class DepthHead(nn.Module):
    """DPT head: 4 selected token levels -> depth [S,H,W] (exp) and confidence [S,H,W] (1+exp)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = 2 * cfg.embed_dim
        out_ch = cfg.dpt_out_channels
        self.patch_size = cfg.patch_size
        self.norm = nn.LayerNorm(dim)
        self.projects = nn.ModuleList(nn.Conv2d(dim, ch, 1) for ch in out_ch)
        self.resize_layers = nn.ModuleList([
            nn.ConvTranspose2d(out_ch[0], out_ch[0], 4, stride=4),
            nn.ConvTranspose2d(out_ch[1], out_ch[1], 2, stride=2),
            nn.Identity(),
            nn.Conv2d(out_ch[3], out_ch[3], 3, stride=2, padding=1),
        ])
        self.scratch = Scratch(out_ch, cfg.dpt_features)
        self._uv_cache: dict[tuple, Tensor] = {}
        self._upsample: Upsample = _interpolate
        self._norm_to: NormTo = _norm_then_cast

    def _uv(self, channels: int, rows: int, cols: int, aspect: float, ref: Tensor) -> Tensor:
        key = (channels, rows, cols, aspect, ref.device, ref.dtype)
        if key not in self._uv_cache:
            uv = (uv_embedding(channels, rows, cols, aspect) * 0.1).to(ref.device)[None].to(ref.dtype)
            if ref.dtype != torch.float32:
                uv = uv.contiguous(memory_format=torch.channels_last)
            self._uv_cache[key] = uv
        return self._uv_cache[key]

    def reduced_precision_copy(self, dtype: torch.dtype = torch.bfloat16,
                               upsample: Upsample | None = None, norm_to: NormTo | None = None) -> "DepthHead":
        """A copy that runs its convolutions in ``dtype`` with channels-last tensors (the
        LayerNorm and the final exp stay float32). Not the reference's precision: the
        session uses it only where the stream already runs in bf16. ``upsample``: a
        stand-in for its bilinear resizes (``kernels.upsample.upsample_bilinear``);
        ``norm_to``: for its float32 LayerNorm followed by the cast to ``dtype``
        (``kernels.layer_norm.layer_norm``, which does both in one pass)."""
        head = copy.deepcopy(self)
        head._uv_cache = {}
        head._upsample = upsample or _interpolate
        head._norm_to = norm_to or _norm_then_cast
        head.to(dtype).to(memory_format=torch.channels_last)
        head.norm.float()
        return head

    def forward(self, levels: list[Tensor], height: int, width: int) -> tuple[Tensor, Tensor]:
        grid_h, grid_w = height // self.patch_size, width // self.patch_size
        aspect = width / height
        dtype = self.projects[0].weight.dtype
        feats = []
        for k, tokens in enumerate(levels):
            x = self._norm_to(tokens[:, SPECIAL_TOKENS:], self.norm, dtype)  # [S, gh*gw, 2C]
            # [S, 2C, gh, gw]: channels innermost in memory, i.e. channels-last already
            x = x.transpose(1, 2).unflatten(2, (grid_h, grid_w))
            x = self.projects[k](x)
            x = x + self._uv(x.shape[1], grid_h, grid_w, aspect, x)
            x = self.resize_layers[k](x)
            feats.append(getattr(self.scratch, f"layer{k + 1}_rn")(x))
        sc, up = self.scratch, self._upsample
        path = sc.refinenet4(feats[3], None, feats[2].shape[-2:], up)
        path = sc.refinenet3(path, feats[2], feats[1].shape[-2:], up)
        path = sc.refinenet2(path, feats[1], feats[0].shape[-2:], up)
        size1 = feats[0].shape[-2:]
        path = sc.refinenet1(path, feats[0], (2 * size1[0], 2 * size1[1]), up)
        out = sc.output_conv1(path)
        out = up(out, (height, width))
        out = out + self._uv(out.shape[1], height, width, aspect, out)
        out = sc.output_conv2(out).float()  # [S, 2, H, W]
        return out[:, 0].exp(), 1 + out[:, 1].exp()
