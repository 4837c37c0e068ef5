"""FlashInfer attention over the K/V pool (CUDA only; bf16 or fp16 pages).

All ``qo_len`` queries of a step attend, unmasked, to the ``kv_len`` tokens of the
plan's visible pages (all full but the last, which holds ``last_page_len`` tokens).
The pages are used in place, whatever their size (999, 777, 28 tokens: no padding
to a power of two).

Two ways to read the pool:

* paged (variants ``fa2-paged``, ``fa3-paged``): FlashInfer's paged kernel, given the
  visible page ids. Its FA3 form gathers K/V rows itself (no TMA; 192 x 96 tiles for
  head_dim 64).
* ragged (variants ``fa2``, ``fa3``, ``fa3-stock``): the pool of one layer is one contiguous
  tensor and the visible pages form a few contiguous runs of it (``cache.pages`` keeps
  them so: ascending patch pages, the special stream in a range of its own); the ragged
  FA3 kernel reads each run with TMA. Order does not matter to unmasked attention over
  already-rotated keys. The keys between runs are skipped by requests with no queries
  (``ragged_requests``). About 10% faster than the paged kernel at the model's shapes
  (``benchmarks/kernels/attention_variants.py``). For FA2 (the path of sm_80/86/89 GPUs)
  the ragged kernel with 8 splits takes 1.03 ms per call where the paged one took 1.43
  (1005 queries over 78k keys on an H200, ``benchmarks/kernels/fa2_class_ab.py``): the
  paged kernel computes each key row's address from the page table (999-token pages, a
  division per row) and, with one request, runs 8 x 16 = 128 thread blocks on 132 SMs. ``fa3`` runs FlashInfer's kernel templates
  built by the project with 128 x 192 tiles (``kernels.fa3_tiles``; ~8% faster per
  frame at 518x378) where it can, FlashInfer's packaged module (192 x 128 tiles)
  otherwise; ``fa3-stock`` always the packaged module.

Split-KV. The FA3 kernel gives each (query tile, head) pair to one SM and walks all
its keys; a one-frame step at 518x378 has ceil(1005/192) x 16 = 96 such pairs
(ceil(1005/128) x 16 = 128 with the project's tiles) for the H200's 132 SMs. The
backend therefore issues the step as a batch of ``S`` requests that share the same
queries (copied S times) and each read a disjoint part of the visible keys (a run of
pages for the paged kernel, a chunk of a run for the ragged one), and merges the S
partial results with their log-sum-exps (``kernels.merge``). ``S`` is chosen per
step from the SM count (``auto_kv_splits``) unless fixed; the ragged kernel takes at
least one split per run when not in CUDA-graph mode.

Interface (the ``AttentionBackend`` protocol plus two optional methods):

* ``FlashInferBackend(device, variant="fa3" | "fa3-stock" | "fa3-paged" | "fa2",
  dtype=None, graph_pages=None, kv_splits=None, min_graph_pages=1, fa3_tiles=FA3_TILES,
  fused_merge=None)``: ``fa3_tiles``, the project-built kernel's shape (``fa3``);
  ``fused_merge``, merge the splits with the Triton kernel (None: where
  ``kernels.available``; a session passes its own decision). ``dtype``, when
  given, is the pool's dtype and is checked here, so an unsupported one (float32) fails
  at construction rather than mid-step (and with bf16, ``fa3`` builds its kernel then).
  ``graph_pages`` (the pool's page count) puts the wrapper in CUDA-graph mode: its index buffers are preallocated and
  stay at fixed addresses (the ragged kernel's batch is always 2 x splits requests,
  padded with empty ones), every step must have the same query length (the first
  plan's) and the same split count (chosen at the first plan, at most
  ``min_graph_pages``, the fewest pages a graphed step can see), and ``prepare`` must
  run ``plan()`` before a capture or replay (a captured ``attend`` only launches
  kernels). A step whose visible keys form more runs than that split count raises
  ``FragmentedPool`` from ``prepare`` (the session then runs it without the graph).
* ``begin_step(plan)``: remembers the step's plan (no device work).
* ``query_buffer(k_pages)``: the [S, qo_len, H, D] tensor that ``attend`` reads its
  queries from when handed it, so a producer can write the S copies directly.
* ``attend(q, k_pages, v_pages)``: the step's first call runs FlashInfer's ``plan()``
  (it needs the head count, head width and dtype, which are read from the pages);
  every call then runs the kernel (and the merge). ``plan()`` runs once per step.

Host/device traffic per step: the page ids are already on the device
(``DevicePlan.read_pages``, int32); the indptr/length arrays are tiny host tensors,
which is where ``plan()`` wants them (device ones would cost a ``.cpu()`` sync).
``plan()`` copies them and its own schedule to the device asynchronously.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from .. import kernels
from ..config import FA3_TILES, check_fa3_tiles
from ..kernels.merge import merge_reference, merge_states
from .pool import DevicePlan, UngraphableStep

VARIANTS = ("fa2", "fa2-paged", "fa3", "fa3-paged", "fa3-stock")
# the ragged kernel over the pool's runs: FA2 (sm_80+), FA3 with project-built tiles / FlashInfer's module
RAGGED = ("fa2", "fa3", "fa3-stock")
KV_DTYPES = (torch.bfloat16, torch.float16)  # FlashInfer has no float32 attention kernels
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partials)

log = logging.getLogger(__name__)
_tile_fallbacks_logged: set[str] = set()


def check_kv_dtype(dtype: torch.dtype) -> None:
    """Raise ValueError naming the fix when FlashInfer cannot attend over pages of ``dtype``."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"the flashinfer backend needs a bf16 (or fp16) K/V pool, got {dtype}; "
                         "run with dtype 'bf16', or use backend 'sdpa' for float32")




