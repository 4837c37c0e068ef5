"""The steady-state one-frame step as CUDA graphs (phase 2, S = 1, one resolution).

A phase-2 step launches thousands of small kernels (24 DINO blocks, 24 frame and 24
global blocks, 4 x 4 camera-trunk blocks, the DPT head); launched from Python they
leave the GPU idle between kernels. ``GraphedStep`` captures the whole step (the
aggregator with its K/V pool writes and FlashInfer attention, the camera head and the
depth head) once and replays it for every later frame.

What changes from frame to frame lives in static device buffers that the graph reads:

* ``image`` [1, 3, H, W] float32, ``positions`` [1] long (the frame's temporal index),
  ``write_slots`` [P] long (the pool slots of its tokens), copied in before a replay;
* FlashInfer's plan: the wrapper runs in CUDA-graph mode (indptr, page indices and
  last-page length in preallocated buffers, see ``FlashInferBackend(graph_pages=...)``)
  and ``plan()`` runs on the host before every replay;
* the camera head attends over the camera cache up to the position it reads from the
  device (``CameraKVCache.attend_at``: one Triton kernel, or matrix-vector products over
  every slot with a mask), so no Python int sets a shape or an offset inside the graph.

The step is captured as two graphs: the trunk (DINO and the aggregator, which write the
cache) on the caller's stream, and the heads on a stream of their own
(``output_stream``). A replay hands the trunk's 4 levels and the frame's position over
to buffers that only the heads graph reads (a ~16 MB device copy), so the next frame's
trunk can start as soon as that copy ran, while this frame's heads still run: with
frames queued (``StreamingSession.submit``), the heads of frame t overlap the trunk of
frame t+1 instead of adding to every frame's time.

Everything else (phase 1, attend steps of other shapes, the SDPA backend, CPU) stays
eager. Replaying writes the same slots an eager step would, so the cache bookkeeping
(``PageTable``) is unaware of graphs; the graph stays valid across ``reset``,
rollback and eviction because no buffer moves. It is bound to one K/V pool: a new
resolution (a new pool) needs a new ``GraphedStep``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

from ..cache.flashinfer_backend import FlashInferBackend
from ..cache.varlen import FlashVarlenBackend
from ..cache.pool import CameraKVCache, DevicePlan, FramewiseAttention, KVPool, PoolAttention
from ..config import FA3_TILES, StreamConfig
from ..model.lingbot import LingBotMap, StepOptions, StepOutput

log = logging.getLogger(__name__)


_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of the eager run before every capture (one per device, reused).

    A stream that runs a matrix product gets a cuBLAS workspace of its own (32 MiB on an
    H200), which PyTorch keeps for the life of the process; a fresh stream per capture
    (a camera set's batched trunk, a graph rebuilt for another resolution) would keep one
    more each time. Measured on the H200 (``benchmarks/stream/memory_probe.py``): 33-99 MiB
    stayed allocated after every dropped session until the workspaces were cleared, then
    the baseline was back within 4 MiB. Captures run from one thread at a time; the
    stream's users wait for the caller's stream and the caller waits for them."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _warmup_streams.get(device)
    if stream is None:
        stream = _warmup_streams[device] = torch.cuda.Stream(device)
    return stream


def capture_trunk(run, pool, after_warmup=None) -> tuple[torch.cuda.CUDAGraph, list[Tensor]]:
    """``run()`` (a trunk: it returns its levels) once eagerly on the warm-up stream (as
    torch.cuda.graph wants; ``after_warmup(levels)`` may use that run's levels there), then
    captured in graph pool ``pool``; returns the graph and its static levels. Both runs do
    the step of the frame loaded now: they write the same K/V into the same slots as the
    replay that follows, so the extra runs change nothing."""
    current = torch.cuda.current_stream()
    side = warmup_stream(current.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        levels = run()
        if after_warmup is not None:
            after_warmup(levels)
    current.wait_stream(side)
    del levels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads may use CUDA
        levels = run()
    return graph, levels


class HandOff:
    """When the heads stream last took a trunk graph's levels (an event on the output stream).

    Trunk graphs that share a memory pool (several cameras' steps, their batched trunks) may
    reuse one another's temporaries: a graph captured earlier can write, as scratch, where a
    later graph keeps its levels. So no trunk replays in that pool before the heads stream
    has copied the levels of the trunk replayed before it; every trunk sharing the pool waits
    for the same hand-off. With one step alone this is its own previous hand-off, as before:
    the heads of frame t still overlap the trunk of frame t+1.
    """

    def __init__(self) -> None:
        self._event = torch.cuda.Event()
        self._recorded = False

    def wait(self, stream: torch.cuda.Stream) -> None:
        """``stream`` waits until the last recorded hand-off ran (nothing before the first)."""
        if self._recorded:
            stream.wait_event(self._event)

    def record(self, stream: torch.cuda.Stream) -> None:
        """The levels were handed over on ``stream`` (call after the copies are enqueued there)."""
        self._event.record(stream)
        self._recorded = True


class GraphedStep:
    """One phase-2 frame at one resolution: eager warm-up, capture on first use, then replay.

    ``options``: the stream's ``StepOptions`` (those of its eager steps; a ``head_stream`` is
    forked and joined inside the heads graph). ``capture=False`` runs the same static-shape
    computation eagerly on every call (used where graphs are unavailable, and to test the
    static path itself).
    """

    def __init__(self, model: LingBotMap, pool: KVPool, camera: CameraKVCache, backend, resolution: tuple[int, int],
                 options: StepOptions, *, capture: bool = True, trunk_pool=None, heads_pool=None,
                 output_stream: torch.cuda.Stream | None = None, hand_off: HandOff | None = None) -> None:
        self.model, self.pool, self.camera, self.backend = model, pool, camera, backend
        # the trunk graph's memory pool: its own (None), or one shared by graphs whose trunks
        # replay in turn on one stream (several cameras): only one of them is live at a time
        self.trunk_pool = trunk_pool
        # likewise the heads graph's pool, shared only by steps that also share ``output_stream``
        # (their heads then run one after another there)
        if heads_pool is not None and output_stream is None:
            raise ValueError("a shared heads pool needs a shared output stream")
        self.heads_pool = heads_pool
        if hand_off is not None and trunk_pool is None:
            raise ValueError("a shared hand-off goes with a shared trunk pool")
        self.resolution = resolution
        self.options = options
        self.capture = capture
        device = pool.k.device
        h, w = resolution
        self.image = torch.zeros(1, 3, h, w, dtype=torch.float32, device=device)
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.write_slots = torch.zeros(model.cfg.tokens_per_frame(h, w), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None  # the trunk
        self.heads_graph: torch.cuda.CUDAGraph | None = None
        # the heads' inputs: the trunk's levels and the frame's position, handed over per replay
        self.head_positions = torch.zeros(1, dtype=torch.long, device=device)
        self._head_levels: list[Tensor] | None = None
        self._levels: list[Tensor] | None = None  # the trunk graph's outputs
        # where the heads graph runs and the outputs are ready (None: the caller's stream)
        self.output_stream = (output_stream or torch.cuda.Stream(device)) if capture else None
        # when the heads stream took the last levels of a trunk in this step's graph pool
        self.hand_off = (hand_off or HandOff()) if capture else None
        self._out: StepOutput | None = None
        self._prepared = None  # the StepPlan whose slots and FlashInfer plan are loaded
        self.replays = 0

    def prepare(self, dplan: DevicePlan) -> None:
        """Load a step's plan into the graph's buffers: its write slots, and FlashInfer's plan()
        (host work). Stream-ordered: a replay already launched still sees the previous plan,
        so the next step can be prepared while the GPU runs the current one."""
        plan = dplan.plan
        if plan.phase1 or plan.num_frames != 1:
            raise ValueError("GraphedStep takes one phase-2 frame at its own resolution")
        self.write_slots.copy_(dplan.write_slots, non_blocking=True)
        self.backend.begin_step(dplan)
        if hasattr(self.backend, "prepare"):
            self.backend.prepare(self.pool.layer_view(0)[0])  # FlashInfer plan(), host side, before the replay
        self._prepared = plan

    def __call__(self, frame: Tensor, dplan: DevicePlan, prepared: bool = False) -> StepOutput:
        """``launch``, then the caller's stream waits for the outputs."""
        out = self.launch(frame, dplan, prepared)
        if self.output_stream is not None:
            torch.cuda.current_stream(self.image.device).wait_stream(self.output_stream)
        return out

    def launch(self, frame: Tensor, dplan: DevicePlan, prepared: bool = False) -> StepOutput:
        """frame [1, 3, H, W] float32 on the device; dplan of a one-frame phase-2 step
        (``prepared``: ``prepare(dplan)`` already ran for it). Returns the step's outputs in
        static tensors (overwritten by the next launch), complete in the order of
        ``output_stream`` (the caller's stream when that is None); the cache writes are
        ordered on the caller's stream."""
        plan = dplan.plan
        if tuple(frame.shape[-2:]) != self.resolution:
            raise ValueError("GraphedStep takes one phase-2 frame at its own resolution")
        self.take_plan(dplan, prepared)
        if self.capture:  # the heads have taken the previous trunk's levels (and this step's position)
            self.hand_off.wait(torch.cuda.current_stream(self.image.device))
        self.image.copy_(frame, non_blocking=True)
        self.positions.fill_(plan.first_position)  # == plan.positions[0] for stored and attend-only frames
        if not self.capture:
            return self._forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        current, heads = torch.cuda.current_stream(self.image.device), self.output_stream
        heads.wait_stream(current)
        with torch.cuda.stream(heads):
            self.hand_over(self._levels, self.positions)
            self.hand_off.record(heads)
            self.heads_graph.replay()
        self.replays += 1
        return self._out

    def take_plan(self, dplan: DevicePlan, prepared: bool = True) -> None:
        """Make ``dplan`` the plan of the next replay: loaded by ``prepare`` unless it already is
        (``prepared`` and the last one loaded), then marked as taken (the next step must load
        its own)."""
        if not prepared or self._prepared is not dplan.plan:
            self.prepare(dplan)
        self._prepared = None

    def hand_over(self, levels: list[Tensor], positions: Tensor) -> None:
        """Copy a trunk's levels [1, P, 2C] and the frame's position [1] into the heads graph's
        inputs (on the current stream: the output stream during a replay)."""
        for dst, src in zip(self._head_levels, levels):
            dst.copy_(src)
        self.head_positions.copy_(positions)

    def replay_heads(self) -> StepOutput:
        """Replay the captured heads graph on the inputs last handed over; its static outputs
        (on the current stream, the output stream; the caller moves them off, e.g. lands
        them, before another heads graph of the shared heads pool replays: an earlier captured
        one may use their memory as scratch)."""
        self.heads_graph.replay()
        self.replays += 1
        return self._out

    def heads(self, levels: list[Tensor], positions: Tensor) -> StepOutput:
        """The heads on ``levels`` eagerly (the static-shape path without capture)."""
        return self._heads(levels, positions)

    def _trunk(self) -> list[Tensor]:
        return self.model.trunk(self.image, self.positions, PoolAttention(self.pool, self.backend, self.write_slots),
                                phase1=False, sequence_start=False, options=self.options)

    def _heads(self, levels: list[Tensor], positions: Tensor) -> StepOutput:
        camera = self.camera
        bias = camera.visible_bias(positions)

        def camera_attend(it: int, block: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return camera.attend_at(it, block, q, k, v, positions, bias)

        h, w = self.resolution
        return self.model.heads(levels, h, w, camera_attend, self.options)

    def _forward(self) -> StepOutput:
        return self._heads(self._trunk(), self.positions)

    def _capture(self) -> None:
        def warm_heads(levels: list[Tensor]) -> None:  # the heads' eager run, on the warm-up's levels
            if self._head_levels is None:
                self._head_levels = [torch.empty_like(lv) for lv in levels]
            self.hand_over(levels, self.positions)
            self._heads(self._head_levels, self.head_positions)

        current = torch.cuda.current_stream()
        trunk, levels = capture_trunk(self._trunk, self.trunk_pool, warm_heads)
        heads = torch.cuda.CUDAGraph()
        self.output_stream.wait_stream(current)
        # a pool of its own: it runs beside the trunk graph, so their memory must not overlap
        with torch.cuda.graph(heads, pool=self.heads_pool, stream=self.output_stream,
                              capture_error_mode="thread_local"):
            out = self._heads(self._head_levels, self.head_positions)
        current.wait_stream(self.output_stream)
        self.graph, self.heads_graph, self._levels, self._out = trunk, heads, levels, out
        log.info("captured the one-frame step at %dx%d in CUDA graphs (trunk, heads)", self.resolution[1],
                 self.resolution[0])


class BatchedTrunk:
    """The trunks of several cameras' one-frame steps in one pass: one CUDA graph for this
    set of cameras (their GraphedSteps, in this order), then each camera's own heads graph.

    Dense layers (DINO, the frame blocks, every projection and MLP) run on all frames at
    once, where the matrix products fill the GPU better than one frame's ~1000 rows do;
    global attention stays per camera (``FramewiseAttention``: frame i writes and reads
    only its camera's pool, through that camera's FlashInfer plan, which
    ``GraphedStep.prepare`` loaded). ``launch`` replays the trunk and hands each camera's
    levels and position to its own heads graph's inputs (on the shared output stream);
    ``heads(i)`` then replays camera i's heads graph there, so a camera's outputs, its
    camera-head cache and its landing are those of its own ``GraphedStep``. The caller lands
    camera i's outputs before it asks for camera i+1's heads (the heads graphs share a
    memory pool: see ``GraphedStep.replay_heads``).

    The steps must share the model, resolution, step options, output stream, trunk pool and
    hand-off, and each must have captured its own graphs (its heads graph is replayed here).
    ``capture=False`` runs the same computation eagerly (CPU tests of the batched maths).
    """

    def __init__(self, steps: list[GraphedStep], *, capture: bool = True, trunk_pool=None) -> None:
        if len(steps) < 2:
            raise ValueError("a batched trunk needs at least two cameras' steps")
        first = steps[0]
        for st in steps[1:]:
            if st.model is not first.model or st.resolution != first.resolution or st.options is not first.options:
                raise ValueError("batched steps must share the model, the resolution and the step options")
            if st.output_stream is not first.output_stream or st.hand_off is not first.hand_off:
                raise ValueError("batched steps must share their output stream and their hand-off")
        if capture and any(st.heads_graph is None for st in steps):
            raise ValueError("every step must have captured its own graphs before it joins a batch")
        if capture and (trunk_pool is None or any(st.trunk_pool is not trunk_pool for st in steps)):
            raise ValueError("a batched trunk is captured in the trunk pool that its cameras' steps share")
        self.steps = list(steps)
        self.model, self.options, self.resolution = first.model, first.options, first.resolution
        self.capture, self.trunk_pool = capture, trunk_pool
        self.hand_off = first.hand_off
        device = first.image.device
        h, w = first.resolution
        self.image = torch.zeros(len(steps), 3, h, w, dtype=torch.float32, device=device)
        self.positions = torch.zeros(len(steps), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._levels: list[Tensor] | None = None
        self._eager_levels: list[Tensor] | None = None  # capture=False: the last launch's levels
        self.replays = 0

    def launch(self, frames: list[Tensor], dplans: list[DevicePlan]) -> None:
        """frames[i] [1, 3, H, W] float32 of camera i; dplans[i] its one-frame phase-2 plan (loaded
        into its step here unless already: ``GraphedStep.take_plan``). Replays the trunk (K/V
        writes on the caller's stream) and hands the levels over; ``heads(i)`` gives the outputs."""
        if len(frames) != len(self.steps) or len(dplans) != len(self.steps):
            raise ValueError(f"a batch of {len(self.steps)} cameras takes {len(self.steps)} frames and plans")
        for step, dplan in zip(self.steps, dplans):
            step.take_plan(dplan)
        current = torch.cuda.current_stream(self.image.device) if self.capture else None
        if self.capture:  # the heads have taken the previous trunk's levels (and positions)
            self.hand_off.wait(current)
        for i, (frame, dplan) in enumerate(zip(frames, dplans)):
            self.image[i].copy_(frame.reshape(self.image.shape[1:]), non_blocking=True)
            self.positions[i].fill_(dplan.plan.first_position)
        if not self.capture:
            self._eager_levels = self._trunk()
            return
        if self.graph is None:
            self._capture()
        self.graph.replay()
        heads = self.steps[0].output_stream
        heads.wait_stream(current)
        with torch.cuda.stream(heads):
            for i, step in enumerate(self.steps):
                step.hand_over([lv[i:i + 1] for lv in self._levels], self.positions[i:i + 1])
            self.hand_off.record(heads)  # the next trunk replay may overwrite the levels
        self.replays += 1

    def heads(self, i: int) -> StepOutput:
        """Camera i's outputs from the last launch: its heads graph replayed on the output stream
        (its static tensors, complete in that stream's order), or computed eagerly."""
        step = self.steps[i]
        if not self.capture:
            return step.heads([lv[i:i + 1] for lv in self._eager_levels], self.positions[i:i + 1])
        with torch.cuda.stream(step.output_stream):
            return step.replay_heads()

    def _trunk(self) -> list[Tensor]:
        attend = FramewiseAttention([PoolAttention(st.pool, st.backend, st.write_slots) for st in self.steps])
        return self.model.trunk(self.image, self.positions, attend, phase1=False, sequence_start=False,
                                options=self.options)

    def _capture(self) -> None:
        self.graph, self._levels = capture_trunk(self._trunk, self.trunk_pool)
        log.info("captured the trunk of %d cameras' steps at %dx%d in one CUDA graph", len(self.steps),
                 self.resolution[1], self.resolution[0])


def graphable(backend) -> bool:
    """Whether a backend's step can be captured (``make_graphed_step`` builds a graph-mode twin):
    FlashInfer's, and ``sdpa`` in its FlashAttention varlen form; not the gather form."""
    return isinstance(backend, (FlashInferBackend, FlashVarlenBackend))


def make_graphed_step(model: LingBotMap, pool: KVPool, camera: CameraKVCache, num_pages: int,
                      resolution: tuple[int, int], variant: str, dtype: torch.dtype, options: StepOptions, *,
                      kv_splits: int | None = None, min_pages: int = 1, fa3_tiles: tuple[int, int, int] = FA3_TILES,
                      fused_merge: bool | None = None, workspace: Tensor | None = None,
                      trunk_pool=None, heads_pool=None, output_stream: torch.cuda.Stream | None = None,
                      hand_off: HandOff | None = None) -> GraphedStep:
    """A GraphedStep with its own attention backend in CUDA-graph mode (``variant``: FlashInfer's, or
    ``FlashVarlenBackend.variant`` for backend sdpa's FlashAttention varlen form), sized for ``num_pages``;
    ``min_pages``, the fewest visible pages of a phase-2 step, bounds its KV split count;
    ``fa3_tiles``, ``fused_merge`` and ``workspace`` as for ``FlashInferBackend``; ``trunk_pool``,
    ``heads_pool``, ``output_stream``, ``hand_off``: shared with other steps, as for ``GraphedStep``)."""
    if variant == FlashVarlenBackend.variant:  # backend sdpa on a GPU: PyTorch's FlashAttention over the runs
        backend = FlashVarlenBackend(pool.k.device, dtype, graph_pages=num_pages, kv_splits=kv_splits,
                                     min_graph_pages=min_pages, fused_merge=fused_merge)
    else:
        backend = FlashInferBackend(pool.k.device, variant, dtype, graph_pages=num_pages, kv_splits=kv_splits,
                                    min_graph_pages=min_pages, fa3_tiles=fa3_tiles, fused_merge=fused_merge,
                                    workspace=workspace)
    return GraphedStep(model, pool, camera, backend, resolution, options, trunk_pool=trunk_pool,
                       heads_pool=heads_pool, output_stream=output_stream, hand_off=hand_off)


@dataclass(frozen=True)
class StepSite:
    """What a session's one-frame step is built on (``StepCapture.make``): its model, K/V pool
    (sized ``num_pages``) and camera cache at ``resolution`` (H, W), its stream settings, dtype and
    step options, its eager ``backend``, the split-KV merge choice, and ``graph_kwargs``: () -> the
    CUDA graph pools and streams it shares with other sessions on one storage (made on first call;
    {} for a session alone)."""

    model: LingBotMap
    pool: KVPool
    camera: CameraKVCache
    num_pages: int
    resolution: tuple[int, int]
    cfg: StreamConfig
    dtype: torch.dtype
    options: StepOptions
    backend: object
    fused_merge: bool | None = None
    graph_kwargs: Callable[[], dict] = dict


class StepCapture(Protocol):
    """How a session captures its one-frame phase-2 step (injected: ``StreamingSession(steps=...)``).
    ``applies`` is asked once per session; ``make`` when a step is needed (first use, a new pool)."""

    def applies(self, cfg: StreamConfig, device: torch.device, backend) -> bool: ...
    def make(self, site: StepSite) -> GraphedStep: ...


class CudaGraphSteps:
    """The sessions' default: the step as CUDA graphs (``make_graphed_step``) where they apply:
    ``cuda_graphs`` on, a CUDA device and a graphable backend (``graphable``: FlashInfer's, or sdpa's
    FlashAttention varlen form); everything else runs eagerly."""

    def applies(self, cfg: StreamConfig, device: torch.device, backend) -> bool:
        return bool(cfg.cuda_graphs) and device.type == "cuda" and graphable(backend)

    def make(self, site: StepSite) -> GraphedStep:
        cfg = site.cfg
        return make_graphed_step(site.model, site.pool, site.camera, site.num_pages, site.resolution,
                                 site.backend.variant, site.dtype, site.options, kv_splits=cfg.kv_splits or None,
                                 min_pages=cfg.num_scale_frames + 2, fa3_tiles=cfg.fa3_tiles,
                                 fused_merge=site.fused_merge, **site.graph_kwargs())


__all__ = ["GraphedStep", "BatchedTrunk", "HandOff", "capture_trunk", "graphable", "make_graphed_step",
           "warmup_stream", "StepSite", "StepCapture", "CudaGraphSteps"]
