"""StreamingSession: the model, the paged cache and the streaming policy in one owner.

``push(image)`` takes one preprocessed frame and returns the results that became
available: nothing while the scale frames are being collected, all of them when
phase 1 runs, then one result per frame. ``submit(image)`` does the same without
waiting: it launches the step and returns a ``PendingResults``; submitting the next
frame before asking for the results keeps the GPU busy (a frame's heads then run
beside the next frame's trunk, and the host's work on results overlaps the GPU).
Keyframes follow the interval policy unless the caller decides
(``push(image, keyframe=...)``). External keyframe
logic uses ``set_deferred_eviction``, ``commit_eviction`` and
``rollback_last_frame``; ``reset`` starts a new sequence. Every transition is a
method of this object; a step that raises leaves the cache as it was. Frames are
checked here (``check_frame``: layout, size, resolution of the running sequence); a
refused one raises ``InvalidFrameError`` and changes nothing. The public methods are
the ``stream.protocol.Session`` protocol, which ``LongStreamSession`` shares.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .. import kernels
from ..cache.attention import AttentionBackend, UngraphableStep, make_backend
from ..cache.fp8 import Fp8KVPool
from ..cache.pages import CacheError, CacheFullError, CacheStats, PageTable, StepPlan
from ..cache.pool import CameraKVCache, KVPool, PoolAttention, PoolFullError, SharedKVStorage, make_device_plan
from ..config import SPECIAL_TOKENS, StreamConfig
from ..geometry import fov_to_intrinsics, pose_enc_to_c2w
from ..kernels.fp8_gemm import quantize_linears_
from ..model.lingbot import LingBotMap, StepOptions
from .errors import FrameMismatchError, InvalidFrameError, SessionError
from .graphs import BatchedTrunk, CudaGraphSteps, GraphedStep, HandOff, StepCapture, StepSite
from .landing import LandingRing
from .results import FrameResult

LANDING_BUFFERS = 6  # outputs of this many recent steps (in flight or held by callers) land without a copy
MAX_IN_FLIGHT = 2  # submitted steps whose results are not on the host yet; an older one is waited for first

log = logging.getLogger(__name__)


class PendingResults:
    """The results of one ``submit``: ``result()`` waits for the step's outputs (the first
    time) and returns its FrameResults, like ``push`` would have."""

    __slots__ = ("_event", "_finish", "_results")

    def __init__(self, finish: Callable[[], list[FrameResult]] | None = None, event: torch.cuda.Event | None = None,
                 results: list[FrameResult] | None = None) -> None:
        self._finish, self._event, self._results = finish, event, results

    @property
    def done(self) -> bool:
        """The results are ready (``result()`` will not wait for the GPU)."""
        return self._results is not None or self._event is None or self._event.query()

    @property
    def settled(self) -> bool:
        return self._results is not None

    def result(self) -> list[FrameResult]:
        if self._results is None:
            finish, self._finish = self._finish, None
            self._results = finish()
            self._event = None
        return self._results


@dataclass
class _PlannedStep:
    """A step planned but not launched (``StreamingSession._plan_run``)."""

    plan: StepPlan
    dplan: object  # DevicePlan
    prepared: bool  # dplan is already loaded into ``graphed`` (speculated)
    tokens: int  # per frame
    graphed: GraphedStep | None  # the graphed step that may run it (None: eager)


@dataclass
class PlannedFrame:
    """One checked frame's step, planned and not launched (``StreamingSession.plan``): launch it
    with ``StreamingSession.launch``, or launch its ``graphed`` step with others (a batched trunk)
    and hand the outputs to ``StreamingSession.complete``."""

    frame: Tensor  # [1, 3, H, W] on the device
    host: Tensor  # as ``check_frame`` returned it
    step: _PlannedStep
    t0: float  # perf_counter when the step's work began (the frame's model time counts from it)

    @property
    def graphed(self) -> GraphedStep | None:
        """The captured step that runs it (None: eager)."""
        return self.step.graphed

    @property
    def dplan(self):
        """Its plan's device tensors (``DevicePlan``), loaded into ``graphed`` when prepared."""
        return self.step.dplan


