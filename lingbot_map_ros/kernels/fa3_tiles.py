"""FlashInfer's FA3 ragged kernel built with 128-query tiles (Hopper, bf16, head_dim 64).

The global attention of a one-frame step is a ragged batch of S requests that share the
frame's queries (``cache.flashinfer_backend``). FlashInfer's packaged FA3 module fixes the
tile at head_dim 64 to 192 query rows x 128 keys, so a 518x378 frame (1005 tokens) runs
6 tiles = 1152 rows and a 518x294 frame (783 tokens) 5 tiles = 960 rows; with 128-row tiles
they are 1024 and 896. ``csrc/fa3_ragged.cu`` instantiates FlashInfer's SM90 kernel
templates (its headers as installed) with ``TILE_Q`` x ``TILE_KV`` tiles and carries its own
work schedule for the kernel's persistent scheduler (FlashInfer's plan assumes its tile).
The module is compiled on first use through FlashInfer's JIT builder (nvcc), then cached
with FlashInfer's other JIT modules; the name carries a hash of the source, so an edited
source is rebuilt.

Measured on an H200 (``benchmarks/kernels/fa3_tiles_ab.sh``, the 518x378 stream, queued):
FlashInfer's module 24.88 ms per frame, this one 22.98 (25.02 vs 23.19 in
``benchmarks/stream/gpu_batch.sh``); 128 x 256 tiles 27.7 ms, 3 pipeline stages within noise of
2. Build: ~90 s on the H200 machine's nvcc. Another shape is an argument (``tiles``; for a
stream, ``StreamConfig.fa3_tiles``, which the backend passes here).

``TiledRaggedAttention`` has the two calls ``FlashInferBackend`` makes on FlashInfer's
``BatchPrefillWithRaggedKVCacheWrapper`` (``plan`` and ``run``), so the backend can use
either. ``plan_reference`` is the schedule's Python twin (CPU tests; the GPU tests compare
it with the compiled plan).
"""
from __future__ import annotations

import hashlib
import heapq
import logging
import math
import threading
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..config import FA3_TILES, check_fa3_tiles

HEAD_DIM = 64
TILES = FA3_TILES  # (query rows, keys, pipeline stages) of the kernel built unless told otherwise
TILE_Q, TILE_KV, STAGES = TILES
ITEM_ARRAYS = 7  # tile, first query row, first key row, query count, key count, head, request
SOURCE = Path(__file__).with_name("csrc") / "fa3_ragged.cu"

log = logging.getLogger(__name__)
_lock = threading.Lock()
_modules: dict[tuple[int, int, int], object] = {}
_failures: dict[tuple[int, int, int], str] = {}


def schedule_size(num_ctas: int, capacity: int) -> int:
    """int32 entries of a schedule for ``num_ctas`` CTAs and ``capacity`` work items."""
    return num_ctas + 1 + ITEM_ARRAYS * capacity


