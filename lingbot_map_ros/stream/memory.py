"""GPU memory a stream needs, estimated before anything is allocated, and the start-up check.

``estimate_memory`` adds up, for a model architecture, streaming settings and a resolution:

* weights: counted from the architecture (built on the meta device: no memory, ~0.3 s),
  the aggregator in the stream's dtype (its linears in FP8 with ``precision`` fp8), each head
  once: the bf16 copy a CUDA bf16 stream makes of it (``bf16_depth_head``, ``bf16_camera_head``;
  the float32 original then waits in host memory), else in float32;
* the K/V cache: exact, from the page table's size (scale frames + window + pending
  evictions + 1 page for the frame stored before an eviction + 2 scratch pages + the
  special tokens' pages for the model's horizon) and ``kv_cache_dtype`` (``cache.fp8``);
* the camera head's cache: exact (float32, one token per frame of the horizon);
* activations, CUDA-graph pools, FlashInfer's workspace and the allocator's slack: a
  linear model in the pixels of one frame and in the pixels of the phase-1 step
  (``num_scale_frames`` frames at once, the largest step), fitted to peaks measured on an
  H200 (``ACTIVATION_FIT``; the measurements and the fit are in
  ``benchmarks/results/nvidia_h200_memory_budgets_*.json``, made by
  ``benchmarks/stream/memory_budgets.py``), fitted to the allocated peak with a margin.
  The caching allocator's reserved peak of an unconstrained run is ~1 GiB higher still
  (cached blocks); under a cap (``set_per_process_memory_fraction``, or a small card) the
  allocator frees its cache and retries before it fails, so the allocated peak plus a
  margin is what must fit.

``check_fits`` compares the estimate with the free memory of the device and, when it does
not fit, raises ``MemoryBudgetError`` naming the numbers and the settings that would make
it fit (the node refuses to start with it instead of running out of memory mid-stream).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

from ..cache.fp8 import kv_pool_bytes
from ..cache.pages import PageTable
from ..config import SPECIAL_TOKENS, ConfigError, ModelConfig, StreamConfig

GIB = 2**30
# activations etc. = BASE + PER_PIXEL * pixels of a frame + PER_PHASE1_PIXEL * pixels of the phase-1 step,
# bytes; scaled by the model's width relative to the released architecture's (1024). Least squares over
# the 19 bf16 runs of benchmarks/results/nvidia_h200_memory_budgets_{fa3,fa2,sdpa}.json (allocated
# peak minus the exact parts: base 0.61 GiB, 2709 and 533 bytes), with the base raised by 0.34 GiB
# (the largest residual, 0.24, plus room for the allocator's fragmentation): the estimate is 0.1-0.6
# GiB above every measured allocated peak, and separates the 8 GiB budget's run that fitted (518x294,
# estimate 6.66 GiB, cap 7.0) from the one that ran out of memory (518x378, 7.29 GiB).
ACTIVATION_FIT = {"base": 0.95 * GIB, "per_pixel": 2709.0, "per_phase1_pixel": 533.0}
FP8_GEMM_EXTRA = int(0.35 * GIB)  # precision fp8: the inputs' quantisation temporaries (measured +0.1 over the fit)
RESERVE_BYTES = int(0.5 * GIB)  # left free for what the caching allocator does not count (kernel images, cuBLAS)


class MemoryBudgetError(ConfigError):
    """The configuration needs more GPU memory than the device has free."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a stream needs on its device, by part (``total`` their sum)."""

    weights: int
    kv_cache: int
    camera_cache: int
    activations: int
    kv_pages: int  # pages of the K/V pool (one page = the patch tokens of one frame)
    kv_tokens: int  # tokens of the pool
    resolution: tuple[int, int]  # (height, width)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.camera_cache + self.activations

    def describe(self) -> str:
        h, w = self.resolution
        return (f"{self.total / GIB:.1f} GiB (weights {self.weights / GIB:.1f}, K/V cache {self.kv_cache / GIB:.1f} "
                f"in {self.kv_pages} pages at {w}x{h}, camera cache {self.camera_cache / GIB:.2f}, activations "
                f"and buffers {self.activations / GIB:.1f})")


