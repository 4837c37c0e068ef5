"""Top-level LingBot-Map model with the official parameter names
(``aggregator.*``, ``camera_head.*``, ``depth_head.*``).

``step`` runs one streaming step given the attention callables that implement
the cache policy and the stream's ``StepOptions``; the model itself holds no
streaming state.
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


@dataclass(frozen=True)
class StepOptions:
    """How every step of one stream runs: built once by its owner (the session) and handed,
    unchanged, to ``LingBotMap.step`` / ``trunk`` / ``heads`` and to the CUDA-graph step.

    camera_iterations: refinement iterations of the camera head.
    autocast_dtype: run the aggregator under autocast in this dtype (bf16); None: float32.
        The heads run in float32 (or as their reduced-precision copies, below).
    with_depth: run the depth head (otherwise ``StepOutput.depth`` is None).
    fused: the aggregator uses the Triton kernels (see ``Aggregator.forward``).
    depth_head: a stand-in for the model's depth head (e.g. its bf16 copy,
        ``DepthHead.reduced_precision_copy``); None: the model's own.
    camera_head: likewise for the camera head (``CameraHead.reduced_precision_copy``).
    head_stream: a CUDA stream for the camera head, which then runs concurrently with the
        depth head (they share only their read-only input). The camera head is a chain of
        small, memory-bound matrix-vector products, the depth head a few compute-bound
        convolutions: side by side they fill the GPU better than one after the other.
        The step's outputs are ready on the current stream when ``heads`` returns (it
        waits for the side stream).
    """

    camera_iterations: int = 4
    autocast_dtype: torch.dtype | None = None
    with_depth: bool = True
    fused: bool = False
    depth_head: nn.Module | None = None
    camera_head: nn.Module | None = None
    head_stream: torch.cuda.Stream | None = None

    def __post_init__(self) -> None:
        if self.camera_iterations < 1:
            raise ValueError(f"camera_iterations must be >= 1, got {self.camera_iterations}")


PLAIN = StepOptions()  # float32, the model's own heads, no kernels


class LingBotMap(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.aggregator = Aggregator(cfg)
        self.camera_head = CameraHead(cfg)
        self.depth_head = DepthHead(cfg)

    def step(self, images: Tensor, positions: Tensor, global_attend: GlobalAttend, camera_attend: CameraAttend, *,
             phase1: bool, sequence_start: bool, options: StepOptions = PLAIN) -> StepOutput:
        """One streaming step: ``trunk`` then ``heads``.

        Args:
            images: [S, 3, H, W] RGB in [0, 1].
            positions: [S] long temporal indices of the frames.
            global_attend / camera_attend: cache-backed attention (see Aggregator, CameraHead).
            phase1, sequence_start: see ``Aggregator.forward``.
            options: how the stream runs its steps (``StepOptions``).
        """
        levels = self.trunk(images, positions, global_attend, phase1=phase1, sequence_start=sequence_start,
                            options=options)
        return self.heads(levels, images.shape[-2], images.shape[-1], camera_attend, options)

    def trunk(self, images: Tensor, positions: Tensor, global_attend: GlobalAttend, *, phase1: bool,
              sequence_start: bool, options: StepOptions = PLAIN) -> list[Tensor]:
        """The aggregator part of ``step`` (it writes the cache): the 4 selected levels
        [S, P, 2*embed_dim] in the aggregator's dtype. Nothing in it depends on the heads, so
        a step's heads may run while the next step's trunk does. Reads ``options.autocast_dtype``
        and ``options.fused``."""
        autocast_dtype = options.autocast_dtype
        # cache_enabled=False: no weight-cast cache, which CUDA-graph capture cannot keep (weights are bf16 anyway)
        with torch.autocast(images.device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None, cache_enabled=False):
            return self.aggregator(images, positions, global_attend, phase1=phase1, sequence_start=sequence_start,
                                   fused=options.fused)

    def heads(self, levels: list[Tensor], height: int, width: int, camera_attend: CameraAttend,
              options: StepOptions = PLAIN) -> StepOutput:
        """The heads part of ``step`` on ``trunk``'s levels (read only) for frames of height x width."""
        head_stream, with_depth = options.head_stream, options.with_depth
        with torch.autocast(levels[0].device.type, enabled=False):
            levels = [lv.float() for lv in levels]  # the heads run in float32
            parallel = head_stream is not None and with_depth
            cam = options.camera_head if options.camera_head is not None else self.camera_head
            if parallel:
                main = torch.cuda.current_stream(levels[0].device)
                head_stream.wait_stream(main)  # the levels are written
                with torch.cuda.stream(head_stream):
                    pose_enc = cam(levels[-1], options.camera_iterations, camera_attend)
            else:
                pose_enc = cam(levels[-1], options.camera_iterations, camera_attend)
            depth = conf = None
            if with_depth:
                head = options.depth_head if options.depth_head is not None else self.depth_head
                depth, conf = head(levels, height, width)
            if parallel:
                # join: everything after this on the current stream sees the pose. The
                # levels stay referenced until here, so the allocator cannot hand their
                # memory to the current stream while the camera head still reads it.
                main.wait_stream(head_stream)
        return StepOutput(pose_enc, depth, conf)

    def head_modules(self) -> list[nn.Module]:
        return [self.camera_head, self.depth_head]