class SharedGpuState:
    """Device memory that sessions on one ``SharedKVStorage`` share because their steps run in
    turn: FlashInfer's float workspace (128 MiB per backend otherwise; each session has an
    eager and a graph backend), the memory pool of the trunk CUDA graphs (all trunks replay
    on the caller's stream, one at a time, each after the heads stream took the previous
    trunk's levels: one ``HandOff``), and one output stream with one pool for the heads
    graphs (the heads of one camera's step run beside the next camera's trunk, and after
    the previous camera's heads and its landing)."""

    def __init__(self, workspace: Tensor | None) -> None:
        self.workspace = workspace
        self._graphs: dict | None = None
        # batched trunks (several cameras' steps in one pass) by their cameras' GraphedSteps
        self.batches: dict[tuple[str, ...], BatchedTrunk] = {}
        # sets of cameras whose batched trunk failed (why): their frames run one after another
        self.refused: dict[tuple[str, ...], str] = {}

    def refuse(self, owners: tuple[str, ...], exc: Exception) -> None:
        """Stop batching these cameras together after their batched trunk failed (logged once)."""
        self.batches.pop(owners, None)
        self.refused[owners] = f"{type(exc).__name__}: {exc}"
        log.warning("cameras %s: their batched step failed (%s); their frames run one after another from now on",
                    ", ".join(owners), self.refused[owners])

    def batch_for(self, owners: tuple[str, ...], steps: list[GraphedStep]) -> BatchedTrunk:
        """The batched trunk of these cameras' current steps (made on first use; remade when a
        camera's step was rebuilt: a new resolution or a moved storage)."""
        batch = self.batches.get(owners)
        if batch is None or any(a is not b for a, b in zip(batch.steps, steps)):
            capture = steps[0].capture
            pool = self.graph_kwargs()["trunk_pool"] if capture else None
            batch = self.batches[owners] = BatchedTrunk(steps, capture=capture, trunk_pool=pool)
        return batch

    def graph_kwargs(self) -> dict:
        if self._graphs is None:
            self._graphs = {"trunk_pool": torch.cuda.graph_pool_handle(), "heads_pool": torch.cuda.graph_pool_handle(),
                            "output_stream": torch.cuda.Stream(), "hand_off": HandOff()}
        return {"workspace": self.workspace, **self._graphs}


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


