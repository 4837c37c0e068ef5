"""``FrameResult``: what a session returns for each frame (numpy arrays on the host).

A light module (numpy only): the ROS layer and the writers use the type without
importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..io.preprocess import input_size, uint8_to_image


@dataclass
class FrameResult:
    """Per-frame output. World = the first camera of the sequence, OpenCV axes (x right,
    y down, z forward); units are the model's own (metre-like, not guaranteed metric)."""

    frame_index: int  # frames pushed since reset, this one's 0-based index
    position: int  # temporal index used by the model (frames stored before it)
    is_keyframe: bool  # stored in the cache
    pose_enc: np.ndarray  # [9] translation, quaternion xyzw, fov_h, fov_w
    c2w: np.ndarray  # [4, 4] camera-to-world
    intrinsics: np.ndarray  # [3, 3] at the model resolution (pixels)
    depth: np.ndarray | None  # [H, W] z-depth
    confidence: np.ndarray | None  # [H, W] >= 1
    # the model input as pushed: float32 [3, H, W] RGB in [0, 1], or uint8 [H, W, 3] RGB
    frame: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)  # ms: model (until outputs on the host), postprocess

    @property
    def size(self) -> tuple[int, int]:
        """(H, W) of the model input."""
        return input_size(self.frame)

    @property
    def image(self) -> np.ndarray:
        """The model input as float32 [3, H, W] RGB in [0, 1] (converted from a uint8 frame)."""
        if self.frame.dtype == np.uint8:
            return uint8_to_image(self.frame)
        return self.frame

    def colors(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [N, 3] RGB of the input at flat pixel indices ``pixels`` (row-major, [H*W])."""
        if self.frame.dtype == np.uint8:
            return self.frame.reshape(-1, 3)[pixels]
        return np.clip(np.rint(self.frame.reshape(3, -1)[:, pixels].T * 255.0), 0, 255).astype(np.uint8)


__all__ = ["FrameResult"]
