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
    """K and V pages of every global layer: [layers, pages, page_size, heads, head_dim].

    Its own allocation, or (``KVPool.of``) a view of a ``SharedKVStorage`` extent: the
    same layout (each layer's pages one contiguous block), so backends and CUDA graphs
    take either."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_pages, page_size, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @classmethod
    def of(cls, k: Tensor, v: Tensor) -> "KVPool":
        """A pool over existing [layers, pages, page_size, heads, head_dim] tensors (no copy)."""
        pool = cls.__new__(cls)
        pool.k, pool.v, pool.page_size = k, v, k.shape[2]
        return pool

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [N, H, D] at flat token slots [N]."""
        self.k[layer].view(-1, *k.shape[-2:]).index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].view(-1, *v.shape[-2:]).index_copy_(0, slots, v.to(self.v.dtype))

    # How attention reaches a layer's pages. Here they are the pages themselves; a pool that
    # stores them in another form (``cache.fp8.Fp8KVPool``) answers with a buffer it fills.
    def layer_view(self, layer: int) -> tuple[Tensor, Tensor]:
        """(k, v) [pages, page_size, H, D] that attention reads and a kernel may write rows into."""
        return self.k[layer], self.v[layer]

    def store_written(self, layer: int, slots: Tensor) -> None:
        """Rows written into ``layer_view`` at ``slots`` are in the pool already (nothing to do)."""

    def load(self, layer: int) -> tuple[Tensor, Tensor]:
        """``layer_view`` made current (nothing to do here)."""
        return self.k[layer], self.v[layer]


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

    fusable = True  # offers destinations / attend_written
    framewise = None  # one cache for every frame of the step

    def __init__(self, pool: KVPool, backend, write_slots: Tensor) -> None:
        self.pool, self.backend, self.write_slots = pool, backend, write_slots

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.pool.write(layer, self.write_slots, k, v)
        return self.backend.attend(q, *self.pool.load(layer))

    def destinations(self, layer: int, n: int, heads: int, dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q_out, k_rows, v_rows, slots): q_out is [n, H, D] or the backend's [S, n, H, D]
        query buffer; k/v rows are the layer's pool viewed as [slots, H, D]."""
        k_pages, v_pages = self.pool.layer_view(layer)
        query_buffer = getattr(self.backend, "query_buffer", None)
        q = query_buffer(k_pages) if query_buffer is not None else \
            torch.empty(n, heads, dim, dtype=k_pages.dtype, device=k_pages.device)
        return q, k_pages.view(-1, heads, dim), v_pages.view(-1, heads, dim), self.write_slots

    def attend_written(self, layer: int, q: Tensor) -> Tensor:
        self.pool.store_written(layer, self.write_slots)
        return self.backend.attend(q, *self.pool.load(layer))


class FramewiseAttention:
    """Global attention of a step whose frames belong to different caches (several cameras'
    frames in one trunk pass): frame i writes and reads only through ``parts[i]`` (a
    ``PoolAttention`` of its camera). The aggregator's fused path asks ``framewise`` itself;
    called with q, k, v of all frames' tokens ([S*P, H, D], frame-major) it splits them."""

    fusable = True  # the fused path goes through each part's destinations / attend_written

    def __init__(self, parts: list[PoolAttention]) -> None:
        if not parts:
            raise ValueError("FramewiseAttention needs at least one frame")
        self.parts = list(parts)

    @property
    def framewise(self) -> list[PoolAttention]:
        """The per-frame attentions (frame i writes and reads through ``framewise[i]``)."""
        return self.parts

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[0]
        if n % len(self.parts):
            raise ValueError(f"{n} tokens do not split into {len(self.parts)} frames")
        p = n // len(self.parts)
        return torch.cat([part(layer, q[i * p:(i + 1) * p], k[i * p:(i + 1) * p], v[i * p:(i + 1) * p])
                          for i, part in enumerate(self.parts)])


class PoolFullError(RuntimeError):
    """A ``SharedKVStorage`` lease does not fit; nothing changed."""


@dataclass(frozen=True)
class Lease:
    """One owner's extent of a ``SharedKVStorage``: tokens [start, start + pages * page_size)."""

    owner: str
    start: int
    pages: int
    page_size: int

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def end(self) -> int:
        return self.start + self.tokens