def work_items(qo_indptr, heads: int, tile_q: int = TILE_Q) -> int:
    """Work items (a query tile of one head of one request) of a ragged batch."""
    qo = [int(x) for x in qo_indptr]
    return heads * sum(-(-(b - a) // tile_q) for a, b in zip(qo, qo[1:]))


def plan_reference(qo_indptr, kv_indptr, heads: int, num_ctas: int, capacity: int,
                   tile_q: int = TILE_Q) -> np.ndarray:
    """The compiled ``plan`` in Python: the int32 schedule of a ragged batch.

    Longest-first list scheduling: requests by descending key count (stable), then for each
    head and each query tile (last first) the CTA with the least estimated work so far (ties:
    the lowest index) takes the tile, whose cost is its request's keys plus 2 x ``tile_q``.
    Layout: ``work_indptr`` [num_ctas + 1], then ``ITEM_ARRAYS`` arrays of ``capacity``
    entries (tile index, request's first query row, first key row, query count, key count,
    head, request), the items of CTA 0 first."""
    qo = [int(x) for x in qo_indptr]
    kv = [int(x) for x in kv_indptr]
    if len(qo) != len(kv) or not qo:
        raise ValueError("qo_indptr and kv_indptr must be non-empty and of equal length")
    if any(b < a for a, b in zip(qo, qo[1:])) or any(b < a for a, b in zip(kv, kv[1:])):
        raise ValueError("indptr arrays must not decrease")
    batch = len(qo) - 1
    order = sorted(range(batch), key=lambda r: -(kv[r + 1] - kv[r]))  # sorted() is stable
    idle = [(0, c) for c in range(num_ctas)]
    lists: list[list[tuple[int, int, int]]] = [[] for _ in range(num_ctas)]
    for r in order:
        tiles = -(-(qo[r + 1] - qo[r]) // tile_q)
        cost = kv[r + 1] - kv[r] + 2 * tile_q
        for h in range(heads):
            for t in range(tiles - 1, -1, -1):
                load, c = idle[0]
                heapq.heapreplace(idle, (load + cost, c))
                lists[c].append((r, h, t))
    works = sum(len(x) for x in lists)
    if works > capacity:
        raise ValueError(f"{works} work items exceed the schedule's capacity of {capacity}")
    out = np.zeros(schedule_size(num_ctas, capacity), dtype=np.int32)
    items = out[num_ctas + 1:].reshape(ITEM_ARRAYS, capacity)
    w = 0
    for c, work in enumerate(lists):
        for r, h, t in work:
            items[:, w] = (t, qo[r], kv[r], qo[r + 1] - qo[r], kv[r + 1] - kv[r], h, r)
            w += 1
        out[c + 1] = w
    return out


def module_name(tiles: tuple[int, int, int] = TILES) -> str:
    """JIT module name: tiles, FlashInfer's version and a hash of the source."""
    import flashinfer

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    version = flashinfer.__version__.replace(".", "_").replace("+", "_")
    q, kv, stages = tiles
    return f"lingbot_fa3_ragged_q{q}_kv{kv}_s{stages}_fi{version}_{digest}"


def load(tiles: tuple[int, int, int] = TILES):
    """The compiled module (built on first use; raises RuntimeError saying why it cannot be,
    ConfigError for a shape outside ``config.check_fa3_tiles``)."""
    key = tile_q, tile_kv, stages = check_fa3_tiles(tiles)
    with _lock:
        if key in _modules:
            return _modules[key]
        if key in _failures:
            raise RuntimeError(_failures[key])
        try:
            from flashinfer.jit import gen_jit_spec, sm90a_nvcc_flags

            spec = gen_jit_spec(module_name(key), [SOURCE],
                                extra_cuda_cflags=[*sm90a_nvcc_flags, f"-DLINGBOT_TILE_Q={tile_q}",
                                                   f"-DLINGBOT_TILE_KV={tile_kv}", f"-DLINGBOT_STAGES={stages}"])
            if not spec.is_compiled:
                log.info("compiling the FA3 attention module with %dx%d tiles, %d stages (first use on "
                         "this machine, about two minutes; cached afterwards)", tile_q, tile_kv, stages)
            module = spec.build_and_load()
            built = (int(module.tile_q()), int(module.tile_kv()), int(module.stages()))
            if built != key:
                raise RuntimeError(f"module built with tiles {built}, wanted {key}")
        except Exception as exc:  # noqa: BLE001 - any build or load failure means: use FlashInfer's module
            _failures[key] = (f"could not build the {tile_q}x{tile_kv}x{stages} FA3 module: "
                              f"{type(exc).__name__}: {exc}")
            raise RuntimeError(_failures[key]) from exc
        _modules[key] = module
        return module


def unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the tiled kernel cannot serve this device / pool dtype / head width, or None."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "needs a Hopper GPU (SM90)"
    if dtype != torch.bfloat16:
        return f"is built for bf16 pools, got {dtype}"
    if head_dim != HEAD_DIM:
        return f"is built for head_dim {HEAD_DIM}, got {head_dim}"
    return None


class TiledRaggedAttention:
    """``plan`` / ``run`` of FlashInfer's ragged wrapper (non-causal, bf16, head_dim 64) on the
    project-built kernel.

    ``fixed=True`` (CUDA graphs): the schedule's device buffer is allocated at the first plan
    and keeps its address; a later plan with more work items raises ValueError. Otherwise
    the buffers grow as needed. ``plan`` fills a pinned host buffer and copies it to the
    device asynchronously on the current stream; as with FlashInfer's wrapper, the caller
    must not plan again before that copy ran (``FlashInferBackend`` records an event).
    """

    def __init__(self, device: torch.device | str, fixed: bool = False,
                 tiles: tuple[int, int, int] = TILES) -> None:
        self.device = torch.device(device)
        self.fixed = fixed
        self.tiles = check_fa3_tiles(tiles)
        self.tile_q, self.tile_kv, self.stages = self.tiles
        self._module = load(self.tiles)
        self.num_ctas = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.capacity = 0
        self._host: Tensor | None = None
        self._schedule: Tensor | None = None
        self._heads = 0
        self._sm_scale = 1.0 / math.sqrt(HEAD_DIM)

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             causal: bool = False, q_data_type: torch.dtype = torch.bfloat16,
             kv_data_type: torch.dtype = torch.bfloat16) -> None:
        if causal:
            raise ValueError("the tiled FA3 kernel is built non-causal")
        if num_qo_heads != num_kv_heads:
            raise ValueError(f"the tiled FA3 kernel has no grouped heads ({num_qo_heads} query, {num_kv_heads} kv)")
        reason = unsupported(self.device, kv_data_type, head_dim) or (
            None if q_data_type == kv_data_type else f"needs queries in the pool's dtype, got {q_data_type}")
        if reason:
            raise ValueError(f"the tiled FA3 kernel {reason}")
        qo_indptr = qo_indptr.to(torch.int32).contiguous()
        kv_indptr = kv_indptr.to(torch.int32).contiguous()
        works = work_items(qo_indptr.tolist(), num_qo_heads, self.tile_q)
        if works > self.capacity:
            if self.fixed and self._schedule is not None:
                raise ValueError(f"{works} work items exceed the {self.capacity} this CUDA-graph schedule "
                                 "was sized for")
            self.capacity = works if self.fixed else max(works, 2 * self.capacity)
            size = schedule_size(self.num_ctas, self.capacity)
            self._host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
            self._schedule = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._module.plan(qo_indptr, kv_indptr, num_qo_heads, self.num_ctas, self.capacity, self._host)
        self._schedule.copy_(self._host, non_blocking=True)
        self._heads = num_qo_heads

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None = None, lse: Tensor | None = None,
            return_lse: bool = False):
        """q [rows, H, 64], k/v [keys, H, 64] -> out [rows, H, 64] (and lse [rows, H] fp32)."""
        if self._schedule is None:
            raise RuntimeError("TiledRaggedAttention.run called before plan")
        if q.shape[1] != self._heads:
            raise ValueError(f"planned for {self._heads} heads, q has {q.shape[1]}")
        if out is None:
            out = torch.empty_like(q)
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._module.run(q, k, v, out, lse if return_lse else None, self._schedule, self.num_ctas, self.capacity,
                         self._sm_scale, stream)
        return (out, lse) if return_lse else out
