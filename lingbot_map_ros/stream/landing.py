"""Host buffers that a step's outputs land in, handed to the caller without a copy.

A step's outputs (pose, depth, confidence: 1.6 MB at 518x378) reach the host by DMA
into page-locked memory. Copying them out into fresh arrays cost ~0.3-0.8 ms per
frame on the GPU machine, on the critical path between two steps. Instead, the
results are numpy views of one of a few page-locked buffers, and a buffer is reused
only when no array of an earlier step still views it. numpy views keep their base
array alive, so the base's reference count tells: no more than right after the
buffer was made. When every buffer is still viewed (a
caller that keeps all its results), the outputs land in a staging buffer that is
never handed out and are copied from there, as before.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from torch import Tensor


class _Buffer:
    __slots__ = ("tensor", "array", "_idle_refs")

    def __init__(self, n: int, pin: bool) -> None:
        self.tensor = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.array = self.tensor.numpy()  # the base of every view handed out
        # the count with no view alive, taken the way ``free`` takes it (what getrefcount
        # itself adds differs between Python versions)
        self._idle_refs = sys.getrefcount(self.array)

    def free(self) -> bool:
        return sys.getrefcount(self.array) <= self._idle_refs


class LandingRing:
    """At most ``size`` float32 landing buffers (page-locked when ``pin``) plus a staging one."""

    def __init__(self, size: int = 4, pin: bool = True) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.pin = size, pin
        self._ring: list[_Buffer] = []
        self._staging: _Buffer | None = None
        self.copies = 0  # steps that had to copy (every buffer still in use)

    def acquire(self, n: int) -> tuple[Tensor, np.ndarray, bool]:
        """Somewhere to land n floats: (the tensor to copy them into, the numpy array that will
        hold them once they landed, staging). The array is a view of a free ring buffer, which
        stays reserved for as long as it, or any view of it, is alive (so a step still in
        flight keeps its buffer). When every ring buffer is in use, it is the staging buffer
        (``staging`` True), which later acquires reuse: copy the data out before then."""
        for i, buf in enumerate(self._ring):
            if buf.free():
                if buf.tensor.numel() < n:  # too small for this resolution: replace it
                    buf = self._ring[i] = _Buffer(n, self.pin)
                return buf.tensor, buf.array[:n], False
        if len(self._ring) < self.size:
            buf = _Buffer(n, self.pin)
            self._ring.append(buf)
            return buf.tensor, buf.array[:n], False
        if self._staging is None or self._staging.tensor.numel() < n:
            self._staging = _Buffer(n, self.pin)
        self.copies += 1
        return self._staging.tensor, self._staging.array[:n], True


__all__ = ["LandingRing"]
