"""StreamingSession: the model, the paged cache and the streaming policy in one owner.

This is one window of the model: ``LongStreamSession`` (the session the node and the command
line hold) cuts a stream into windows of it. ``step(frame)`` takes one checked frame
(``check_frame``: layout, size, the running sequence's resolution; a refused one raises
``InvalidFrameError`` and changes nothing) and returns a ``PendingResults``: nothing while the
scale frames are being collected, all of them when phase 1 runs, then one result per frame.
Stepping the next frame before taking the results keeps the GPU busy (a frame's heads then run
beside the next frame's trunk, and the host's work on results overlaps the GPU). ``submit`` is
``check_frame`` + ``step``, ``push`` waits for the results too. Keyframes follow the interval
policy unless the caller decides (``keyframe=``). External keyframe logic uses
``set_deferred_eviction``, ``commit_eviction`` and ``rollback_last_frame``; ``reset`` starts a
new sequence. Every transition is a method of this object; a step that raises leaves the cache
as it was. ``stream.multi.submit_batch`` drives the step seam ``plan_step`` -> ``run_step`` |
``finish_batched``.

The session checks frames, collects the scale frames and keeps the protocol; the cache
of the running sequence and the steps that write it (planning, eager or graphed launches,
speculation, landing the outputs, FrameResults) are its ``StepRunner`` (``stream.steps``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .. import kernels
from ..cache.attention import AttentionBackend, UngraphableStep, make_backend
from ..cache.pages import CacheError, CacheFullError, CacheStats
from ..cache.pool import SharedKVStorage
from ..cache.storage import PrivateStorage
from ..config import SPECIAL_TOKENS, StreamConfig
from ..kernels.fp8_gemm import quantize_linears_
from ..model.lingbot import LingBotMap, StepOptions
from .errors import FrameMismatchError, InvalidFrameError, SessionError
from .graphs import CudaGraphSteps, StepCapture
from .results import FrameResult
from .steps import PendingResults, PlannedFrame, SharedGpuState, StepRunner, is_keyframe_index

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


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


def _resolve_kernels(model: LingBotMap, cfg: StreamConfig, device: torch.device, dtype: torch.dtype
                     ) -> tuple[bool, bool]:
    """(fused, triton): whether a session runs the Triton kernels of the model's step
    (``cfg.fused_kernels``, CUDA, bf16, and they pass ``kernels.self_check`` here), and
    whether Triton kernels run here at all (False once the self-check failed). Decided
    once; the result is handed to everything that launches a kernel."""
    triton = kernels.available(device)
    if not (cfg.fused_kernels and dtype == torch.bfloat16 and triton):
        return False, triton
    mcfg = model.cfg
    problem = kernels.self_check(device, mcfg.num_heads, mcfg.head_dim, (mcfg.embed_dim, mcfg.dino_dim))
    if problem is not None:
        log.warning("the Triton kernels cannot be used here (%s); running the PyTorch path instead", problem)
        return False, False
    return True, True


def _step_options(model: LingBotMap, cfg: StreamConfig, device: torch.device, dtype: torch.dtype, fused: bool,
                  with_depth: bool) -> StepOptions:
    """The StepOptions of a session: bf16 streams on CUDA get the heads' reduced-precision
    copies (the depth head's bf16 channels-last copy; with the kernels, the camera head's
    copy with bf16 weights read by one matrix-vector kernel per product: the PyTorch twin
    would convert the weights on every call) and the camera head its own CUDA stream
    beside the depth head. The model's own heads stay float32 (``place_heads`` parks them in
    host memory while no session runs them)."""
    cuda = device.type == "cuda"
    depth_head = camera_head = None
    if cfg.bf16_depth_head and dtype == torch.bfloat16 and cuda:
        fast_upsample = fast_norm = None
        if fused:
            from ..kernels.layer_norm import layer_norm as fast_norm
            from ..kernels.upsample import upsample_bilinear as fast_upsample
        # made where the model's head is (host memory when ``place_heads`` parked it), used on the device
        depth_head = model.depth_head.reduced_precision_copy(upsample=fast_upsample, norm_to=fast_norm).to(device)
    if cfg.bf16_camera_head and fused:
        from ..kernels.gemv import gemv

        camera_head = model.camera_head.reduced_precision_copy(gemv=gemv).to(device)
    head_stream = torch.cuda.Stream(device) if cfg.parallel_heads and with_depth and cuda else None
    return StepOptions(camera_iterations=cfg.camera_iterations,
                       autocast_dtype=dtype if dtype != torch.float32 else None,
                       with_depth=with_depth, fused=fused, depth_head=depth_head, camera_head=camera_head,
                       head_stream=head_stream)


HEADS = ("camera_head", "depth_head")
# per model: the sessions whose steps run the model's own float32 head, by head (``place_heads``)
_HEAD_USERS: "weakref.WeakKeyDictionary[LingBotMap, dict[str, weakref.WeakSet]]" = weakref.WeakKeyDictionary()
PARKED = torch.device("cpu")


def _move_module(module: torch.nn.Module, device: torch.device) -> None:
    first = next(module.parameters(), None)
    if first is not None and first.device != device:
        module.to(device)


def place_heads(model: LingBotMap, device: torch.device, options: StepOptions, user: object,
                move: Callable[[torch.nn.Module, torch.device], None] = _move_module) -> None:
    """Keep each of the model's float32 heads on ``device`` only while a session runs it.

    A CUDA bf16 stream runs the heads' reduced-precision copies (``_step_options``); the
    float32 originals (the camera head alone is 0.8 GiB at the released size) then sit idle
    on the GPU. ``user`` (a session) says which heads its steps run (``options``): a head it
    runs is brought (back) to ``device`` and ``user`` is remembered as needing it while it
    lives; a head that no live session needs is parked in host memory. Other devices: nothing
    moves. ``move``: how a head changes place (a test's stand-in)."""
    if device.type != "cuda":
        return
    users = _HEAD_USERS.get(model)
    if users is None:
        users = _HEAD_USERS[model] = {name: weakref.WeakSet() for name in HEADS}
    needs = {"camera_head": options.camera_head is None,
             "depth_head": options.with_depth and options.depth_head is None}
    for name in HEADS:
        head = getattr(model, name)
        if needs[name]:
            users[name].add(user)
            move(head, device)
        else:
            users[name].discard(user)
            if not users[name]:
                move(head, PARKED)


class StreamingSession:
    window_index = 0  # cache restarts since reset: always 0, one window (``LongStreamSession`` restarts windows)

    def __init__(self, model: LingBotMap, cfg: StreamConfig, backend: AttentionBackend | None = None,
                 with_depth: bool = True, storage: SharedKVStorage | None = None, owner: str = "",
                 share_from: StreamingSession | None = None, steps: StepCapture | None = None,
                 fused: bool | None = None) -> None:
        """``storage``/``owner``: take the K/V pages from that shared storage under that name
        (several cameras, ``stream.multi``); None: a ``PrivateStorage`` of its own.
        ``share_from``: a session on the same model whose step options (the heads'
        reduced-precision copies, the head stream, the kernel decision) this one reuses,
        so N sessions hold one copy of the weights; both are driven from one thread.
        ``steps``: how the one-frame phase-2 step is captured (default ``CudaGraphSteps``:
        CUDA graphs where they apply, else eager steps). ``fused``: whether the step runs the
        Triton kernels (None: decided here, ``_resolve_kernels``; a test forces it to run the
        kernels' PyTorch twins on the CPU). The cache and the steps themselves are its
        ``StepRunner``'s (``stream.steps``)."""
        self.model = model.eval()
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.dtype = torch_dtype(cfg.dtype)
        agg_dtype = next(model.aggregator.parameters()).dtype
        if agg_dtype != self.dtype:
            raise SessionError(f"the model's aggregator is {agg_dtype} but the stream dtype is {cfg.dtype}; "
                               "load the model with the same dtype (io.checkpoint.load_model(dtype=...))")
        _apply_precision(model, cfg)
        if share_from is not None:
            if share_from.model is not model or share_from.dtype != self.dtype or \
                    share_from.step_options.with_depth != with_depth:
                raise SessionError("share_from must be a session on the same model, dtype and depth setting")
            resolved, triton = share_from.step_options.fused, share_from.merge_kernel
        else:
            resolved, triton = _resolve_kernels(model, cfg, self.device, self.dtype)
        self.merge_kernel = triton  # FlashInfer's split-KV merge: the Triton kernel wherever Triton runs here
        shared = share_from.batch_group if share_from is not None else None
        if backend is None and share_from is not None and share_from.cfg.backend == cfg.backend \
                and share_from.cfg.kv_splits == cfg.kv_splits and share_from.cfg.fa3_tiles == cfg.fa3_tiles:
            backend = share_from.backend  # the eager steps (phase 1, fallbacks) run in turn: one backend, one set of buffers
        self.backend = backend or make_backend(cfg.backend, self.device, self.dtype, kv_splits=cfg.kv_splits,
                                               fa3_tiles=cfg.fa3_tiles, fused_merge=triton,
                                               workspace=None if shared is None else shared.workspace)
        # what sessions on one storage share besides the weights, their batched trunks (None: a session on its own)
        self.batch_group: SharedGpuState | None = shared or (
            SharedGpuState(getattr(self.backend, "workspace", None)) if storage is not None else None)
        if share_from is not None:
            options = share_from.step_options
        else:
            options = _step_options(model, cfg, self.device, self.dtype, resolved, with_depth)
            if fused is not None and fused != options.fused:
                options = dataclasses.replace(options, fused=fused)
        place_heads(model, self.device, options, self)
        if storage is not None and cfg.kv_cache_dtype == "fp8":
            raise SessionError("kv_cache_dtype 'fp8' is for a single camera: several cameras share one bf16 K/V "
                               "storage; use kv_cache_dtype 'auto'")
        self.owner = owner  # the name this session's pages are leased under in a shared storage ("" alone)
        self._scale_frames: list[tuple[Tensor, Tensor]] = []  # the scale frames so far (device, as checked)
        self.batched_steps = 0  # one-frame steps that ran in a batched trunk with other cameras' (submit_batch)
        mcfg = model.cfg
        if storage is None:
            storage = PrivateStorage(mcfg.depth, mcfg.num_heads, mcfg.head_dim, self.dtype, self.device,
                                     cfg.kv_cache_dtype, fused=triton)
        self._runner = StepRunner(model, cfg, self.device, self.dtype, self.backend, options, triton,
                                  steps if steps is not None else CudaGraphSteps(), self.batch_group, storage, owner)

    # ------------------------------------------------------------------ state
    @property
    def step_options(self) -> StepOptions:
        """How every step runs, eager or graphed (decided at construction)."""
        return self._runner.options

    @property
    def resolution(self) -> tuple[int, int] | None:
        return self._runner.resolution

    @property
    def frames_pushed(self) -> int:
        return self._runner.frames_pushed

    @property
    def deferred_eviction(self) -> bool:
        return self._runner.deferred

    @property
    def graph_fallbacks(self) -> int:
        """One-frame steps that ran without their graph (UngraphableStep)."""
        return self._runner.graph_fallbacks

    def stats(self) -> CacheStats | None:
        pages = self._runner.pages
        return pages.stats() if pages is not None else None

    def is_keyframe_index(self, frame_index: int) -> bool:
        return is_keyframe_index(self.cfg, frame_index)

    # ------------------------------------------------------------------ transitions
    @property
    def scale_frames_waiting(self) -> int:
        """Scale frames collected for the next phase-1 step (0 once it ran, or after it failed)."""
        return len(self._scale_frames)

    def reset(self) -> None:
        """Empty the cache; the next frame starts a new sequence (buffers are kept and reused)."""
        self._runner.reset()
        self._scale_frames.clear()

    def set_deferred_eviction(self, deferred: bool) -> None:
        self._runner.set_deferred(deferred)

    def commit_eviction(self) -> int:
        """Perform the pending evictions; returns pages freed (0 when nothing was pending)."""
        pages = self._runner.pages
        return pages.commit() if pages is not None else 0

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        """Remove the most recently stored frame from the cache; returns its frame index.

        ``expected_frame_index`` guards against removing another frame than the caller
        meant. Raises SessionError (state unchanged) when there is nothing to roll back
        or the index does not match. Rolling back the scale frames removes all of them.
        """
        return self._runner.rollback_last_frame(expected_frame_index)

    def seek(self, frame_index: int) -> None:
        """Make ``frame_index`` the next frame's index without running a step (journal replay,
        ``journal.resume``: the frames in between were attended only, which changes nothing in
        the cache). After the scale frames, forward only; SessionError otherwise."""
        pages = self._runner.pages
        if pages is None or pages.in_phase1 or self._scale_frames:
            raise SessionError("seek: the scale frames have not run yet")
        if frame_index < self.frames_pushed:
            raise SessionError(f"seek: frame {frame_index} is before the next frame {self.frames_pushed}")
        self._runner.seek(frame_index)

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
        """``push`` without waiting for the results: ``step(check_frame(image), keyframe)``."""
        return self.step(self.check_frame(image), keyframe)

    def step(self, host: Tensor, keyframe: bool | None = None) -> PendingResults:
        """Plan and launch the step of a frame ``check_frame`` accepted (``host``: as it returned
        it); its results come from the returned object's ``result()``. The cache state (frame
        indices, rollback, commit) moves on at once. Step frame t+1 before taking frame t's
        results to keep the GPU busy; at most ``MAX_IN_FLIGHT`` steps are left running (a step
        waits for an older one first)."""
        runner = self._runner
        frame = runner.device_frame(host)
        if runner.pages is None or runner.pages.in_phase1:
            self._scale_frames.append((frame, host))
            if len(self._scale_frames) < self.cfg.num_scale_frames:
                return PendingResults(results=[])
            frames = torch.stack([f for f, _ in self._scale_frames])
            hosts = [h for _, h in self._scale_frames]
            try:
                return runner.run(frames, hosts, store=True)
            finally:
                self._scale_frames.clear()
        return runner.run(frame[None], [host], store=runner.store_decision(keyframe))

    def wait(self) -> None:
        """Take the results of every submitted step onto the host (they stay with their
        ``PendingResults``); the GPU is idle afterwards as far as this session goes."""
        self._runner.wait()

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
        expected = resolution
        if not expected:  # the running sequence's (None at its start)
            pages = self._runner.pages
            expected = tuple(self._scale_frames[0][0].shape[-2:]) if self._scale_frames else \
                None if pages is None or pages.in_phase1 else self._runner.resolution
        if expected is not None and (h, w) != tuple(expected):
            raise InvalidFrameError(f"image size changed: {w}x{h}, the sequence's frames are {expected[1]}x"
                                    f"{expected[0]}; reset the session to change resolution")
        return image

    # ------------------------------------------------------------------ the step seam: plan_step -> run_step | finish_batched
    # ``step`` in public parts, for a caller that launches several sessions' steps together
    # (``stream.multi.submit_batch``: one batched trunk of several cameras' graphed steps); ``owner``
    # and ``batch_group`` (attributes) name the session's lease and what the sessions on its storage share
    def batch_key(self, host: Tensor) -> tuple | None:
        """For a checked frame (``check_frame``): the key of the batched steps it can join now
        (sessions whose frames have equal keys may run in one trunk), or None: its one-frame
        phase-2 step at the running resolution has no captured graph on the current storage."""
        if self.batch_group is None or self._scale_frames or not self._runner.batchable(host):
            return None
        return (id(self.batch_group), self.resolution)

    @torch.inference_mode()
    def plan_step(self, host: Tensor, keyframe: bool | None = None, prepare: bool = False,
                  t0: float | None = None) -> PlannedFrame:
        """The first part of ``step`` for a checked one-frame phase-2 frame: its device copy and
        its step's plan (no cache state changes; CacheFullError, CrossedExtentError as ``step``
        raises them). ``prepare``: load the plan into its graphed step now (UngraphableStep when it
        cannot: counted as a graph fallback; nothing changed). Older steps in flight are waited for
        until the next may launch."""
        t0 = time.perf_counter() if t0 is None else t0
        runner = self._runner
        frame = runner.device_frame(host)[None]
        try:
            step = runner.plan(frame, runner.store_decision(keyframe))
            if prepare and not step.prepared:
                step.graphed.prepare(step.dplan)
                step.prepared = True
        except UngraphableStep as exc:
            runner.note_graph_fallback(exc)
            raise
        runner.make_room()
        return PlannedFrame(frame, host, step, t0)

    @torch.inference_mode()
    def run_step(self, planned: PlannedFrame) -> PendingResults:
        """Run a planned step on its own (its graph, or eagerly); the rest of ``step``."""
        return self._runner.execute(planned.frame, [planned.host], planned.step, planned.t0)

    @torch.inference_mode()
    def finish_batched(self, planned: PlannedFrame, outputs) -> PendingResults:
        """A planned step whose graphed trunk ran outside (a batched trunk; ``outputs``: its heads'
        ``StepOutput``): it becomes part of the cache and its outputs start landing, as after
        ``run_step``. Counted in ``batched_steps``."""
        self.batched_steps += 1
        return self._runner.apply(planned.frame, [planned.host], outputs, planned.step, planned.t0,
                                  planned.graphed)


__all__ = ["StreamingSession", "PlannedFrame", "SharedGpuState", "FrameResult", "PendingResults", "SessionError",
           "FrameMismatchError", "InvalidFrameError", "CacheError", "CacheFullError"]