def assumed_height(model: ModelConfig, width: int, aspect: float = 0.75) -> int:
    """The input height for ``width`` when the camera's aspect (height/width) is ``aspect``,
    as the session resizes: a multiple of the patch size (518 -> 378 at 4:3)."""
    p = model.patch_size
    return max(p, int(width * aspect) // p * p)


@functools.lru_cache(maxsize=8)
def parameter_counts(model: ModelConfig) -> tuple[int, int, int, int]:
    """(aggregator, camera head, depth head, aggregator weights that ``precision`` fp8 stores in
    FP8) parameter counts of the architecture."""
    import torch
    from torch import nn

    from ..kernels.fp8_gemm import LINEAR_NAMES
    from ..model.lingbot import LingBotMap

    with torch.device("meta"):
        m = LingBotMap(model)
    fp8 = sum(child.weight.numel() for parent in m.aggregator.modules() for name, child in parent.named_children()
              if name in LINEAR_NAMES and isinstance(child, nn.Linear))
    return tuple(sum(p.numel() for p in part.parameters())
                 for part in (m.aggregator, m.camera_head, m.depth_head)) + (fp8,)


def estimate_memory(model: ModelConfig, stream: StreamConfig, height: int, width: int, with_depth: bool = True,
                    cuda: bool = True) -> MemoryEstimate:
    """Bytes one stream of ``stream`` at ``height`` x ``width`` needs (see the module text).
    ``cuda``: the stream runs on a CUDA device (the bf16 head copies are made there only)."""
    agg, cam, depth, fp8_weights = parameter_counts(model)
    bf16 = stream.dtype == "bf16"
    weights = agg * (2 if bf16 else 4)
    if stream.precision == "fp8":
        weights -= fp8_weights * ((2 if bf16 else 4) - 1)
    # each head once on the device: its bf16 copy where the stream makes one (the float32 original
    # is then parked in host memory, ``session.place_heads``), else the float32 original
    copies = bf16 and cuda
    weights += cam * (2 if copies and stream.bf16_camera_head and stream.fused_kernels else 4)
    if with_depth:
        weights += depth * (2 if copies and stream.bf16_depth_head else 4)
    page_size = (height // model.patch_size) * (width // model.patch_size)
    if page_size < SPECIAL_TOKENS:
        raise ConfigError(f"{width}x{height} gives {page_size} patch tokens, fewer than the {SPECIAL_TOKENS} special "
                          "tokens of a frame; use larger images")
    table = PageTable(page_size, stream.num_scale_frames, stream.sliding_window, model.max_frame_num,
                      stream.max_pending_evictions)
    kv = kv_pool_bytes(model.depth, table.num_pages, page_size, model.num_heads, model.head_dim, 2 if bf16 else 4,
                       fp8=stream.kv_cache_dtype == "fp8")
    camera_head_dim = model.camera_dim // model.camera_num_heads
    camera = 2 * stream.camera_iterations * model.camera_trunk_depth * model.max_frame_num * \
        model.camera_num_heads * camera_head_dim * 4
    pixels = height * width
    width_scale = model.embed_dim / 1024
    fit = ACTIVATION_FIT
    act = fit["base"] * width_scale + (fit["per_pixel"] * pixels
                                       + fit["per_phase1_pixel"] * pixels * stream.num_scale_frames) * width_scale
    if stream.precision == "fp8":
        act += FP8_GEMM_EXTRA * width_scale
    return MemoryEstimate(weights=int(weights), kv_cache=int(kv), camera_cache=int(camera), activations=int(act),
                          kv_pages=table.num_pages, kv_tokens=table.num_pages * page_size,
                          resolution=(height, width))


def device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA ``device`` ("cuda", "cuda:N"); None for other devices."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(torch.device(device))


def _needed(model: ModelConfig, stream: StreamConfig, width: int, with_depth: bool, cameras: int) -> int:
    """Bytes ``cameras`` streams need (one set of weights and buffers, a K/V cache each)."""
    est = estimate_memory(model, stream, assumed_height(model, width), width, with_depth)
    return est.total + (cameras - 1) * est.kv_cache


def _fits(model, stream, width, with_depth, available, cameras) -> bool:
    return _needed(model, stream, width, with_depth, cameras) <= available


def suggestions(model: ModelConfig, stream: StreamConfig, width: int, available: int, with_depth: bool = True,
                cameras: int = 1) -> list[str]:
    """Settings that would bring the estimate under ``available`` bytes, each changed alone."""
    out = []
    if stream.kv_cache_dtype != "fp8" and cameras == 1 and _fits(model, replace(stream, kv_cache_dtype="fp8"),
                                                                 width, with_depth, available, cameras):
        out.append("kv_cache_dtype fp8")
    best = None
    for window in range(stream.sliding_window - 1, 0, -1):
        if _fits(model, replace(stream, sliding_window=window), width, with_depth, available, cameras):
            best = window
            break
    if best is not None:
        out.append(f"sliding_window {best} (or less)")
    if stream.max_pending_evictions and _fits(model, replace(stream, max_pending_evictions=0), width, with_depth,
                                              available, cameras):
        out.append("max_pending_evictions 0")
    p = model.patch_size
    for w in range(width - p, p * 4 - 1, -p):
        if _fits(model, stream, w, with_depth, available, cameras):
            out.append(f"image_width {w} (or less)")
            break
    if stream.num_scale_frames > 1:
        for s in range(stream.num_scale_frames - 1, 0, -1):
            if _fits(model, replace(stream, num_scale_frames=s), width, with_depth, available, cameras):
                out.append(f"num_scale_frames {s} (or less)")
                break
    return out


def check_fits(model: ModelConfig, stream: StreamConfig, width: int, with_depth: bool = True, cameras: int = 1,
               memory: Callable[[str], tuple[int, int] | None] | None = None,
               reserve: int = RESERVE_BYTES, budget_gib: float = 0.0) -> MemoryEstimate | None:
    """Raise ``MemoryBudgetError`` when ``cameras`` streams of ``stream`` at ``width`` (4:3 assumed)
    need more memory than ``stream.device`` has free (less ``reserve``); the message gives both
    numbers, the parts of the estimate and the settings to lower. Returns the estimate (None
    where ``memory`` knows no size for the device, e.g. the CPU). ``memory(device)`` ->
    (free, total) bytes (default ``device_memory``). ``budget_gib`` > 0 (the node's parameter
    ``gpu_memory_budget_gib``) stands for the device: a card of that many GiB, all free, whatever
    the device (would this configuration fit an 8 GiB card?)."""
    if budget_gib < 0:
        raise ConfigError(f"gpu_memory_budget_gib must be >= 0 GiB, got {budget_gib}")
    if budget_gib:
        size = int(budget_gib * GIB)
        sizes, device = (size, size), f"{stream.device} (taken as a {budget_gib:g} GiB card: gpu_memory_budget_gib)"
    else:
        sizes, device = (memory or device_memory)(stream.device), stream.device
    if sizes is None:
        return None
    free, total = sizes
    est = estimate_memory(model, stream, assumed_height(model, width), width, with_depth)
    needed = _needed(model, stream, width, with_depth, cameras)
    available = free - reserve
    if needed <= available:
        return est
    lower = suggestions(model, stream, width, available, with_depth, cameras)
    what = f"{cameras} cameras' streams" if cameras > 1 else "this configuration"
    hint = ("; any one of these fits: " + ", ".join(lower)) if lower else \
        "; no single setting makes it fit: lower several, or use a GPU with more memory"
    raise MemoryBudgetError(
        f"not enough GPU memory: {what} needs about {needed / GIB:.1f} GiB (one stream: {est.describe()}), but "
        f"{device} has {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB ({reserve / GIB:.1f} GiB kept in "
        f"reserve){hint}. The profiles in config/profiles/ are measured settings for 8, 12, 16 and 24 GiB; "
        "gpu_memory_check false skips this check")


__all__ = ["MemoryEstimate", "MemoryBudgetError", "estimate_memory", "check_fits", "suggestions", "assumed_height",
           "device_memory", "parameter_counts", "ACTIVATION_FIT", "RESERVE_BYTES", "GIB"]
