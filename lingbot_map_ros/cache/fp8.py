"""FP8 (e4m3) storage of the paged K/V cache (``kv_cache_dtype: fp8``).

The pool holds every global layer's keys and values as ``float8_e4m3fn`` with one scale
per (token, head): the 64 values of a head's row are divided by ``amax / 448`` (448 being
e4m3's largest finite value) before rounding, so each row uses the whole e4m3 range
whatever the magnitudes of the other rows, heads or frames. That costs 1 byte per value
plus one scale (in the stream's dtype) per 64 values: 53 % of the bf16 pool.

Attention reads the cache through a dequantised copy of ONE layer (``read_k``/``read_v``,
the layout of one layer of the pool in the stream's dtype): before a layer attends, its
pages are expanded into that buffer (``load``), and every attention backend (SDPA,
FlashInfer FA2 and FA3, paged or ragged, CUDA graphs) runs unchanged on it. Why not an
FP8 attention kernel: FlashInfer 0.6.18's FA3 did not compile with FP8 K/V (GPU.md), and
its FA2 kernel takes one scale per tensor, which per-row scales cannot feed
(``benchmarks/stream/memory_budgets.py`` records the measurements behind the choice).

The step's own K/V arrive in one of two ways, both ending quantised in the pool:

* ``write(layer, slots, k, v)`` (eager path): quantised and stored at the slots;
* the fused kernel path (``cache.pool.PoolAttention.destinations``): the kernel writes the
  rotated K/V rows into ``read_k``/``read_v`` at the step's slots, then
  ``store_written(layer, slots)`` quantises those rows into the pool.

``load(layer)`` then expands the whole layer (its size is fixed, so a CUDA graph captures
it) — the step's rows included, so a frame attends to its own K/V exactly as later
frames will see them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .pool import KVPool

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
TINY = 1e-12  # amax floor: an all-zero row gets a tiny scale instead of a division by zero


def quantize_rows(x: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (q [..., D] float8_e4m3fn, scale [...] in ``scale_dtype``) with
    ``q * scale ~= x``: one scale per row (the last dimension), rounded to ``scale_dtype``
    before dividing, so dequantising with the stored scale undoes exactly what was done."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1).clamp_min(TINY) / FP8_MAX).to(scale_dtype)
    q = (xf / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_reference(q: Tensor, scale: Tensor, out: Tensor) -> Tensor:
    """out[..., D] = q * scale[..., None] (PyTorch twin of ``dequantize``)."""
    return out.copy_(q.float() * scale.float().unsqueeze(-1))


_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant_kernel(q_ptr, s_ptr, out_ptr, rows_total, D: tl.constexpr, BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        valid = rows < rows_total
        offs = rows[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :]
        q = tl.load(q_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None])

    return dequant_kernel


def dequantize(q: Tensor, scale: Tensor, out: Tensor) -> Tensor:
    """One Triton kernel: out [..., D] = q [..., D] (fp8, contiguous) * scale [...] (contiguous)."""
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    d = q.shape[-1]
    rows = q.numel() // d
    if not (q.is_contiguous() and scale.is_contiguous() and out.is_contiguous()) or scale.numel() != rows:
        raise ValueError("dequantize: contiguous q [..., D], scale [...] and out [..., D] expected")
    block_r = 64
    _kernel[(-(-rows // block_r),)](q, scale, out, rows, D=d, BLOCK_R=block_r, num_warps=4)
    return out


class Fp8KVPool(KVPool):
    """``KVPool`` whose pages are stored in FP8 with per-(token, head) scales, read through a
    dequantised one-layer buffer (see the module text). ``dtype``: the stream's dtype (that
    of the scales and of the read buffer); ``fused``: dequantise with the Triton kernel."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fused: bool = False) -> None:
        shape = (num_layers, num_pages, page_size, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=FP8, device=device)
        self.v = torch.zeros(shape, dtype=FP8, device=device)
        self.k_scale = torch.zeros(shape[:-1], dtype=dtype, device=device)
        self.v_scale = torch.zeros(shape[:-1], dtype=dtype, device=device)
        self.read_k = torch.zeros(shape[1:], dtype=dtype, device=device)
        self.read_v = torch.zeros(shape[1:], dtype=dtype, device=device)
        self.page_size = page_size
        self.compute_dtype = dtype
        self.fused = bool(fused) and torch.device(device).type == "cuda"

    @property
    def nbytes(self) -> int:
        """Bytes of the pool: FP8 pages, scales and the one-layer read buffer."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale,
                                                         self.read_k, self.read_v))

    def _store(self, layer: int, slots: Tensor, rows: Tensor, pages: Tensor, scales: Tensor) -> None:
        heads, dim = rows.shape[-2:]
        q, s = quantize_rows(rows, scales.dtype)
        # fp8 index_copy_ is not implemented everywhere: copy the bytes
        pages[layer].view(torch.uint8).view(-1, heads, dim).index_copy_(0, slots, q.view(torch.uint8))
        scales[layer].view(-1, heads).index_copy_(0, slots, s)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Quantise and store k, v [N, H, D] at flat token slots [N]."""
        self._store(layer, slots, k, self.k, self.k_scale)
        self._store(layer, slots, v, self.v, self.v_scale)

    def layer_view(self, layer: int) -> tuple[Tensor, Tensor]:
        """The read buffers (what attention sees; their contents are those of the last ``load``)."""
        return self.read_k, self.read_v

    def store_written(self, layer: int, slots: Tensor) -> None:
        """Quantise the rows a kernel wrote into the read buffers at ``slots`` into the pool."""
        heads, dim = self.read_k.shape[-2:]
        self._store(layer, slots, self.read_k.view(-1, heads, dim).index_select(0, slots), self.k, self.k_scale)
        self._store(layer, slots, self.read_v.view(-1, heads, dim).index_select(0, slots), self.v, self.v_scale)

    def load(self, layer: int) -> tuple[Tensor, Tensor]:
        """Dequantise ``layer``'s pages into the read buffers and return them."""
        expand = dequantize if self.fused else dequantize_reference
        expand(self.k[layer], self.k_scale[layer], self.read_k)
        expand(self.v[layer], self.v_scale[layer], self.read_v)
        return self.read_k, self.read_v


def kv_pool_bytes(num_layers: int, num_pages: int, page_size: int, num_heads: int, head_dim: int,
                  dtype_bytes: int, fp8: bool) -> int:
    """Bytes ``KVPool`` (``fp8`` False, pages in a dtype of ``dtype_bytes``) or ``Fp8KVPool``
    (scales and read buffer in that dtype) allocates for these sizes."""
    values = num_layers * num_pages * page_size * num_heads * head_dim
    if not fp8:
        return 2 * values * dtype_bytes
    scales = num_layers * num_pages * page_size * num_heads
    read = num_pages * page_size * num_heads * head_dim
    return 2 * (values + scales * dtype_bytes + read * dtype_bytes)


__all__ = ["FP8", "FP8_MAX", "Fp8KVPool", "quantize_rows", "dequantize", "dequantize_reference", "kv_pool_bytes"]
