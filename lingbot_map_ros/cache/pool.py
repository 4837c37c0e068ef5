"""Device-side cache storage: per-layer K/V page pools, the camera-head cache, and the
per-step plan tensors shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import SPECIAL_TOKENS
from ..kernels.camera_attention import camera_attention, camera_attention_reference, visibility_bias
from .pages import StepPlan


class UngraphableStep(ValueError):
    """A step the CUDA-graph step of a backend cannot take (e.g. its visible keys form more
    runs than the graph has splits for); raised before anything ran, so the owner runs
    that step eagerly instead."""


@dataclass
class DevicePlan:
    """Tensors of one step's plan, built once before the layer loop and reused by all layers."""

    plan: StepPlan
    write_slots: Tensor  # [S*P] long: flat slot of every token of the step (frame-major, specials first)
    read_pages: Tensor  # [n] int32: visible pages, all full but the last
    tokens_per_frame: int
    read_slots: Tensor | None = None  # [kv_len] long; built on the device on first use (gather backends)

    @property
    def qo_len(self) -> int:
        return self.plan.num_frames * self.tokens_per_frame

    def visible_slots(self) -> Tensor:
        """[kv_len] long flat slots of the visible tokens (device ops only, no host work)."""
        if self.read_slots is None:
            ps = self.plan.page_size
            offsets = torch.arange(ps, device=self.read_pages.device)
            self.read_slots = (self.read_pages.long()[:, None] * ps + offsets[None]).flatten()[:self.plan.kv_len]
        return self.read_slots


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def make_device_plan(plan: StepPlan, tokens_per_frame: int, device: torch.device) -> DevicePlan:
    """Host work of a step: a few small index tensors, copied to the device without a sync."""
    ps = plan.page_size
    patches = tokens_per_frame - SPECIAL_TOKENS
    if patches != ps:
        raise ValueError(f"frame has {patches} patch tokens but the cache pages hold {ps}")
    offsets = torch.arange(ps)
    special = torch.tensor(plan.special_slots, dtype=torch.long).view(plan.num_frames, SPECIAL_TOKENS)
    patch = torch.tensor(plan.frame_pages, dtype=torch.long)[:, None] * ps + offsets[None]
    write_slots = torch.cat([special, patch], dim=1).flatten()
    pages = torch.tensor(plan.read_pages, dtype=torch.int32)
    return DevicePlan(plan=plan, write_slots=_to_device(write_slots, device), read_pages=_to_device(pages, device),
                      tokens_per_frame=tokens_per_frame)


class KVPool:
    """K and V pages of every global layer: [layers, pages, page_size, heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_pages, page_size, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [N, H, D] at flat token slots [N]."""
        self.k[layer].view(-1, *k.shape[-2:]).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].view(-1, *v.shape[-2:]).index_copy_(0, slots, v.to(self.v.dtype))


class CameraKVCache:
    """K/V of the camera head: one token per stored frame, per iteration and trunk block.

    Slot i holds the frame of temporal index i; a step writes its tokens at
    ``start`` (the number of frames stored) and attends to slots [0, start + S).
    An attend-only step's slot is simply overwritten by the next step.
    ``fused``: ``attend_at`` through the Triton kernel (``kernels.camera_attention``);
    the owner decides (a session: where its kernels passed their self-check).
    """

    def __init__(self, iterations: int, depth: int, capacity: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fused: bool = False) -> None:
        shape = (iterations, depth, capacity, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.fused = fused

    def attend(self, iteration: int, block: int, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """q, k, v [S, H, D] -> [S, H, D] attending over the stored frames and the step's own."""
        end = start + q.shape[0]
        kc, vc = self.k[iteration, block], self.v[iteration, block]
        kc[start:end] = k
        vc[start:end] = v
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[:end].transpose(0, 1)[None],
                                             vc[:end].transpose(0, 1)[None])
        return out[0].transpose(0, 1)

    # Static-shape variant of ``attend`` for one frame (CUDA graphs): no Python int decides
    # a shape or an offset, the slot and the visible length come from a device tensor.
    def visible_bias(self, position: Tensor) -> Tensor | None:
        """Additive mask [1, 1, capacity]: 0 for slots <= position [1] (long), -inf after (None
        with the fused kernel, which reads the position itself)."""
        return None if self.fused else visibility_bias(self.k.shape[2], position, self.k.dtype)

    def attend_at(self, iteration: int, block: int, q: Tensor, k: Tensor, v: Tensor, slot: Tensor,
                  bias: Tensor | None) -> Tensor:
        """q, k, v [1, H, D]; slot [1] long (= the frame's position); bias from ``visible_bias(slot)``.
        Same result as ``attend(..., start=slot)`` up to the order of the softmax sums: one
        query per head over every slot with the mask (``kernels.camera_attention``'s PyTorch
        twin; PyTorch's SDPA with a mask took a kernel that tiles 64 queries and spent
        ~115 us per call on 1024 slots, 16 calls per frame), or, with ``fused``, one kernel
        that stores the token and reads only the visible slots."""
        kc, vc = self.k[iteration, block], self.v[iteration, block]
        if self.fused:
            return camera_attention(q.contiguous(), k.contiguous(), v.contiguous(), kc, vc, slot)
        return camera_attention_reference(q, k, v, kc, vc, slot, bias)


class PoolAttention:
    """Global attention of one step over the K/V pool (the aggregator's ``GlobalAttend``).

    Called with q, k, v it stores k/v at the step's slots and attends; the fused path
    instead asks for ``destinations`` (where a kernel writes rotated q and the K/V rows
    itself) and then calls ``attend_written``.
    """

    def __init__(self, pool: KVPool, backend, write_slots: Tensor) -> None:
        self.pool, self.backend, self.write_slots = pool, backend, write_slots

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.pool.write(layer, self.write_slots, k, v)
        return self.backend.attend(q, self.pool.k[layer], self.pool.v[layer])

    def destinations(self, layer: int, n: int, heads: int, dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q_out, k_rows, v_rows, slots): q_out is [n, H, D] or the backend's [S, n, H, D]
        query buffer; k/v rows are the layer's pool viewed as [slots, H, D]."""
        k_pages, v_pages = self.pool.k[layer], self.pool.v[layer]
        query_buffer = getattr(self.backend, "query_buffer", None)
        q = query_buffer(k_pages) if query_buffer is not None else \
            torch.empty(n, heads, dim, dtype=k_pages.dtype, device=k_pages.device)
        return q, k_pages.view(-1, heads, dim), v_pages.view(-1, heads, dim), self.write_slots

    def attend_written(self, layer: int, q: Tensor) -> Tensor:
        return self.backend.attend(q, self.pool.k[layer], self.pool.v[layer])