WAVES = 8.5  # work items per SM that auto_kv_splits aims for with FlashInfer's FA3 tiles
TILED_WAVES = 7.5  # the same with the project-built 128-row tiles (kernels.fa3_tiles)
MAX_RAGGED_SPLITS = 64  # a bound on explicit kv_splits for the ragged kernel (its batch is 2 x splits requests)
MIN_SPLIT_KEYS = 32  # keys per split at least, for the automatic count of the ragged kernel in a graph
FA2_TILE_Q = 128  # FlashInfer's FA2 query tile for a frame's queries at head_dim 64 (sm_80+)
FA2_WAVES = 7.5  # work items per SM that auto_kv_splits aims for with the FA2 ragged kernel
MIN_GRAPH_RAGGED_SPLITS = 4  # automatic splits of a graphed ragged step at least: room for a full window's runs


def auto_kv_splits(qo_len: int, heads: int, head_dim: int, num_pages: int, num_sms: int, variant: str,
                   max_splits: int = 12, tile_q: int | None = None, waves: float = WAVES) -> int:
    """Split count for FA3 and FA2 over the runs: enough (query tile of ``tile_q`` rows, head,
    split) work items for about ``waves`` per SM, at most ``max_splits`` and never more splits
    than pages. The paged FA2 kernel (``fa2-paged``) splits keys itself: 1.

    Measured, not modelled (``benchmarks/stream/stream_fps.py --kv-splits S``, H200): in
    CUDA-graph steps on an H200 (132 SMs) more and shorter items keep FA3 busier than a few
    long ones. 518x378 (96 items), ragged kernel, ms per frame: 4 splits 31.3, 6 28.7,
    8 28.4, 10 28.1; 518x294 (80 items): 3 splits 26.2, 8 21.8. An earlier model that
    only counted whole waves picked 4 and 3. Later, at 518x378 with the queued stream, two
    interleaved pairs of runs: 10 splits 25.46 / 25.51 ms, 12 splits 24.99 / 25.19
    (11: 25.65, 22: 26.26), hence 8.5 items per SM and at most 12. With the project-built
    128-row tiles (``tile_q=128``; 518x378: 128 items per split, 518x294: 112), one call,
    ms per frame: 518x378 7 splits 22.99 / 22.79, 8: 22.83 / 22.76, 9: 22.98, 22.49, 22.87,
    10: 23.16, 12: 23.44; 518x294 8: 17.10, 9: 17.22, 11: 17.46
    (``benchmarks/kernels/fa3_tiles_ab.sh``), hence 7.5 items per SM there (8 and 9 splits).
    FA2 over the pool's runs (variant ``fa2``, ``tile_q`` 128), H200, one frame at 518x378
    over a full window (``benchmarks/kernels/fa2_class_ab.py``, results/nvidia_h200_fa2_class_ab.json),
    us per call: 3 splits 1454, 8 splits 1034, 16: 1075; the paged FA2 kernel 1426 / 1388 /
    1411 / 1458 with 1 / 2 / 4 / 8 splits (``fa2-paged``: FlashInfer's own split, 1). Hence
    7.5 items per SM for FA2 too (8 splits on 132 SMs).
    """
    if variant == "fa2":
        tile_q, waves = tile_q or FA2_TILE_Q, FA2_WAVES
    elif not variant.startswith("fa3"):
        return 1
    if tile_q is None:  # FlashInfer's FA3 query tile (paged and ragged)
        tile_q = 192 if head_dim == 64 else 128
    items = -(-qo_len // tile_q) * heads
    want = math.ceil(waves * num_sms / items)
    return max(1, min(want, max_splits, num_pages))


def split_pages(num_pages: int, splits: int) -> list[int]:
    """Pages per request when ``num_pages`` visible pages go to ``splits`` contiguous runs."""
    base, extra = divmod(num_pages, splits)
    return [base + (1 if i < extra else 0) for i in range(splits)]


class FragmentedPool(UngraphableStep):
    """The visible keys form more contiguous runs of the pool than a CUDA-graph step of the
    ragged kernel has splits for (the session then runs that step without its graph)."""


def visible_runs(pages, last_page_len: int, page_size: int) -> list[tuple[int, int]]:
    """Token intervals [start, end) of the pool (viewed as [pages * page_size, ...]) that the
    visible ``pages`` cover (all full but the last listed, which holds ``last_page_len``),
    ascending, adjacent pages merged."""
    last = len(pages) - 1
    spans = sorted((p * page_size, p * page_size + (last_page_len if i == last else page_size))
                   for i, p in enumerate(pages))
    runs: list[list[int]] = []
    for a, b in spans:
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs]