class StreamingSession:
    def __init__(self, model: LingBotMap, cfg: StreamConfig, backend: AttentionBackend | None = None,
                 with_depth: bool = True, storage: SharedKVStorage | None = None, owner: str = "",
                 share_from: StreamingSession | None = None, steps: StepCapture | None = None) -> None:
        """``storage``/``owner``: take the K/V pages from that shared storage under that name
        (several cameras, ``stream.multi``) instead of an allocation of its own.
        ``share_from``: a session on the same model whose step options (the heads'
        reduced-precision copies, the head stream, the kernel decision) this one reuses,
        so N sessions hold one copy of the weights; both are driven from one thread.
        ``steps``: how the one-frame phase-2 step is captured (default ``CudaGraphSteps``:
        CUDA graphs where they apply, else eager steps)."""
        self.model = model.eval()
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.dtype = torch_dtype(cfg.dtype)
        agg_dtype = next(model.aggregator.parameters()).dtype
        if agg_dtype != self.dtype:
            raise SessionError(f"the model's aggregator is {agg_dtype} but the stream dtype is {cfg.dtype}; "
                               "load the model with the same dtype (io.checkpoint.load_model(dtype=...))")
        self._apply_precision(model, cfg)
        if share_from is not None:
            if share_from.model is not model or share_from.dtype != self.dtype or share_from.with_depth != with_depth:
                raise SessionError("share_from must be a session on the same model, dtype and depth setting")
            fused, triton = share_from.fused, share_from._merge_kernel
        else:
            fused, triton = self._resolve_kernels()
        self._merge_kernel = triton  # FlashInfer's split-KV merge: the Triton kernel wherever Triton runs here
        shared = share_from._shared if share_from is not None else None
        if backend is None and share_from is not None and share_from.cfg.backend == cfg.backend \
                and share_from.cfg.kv_splits == cfg.kv_splits and share_from.cfg.fa3_tiles == cfg.fa3_tiles:
            backend = share_from.backend  # the eager steps (phase 1, fallbacks) run in turn: one backend, one set of buffers
        self.backend = backend or make_backend(cfg.backend, self.device, self.dtype, kv_splits=cfg.kv_splits,
                                               fa3_tiles=cfg.fa3_tiles, fused_merge=triton,
                                               workspace=None if shared is None else shared.workspace)
        # what sessions on one storage share besides the weights (None: a session on its own)
        self._shared = shared or (SharedGpuState(getattr(self.backend, "workspace", None))
                                  if storage is not None else None)
        # how every step runs, eager or graphed (a test may replace it before the first frame)
        self.step_options = share_from.step_options if share_from is not None else \
            self._make_step_options(fused, with_depth)
        if storage is not None and cfg.kv_cache_dtype == "fp8":
            raise SessionError("kv_cache_dtype 'fp8' is for a single camera: several cameras share one bf16 K/V "
                               "storage; use kv_cache_dtype 'auto'")
        self._storage, self._owner = storage, owner
        self._pool_generation = -1  # the storage generation self._pool views
        self._pages: PageTable | None = None
        self._pool: KVPool | None = None
        self._camera: CameraKVCache | None = None
        self._resolution: tuple[int, int] | None = None
        self._pending: list[Tensor] = []
        self._frames_pushed = 0
        self._deferred = cfg.deferred_eviction
        self._last_stored_frame: int | None = None
        self._graphed: GraphedStep | None = None  # the one-frame step as a CUDA graph (see graphs.py)
        self.graph_fallbacks = 0  # one-frame steps that ran without their graph (UngraphableStep)
        self.batched_steps = 0  # one-frame steps that ran in a batched trunk with other cameras' (submit_batch)
        self._steps = steps if steps is not None else CudaGraphSteps()
        self._steps_apply = self._steps.applies(cfg, self.device, self.backend)  # asked once
        # the next graphed step, planned and loaded while the GPU ran the current one
        self._next: tuple[StepPlan, object] | None = None
        self._landing: LandingRing | None = None  # page-locked landing buffers of the outputs (CUDA)
        self._in_flight: deque[PendingResults] = deque()  # submitted, results not yet taken (CUDA)
        self._u8_scale: Tensor | None = None  # 255 on the device (uint8 frames)

    @staticmethod
    def _apply_precision(model: LingBotMap, cfg: StreamConfig) -> None:
        """``precision`` fp8: convert the aggregator's linears to FP8 (``kernels.fp8_gemm``), once
        per model; a model converted so cannot serve a bf16 stream."""
        converted = getattr(model, "fp8_linears", 0)
        if cfg.precision == "fp8" and not converted:
            model.fp8_linears = quantize_linears_(model.aggregator)
            log.info("precision fp8: %d linears of the aggregator run as FP8 GEMMs", model.fp8_linears)
        elif cfg.precision != "fp8" and converted:
            raise SessionError("the model's linears were converted to FP8 by a precision 'fp8' stream; load the "
                               "model again for a bf16 stream")

    def _resolve_kernels(self) -> tuple[bool, bool]:
        """(fused, triton): whether this session runs the Triton kernels of the model's step
        (``cfg.fused_kernels``, CUDA, bf16, and they pass ``kernels.self_check`` here), and
        whether Triton kernels run here at all (False once the self-check failed). Decided
        once; the result is handed to everything that launches a kernel."""
        triton = kernels.available(self.device)
        if not (self.cfg.fused_kernels and self.dtype == torch.bfloat16 and triton):
            return False, triton
        mcfg = self.model.cfg
        problem = kernels.self_check(self.device, mcfg.num_heads, mcfg.head_dim, (mcfg.embed_dim, mcfg.dino_dim))
        if problem is not None:
            log.warning("the Triton kernels cannot be used here (%s); running the PyTorch path instead", problem)
            return False, False
        return True, True

    def _make_step_options(self, fused: bool, with_depth: bool) -> StepOptions:
        """The StepOptions of this session: bf16 streams on CUDA get the heads' reduced-precision
        copies (the depth head's bf16 channels-last copy; with the kernels, the camera head's
        copy with bf16 weights read by one matrix-vector kernel per product: the PyTorch twin
        would convert the weights on every call) and the camera head its own CUDA stream
        beside the depth head. The model's own heads stay float32."""
        cfg, model, cuda = self.cfg, self.model, self.device.type == "cuda"
        depth_head = camera_head = None
        if cfg.bf16_depth_head and self.dtype == torch.bfloat16 and cuda:
            fast_upsample = fast_norm = None
            if fused:
                from ..kernels.layer_norm import layer_norm as fast_norm
                from ..kernels.upsample import upsample_bilinear as fast_upsample
            depth_head = model.depth_head.reduced_precision_copy(upsample=fast_upsample, norm_to=fast_norm)
        if cfg.bf16_camera_head and fused:
            from ..kernels.gemv import gemv

            camera_head = model.camera_head.reduced_precision_copy(gemv=gemv)
        head_stream = torch.cuda.Stream(self.device) if cfg.parallel_heads and with_depth and cuda else None
        return StepOptions(camera_iterations=cfg.camera_iterations,
                           autocast_dtype=self.dtype if self.dtype != torch.float32 else None,
                           with_depth=with_depth, fused=fused, depth_head=depth_head, camera_head=camera_head,
                           head_stream=head_stream)

    # ------------------------------------------------------------------ state
    @property
    def fused(self) -> bool:
        """The step runs the Triton kernels (decided at construction, see ``_resolve_kernels``)."""
        return self.step_options.fused

    @property
    def with_depth(self) -> bool:
        return self.step_options.with_depth

    @property
    def depth_head(self):
        """The depth head the steps run (its bf16 copy), or None for the model's own."""
        return self.step_options.depth_head

    @property
    def camera_head(self):
        """The camera head the steps run (its bf16-weight copy), or None for the model's own."""
        return self.step_options.camera_head

    @property
    def resolution(self) -> tuple[int, int] | None:
        return self._resolution

    @property
    def frames_pushed(self) -> int:
        return self._frames_pushed

    @property
    def window_index(self) -> int:
        """Always 0: one window, the whole sequence (``LongStreamSession`` restarts windows)."""
        return 0

    @property
    def deferred_eviction(self) -> bool:
        return self._deferred

    def stats(self) -> CacheStats | None:
        return self._pages.stats() if self._pages is not None else None

    def is_keyframe_index(self, frame_index: int) -> bool:
        s0 = self.cfg.num_scale_frames
        return frame_index < s0 or (frame_index - s0) % self.cfg.keyframe_interval == 0

    # ------------------------------------------------------------------ transitions
    def reset(self) -> None:
        """Empty the cache; the next frame starts a new sequence (buffers are kept and reused)."""
        if self._pages is not None:
            self._pages.reset()
            self._pages.set_deferred(self._deferred)
        self._pending.clear()
        self._frames_pushed = 0
        self._last_stored_frame = None
        self._next = None

    def set_deferred_eviction(self, deferred: bool) -> None:
        self._deferred = bool(deferred)
        if self._pages is not None:
            self._pages.set_deferred(self._deferred)

    def commit_eviction(self) -> int:
        """Perform the pending evictions; returns pages freed (0 when nothing was pending)."""
        return self._pages.commit() if self._pages is not None else 0

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        """Remove the most recently stored frame from the cache; returns its frame index.

        ``expected_frame_index`` guards against removing another frame than the caller
        meant. Raises SessionError (state unchanged) when there is nothing to roll back
        or the index does not match. Rolling back the scale frames removes all of them.
        """
        if self._pages is None or self._last_stored_frame is None or not self._pages.stats().can_rollback:
            raise SessionError("nothing to roll back")
        if expected_frame_index is not None and expected_frame_index != self._last_stored_frame:
            raise FrameMismatchError(self._last_stored_frame, expected_frame_index)
        frame = self._last_stored_frame
        self._pages.rollback_last()
        was_phase1 = self._pages.in_phase1
        self._frames_pushed = 0 if was_phase1 else frame
        self._last_stored_frame = None
        return frame

    def seek(self, frame_index: int) -> None:
        """Make ``frame_index`` the next frame's index without running a step (journal replay,
        ``journal.resume``: the frames in between were attended only, which changes nothing in
        the cache). After the scale frames, forward only; SessionError otherwise."""
        if self._pages is None or self._pages.in_phase1 or self._pending:
            raise SessionError("seek: the scale frames have not run yet")
        if frame_index < self._frames_pushed:
            raise SessionError(f"seek: frame {frame_index} is before the next frame {self._frames_pushed}")
        self._frames_pushed = int(frame_index)
        self._next = None

    # ------------------------------------------------------------------ frames
    def push(self, image: Tensor | np.ndarray, keyframe: bool | None = None) -> list[FrameResult]:
        """Feed one frame: float [3, H, W] RGB in [0, 1], or uint8 [H, W, 3] RGB (a camera
        frame already at the model's size; it travels to the device as bytes and becomes
        the same float32 values there). H, W multiples of the patch size.

        keyframe: None follows the interval policy; True/False forces the decision
        (ignored for the scale frames, which are always stored).
        """
        return self.submit(image, keyframe).result()

    def submit(self, image: Tensor | np.ndarray, keyframe: bool | None = None) -> PendingResults:
        """``push`` without waiting for the results: the frame is checked, planned and
        launched, and its results come from the returned object's ``result()``. The cache
        state (frame indices, rollback, commit) moves on at once, as after a ``push``.
        Submit frame t+1 before taking frame t's results to keep the GPU busy; at most
        ``MAX_IN_FLIGHT`` steps are left running (a submit waits for an older one first).
        Bad input raises InvalidFrameError here, as in ``push``, and changes nothing."""
        host = self.check_frame(image)
        frame = self._device_frame(host)
        if self._pages is None or self._pages.in_phase1:
            self._pending.append((frame, host))
            if len(self._pending) < self.cfg.num_scale_frames:
                return PendingResults(results=[])
            frames = torch.stack([f for f, _ in self._pending])
            hosts = [h for _, h in self._pending]
            try:
                return self._run(frames, hosts, store=True)
            finally:
                self._pending.clear()
        return self._run(frame[None], [host], store=self._store_decision(keyframe))

    def wait(self) -> None:
        """Take the results of every submitted step onto the host (they stay with their
        ``PendingResults``); the GPU is idle afterwards as far as this session goes."""
        while self._in_flight:
            self._in_flight.popleft().result()

    def _device_frame(self, host: Tensor) -> Tensor:
        """[3, H, W] float32 on the session's device. A uint8 [H, W, 3] frame is copied as
        bytes (4x less than float32) from page-locked memory, then divided by 255 on the
        device with a tensor divisor: a correctly rounded division per pixel, the same
        float32 numbers as the host's preprocessing (a scalar divisor would be turned into
        a multiplication by its reciprocal, off by an ulp here and there)."""
        if host.dtype != torch.uint8:
            return host.to(self.device, torch.float32, non_blocking=True)
        if self._u8_scale is None:
            self._u8_scale = torch.full((1, 1, 1), 255.0, dtype=torch.float32, device=self.device)
        src = host.pin_memory() if self.device.type == "cuda" and host.device.type == "cpu" else host
        u8 = src.to(self.device, non_blocking=True)
        out = torch.empty((3, u8.shape[0], u8.shape[1]), dtype=torch.float32, device=self.device)
        out.copy_(u8.permute(2, 0, 1))
        return out.div_(self._u8_scale)

    def check_frame(self, image: Tensor | np.ndarray, resolution: tuple[int, int] | None = None) -> Tensor:
        """The one place frames are checked: layout and dtype, a positive multiple of the patch
        size, at least ``SPECIAL_TOKENS`` patches, and the running sequence's resolution
        (``resolution`` (H, W) instead, when given). Raises InvalidFrameError naming the
        problem; returns the frame as a tensor where it came from (host or device)."""
        if isinstance(image, np.ndarray):
            image = torch.from_numpy(np.ascontiguousarray(image))
        if image.dtype == torch.uint8:
            if image.ndim != 3 or image.shape[2] != 3:
                raise InvalidFrameError(f"expected a uint8 RGB image [H, W, 3], got shape {tuple(image.shape)}")
            h, w = int(image.shape[0]), int(image.shape[1])
        else:
            if image.ndim != 3 or image.shape[0] != 3:
                raise InvalidFrameError(f"expected an image [3, H, W], got shape {tuple(image.shape)}")
            if not torch.is_floating_point(image):
                raise InvalidFrameError(f"expected a float image in [0, 1] or a uint8 image [H, W, 3], got dtype "
                                        f"{image.dtype}")
            h, w = int(image.shape[1]), int(image.shape[2])
        p = self.model.cfg.patch_size
        if h % p or w % p or h == 0 or w == 0:
            raise InvalidFrameError(f"image size {w}x{h} is not a positive multiple of the patch size {p}")
        if (h // p) * (w // p) < SPECIAL_TOKENS:
            raise InvalidFrameError(f"image {w}x{h} is too small: at least {SPECIAL_TOKENS} patches are needed")
        expected = resolution or self._sequence_resolution()
        if expected is not None and (h, w) != tuple(expected):
            raise InvalidFrameError(f"image size changed: {w}x{h}, the sequence's frames are {expected[1]}x"
                                    f"{expected[0]}; reset the session to change resolution")
        return image

    def _sequence_resolution(self) -> tuple[int, int] | None:
        """(H, W) that the next frame must have; None at the start of a sequence."""
        if self._pending:
            return tuple(self._pending[0][0].shape[-2:])
        if self._pages is None or self._pages.in_phase1:
            return None
        return self._resolution

    def _ensure_cache(self, h: int, w: int) -> None:
        if self._resolution == (h, w) and self._pages is not None:
            return
        mcfg, cfg = self.model.cfg, self.cfg
        page_size = (h // mcfg.patch_size) * (w // mcfg.patch_size)
        self._pages = PageTable(page_size, cfg.num_scale_frames, cfg.sliding_window, mcfg.max_frame_num,
                                cfg.max_pending_evictions)
        self._pages.set_deferred(self._deferred)
        self.wait()  # nothing in flight may still read the old pool, graphs or outputs
        self._graphed = None  # bound to the old pool
        self._next = None
        self._pool = None  # free the old pool before allocating the new one
        if self._storage is None and cfg.kv_cache_dtype == "fp8":
            self._pool = Fp8KVPool(mcfg.depth, self._pages.num_pages, page_size, mcfg.num_heads, mcfg.head_dim,
                                   self.dtype, self.device, fused=self._merge_kernel)
        elif self._storage is None:
            self._pool = KVPool(mcfg.depth, self._pages.num_pages, page_size, mcfg.num_heads, mcfg.head_dim,
                                self.dtype, self.device)
        else:
            self._storage.release(self._owner)
            try:
                self._pool = self._storage.lease(self._owner, self._pages.num_pages, page_size)
            except PoolFullError as exc:
                self._pages, self._resolution = None, None
                raise CacheFullError(str(exc)) from None
            self._pool_generation = self._storage.generation
        if self._camera is None:
            head_dim = mcfg.camera_dim // mcfg.camera_num_heads
            # fused: its graph-step attention through the Triton kernel
            self._camera = CameraKVCache(cfg.camera_iterations, mcfg.camera_trunk_depth, mcfg.max_frame_num,
                                         mcfg.camera_num_heads, head_dim, torch.float32, self.device,
                                         fused=self.step_options.fused)
        self._resolution = (h, w)
        log.info("cache for %dx%d: %d pages of %d tokens, %.1f MiB of K/V", w, h, self._pages.num_pages,
                 page_size, self._pool.nbytes / 2**20)

    @torch.inference_mode()
    def _run(self, frames: Tensor, hosts: list[Tensor], store: bool) -> PendingResults:
        t0 = time.perf_counter()
        step = self._plan_run(frames, store)
        self._make_room()
        return self._launch_planned(frames, hosts, step, t0)

    def _plan_run(self, frames: Tensor, store: bool) -> _PlannedStep:
        """Everything of a step before its launch: the cache for the frames' size, the page
        plan (checked against the camera's extent), its device tensors (the speculated ones
        when the plan matches) and the graphed step that may run it. Changes no cache state
        (``PageTable.apply`` comes after the launch); raises CacheFullError when it cannot be
        stored."""
        s, _, h, w = frames.shape
        self._ensure_cache(h, w)
        if self._storage is not None and self._storage.generation != self._pool_generation:
            self._rebind_storage()
        plan: StepPlan = self._pages.plan_step(s, store)
        if self._storage is not None:  # never a page of another camera's extent
            self._storage.check_pages(self._owner, plan.read_pages + plan.frame_pages, max(plan.special_slots))
        tokens = SPECIAL_TOKENS + plan.page_size
        speculated, self._next = self._next, None
        prepared = speculated is not None and speculated[0] == plan
        dplan = speculated[1] if prepared else make_device_plan(plan, tokens, self.device)
        graphed = self._graphed_step() if s == 1 and not plan.phase1 else None
        return _PlannedStep(plan, dplan, prepared, tokens, graphed)

    def _launch_planned(self, frames: Tensor, hosts: list[Tensor], step: _PlannedStep, t0: float) -> PendingResults:
        plan, dplan, graphed = step.plan, step.dplan, step.graphed
        out = None
        if graphed is not None:
            try:
                out = graphed.launch(frames, dplan, prepared=step.prepared)
            except UngraphableStep as exc:  # nothing ran yet: this step goes without the graph
                self._note_graph_fallback(exc)
                graphed = None
        if out is None:
            if self._graphed is not None and self._graphed.output_stream is not None:
                # heads of graphed steps still in flight write the camera cache: they go first
                torch.cuda.current_stream(self.device).wait_stream(self._graphed.output_stream)
            out = self._eager_step(frames, plan, dplan, self._pool, self._camera)
        return self._complete(frames, hosts, out, step, t0, graphed)

    def _note_graph_fallback(self, exc: Exception) -> None:
        self.graph_fallbacks += 1
        if self.graph_fallbacks == 1 or self.graph_fallbacks % 1000 == 0:
            log.warning("step without its CUDA graph (%d so far): %s", self.graph_fallbacks, exc)

    def _complete(self, frames: Tensor, hosts: list[Tensor], out, step: _PlannedStep, t0: float,
                  graphed: GraphedStep | None) -> PendingResults:
        """After the launch: the step becomes part of the cache, its outputs start landing, and
        the next step is speculated (graphed steps)."""
        plan = step.plan
        s = frames.shape[0]
        self._pages.apply(plan)  # only now does the step become part of the cache
        first_frame = 0 if plan.phase1 else self._frames_pushed
        self._frames_pushed = first_frame + s
        if plan.store:
            self._last_stored_frame = first_frame + s - 1
        pending = self._land(frames, hosts, out, plan, first_frame, t0,
                             graphed.output_stream if graphed is not None else None)
        if graphed is not None:
            self._speculate(graphed, step.tokens)
        return pending

    # ------------------------------------------------------------------ the step seam: plan -> launch -> complete
    # ``submit`` in three public parts, for a caller that launches several sessions' steps together
    # (``stream.multi.submit_batch``: one batched trunk of several cameras' graphed steps)
    @property
    def owner(self) -> str:
        """The name this session's pages are leased under in a shared storage ("" alone)."""
        return self._owner

    @property
    def batch_group(self) -> SharedGpuState | None:
        """What the sessions on this one's storage share (their batched trunks); None alone."""
        return self._shared

    def batch_key(self, host: Tensor) -> tuple | None:
        """For a checked frame (``check_frame``): the key of the batched steps it can join now
        (sessions whose frames have equal keys may run in one trunk), or None: its one-frame
        phase-2 step at the running resolution has no captured graph on the current storage."""
        if self._shared is None or not self._batchable(host):
            return None
        return (id(self._shared), self._resolution)

    @torch.inference_mode()
    def plan(self, host: Tensor, keyframe: bool | None = None, prepare: bool = False,
             t0: float | None = None) -> PlannedFrame:
        """The first part of ``submit`` for a checked one-frame phase-2 frame: its device copy and
        its step's plan (no cache state changes; CacheFullError, CrossedExtentError as ``submit``
        raises them). ``prepare``: load the plan into its graphed step now (UngraphableStep when it
        cannot: counted as a graph fallback; nothing changed). Older steps in flight are waited for
        until the next may launch."""
        t0 = time.perf_counter() if t0 is None else t0
        frame = self._device_frame(host)[None]
        try:
            step = self._plan_run(frame, self._store_decision(keyframe))
            if prepare and not step.prepared:
                step.graphed.prepare(step.dplan)
                step.prepared = True
        except UngraphableStep as exc:
            self._note_graph_fallback(exc)
            raise
        self._make_room()
        return PlannedFrame(frame, host, step, t0)

    @torch.inference_mode()
    def launch(self, planned: PlannedFrame) -> PendingResults:
        """Launch a planned step on its own (its graph, or eagerly); the rest of ``submit``."""
        return self._launch_planned(planned.frame, [planned.host], planned.step, planned.t0)

    @torch.inference_mode()
    def complete(self, planned: PlannedFrame, outputs) -> PendingResults:
        """A planned step whose graphed trunk ran outside (a batched trunk; ``outputs``: its heads'
        ``StepOutput``): it becomes part of the cache and its outputs start landing, as after
        ``launch``. Counted in ``batched_steps``."""
        self.batched_steps += 1
        return self._complete(planned.frame, [planned.host], outputs, planned.step, planned.t0, planned.graphed)

    # ------------------------------------------------------------------ batched steps (several cameras)
    def _batchable(self, host: Tensor) -> bool:
        """Whether this checked frame can join a batched step now: its one-frame phase-2 step
        at the running resolution has a captured CUDA graph on the current storage."""
        g = self._graphed
        return (g is not None and (g.graph is not None or not g.capture) and not self._pending
                and self._pages is not None and not self._pages.in_phase1
                and self._storage is not None and self._storage.generation == self._pool_generation
                and tuple(host.shape[:2] if host.dtype == torch.uint8 else host.shape[-2:]) == self._resolution)

    def _store_decision(self, keyframe: bool | None) -> bool:
        return self.is_keyframe_index(self._frames_pushed) if keyframe is None else bool(keyframe)

    def _rebind_storage(self) -> None:
        """The shared storage moved (it grew for another owner): view the new allocation (the
        contents were copied to the same offsets); graphs bound to the old one are rebuilt."""
        self.wait()
        self._pool = self._storage.view(self._owner)
        self._graphed, self._next = None, None
        self._pool_generation = self._storage.generation

    def _make_room(self) -> None:
        """Forget settled steps; wait for the oldest ones until fewer than MAX_IN_FLIGHT run."""
        while self._in_flight and (self._in_flight[0].settled or len(self._in_flight) >= MAX_IN_FLIGHT):
            self._in_flight.popleft().result()  # no wait for a settled one

    def _eager_step(self, frames: Tensor, plan: StepPlan, dplan, pool: KVPool, camera: CameraKVCache):
        """The step without a CUDA graph (phase 1, CPU, SDPA, graphs off)."""
        s = frames.shape[0]
        self.backend.begin_step(dplan)
        positions = torch.arange(plan.first_position, plan.first_position + s, device=self.device) if plan.store \
            else torch.full((s,), plan.first_position, device=self.device, dtype=torch.long)
        start = plan.first_position

        def camera_attend(it: int, block: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return camera.attend(it, block, q, k, v, start)

        return self.model.step(frames, positions, PoolAttention(pool, self.backend, dplan.write_slots), camera_attend,
                               phase1=plan.phase1, sequence_start=plan.phase1, options=self.step_options)

    def _speculate(self, graphed: GraphedStep, tokens: int) -> None:
        """Plan the next frame's step as the keyframe policy predicts it and load it into the
        graph while the GPU still runs this one (host work that would otherwise leave the
        GPU idle). ``_run`` uses it only if the next step's plan turns out identical; any
        transition in between (reset, rollback, commit, a forced keyframe decision) just
        makes it plan again, which also overwrites what was loaded here."""
        try:
            plan = self._pages.plan_step(1, self.is_keyframe_index(self._frames_pushed))
        except CacheError:
            return
        dplan = make_device_plan(plan, tokens, self.device)
        try:
            graphed.prepare(dplan)
        except UngraphableStep:
            return  # the step will say so and run without the graph
        self._next = (plan, dplan)

    def _graphed_step(self) -> GraphedStep | None:
        """The captured step for the current pool (``steps.make``), made on first use; None where the
        session's step capture does not apply."""
        if not self._steps_apply:
            return None
        if self._graphed is None:
            self._graphed = self._steps.make(StepSite(
                self.model, self._pool, self._camera, self._pages.num_pages, self._resolution, self.cfg, self.dtype,
                self.step_options, self.backend, self._merge_kernel,
                self._shared.graph_kwargs if self._shared is not None else dict))
        return self._graphed

    def _land(self, frames: Tensor, hosts: list[Tensor], out, plan: StepPlan, first_frame: int, t0: float,
              stream: torch.cuda.Stream | None) -> PendingResults:
        """Start moving a step's outputs to the host; the returned object turns them into
        FrameResults. ``stream``: where the outputs are complete (None: the current stream).

        All outputs go into one host array with one wait; inputs that came as device float
        tensors ride along. On CUDA each part goes by DMA straight into a page-locked
        buffer (no concatenation kernel, no staging through pageable memory); the arrays
        handed out are views of that buffer, which is not reused while any of them is alive
        (``LandingRing``; the outputs are copied out only when all its buffers are in use)."""
        s = frames.shape[0]
        parts = [out.pose_enc.flatten()]
        if out.depth is not None:
            parts += [out.depth.flatten(), out.depth_conf.flatten()]
        parts += [im.flatten() for im in hosts if im.device.type != "cpu" and im.dtype != torch.uint8]
        n = sum(p.numel() for p in parts)
        args = (frames.shape[-2:], s, hosts, out.depth is not None, plan, first_frame, t0)
        if self.device.type != "cuda":
            host = torch.cat([p.float() for p in parts]).numpy()  # cat copies
            return PendingResults(results=self._results(host, False, None, *args))
        if self._landing is None:
            self._landing = LandingRing(LANDING_BUFFERS)
        buf, host, staging = self._landing.acquire(n)
        if staging:
            self.wait()  # a step still in flight may be landing in the staging buffer
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            at = 0
            for p in parts:
                buf[at:at + p.numel()].copy_(p, non_blocking=True)
                at += p.numel()
        event = torch.cuda.Event()  # the step's own: it is waited for long after later steps record theirs
        event.record(stream)

        pending = PendingResults(lambda: self._results(host, staging, event, *args), event)
        self._in_flight.append(pending)
        return pending

    def _results(self, host: np.ndarray, staging: bool, landed: torch.cuda.Event | None, size: tuple[int, int],
                 s: int, hosts: list[Tensor], with_depth: bool, plan: StepPlan, first_frame: int,
                 t0: float) -> list[FrameResult]:
        """FrameResults from a step's outputs in ``host`` once ``landed`` (the copy's event,
        None: already there); ``staging``: copy them out of the shared staging buffer."""
        if landed is not None:
            landed.synchronize()
        t_model = time.perf_counter()
        if staging:
            host = host.copy()
        h, w = size
        pose_enc = host[:s * 9].reshape(s, 9)
        depth = conf = None
        outputs = s * 9
        if with_depth:
            depth = host[s * 9:s * 9 + s * h * w].reshape(s, h, w)
            conf = host[s * 9 + s * h * w:s * 9 + 2 * s * h * w].reshape(s, h, w)
            outputs += 2 * s * h * w
        images, at = [], outputs
        for im in hosts:
            if im.device.type == "cpu":
                images.append(im.numpy() if im.dtype == torch.uint8 else im.float().numpy())  # no copy usually
            elif im.dtype == torch.uint8:
                images.append(im.cpu().numpy())  # a uint8 frame pushed from the device (the wait is behind us)
            else:
                images.append(host[at:at + im.numel()].reshape(im.shape))
                at += im.numel()
        c2w = pose_enc_to_c2w(pose_enc)
        intrinsics = fov_to_intrinsics(pose_enc[:, 7], pose_enc[:, 8], h, w)
        results = [FrameResult(frame_index=first_frame + i, position=plan.positions[i], is_keyframe=plan.store,
                               pose_enc=pose_enc[i], c2w=c2w[i], intrinsics=intrinsics[i],
                               depth=None if depth is None else depth[i],
                               confidence=None if conf is None else conf[i], frame=images[i]) for i in range(s)]
        # model: until the outputs are on the host (on a GPU that includes waiting for it, and
        # for steps submitted before); postprocess: turning them into FrameResults
        t_end = time.perf_counter()
        for r in results:
            r.timings.update(model_ms=(t_model - t0) * 1e3 / s, postprocess_ms=(t_end - t_model) * 1e3 / s)
        return results


__all__ = ["StreamingSession", "PlannedFrame", "SharedGpuState", "FrameResult", "PendingResults", "SessionError",
           "FrameMismatchError", "InvalidFrameError", "CacheError", "CacheFullError"]