class SharedKVStorage:
    """One K/V allocation that several caches draw their pages from (several cameras).

    K and V are [layers, capacity, heads, head_dim]; an owner leases a contiguous extent
    of ``pages * page_size`` tokens and gets a ``KVPool`` viewing it as its own
    [layers, pages, page_size, heads, head_dim] pool, with page ids 0..pages-1 of its
    own (its ``PageTable`` is unchanged). Owners with different resolutions (page
    sizes) share the storage. Free extents form one list (first fit, neighbours merged
    on release). An owner can address only its extent: the view ends there, and
    ``check_pages`` refuses a page id past it before a step writes or reads anything.

    Capacity is given, or (0) taken at the first lease as ``reserve`` times that lease;
    a lease that does not fit grows the storage to what is needed when ``growable``:
    the extents are copied to the same offsets of a new allocation and ``generation``
    goes up (owners must take their view again, ``view``; CUDA graphs bound to the old
    one must be rebuilt). Not thread-safe: one thread drives all owners.
    """

    shared = True  # several owners (``cache.storage.PrivateStorage`` is the one-owner kind)

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity_tokens: int = 0, reserve: int = 1, growable: bool = True) -> None:
        if capacity_tokens < 0 or reserve < 1:
            raise ValueError(f"capacity_tokens must be >= 0 and reserve >= 1 (got {capacity_tokens}, {reserve})")
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.reserve, self.growable = reserve, growable
        self.capacity = capacity_tokens
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.generation = 0  # bumped when the allocation moves (growth)
        self._leases: dict[str, Lease] = {}
        self._free: list[tuple[int, int]] = [(0, capacity_tokens)] if capacity_tokens else []  # (start, end)
        if capacity_tokens:
            self._allocate(capacity_tokens)

    # ------------------------------------------------------------------ queries
    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    @property
    def leased_tokens(self) -> int:
        return sum(l.tokens for l in self._leases.values())

    def lease_of(self, owner: str) -> Lease | None:
        return self._leases.get(owner)

    def leases(self) -> list[Lease]:
        return sorted(self._leases.values(), key=lambda l: l.start)

    def free_extents(self) -> list[tuple[int, int]]:
        return list(self._free)

    def owner_of(self, token: int) -> str | None:
        """The owner whose extent holds flat token ``token`` (None: free)."""
        for lease in self._leases.values():
            if lease.start <= token < lease.end:
                return lease.owner
        return None

    # ------------------------------------------------------------------ leases
    def lease(self, owner: str, pages: int, page_size: int) -> KVPool:
        """Take an extent of ``pages`` pages of ``page_size`` tokens for ``owner`` (which must
        hold none) and return its pool view. PoolFullError when it does not fit and the
        storage may not grow; nothing changed then."""
        if owner in self._leases:
            raise ValueError(f"{owner!r} already holds an extent; release it first")
        if pages <= 0 or page_size <= 0:
            raise ValueError(f"a lease needs pages > 0 and page_size > 0 (got {pages}, {page_size})")
        need = pages * page_size
        if self.k is None and not self.capacity:
            self.capacity = need * self.reserve
            self._free = [(0, self.capacity)]
            self._allocate(self.capacity)
        start = self._first_fit(need)
        if start is None:
            if not self.growable:
                raise PoolFullError(f"the shared K/V storage has no free extent of {need} tokens for {owner!r} "
                                    f"(capacity {self.capacity}, leased {self.leased_tokens}, free "
                                    f"{self.capacity - self.leased_tokens} in {len(self._free)} extents)")
            self._grow(need)
            start = self._first_fit(need)
            assert start is not None
        self._take(start, need)
        self._leases[owner] = Lease(owner, start, pages, page_size)
        return self.view(owner)

    def release(self, owner: str) -> None:
        """Return ``owner``'s extent to the free list (nothing when it holds none)."""
        lease = self._leases.pop(owner, None)
        if lease is None:
            return
        self._free.append((lease.start, lease.end))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, e in self._free:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self._free = merged

    def view(self, owner: str) -> KVPool:
        """``owner``'s pool: [layers, pages, page_size, heads, head_dim] views of its extent."""
        lease = self._leases[owner]
        shape = (self.num_layers, lease.pages, lease.page_size, self.num_heads, self.head_dim)
        return KVPool.of(self.k[:, lease.start:lease.end].view(shape), self.v[:, lease.start:lease.end].view(shape))

    def check_pages(self, owner: str, page_ids, last_slot: int | None = None) -> None:
        """Raise CrossedExtentError unless every page id lies in ``owner``'s extent (0..pages-1)
        and flat slot ``last_slot`` (relative to the extent) does too."""
        lease = self._leases.get(owner)
        if lease is None:
            raise CrossedExtentError(f"{owner!r} holds no extent of the shared K/V storage")
        lo, hi = min(page_ids), max(page_ids)
        if lo < 0 or hi >= lease.pages or (last_slot is not None and not 0 <= last_slot < lease.tokens):
            raise CrossedExtentError(f"{owner!r} would address page {lo if lo < 0 else hi} (slot {last_slot}) "
                                     f"outside its {lease.pages} pages: another owner's cache")

    # ------------------------------------------------------------------ internals
    def _allocate(self, tokens: int) -> None:
        shape = (self.num_layers, tokens, self.num_heads, self.head_dim)
        self.k = self.v = None  # the old tensors go before the new ones come (growth copies first)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _first_fit(self, need: int) -> int | None:
        for s, e in self._free:
            if e - s >= need:
                return s
        return None

    def _take(self, start: int, need: int) -> None:
        for i, (s, e) in enumerate(self._free):
            if s == start:
                if e - s == need:
                    del self._free[i]
                else:
                    self._free[i] = (s + need, e)
                return
        raise AssertionError("extent not free")

    def _grow(self, need: int) -> None:
        """A larger allocation holding every extent at its offset plus ``need`` free tokens at the end."""
        tail_free = self._free[-1][1] - self._free[-1][0] if self._free and self._free[-1][1] == self.capacity else 0
        new_capacity = self.capacity + need - tail_free
        old_k, old_v, old_capacity = self.k, self.v, self.capacity
        shape = (self.num_layers, new_capacity, self.num_heads, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if old_k is not None:
            k[:, :old_capacity].copy_(old_k)
            v[:, :old_capacity].copy_(old_v)
        self.k, self.v = k, v
        del old_k, old_v
        if tail_free:
            self._free[-1] = (self._free[-1][0], new_capacity)
        else:
            self._free.append((old_capacity, new_capacity))
        self.capacity = new_capacity
        self.generation += 1


class CrossedExtentError(AssertionError):
    """A step would have addressed pages outside its owner's extent of a shared storage."""
