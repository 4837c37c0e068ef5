"""Global attention with PyTorch's own FlashAttention-2 kernel over the pool's runs (no FlashInfer).

The ``sdpa`` backend on a CUDA GPU with a bf16/fp16 pool. It reads the pool in place:
the visible pages form a few contiguous runs of a layer's pool (``cache.pages`` keeps
them so; ``flashinfer_backend.visible_runs``), and the variable-length form of the
FlashAttention-2 kernel that PyTorch ships (``aten._flash_attention_forward`` with
cumulative sequence lengths, built for sm_80 and later) takes a batch of requests over
one packed key tensor: request j reads keys ``[cu_k[j], cu_k[j + 1])``. The step is issued
as the ragged FA3 path issues it (``ragged_requests``): ``S`` copies of the queries, each
over a chunk of one run, requests without queries over the keys between runs (they do
no work), then the S partial results are merged with their log-sum-exps
(``kernels.merge``). No gather of the cache, no mask, and the index arrays are device
tensors, so the call is captured in the step's CUDA graph (``graph_pages``): the
request count and ``max_k`` are then fixed at capture, ``prepare`` copies the next
step's arrays into the same buffers before a replay.

Measured (H200, the kernels of sm_80 forced, per call at 518x378 over a full window of
78k keys): 1.10 ms with 4-8 splits, against 1.43 ms for FlashInfer's FA2 paged kernel
and 0.93 ms for the gather + SDPA form before (PyTorch picks cuDNN's Hopper kernel on an
H200; on sm_80/86/89 it would pick this same FlashAttention-2 kernel, plus the gather).

Why split at all: the kernel gives each (128-query tile, head, request) to one thread
block; one frame at 518x378 is 8 x 16 = 128 blocks over 78k keys for a GPU that holds
two such blocks per SM (264 on an H200, 116 on an RTX 4090's 58 SMs... more SMs on
bigger parts), so a single request leaves SMs idle through the whole call.

``attention_reference`` computes the same requests with PyTorch ops (CPU, tests).
"""
from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from .flashinfer_backend import FragmentedPool, PlannedBackend, ragged_requests, visible_runs
from .pool import DevicePlan

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634  # natural-log LSE (FlashAttention) -> base 2 (kernels.merge)
HALF_DTYPES = (torch.bfloat16, torch.float16)
TILE_Q = 128  # FlashAttention-2's query tile at head_dim <= 128 (sm_80+)
BLOCKS_PER_SM = 2  # resident thread blocks per SM at head_dim 64 (registers)
# (query tile, head, split) items per resident block that auto_splits aims for. Measured on an
# H200 (benchmarks/kernels/fa2_class_ab.py, one frame at 518x378 over a full window, CUDA
# graph), us per call: 3 splits 1533, 4: 1100, 6: 1130, 8: 1111, 12: 1145, 16: 1141, 24: 1196;
# flat from 4 to 16, so 3.5 (8 splits on 132 SMs, 4 on 58)
WAVES = 3.5
MAX_SPLITS = 32
MIN_SPLIT_KEYS = 32
MIN_GRAPH_SPLITS = 4  # room for the runs of a full window (patch pages around the free one, specials)


def flash_varlen_supported(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """None where this backend runs, else why not (CPU, float32, a GPU before sm_80)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if dtype is not None and dtype not in HALF_DTYPES:
        return f"needs a bf16/fp16 pool, got {dtype}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"needs compute capability 8.0 or later, got {major}.x"
    return None


def auto_splits(qo_len: int, heads: int, num_sms: int, waves: float = WAVES) -> int:
    """Requests per step: enough (query tile, head, request) items for ``waves`` per resident block."""
    items = -(-qo_len // TILE_Q) * heads
    return max(1, min(MAX_SPLITS, math.ceil(waves * BLOCKS_PER_SM * num_sms / items)))


def attention_reference(q: Tensor, k: Tensor, v: Tensor, qo: list[int], kv: list[int]) -> tuple[Tensor, Tensor]:
    """What the varlen kernel computes, in float32 with PyTorch ops: q [Nq, H, D], k/v [Nk, H, D],
    host index arrays (qo, kv) -> (out [Nq, H, D], lse [H, Nq] natural log)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    scale = q.shape[-1] ** -0.5
    for j in range(len(qo) - 1):
        a, b, c, d = qo[j], qo[j + 1], kv[j], kv[j + 1]
        if a == b or c == d:
            continue
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), k[c:d].float()) * scale
        lse[:, a:b] = torch.logsumexp(s, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v[c:d].float())
    return out.to(q.dtype), lse


