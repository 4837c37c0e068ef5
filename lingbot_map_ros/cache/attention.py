"""Attention backends over the paged cache.

A backend sees a plan and the page tensors, never the bookkeeping: ``begin_step``
once per step (before the layer loop), then ``attend`` per layer. No mask: every
query of the step attends to every visible key (keys are stored after RoPE).
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import FA3_TILES
from .flashinfer_backend import KV_DTYPES  # the module imports flashinfer only when a backend is built
from .pool import DevicePlan, UngraphableStep

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """What a session needs of an attention backend. A CUDA-graph step built on one may
    raise ``UngraphableStep`` for a step it cannot take (before anything ran)."""

    name: str

    def begin_step(self, plan: DevicePlan) -> None:
        """Prepare for a step (host work happens here, once for all layers)."""

    def attend(self, q: Tensor, k_pages: Tensor, v_pages: Tensor) -> Tensor:
        """q [qo_len, H, D]; k/v pages [num_pages, page_size, H, D] -> [qo_len, H, D]."""


class SdpaBackend:
    """PyTorch's scaled_dot_product_attention over the visible tokens (CPU, float32 pools, GPUs
    before sm_80; ``make_backend`` gives ``cache.varlen.FlashVarlenBackend`` for sdpa elsewhere).

    The visible tokens are a few contiguous runs of the pool (``cache.pages``): one run is
    read as a view, several are concatenated (contiguous copies, no index gather); no mask.
    The keys keep the plan's order (``read_pages``: scale frames, window frames oldest first,
    special tokens), so two caches holding the same frames on different pages give
    bit-identical float32 results."""

    name = "sdpa"

    def __init__(self) -> None:
        self._runs: list[tuple[int, int]] = []

    def begin_step(self, plan: DevicePlan) -> None:
        self._runs = ordered_runs(plan.plan.read_pages, plan.plan.last_page_len, plan.plan.page_size)

    def _visible(self, pages: Tensor) -> Tensor:
        rows = pages.view(-1, *pages.shape[-2:])
        if len(self._runs) == 1:
            a, b = self._runs[0]
            return rows[a:b]
        return torch.cat([rows[a:b] for a, b in self._runs])

    def attend(self, q: Tensor, k_pages: Tensor, v_pages: Tensor) -> Tensor:
        k = self._visible(k_pages)
        v = self._visible(v_pages)
        out = F.scaled_dot_product_attention(q.to(k.dtype).transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None])
        return out[0].transpose(0, 1)


def ordered_runs(pages, last_page_len: int, page_size: int) -> list[tuple[int, int]]:
    """Token intervals [start, end) of the pool covering the visible ``pages`` in their listed
    order (all full but the last listed), pages that follow each other in the list and in
    the pool merged into one interval."""
    runs: list[list[int]] = []
    last = len(pages) - 1
    for i, p in enumerate(pages):
        a, b = p * page_size, p * page_size + (last_page_len if i == last else page_size)
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs]


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


class BackendUnavailable(RuntimeError):
    pass


def choose_backend(device_type: str, capability: tuple[int, int] | None, flashinfer: bool,
                   dtype: torch.dtype | None) -> tuple[str, str]:
    """The backend ``auto`` resolves to, and why (pure: the caller supplies the facts).

    sm_90 (Hopper) with FlashInfer: ``flashinfer-fa3``, the fastest path. Other GPUs of
    sm_80 or later (Ampere, Jetson Orin, Ada, Blackwell) cannot run FA3; with FlashInfer they
    take ``FA2_CLASS_BACKEND``, the fastest FA2-class kernel measured (per global-attention
    call at 518x378 over a full window on an H200 with the non-Hopper kernels forced,
    ``benchmarks/kernels/fa2_class_ab.py``: FlashInfer FA2 over the pool's runs with 8
    splits 1.03 ms, PyTorch's FlashAttention-2 varlen over the runs 1.10 ms, FlashInfer FA2
    paged 1.43 ms); without FlashInfer ``sdpa`` (PyTorch's FlashAttention-2 over the runs).
    CPU, float32 pools and GPUs before sm_80: ``sdpa`` (its gather form).
    """
    if device_type != "cuda" or capability is None:
        return "sdpa", f"{device_type} device"
    if dtype is not None and dtype not in KV_DTYPES:
        return "sdpa", f"{dtype} pool (FlashInfer and FlashAttention need bf16/fp16)"
    major, minor = capability
    arch = f"sm_{major}{minor}"
    if major < 8:
        return "sdpa", f"{arch} predates FlashAttention-2 (sm_80): PyTorch's SDPA over gathered keys"
    if not flashinfer:
        return "sdpa", f"{arch}, FlashInfer not installed: PyTorch's FlashAttention-2 over the pool's runs"
    if major == 9:
        return "flashinfer-fa3", f"{arch} (Hopper): FlashInfer FA3"
    return FA2_CLASS_BACKEND, f"{arch}: FA3 needs Hopper; the FA2-class path ({FA2_CLASS_BACKEND})"


# The FA2-class path of sm_80/86/87/89 (and later non-Hopper) GPUs, chosen by measurement
# (``choose_backend``): FlashInfer's FA2 kernel over the pool's runs
FA2_CLASS_BACKEND = "flashinfer-fa2"
_auto_logged: set[tuple] = set()


def make_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                 kv_splits: int | None = None, fa3_tiles: tuple[int, int, int] = FA3_TILES,
                 fused_merge: bool | None = None, workspace: torch.Tensor | None = None) -> AttentionBackend:
    """Resolve a backend name (auto, sdpa, flashinfer, flashinfer-fa2, flashinfer-fa2-paged,
    flashinfer-fa3, flashinfer-fa3-paged, flashinfer-fa3-stock) for a device.

    auto: ``choose_backend`` for the device's compute capability (logged once per choice).
    sdpa: PyTorch's kernels only; on a CUDA GPU of sm_80 or later with a bf16/fp16 pool
    ``FlashVarlenBackend`` (FlashAttention-2 over the pool's runs, no gather, CUDA-graph
    capable), elsewhere ``SdpaBackend`` (gathers the visible keys).
    kv_splits: the split-KV count (None or 0 = automatic).
    fa3_tiles, fused_merge, workspace: passed to ``FlashInferBackend`` (the project-built FA3 kernel's
    shape; whether the split-KV merge runs as a Triton kernel); fused_merge also to the
    varlen backend.
    dtype: the K/V pool's dtype when known; FlashInfer needs bf16/fp16, so ``auto`` picks
    sdpa for float32 and an explicit flashinfer backend with float32 is refused here.
    """
    device = torch.device(device)
    if name == "auto":
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        name, why = choose_backend(device.type, cap, flashinfer_available(), dtype)
        if (name, why) not in _auto_logged:
            _auto_logged.add((name, why))
            log.info("attention backend auto -> %s (%s)", name, why)
    if name == "sdpa":
        from .varlen import FlashVarlenBackend, flash_varlen_supported

        if flash_varlen_supported(device, dtype) is None and dtype is not None:
            return FlashVarlenBackend(device, dtype, kv_splits=kv_splits or None, fused_merge=fused_merge)
        return SdpaBackend()
    if name.startswith("flashinfer"):
        if device.type != "cuda":
            raise BackendUnavailable(f"backend {name!r} needs a CUDA device, got {device}")
        if not flashinfer_available():
            raise BackendUnavailable(f"backend {name!r} requested but the flashinfer package is not installed "
                                     "(pip install flashinfer-python), or use backend 'sdpa'")
        if dtype is not None and dtype not in KV_DTYPES:
            raise BackendUnavailable(f"backend {name!r} needs dtype bf16 (FlashInfer has no float32 kernels), "
                                     f"got {dtype}; use dtype 'bf16' or backend 'sdpa'")
        from .flashinfer_backend import FlashInferBackend

        variant = name.split("-", 1)[1] if "-" in name else "fa3" if _is_hopper(device) else "fa2"
        return FlashInferBackend(device, variant, dtype, kv_splits=kv_splits or None, fa3_tiles=fa3_tiles,
                                 fused_merge=fused_merge, workspace=workspace)
    raise BackendUnavailable(f"unknown attention backend {name!r}")


def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


__all__ = ["AttentionBackend", "SdpaBackend", "BackendUnavailable", "UngraphableStep", "make_backend",
           "flashinfer_available", "choose_backend"]
