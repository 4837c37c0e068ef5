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
             with_depth: bool = True, fused: bool = False, depth_head: nn.Module | None = None,
             head_streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None) -> StepOutput:
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
            head_streams: two CUDA streams (camera, depth) on which the heads run beside
                the aggregator and each other. The depth head turns each selected level
                into its feature map as soon as that level's block is done (levels 0-2 while
                the aggregator's later blocks still run), then fuses the four; the camera
                head, a chain of small memory-bound matrix-vector products, runs beside the
                depth head's compute-bound convolutions. The step's outputs are ready on the
                current stream when ``step`` returns (it waits for both). Same results.
        """
        device_type = images.device.type
        height, width = images.shape[-2], images.shape[-1]
        head = depth_head if depth_head is not None else self.depth_head
        parallel = head_streams is not None and with_depth
        feats: list[Tensor] = []
        on_level = None
        if parallel:
            camera_stream, depth_stream = head_streams
            main = torch.cuda.current_stream(images.device)

            def on_level(k: int, level: Tensor) -> None:
                depth_stream.wait_stream(main)  # the level is written
                with torch.cuda.stream(depth_stream), torch.autocast(device_type, enabled=False):
                    feats.append(head.level_features(k, level, height, width))

        # cache_enabled=False: no weight-cast cache, which CUDA-graph capture cannot keep (weights are bf16 anyway)
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None,
                            cache_enabled=False):
            levels = self.aggregator(images, positions, global_attend, phase1=phase1, sequence_start=sequence_start,
                                     fused=fused, on_level=on_level)
        with torch.autocast(device_type, enabled=False):
            # the heads run in float32; the camera head reads only the camera token
            camera_input = levels[-1][:, :1].float()
            depth = conf = None
            if parallel:
                camera_stream.wait_stream(main)
                with torch.cuda.stream(camera_stream):
                    pose_enc = self.camera_head(camera_input, camera_iterations, camera_attend)
                with torch.cuda.stream(depth_stream):
                    depth, conf = head.fuse(feats, height, width)
                # join: everything after this on the current stream sees the outputs. The
                # levels stay referenced until here, so the allocator cannot hand their
                # memory to the current stream while a head still reads them.
                main.wait_stream(camera_stream)
                main.wait_stream(depth_stream)
            else:
                pose_enc = self.camera_head(camera_input, camera_iterations, camera_attend)
                if with_depth:
                    depth, conf = head(levels, height, width)
        return StepOutput(pose_enc, depth, conf)

    def head_modules(self) -> list[nn.Module]:
        return [self.camera_head, self.depth_head]
