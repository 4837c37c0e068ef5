"""FlashInfer paged attention over the K/V pool (CUDA only; bf16 or fp16 pages).

A step is one request in a batch of one: all ``qo_len`` queries of the step attend,
unmasked, to the ``kv_len`` tokens of the plan's visible pages (all full but the
last, which holds ``last_page_len`` tokens). The pages are used in place, whatever
their size (999, 777, 28 tokens: no padding to a power of two).

Interface (the ``AttentionBackend`` protocol, nothing more):

* ``FlashInferBackend(device, variant="fa3" | "fa2", dtype=None, graph_pages=None)``:
  allocates the workspace once. ``dtype``, when given, is the pool's dtype and is
  checked here, so an unsupported one (float32) fails at construction rather than
  mid-step. ``graph_pages`` (the pool's page count) puts the wrapper in FlashInfer's
  CUDA-graph mode: its indptr/indices/last-page buffers are preallocated and stay
  at fixed addresses, every step must have the same query length (the first
  plan's) and batch size 1, and ``prepare`` must run ``plan()`` before a capture or
  replay (a captured ``attend`` only launches the kernel).
* ``begin_step(plan)``: remembers the step's plan (no device work).
* ``attend(q, k_pages, v_pages)``: the step's first call runs FlashInfer's
  ``plan()`` (it needs the head count, head width and dtype, which are read from the
  pages, so no separate configuration call exists); every call then runs the kernel.
  ``plan()`` therefore runs exactly once per step, for all layers.

Host/device traffic per step: the page ids are already on the device
(``DevicePlan.read_pages``, int32); the three indptr/length arrays are tiny host
tensors, which is where ``plan()`` wants them (device ones would cost a ``.cpu()``
sync). ``plan()`` copies them and its own schedule to the device asynchronously.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .pool import DevicePlan

VARIANTS = ("fa2", "fa3")
KV_DTYPES = (torch.bfloat16, torch.float16)  # FlashInfer has no float32 attention kernels
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partials)


def check_kv_dtype(dtype: torch.dtype) -> None:
    """Raise ValueError naming the fix when FlashInfer cannot attend over pages of ``dtype``."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"the flashinfer backend needs a bf16 (or fp16) K/V pool, got {dtype}; "
                         "run with dtype 'bf16', or use backend 'sdpa' for float32")


class FlashInferBackend:
    """``BatchPrefillWithPagedKVCacheWrapper`` (NHD layout) with one plan per step."""

    def __init__(self, device: torch.device | str, variant: str = "fa3", dtype: torch.dtype | None = None,
                 graph_pages: int | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"flashinfer variant must be one of {VARIANTS}, got {variant!r}")
        if dtype is not None:
            check_kv_dtype(dtype)
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA device, got {device}")
        import flashinfer  # deferred: importing it is slow and needs CUDA

        self.name = f"flashinfer-{variant}"
        self.variant = variant
        self.device = device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if graph_pages is None:
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                           backend=variant)
        else:  # CUDA-graph mode: plan() copies into these buffers, a captured run() reads them
            def i32(n: int) -> Tensor:
                return torch.zeros(n, dtype=torch.int32, device=device)

            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=i32(2),
                paged_kv_indptr_buf=i32(2), paged_kv_indices_buf=i32(graph_pages),
                paged_kv_last_page_len_buf=i32(1), backend=variant)
        self.graph_mode = graph_pages is not None
        # plan() fills a pinned host buffer and copies it to the device asynchronously; the
        # next plan() must not overwrite that buffer before the copy ran. The event is
        # already complete when the host waited for the previous step's results (the
        # session does), so the wait below never happens there.
        self._plan_copied = torch.cuda.Event()
        self._step: DevicePlan | None = None
        self._planned = False

    def begin_step(self, plan: DevicePlan) -> None:
        self._step = plan
        self._planned = False

    def prepare(self, k_pages: Tensor) -> None:
        """Run the step's ``plan()`` now (host work), e.g. before a CUDA-graph capture or replay."""
        self._plan(k_pages)

    def attend(self, q: Tensor, k_pages: Tensor, v_pages: Tensor) -> Tensor:
        """q [qo_len, H, D] (any float dtype; cast to the pages'); pages [num_pages, page_size, H, D]
        -> [qo_len, H, D] in the pages' dtype."""
        if not self._planned:
            self._plan(k_pages)
        return self._wrapper.run(q.to(k_pages.dtype).contiguous(), (k_pages, v_pages))

    def _plan(self, k_pages: Tensor) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("FlashInferBackend.attend called before begin_step")
        check_kv_dtype(k_pages.dtype)
        page_size, heads, head_dim = k_pages.shape[1:]
        if page_size != step.plan.page_size:
            raise ValueError(f"pages hold {page_size} tokens but the step was planned for {step.plan.page_size}")
        num_pages = len(step.plan.read_pages)
        qo_indptr = torch.tensor([0, step.qo_len], dtype=torch.int32)
        kv_indptr = torch.tensor([0, num_pages], dtype=torch.int32)
        last_page_len = torch.tensor([step.plan.last_page_len], dtype=torch.int32)
        if not self._plan_copied.query():
            self._plan_copied.synchronize()
        self._wrapper.plan(qo_indptr, kv_indptr, step.read_pages, last_page_len, heads, heads, head_dim, page_size,
                           causal=False, q_data_type=k_pages.dtype, kv_data_type=k_pages.dtype)
        self._plan_copied.record(torch.cuda.current_stream(self.device))
        self._planned = True
