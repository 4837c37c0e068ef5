"""The steps of one streaming session: ``StepRunner``, the paged cache of the running
sequence and what runs on it.

``StreamingSession`` (``stream.session``) checks frames, collects the scale frames and keeps
the public protocol; its ``StepRunner`` owns what every step plans against and writes: the
page table, the K/V pool (its own, or its lease of a ``SharedKVStorage``), the camera cache,
the frame counters, the captured one-frame step with the next step's speculated plan, and the
steps in flight with the page-locked buffers their outputs land in. A step goes
``plan`` (the cache for its size, its page plan and device tensors; no state changes) ->
``execute`` (its graph, or eagerly) -> ``apply`` (the plan becomes part of the cache, the
outputs start landing, the next step is speculated); ``PendingResults`` turns the landed
outputs into FrameResults.
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

from ..cache.attention import UngraphableStep
from ..cache.pages import CacheError, CacheFullError, PageTable, StepPlan
from ..cache.pool import CameraKVCache, KVPool, PoolAttention, PoolFullError, SharedKVStorage, make_device_plan
from ..cache.storage import PrivateStorage
from ..config import SPECIAL_TOKENS, StreamConfig
from ..geometry import fov_to_intrinsics, pose_enc_to_c2w
from ..model.lingbot import LingBotMap, StepOptions
from .errors import FrameMismatchError, SessionError
from .graphs import BatchedTrunk, GraphedStep, HandOff, StepCapture, StepSite
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
    """A step planned but not executed (``StepRunner.plan``)."""

    plan: StepPlan
    dplan: object  # DevicePlan
    prepared: bool  # dplan is already loaded into ``graphed`` (speculated)
    tokens: int  # per frame
    graphed: GraphedStep | None  # the graphed step that may run it (None: eager)


@dataclass
class PlannedFrame:
    """One checked frame's step, planned and not executed (``StreamingSession.plan_step``): run it
    with ``StreamingSession.run_step``, or launch its ``graphed`` step with others (a batched trunk)
    and hand the outputs to ``StreamingSession.finish_batched``."""

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



def is_keyframe_index(cfg: StreamConfig, frame_index: int) -> bool:
    """The interval policy: the scale frames, then every ``keyframe_interval``-th frame."""
    s0 = cfg.num_scale_frames
    return frame_index < s0 or (frame_index - s0) % cfg.keyframe_interval == 0


class StepRunner:
    """One session's cache of its running sequence and the steps that write it (module
    docstring). Driven by its ``StreamingSession`` from one thread; what the session reads of
    it are plain attributes (``pages``, ``pool``, ``camera``, ``resolution``, ``frames_pushed``,
    ``deferred``, ``graphed``, ``speculated``, ``in_flight``, ``graph_fallbacks``), what
    changes it are its methods."""

    def __init__(self, model: LingBotMap, cfg: StreamConfig, device: torch.device, dtype: torch.dtype, backend,
                 options: StepOptions, merge_kernel: bool, steps: StepCapture, shared: SharedGpuState | None,
                 storage: SharedKVStorage | PrivateStorage, owner: str) -> None:
        """``options``: how every step runs, eager or graphed; ``merge_kernel``: FlashInfer's
        split-KV merge runs the Triton kernel; ``steps``: how the one-frame phase-2 step is
        captured; ``shared``: what the sessions on a shared ``storage`` share (None alone);
        ``storage``/``owner``: where the K/V pages are leased, under which name."""
        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.backend = backend
        self.options = options
        self._merge_kernel = merge_kernel
        self._shared = shared
        self._storage, self._owner = storage, owner
        self._pool_generation = -1  # the storage generation self.pool views
        self.pages: PageTable | None = None
        self.pool: KVPool | None = None
        self.camera: CameraKVCache | None = None
        self.resolution: tuple[int, int] | None = None
        self.frames_pushed = 0
        self.deferred = cfg.deferred_eviction
        self._last_stored_frame: int | None = None
        self.graphed: GraphedStep | None = None  # the one-frame step as a CUDA graph (see graphs.py)
        self.graph_fallbacks = 0  # one-frame steps that ran without their graph (UngraphableStep)
        self._steps = steps
        self._steps_apply = steps.applies(cfg, device, backend)  # asked once
        # the next graphed step, planned and loaded while the GPU ran the current one
        self.speculated: tuple[StepPlan, object] | None = None
        self._landing: LandingRing | None = None  # page-locked landing buffers of the outputs (CUDA)
        self.in_flight: deque[PendingResults] = deque()  # submitted, results not yet taken (CUDA)
        self._u8_scale: Tensor | None = None  # 255 on the device (uint8 frames)

    # ------------------------------------------------------------------ transitions
    def reset(self) -> None:
        """Empty the cache; the next frame starts a new sequence (buffers are kept and reused)."""
        if self.pages is not None:
            self.pages.reset()
            self.pages.set_deferred(self.deferred)
        self.frames_pushed = 0
        self._last_stored_frame = None
        self.speculated = None

    def set_deferred(self, deferred: bool) -> None:
        self.deferred = bool(deferred)
        if self.pages is not None:
            self.pages.set_deferred(self.deferred)

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        """``StreamingSession.rollback_last_frame``."""
        if self.pages is None or self._last_stored_frame is None or not self.pages.stats().can_rollback:
            raise SessionError("nothing to roll back")
        if expected_frame_index is not None and expected_frame_index != self._last_stored_frame:
            raise FrameMismatchError(self._last_stored_frame, expected_frame_index)
        frame = self._last_stored_frame
        self.pages.rollback_last()
        was_phase1 = self.pages.in_phase1
        self.frames_pushed = 0 if was_phase1 else frame
        self._last_stored_frame = None
        return frame

    def seek(self, frame_index: int) -> None:
        """Make ``frame_index`` the next frame's index (checked by ``StreamingSession.seek``)."""
        self.frames_pushed = int(frame_index)
        self.speculated = None

    # ------------------------------------------------------------------ frames
    def device_frame(self, host: Tensor) -> Tensor:
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

    def store_decision(self, keyframe: bool | None) -> bool:
        """Whether the next frame is stored: ``keyframe``, or the interval policy when None."""
        return is_keyframe_index(self.cfg, self.frames_pushed) if keyframe is None else bool(keyframe)

    def batchable(self, host: Tensor) -> bool:
        """Whether this checked frame's one-frame phase-2 step at the running resolution has a
        captured CUDA graph on the current storage (``StreamingSession.batch_key``)."""
        g = self.graphed
        return (g is not None and (g.graph is not None or not g.capture)
                and self.pages is not None and not self.pages.in_phase1
                and self._shared is not None and self._storage.generation == self._pool_generation
                and tuple(host.shape[:2] if host.dtype == torch.uint8 else host.shape[-2:]) == self.resolution)

    def _ensure_cache(self, h: int, w: int) -> None:
        if self.resolution == (h, w) and self.pages is not None:
            return
        mcfg, cfg = self.model.cfg, self.cfg
        page_size = (h // mcfg.patch_size) * (w // mcfg.patch_size)
        self.pages = PageTable(page_size, cfg.num_scale_frames, cfg.sliding_window, mcfg.max_frame_num,
                               cfg.max_pending_evictions)
        self.pages.set_deferred(self.deferred)
        self.wait()  # nothing in flight may still read the old pool, graphs or outputs
        self.graphed = None  # bound to the old pool
        self.speculated = None
        self.pool = None  # free the old pool before allocating the new one
        self._storage.release(self._owner)
        try:
            self.pool = self._storage.lease(self._owner, self.pages.num_pages, page_size)
        except PoolFullError as exc:
            self.pages, self.resolution = None, None
            raise CacheFullError(str(exc)) from None
        self._pool_generation = self._storage.generation
        if self.camera is None:
            head_dim = mcfg.camera_dim // mcfg.camera_num_heads
            # fused: its graph-step attention through the Triton kernel
            self.camera = CameraKVCache(cfg.camera_iterations, mcfg.camera_trunk_depth, mcfg.max_frame_num,
                                        mcfg.camera_num_heads, head_dim, torch.float32, self.device,
                                        fused=self.options.fused)
        self.resolution = (h, w)
        log.info("cache for %dx%d: %d pages of %d tokens, %.1f MiB of K/V", w, h, self.pages.num_pages,
                 page_size, self.pool.nbytes / 2**20)

    def _rebind_storage(self) -> None:
        """The shared storage moved (it grew for another owner): view the new allocation (the
        contents were copied to the same offsets); graphs bound to the old one are rebuilt."""
        self.wait()
        self.pool = self._storage.view(self._owner)
        self.graphed, self.speculated = None, None
        self._pool_generation = self._storage.generation

    # ------------------------------------------------------------------ steps: plan -> execute -> apply
    @torch.inference_mode()
    def run(self, frames: Tensor, hosts: list[Tensor], store: bool) -> PendingResults:
        """A whole step of ``frames`` [S, 3, H, W] on the device (``hosts``: as checked)."""
        t0 = time.perf_counter()
        step = self.plan(frames, store)
        self.make_room()
        return self.execute(frames, hosts, step, t0)

    def plan(self, frames: Tensor, store: bool) -> _PlannedStep:
        """Everything of a step before its launch: the cache for the frames' size, the page
        plan (checked against the camera's extent), its device tensors (the speculated ones
        when the plan matches) and the graphed step that may run it. Changes no cache state
        (``PageTable.apply`` comes after the launch); raises CacheFullError when it cannot be
        stored."""
        s, _, h, w = frames.shape
        self._ensure_cache(h, w)
        if self._storage.generation != self._pool_generation:
            self._rebind_storage()
        plan: StepPlan = self.pages.plan_step(s, store)
        # never a page of another camera's extent (a private storage has nothing to refuse)
        self._storage.check_pages(self._owner, plan.read_pages + plan.frame_pages, max(plan.special_slots))
        tokens = SPECIAL_TOKENS + plan.page_size
        speculated, self.speculated = self.speculated, None
        prepared = speculated is not None and speculated[0] == plan
        dplan = speculated[1] if prepared else make_device_plan(plan, tokens, self.device)
        graphed = self._graphed_step() if s == 1 and not plan.phase1 else None
        return _PlannedStep(plan, dplan, prepared, tokens, graphed)

    def execute(self, frames: Tensor, hosts: list[Tensor], step: _PlannedStep, t0: float) -> PendingResults:
        """Run a planned step: its graph, or eagerly (no graph, or it refused the step)."""
        plan, dplan, graphed = step.plan, step.dplan, step.graphed
        out = None
        if graphed is not None:
            try:
                out = graphed.launch(frames, dplan, prepared=step.prepared)
            except UngraphableStep as exc:  # nothing ran yet: this step goes without the graph
                self.note_graph_fallback(exc)
                graphed = None
        if out is None:
            if self.graphed is not None and self.graphed.output_stream is not None:
                # heads of graphed steps still in flight write the camera cache: they go first
                torch.cuda.current_stream(self.device).wait_stream(self.graphed.output_stream)
            out = self._eager_step(frames, plan, dplan, self.pool, self.camera)
        return self.apply(frames, hosts, out, step, t0, graphed)

    def note_graph_fallback(self, exc: Exception) -> None:
        self.graph_fallbacks += 1
        if self.graph_fallbacks == 1 or self.graph_fallbacks % 1000 == 0:
            log.warning("step without its CUDA graph (%d so far): %s", self.graph_fallbacks, exc)

    def apply(self, frames: Tensor, hosts: list[Tensor], out, step: _PlannedStep, t0: float,
              graphed: GraphedStep | None) -> PendingResults:
        """After the step ran: it becomes part of the cache, its outputs start landing, and the
        next step is speculated (graphed steps)."""
        plan = step.plan
        s = frames.shape[0]
        self.pages.apply(plan)  # only now does the step become part of the cache
        first_frame = 0 if plan.phase1 else self.frames_pushed
        self.frames_pushed = first_frame + s
        if plan.store:
            self._last_stored_frame = first_frame + s - 1
        pending = self._land(frames, hosts, out, plan, first_frame, t0,
                             graphed.output_stream if graphed is not None else None)
        if graphed is not None:
            self._speculate(graphed, step.tokens)
        return pending

    def make_room(self) -> None:
        """Forget settled steps; wait for the oldest ones until fewer than MAX_IN_FLIGHT run."""
        while self.in_flight and (self.in_flight[0].settled or len(self.in_flight) >= MAX_IN_FLIGHT):
            self.in_flight.popleft().result()  # no wait for a settled one

    def wait(self) -> None:
        """Take the results of every submitted step onto the host (they stay with their
        ``PendingResults``); the GPU is idle afterwards as far as this session goes."""
        while self.in_flight:
            self.in_flight.popleft().result()

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
                               phase1=plan.phase1, sequence_start=plan.phase1, options=self.options)

    def _speculate(self, graphed: GraphedStep, tokens: int) -> None:
        """Plan the next frame's step as the keyframe policy predicts it and load it into the
        graph while the GPU still runs this one (host work that would otherwise leave the
        GPU idle). ``plan`` uses it only if the next step's plan turns out identical; any
        transition in between (reset, rollback, commit, a forced keyframe decision) just
        makes it plan again, which also overwrites what was loaded here."""
        try:
            plan = self.pages.plan_step(1, is_keyframe_index(self.cfg, self.frames_pushed))
        except CacheError:
            return
        dplan = make_device_plan(plan, tokens, self.device)
        try:
            graphed.prepare(dplan)
        except UngraphableStep:
            return  # the step will say so and run without the graph
        self.speculated = (plan, dplan)

    def _graphed_step(self) -> GraphedStep | None:
        """The captured step for the current pool (``steps.make``), made on first use; None where the
        session's step capture does not apply."""
        if not self._steps_apply:
            return None
        if self.graphed is None:
            self.graphed = self._steps.make(StepSite(
                self.model, self.pool, self.camera, self.pages.num_pages, self.resolution, self.cfg, self.dtype,
                self.options, self.backend, self._merge_kernel,
                self._shared.graph_kwargs if self._shared is not None else dict))
        return self.graphed

    # ------------------------------------------------------------------ results
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
        self.in_flight.append(pending)
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


__all__ = ["StepRunner", "PendingResults", "PlannedFrame", "SharedGpuState", "is_keyframe_index", "MAX_IN_FLIGHT",
           "LANDING_BUFFERS"]