def ragged_requests(runs: list[tuple[int, int]], splits: int, qo_len: int,
                    num_requests: int | None = None) -> tuple[list[int], list[int]]:
    """FlashInfer ragged-batch index arrays (qo_indptr, kv_indptr) that attend ``splits``
    copies of the queries over the ``runs`` (token intervals of one contiguous key tensor).

    Every run gets at least one split (more to the longer ones, so the splits carry
    similar numbers of keys) and is cut into equal chunks; request j with queries reads
    query copy j. The keys before and between runs go to requests with no queries (they
    do no work), so every key index is covered once and only visible keys are read.
    ``num_requests`` pads with empty requests to a fixed batch size (CUDA graphs).
    Raises FragmentedPool when there are more runs than splits, ValueError when the
    runs hold fewer keys than splits.
    """
    total = sum(b - a for a, b in runs)
    if len(runs) > splits:
        raise FragmentedPool(f"{len(runs)} runs of visible keys for {splits} splits")
    if total < splits:
        raise ValueError(f"{total} visible keys cannot fill {splits} splits")
    share = [1] * len(runs)
    for _ in range(splits - len(runs)):  # one more split to the run with the most keys per split
        i = max(range(len(runs)), key=lambda j: ((runs[j][1] - runs[j][0]) / share[j], -j))
        share[i] += 1
    qo, kv = [0], [0]
    at = 0
    for (a, b), n in zip(runs, share):
        if a > at:  # skipped keys: a request without queries
            qo.append(qo[-1])
            kv.append(a)
        base, extra = divmod(b - a, n)
        for i in range(n):
            qo.append(qo[-1] + qo_len)
            kv.append(kv[-1] + base + (1 if i < extra else 0))
        at = b
    if num_requests is not None:
        if len(qo) - 1 > num_requests:
            raise FragmentedPool(f"{len(qo) - 1} requests for a batch of {num_requests}")
        while len(qo) - 1 < num_requests:
            qo.append(qo[-1])
            kv.append(kv[-1])
    return qo, kv