class FlashVarlenBackend(PlannedBackend):
    """The ``sdpa`` backend over PyTorch's FlashAttention-2 varlen kernel (see the module doc).

    ``graph_pages``: CUDA-graph mode (fixed buffers, a fixed split count chosen at the first
    plan, at most what ``min_graph_pages`` pages allow); ``kv_splits``: a fixed count (None:
    automatic); ``fused_merge``: the Triton merge (None: where ``kernels.available``);
    ``reference``: PyTorch ops instead of the kernel (CPU tests of the bookkeeping).
    """

    name = "sdpa"
    variant = "varlen"

    def __init__(self, device: torch.device | str, dtype: torch.dtype | None = None, graph_pages: int | None = None,
                 kv_splits: int | None = None, min_graph_pages: int = 1, fused_merge: bool | None = None,
                 reference: bool = False) -> None:
        device = torch.device(device)
        if not reference:
            reason = flash_varlen_supported(device, dtype)
            if reason is not None:
                raise ValueError(f"the FlashAttention varlen backend {reason}")
        if kv_splits is not None and kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1 (or None for automatic), got {kv_splits}")
        from .. import kernels
        from ..kernels.merge import merge_reference, merge_states

        self.device = device
        self.reference = reference
        self.kv_splits = kv_splits
        self.graph_mode = graph_pages is not None
        self._min_graph_pages = max(1, min_graph_pages)
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 8
        if fused_merge is None:
            fused_merge = device.type == "cuda" and kernels.available(device)
        self._merge = merge_states if fused_merge else merge_reference
        self._buffers: dict[tuple, Tensor] = {}
        self._step: DevicePlan | None = None
        self._planned = False
        self.splits: int | None = None  # fixed at the first plan in graph mode
        self._requests = 0  # of the current step (the index arrays' length - 1)
        self._max_k = 0
        self._host: tuple[list[int], list[int]] | None = None  # (qo, kv) of the step, for ``reference``
        self._staging: Tensor | None = None  # pinned host copy of the index arrays
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._schema_splits = "num_splits" in str(torch.ops.aten._flash_attention_forward.default._schema)

    # ------------------------------------------------------------------ protocol
    def attend(self, q: Tensor, k_pages: Tensor, v_pages: Tensor) -> Tensor:
        """q [qo_len, H, D] (cast to the pages' dtype) or ``query_buffer``'s tensor; pages
        [num_pages, page_size, H, D] -> [qo_len, H, D] in the pages' dtype."""
        if not self._planned:
            self._plan(k_pages)
        s, dtype = self.splits, k_pages.dtype
        qo, heads, dim = self._step.qo_len, k_pages.shape[-2], k_pages.shape[-1]
        q_rep = self._buffer("q", (s, qo, heads, dim), dtype)
        if q.data_ptr() != q_rep.data_ptr():
            q_rep.copy_(q.reshape(-1, qo, heads, dim).expand(s, -1, -1, -1))
        k = k_pages.view(-1, heads, dim)
        v = v_pages.view(-1, heads, dim)
        n = self._requests + 1
        index = self._buffer("index", (2, self._index_len()), torch.int32)
        if self.reference:
            o, lse = attention_reference(q_rep.view(s * qo, heads, dim), k, v, *self._host)
        else:
            kwargs = {"num_splits": 1} if self._schema_splits else {}
            o, lse = torch.ops.aten._flash_attention_forward(
                q_rep.view(s * qo, heads, dim), k, v, index[0, :n], index[1, :n], qo, self._max_k, 0.0, False, False,
                **kwargs)[:2]
        if lse.shape != (heads, s * qo):
            raise RuntimeError(f"unexpected log-sum-exp shape {tuple(lse.shape)} from the flash kernel "
                               f"(expected {(heads, s * qo)}); this PyTorch is not supported by backend sdpa")
        if s == 1:
            return o
        lse2 = self._buffer("lse", (s, qo, heads), torch.float32)
        torch.mul(lse.view(heads, s, qo).permute(1, 2, 0), LOG2E, out=lse2)
        return self._merge(o.view(s, qo, heads, dim), lse2, self._buffer("out", (qo, heads, dim), dtype))

    # ------------------------------------------------------------------ planning
    def _index_len(self) -> int:
        return 2 * self.splits + 1 if self.graph_mode else self._requests + 1

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> Tensor:
        key = (name, shape, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def _choose_splits(self, qo_len: int, heads: int, page_size: int, runs: int) -> int:
        if self.graph_mode:
            if self.splits is not None:
                return self.splits
            fewest = self._min_graph_pages
            limit = min(MAX_SPLITS, max(fewest, fewest * page_size // MIN_SPLIT_KEYS))
            s = self.kv_splits or max(MIN_GRAPH_SPLITS, auto_splits(qo_len, heads, self._num_sms))
            return max(1, min(s, limit))
        return max(self.kv_splits or auto_splits(qo_len, heads, self._num_sms), runs)

    def _plan(self, k_pages: Tensor) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("FlashVarlenBackend.attend called before begin_step")
        page_size, heads, _ = k_pages.shape[1:]
        if page_size != step.plan.page_size:
            raise ValueError(f"pages hold {page_size} tokens but the step was planned for {step.plan.page_size}")
        runs = visible_runs(step.plan.read_pages, step.plan.last_page_len, page_size)
        splits = self._choose_splits(step.qo_len, heads, page_size, len(runs))
        total = sum(b - a for a, b in runs)
        splits = min(splits, total) if not self.graph_mode else splits
        qo, kv = ragged_requests(runs, splits, step.qo_len, 2 * splits if self.graph_mode else None)
        self.splits = splits
        self._requests = len(qo) - 1
        # the graph's max_k is fixed: the layer's whole pool bounds every request
        self._max_k = k_pages.shape[0] * page_size if self.graph_mode else \
            max(b - a for a, b in zip(kv[:-1], kv[1:]))
        self._host = (qo, kv)
        index = self._buffer("index", (2, self._index_len()), torch.int32)
        host = torch.tensor([qo, kv], dtype=torch.int32)
        if self.device.type == "cuda":
            if self._staging is None or self._staging.shape != host.shape:
                self._staging = torch.empty(host.shape, dtype=torch.int32).pin_memory()
            elif not self._copied.query():
                self._copied.synchronize()  # the previous step's copy still reads the staging buffer
            self._staging.copy_(host)
            index.copy_(self._staging, non_blocking=True)
            self._copied.record(torch.cuda.current_stream(self.device))
        else:
            index.copy_(host)
        self._planned = True


__all__ = ["FlashVarlenBackend", "FragmentedPool", "attention_reference", "auto_splits", "flash_varlen_supported"]
