"""Top-level LingBot-Map model with the official parameter names
(``aggregator.*``, ``camera_head.*``, ``depth_head.*``).

``step`` runs one streaming step given the attention callables that implement
the cache policy; the model itself holds no streaming state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from .aggregator import Aggregator, GlobalAttend
from .heads import CameraAttend, CameraHead, DepthHead


@dataclass
class StepOutput:
    """Outputs of one step of S frames (float32, on the model's device)."""

    pose_enc: Tensor  # [S, 9] translation, quaternion xyzw, fov_h, fov_w
    depth: Tensor | None  # [S, H, W] z-depth, model units
    depth_conf: Tensor | None  # [S, H, W] >= 1


class LingBotMap(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.aggregator = Aggregator(cfg)
        self.camera_head = CameraHead(cfg)
        self.depth_head = DepthHead(cfg)

    def step(self, images: Tensor, positions: Tensor, global_attend: GlobalAttend, camera_attend: CameraAttend, *,
             phase1: bool, sequence_start: bool, camera_iterations: int, autocast_dtype: torch.dtype | None = None,
             with_depth: bool = True, fused: bool = False, depth_head: nn.Module | None = None) -> StepOutput:
        """One streaming step.

        Args:
            images: [S, 3, H, W] RGB in [0, 1].
            positions: [S] long temporal indices of the frames.
            global_attend / camera_attend: cache-backed attention (see Aggregator, CameraHead).
            autocast_dtype: run the aggregator under autocast in this dtype (bf16); the heads
                always run in float32.
            fused: the aggregator uses the Triton kernels (see ``Aggregator.forward``).
            depth_head: a stand-in for ``self.depth_head`` (e.g. its bf16 copy,
                ``DepthHead.reduced_precision_copy``).
        """
        device_type = images.device.type
        # cache_enabled=False: no weight-cast cache, which CUDA-graph capture cannot keep (weights are bf16 anyway)
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None,
                            cache_enabled=False):
            levels = self.aggregator(images, positions, global_attend, phase1=phase1, sequence_start=sequence_start,
                                     fused=fused)
        with torch.autocast(device_type, enabled=False):
            levels = [lv.float() for lv in levels]  # the heads run in float32
            pose_enc = self.camera_head(levels[-1], camera_iterations, camera_attend)
            depth = conf = None
            if with_depth:
                head = depth_head if depth_head is not None else self.depth_head
                depth, conf = head(levels, images.shape[-2], images.shape[-1])
        return StepOutput(pose_enc, depth, conf)

    def head_modules(self) -> list[nn.Module]:
        return [self.camera_head, self.depth_head]