class PlannedBackend:
    """The step protocol of the backends that plan a step once and split its keys
    (``FlashInferBackend``, ``varlen.FlashVarlenBackend``): ``begin_step`` takes the step's
    ``DevicePlan``, the plan is made at the first ``prepare``/``query_buffer``/``attend`` (host
    work: before a CUDA-graph capture or replay, call ``prepare``). A subclass defines
    ``_plan(k_pages)`` (sets ``_planned`` and ``splits``), ``_buffer(name, shape, dtype)`` and
    ``attend``."""

    _step: DevicePlan | None
    _planned: bool
    splits: int | None

    def begin_step(self, plan: DevicePlan) -> None:
        self._step = plan
        self._planned = False

    def prepare(self, k_pages: Tensor) -> None:
        """Plan the step now (host work), e.g. before a CUDA-graph capture or replay."""
        self._plan(k_pages)

    def query_buffer(self, k_pages: Tensor) -> Tensor:
        """[S, qo_len, H, D] in the pages' dtype: queries written here need no copy in ``attend``."""
        if not self._planned:
            self._plan(k_pages)
        heads, dim = k_pages.shape[-2:]
        return self._buffer("q", (self.splits, self._step.qo_len, heads, dim), k_pages.dtype)

    def _plan(self, k_pages: Tensor) -> None:
        raise NotImplementedError

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError


