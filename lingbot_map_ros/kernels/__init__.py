"""Fused GPU kernels (Triton) for the hot path, each with a PyTorch twin.

Every kernel here replaces a chain of small PyTorch ops whose launches and
memory round trips dominate a one-frame step once attention is fast. The PyTorch
twin (same arguments, same maths) runs where Triton or CUDA is absent and is the
reference the GPU tests compare the kernel with. ``available()`` says whether the
Triton versions can run on a device.
"""
from __future__ import annotations

import importlib.util
import os

import torch

_DISABLE_ENV = "LINGBOT_DISABLE_TRITON"


def available(device: torch.device | str) -> bool:
    """True when the Triton kernels can run on ``device`` (CUDA, Triton importable, not disabled
    through the LINGBOT_DISABLE_TRITON environment variable)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
        return False
    return importlib.util.find_spec("triton") is not None
