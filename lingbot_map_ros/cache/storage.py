"""Where a session's K/V pages live: ``PrivateStorage`` (one camera: a pool of its own).

Every session's ``StepRunner`` takes its pool from a storage through one interface
(``lease``, ``release``, ``view``, ``check_pages``, ``generation``, ``shared``). Several
cameras lease extents of one ``cache.pool.SharedKVStorage``; one camera alone gets a
``PrivateStorage``: the whole pool is its own (bf16, or FP8 with ``kv_cache_dtype`` fp8),
allocated at its first frame's resolution and replaced when the resolution changes, and
every page id is its own (``check_pages`` has nothing to refuse).
"""
from __future__ import annotations

import torch

from .fp8 import Fp8KVPool
from .pool import KVPool


class PrivateStorage:
    """The K/V pages of one session alone (the ``SharedKVStorage`` interface, for one owner).

    ``kv_cache_dtype``: "auto" (the stream's dtype) or "fp8" (``cache.fp8``); ``fused``: the FP8
    pool dequantises with the Triton kernel."""

    shared = False
    generation = 0  # a private pool never moves under its owner

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: str = "auto", fused: bool = False) -> None:
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.kv_cache_dtype, self.fused = kv_cache_dtype, fused
        self._pool: KVPool | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._pool is None else self._pool.nbytes

    def lease(self, owner: str, pages: int, page_size: int) -> KVPool:
        """A new pool of ``pages`` pages of ``page_size`` tokens (the old one is freed first)."""
        self._pool = None
        if self.kv_cache_dtype == "fp8":
            self._pool = Fp8KVPool(self.num_layers, pages, page_size, self.num_heads, self.head_dim, self.dtype,
                                   self.device, fused=self.fused)
        else:
            self._pool = KVPool(self.num_layers, pages, page_size, self.num_heads, self.head_dim, self.dtype,
                                self.device)
        return self._pool

    def release(self, owner: str) -> None:
        self._pool = None

    def view(self, owner: str) -> KVPool:
        return self._pool

    def check_pages(self, owner: str, page_ids, last_slot: int | None = None) -> None:
        """Nothing to refuse: every page of a private pool is its owner's."""


__all__ = ["PrivateStorage"]