class FlashInferBackend(PlannedBackend):
    """``BatchPrefillWithPagedKVCacheWrapper`` (NHD layout), one plan per step, split-KV."""

    def __init__(self, device: torch.device | str, variant: str = "fa3", dtype: torch.dtype | None = None,
                 graph_pages: int | None = None, kv_splits: int | None = None, min_graph_pages: int = 1,
                 fa3_tiles: tuple[int, int, int] = FA3_TILES, fused_merge: bool | None = None,
                 workspace: Tensor | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"flashinfer variant must be one of {VARIANTS}, got {variant!r}")
        if dtype is not None:
            check_kv_dtype(dtype)
        if kv_splits is not None and kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1 (or None for automatic), got {kv_splits}")
        fa3_tiles = check_fa3_tiles(fa3_tiles)
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA device, got {device}")
        import flashinfer  # deferred: importing it is slow and needs CUDA

        self._flashinfer = flashinfer
        self.name = f"flashinfer-{variant}"
        self.variant = variant
        self.ragged = variant in RAGGED
        self._kernel = variant.split("-")[0]  # FlashInfer's backend argument
        self.device = device
        self.kv_splits = kv_splits
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        if workspace is not None and (workspace.numel() * workspace.element_size() < WORKSPACE_BYTES
                                      or workspace.device != device):
            raise ValueError(f"a shared FlashInfer workspace must be >= {WORKSPACE_BYTES} bytes on {device}")
        # FlashInfer's float scratch of a run (plan data lives in the wrapper's own int buffers):
        # backends whose runs are ordered on one stream may share it (several cameras, stream.multi)
        self._workspace = workspace if workspace is not None else \
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.graph_mode = graph_pages is not None
        self._graph_pages = graph_pages
        self._min_graph_pages = max(1, min_graph_pages)
        self._wrapper = None  # made at the first plan, when the pool's dtype and head width are known
        self._tiled = None  # kernels.fa3_tiles.TiledRaggedAttention when variant fa3 uses it
        self._fa3_tiles = fa3_tiles  # the shape it is built with
        if variant == "fa3" and dtype == torch.bfloat16:
            self._build_tiled_kernel()
        self.tiles: tuple[int, int, int] | None = None  # (queries, keys, stages) of the project-built FA3 kernel
        if fused_merge is None:
            fused_merge = kernels.available(device)
        self._merge = merge_states if fused_merge else merge_reference  # of the split-KV partial results
        self._buffers: dict[tuple, Tensor] = {}
        # plan() fills a pinned host buffer and copies it to the device asynchronously; the
        # next plan() must not overwrite that buffer before the copy ran. The event is
        # already complete when the host waited for the previous step's results (the
        # session does), so the wait below never happens there.
        self._plan_copied = torch.cuda.Event()
        self._step: DevicePlan | None = None
        self._planned = False
        self.splits = 1  # of the current step

    @property
    def workspace(self) -> Tensor:
        """FlashInfer's float workspace (shareable by backends whose runs are ordered on one stream)."""
        return self._workspace

    def attend(self, q: Tensor, k_pages: Tensor, v_pages: Tensor) -> Tensor:
        """q [qo_len, H, D] (any float dtype; cast to the pages'), or ``query_buffer``'s tensor;
        pages [num_pages, page_size, H, D] -> [qo_len, H, D] in the pages' dtype."""
        if not self._planned:
            self._plan(k_pages)
        s, dtype = self.splits, k_pages.dtype
        kv = (k_pages.view(-1, *k_pages.shape[2:]), v_pages.view(-1, *v_pages.shape[2:])) if self.ragged \
            else ((k_pages, v_pages),)
        if s == 1:
            q = q[0] if q.dim() == 4 else q
            return self._wrapper.run(q.to(dtype).contiguous(), *kv)
        qo, heads, dim = self._step.qo_len, k_pages.shape[-2], k_pages.shape[-1]
        q_rep = self._buffer("q", (s, qo, heads, dim), dtype)
        if q.data_ptr() != q_rep.data_ptr():
            q_rep.copy_(q.unsqueeze(0).expand(s, -1, -1, -1))
        o = self._buffer("o", (s, qo, heads, dim), dtype)
        lse = self._buffer("lse", (s, qo, heads), torch.float32)
        self._wrapper.run(q_rep.view(s * qo, heads, dim), *kv, out=o.view(s * qo, heads, dim),
                          lse=lse.view(s * qo, heads), return_lse=True)
        return self._merge(o, lse, self._buffer("out", (qo, heads, dim), dtype))

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> Tensor:
        """A persistent tensor per (name, shape, dtype): no allocation in the steady state, and
        fixed addresses for CUDA graphs."""
        key = (name, shape, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def _choose_splits(self, qo_len: int, heads: int, head_dim: int, num_pages: int, page_size: int) -> int:
        if self.graph_mode and self._wrapper is not None:
            if not self.ragged and num_pages < self.splits:
                raise ValueError(f"this CUDA-graph step was captured with {self.splits} KV splits but the "
                                 f"step sees only {num_pages} pages")
            return self.splits
        if not self.graph_mode:
            limit = num_pages
        elif self.ragged:
            # a split is any run of keys. The automatic count keeps at least MIN_SPLIT_KEYS keys
            # per split at the graph's smallest step (each split's output is rounded to the
            # pages' dtype before the merge: many tiny splits only add rounding), and is never
            # below that step's page count (the visible keys may form that many runs, each
            # needing a split of its own)
            if self.kv_splits:
                return min(self.kv_splits, MAX_RAGGED_SPLITS)
            fewest = self._min_graph_pages
            limit = min(MAX_RAGGED_SPLITS, max(fewest, fewest * page_size // MIN_SPLIT_KEYS))
            if self._kernel == "fa2":  # a GPU with few SMs would get 1-2 splits: too few for the runs
                return max(1, min(limit, max(MIN_GRAPH_RAGGED_SPLITS, auto_kv_splits(
                    qo_len, heads, head_dim, limit, self._num_sms, self.variant))))
        else:  # a split is whole pages, and a graph's count must fit its fewest pages
            limit = min(num_pages, self._min_graph_pages)
        tile_q, waves = (self.tiles[0], TILED_WAVES) if self.tiles else (None, WAVES)
        s = self.kv_splits or auto_kv_splits(qo_len, heads, head_dim, limit, self._num_sms, self.variant,
                                             tile_q=tile_q, waves=waves)
        return max(1, min(s, limit))

    def _build_tiled_kernel(self) -> None:
        """Compile (or load) the tiled kernel now, at construction, rather than at the first
        step (a node compiles it at start, not when the first frames arrive). A failure is
        reported at the first plan, which then uses FlashInfer's module."""
        from ..kernels import fa3_tiles

        if fa3_tiles.unsupported(self.device, torch.bfloat16, fa3_tiles.HEAD_DIM) is None:
            try:
                fa3_tiles.load(self._fa3_tiles)
            except RuntimeError:
                pass  # remembered by load(); _tiled_kernel logs it

    def _tiled_kernel(self, dtype: torch.dtype, head_dim: int):
        """The project-built FA3 kernel (``kernels.fa3_tiles``) for variant ``fa3``, or None
        (FlashInfer's packaged module) when it cannot serve this pool or cannot be built; the
        reason is logged once per process."""
        if self.variant != "fa3":
            return None
        from ..kernels import fa3_tiles

        reason = fa3_tiles.unsupported(self.device, dtype, head_dim)
        if reason is None:
            try:
                return fa3_tiles.TiledRaggedAttention(self.device, fixed=self.graph_mode, tiles=self._fa3_tiles)
            except RuntimeError as exc:
                reason = str(exc)
        if reason not in _tile_fallbacks_logged:
            _tile_fallbacks_logged.add(reason)
            log.warning("flashinfer-fa3: using FlashInfer's packaged FA3 module (192-row tiles): the tiled "
                        "kernel %s", reason)
        return None

    def _make_wrapper(self, splits: int):
        """FlashInfer's wrapper for this backend; in CUDA-graph mode with index buffers at fixed
        addresses (``plan()`` copies into them, a captured run reads them)."""
        flashinfer = self._flashinfer
        if not self.graph_mode:
            kind = (flashinfer.BatchPrefillWithRaggedKVCacheWrapper if self.ragged
                    else flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            return kind(self._workspace, kv_layout="NHD", backend=self._kernel)

        def i32(n: int) -> Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        if self.ragged:  # at most one skipped range before each of at most ``splits`` runs
            return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=i32(2 * splits + 1),
                kv_indptr_buf=i32(2 * splits + 1), backend=self._kernel)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=i32(splits + 1),
            paged_kv_indptr_buf=i32(splits + 1), paged_kv_indices_buf=i32(self._graph_pages),
            paged_kv_last_page_len_buf=i32(splits), backend=self._kernel)

    def _plan(self, k_pages: Tensor) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("FlashInferBackend.attend called before begin_step")
        check_kv_dtype(k_pages.dtype)
        page_size, heads, head_dim = k_pages.shape[1:]
        if page_size != step.plan.page_size:
            raise ValueError(f"pages hold {page_size} tokens but the step was planned for {step.plan.page_size}")
        num_pages = len(step.plan.read_pages)
        if self._wrapper is None and self.ragged:
            self._tiled = self._tiled_kernel(k_pages.dtype, head_dim)
            self.tiles = self._tiled.tiles if self._tiled is not None else None
        splits = self._choose_splits(step.qo_len, heads, head_dim, num_pages, page_size)
        if self.ragged:
            runs = visible_runs(step.plan.read_pages, step.plan.last_page_len, page_size)
            if not self.graph_mode:
                splits = max(splits, len(runs))  # a run per split at least
            qo_list, kv_list = ragged_requests(runs, splits, step.qo_len, 2 * splits if self.graph_mode else None)
            args = (torch.tensor(qo_list, dtype=torch.int32), torch.tensor(kv_list, dtype=torch.int32), heads, heads,
                    head_dim)
        else:
            counts = split_pages(num_pages, splits)
            qo_indptr = torch.arange(splits + 1, dtype=torch.int32) * step.qo_len
            kv_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            last_page_len = torch.full((splits,), page_size, dtype=torch.int32)
            last_page_len[-1] = step.plan.last_page_len
            args = (qo_indptr, kv_indptr, step.read_pages, last_page_len, heads, heads, head_dim, page_size)
        if self._wrapper is None:
            self._wrapper = self._tiled or self._make_wrapper(splits)
        self.splits = splits
        if not self._plan_copied.query():
            self._plan_copied.synchronize()
        self._wrapper.plan(*args, causal=False, q_data_type=k_pages.dtype, kv_data_type=k_pages.dtype)
        self._plan_copied.record(torch.cuda.current_stream(self.device))
        self._planned = True
