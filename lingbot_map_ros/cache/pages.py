"""Bookkeeping of the two-stream paged KV cache (SPEC §5). No tensors here.

One ``PageTable`` serves every layer: each layer owns a pool of ``num_pages``
pages of ``page_size`` tokens (page_size = patch tokens of one frame) and all
pools share these page ids.

* Patch stream: one page per stored frame. The pages of the first
  ``num_scale_frames`` frames are pinned; later frames form a FIFO window of
  ``sliding_window`` frames (the newest included) and their pages return to the
  free list when they leave it.
* Special stream: 6 tokens per stored frame packed densely into append-only
  pages. They have their own range of page ids at the end of the pool, taken in
  order, so the stream's tokens are one contiguous run of the pool.
* Two scratch pages take the K/V of an attend-only (non-keyframe) step: its
  patch tokens, and the part of its special tokens that does not fit into the
  special stream's last page. Nothing of such a step is kept.

A step is planned without touching the state (``plan_step``), the model writes
K/V into the slots the plan names and attends over the pages it lists, and only
when the step succeeded is the plan applied (``apply``). A failed step therefore
leaves the bookkeeping exactly as it was. The visible page list is ordered patch
pages first, then special pages, so every page is full but the last, which is
what paged-attention kernels expect.

Page ids: 0 and 1 scratch, then the patch pages (a free stack that hands out
ascending ids until pages come back), then the special range. The visible tokens
are therefore a few contiguous runs of the pool (kernels that read keys as
contiguous ranges rely on that, ``cache.flashinfer_backend.visible_runs``): the
window's pages are the patch range but for the pages that are free.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import SPECIAL_TOKENS


class CacheError(RuntimeError):
    """The cache cannot take this step; its state is unchanged."""


class CacheFullError(CacheError):
    """No free page, or the temporal index would pass the model's horizon."""


@dataclass(frozen=True)
class StepPlan:
    """What one step writes and reads. Slots are flat token indices ``page * page_size + offset``."""

    num_frames: int
    store: bool  # the step's frames are kept after it
    phase1: bool  # the step is the pinned scale frames of a new sequence
    first_position: int  # temporal index of the step's first frame
    frame_pages: tuple[int, ...]  # patch page written by each frame
    special_slots: tuple[int, ...]  # 6 * num_frames slots for the special tokens, frame-major
    read_pages: tuple[int, ...]  # visible pages: patch pages, then special pages
    last_page_len: int  # tokens used in read_pages[-1]
    new_pages: tuple[int, ...]  # patch pages taken from the free list when applied (top of the stack first)
    evict: int  # window frames that leave the cache when applied
    page_size: int
    new_special_pages: tuple[int, ...] = ()  # special pages the stream grows by when applied

    @property
    def kv_len(self) -> int:
        return (len(self.read_pages) - 1) * self.page_size + self.last_page_len

    @property
    def positions(self) -> tuple[int, ...]:
        if self.store:
            return tuple(range(self.first_position, self.first_position + self.num_frames))
        return (self.first_position,) * self.num_frames


@dataclass(frozen=True)
class CacheStats:
    temporal_index: int  # frames stored since reset (the next stored frame's temporal index)
    resident_frames: int  # frames whose patch pages are in the cache
    scale_pages: int
    window_pages: int
    free_pages: int  # patch pages
    special_tokens: int
    special_pages: int
    pending_evictions: int
    deferred: bool
    can_rollback: bool


@dataclass
class _State:
    free: list[int]  # patch pages, a stack: pop() gives the next page
    scale: list[tuple[int, int]] = field(default_factory=list)  # (temporal index, page)
    window: deque = field(default_factory=deque)  # (temporal index, page), oldest first
    special_pages: list[int] = field(default_factory=list)
    special_count: int = 0
    stored: int = 0  # temporal index of the next stored frame

    def copy(self) -> "_State":
        """An independent copy (the containers hold only ints and int tuples)."""
        return _State(free=list(self.free), scale=list(self.scale), window=deque(self.window),
                      special_pages=list(self.special_pages), special_count=self.special_count, stored=self.stored)


class PageTable:
    """Page ids, free list, pinned scale pages, FIFO window, special tail, deferred eviction,
    temporal index, and a one-step undo record."""

    def __init__(self, page_size: int, num_scale_frames: int, sliding_window: int, max_frames: int,
                 max_pending_evictions: int = 0) -> None:
        if page_size < SPECIAL_TOKENS:
            raise ValueError(f"page_size {page_size} is smaller than the {SPECIAL_TOKENS} special tokens of a "
                             "frame; use larger images")
        self.page_size = page_size
        self.num_scale_frames = num_scale_frames
        self.sliding_window = sliding_window
        self.max_frames = max_frames
        self.max_pending_evictions = max_pending_evictions
        special_pages = -(-SPECIAL_TOKENS * max_frames // page_size)
        patch_pages = num_scale_frames + sliding_window + max_pending_evictions + 1  # +1: stored before evicting
        self.scratch_patch_page = 0
        self.scratch_special_page = 1
        self.first_special_page = 2 + patch_pages
        self.num_pages = 2 + patch_pages + special_pages
        self.deferred = False
        self._undo: _State | None = None
        self._state = self._fresh()

    def _fresh(self) -> _State:
        return _State(free=list(range(self.first_special_page - 1, 1, -1)))

    # ------------------------------------------------------------------ queries
    @property
    def temporal_index(self) -> int:
        return self._state.stored

    @property
    def in_phase1(self) -> bool:
        """True until the scale frames of the current sequence are stored."""
        return self._state.stored == 0

    @property
    def pending_evictions(self) -> int:
        return max(0, len(self._state.window) - self.sliding_window)

    def stats(self) -> CacheStats:
        st = self._state
        return CacheStats(temporal_index=st.stored, resident_frames=len(st.scale) + len(st.window),
                          scale_pages=len(st.scale), window_pages=len(st.window), free_pages=len(st.free),
                          special_tokens=st.special_count, special_pages=len(st.special_pages),
                          pending_evictions=self.pending_evictions, deferred=self.deferred,
                          can_rollback=self._undo is not None)

    def resident_positions(self) -> list[int]:
        """Temporal indices of the frames whose patch pages are resident, scale frames first."""
        st = self._state
        return [t for t, _ in st.scale] + [t for t, _ in st.window]

    def state_signature(self) -> tuple:
        """Everything that defines the cache contents, for equality checks in tests."""
        st = self._state
        return (tuple(st.free), tuple(st.scale), tuple(st.window), tuple(st.special_pages), st.special_count,
                st.stored)

    # ------------------------------------------------------------------ planning
    def plan_step(self, num_frames: int, store: bool) -> StepPlan:
        """Plan a step of ``num_frames`` frames without changing any state.

        Phase 1 (nothing stored yet) must be ``num_scale_frames`` frames, stored.
        Afterwards a step is one frame: stored (keyframe) or attend-only.
        """
        st = self._state
        phase1 = st.stored == 0
        if phase1:
            if not store or num_frames != self.num_scale_frames:
                raise CacheError(f"the first step of a sequence must store exactly {self.num_scale_frames} "
                                 f"scale frames (got {num_frames}, store={store})")
        elif num_frames != 1:
            raise CacheError(f"after the scale frames a step holds one frame, got {num_frames}")
        last_position = st.stored + (num_frames - 1 if store else 0)
        if last_position >= self.max_frames or (store and st.stored + num_frames > self.max_frames):
            raise CacheFullError(f"temporal index {last_position} would pass the model's horizon of "
                                 f"{self.max_frames} frames since reset; reset or restart the sequence")

        ps = self.page_size
        free = st.free
        taken: list[int] = []

        def take() -> int:
            if len(taken) >= len(free):
                raise CacheFullError(f"no free page left in the pool of {self.num_pages} pages "
                                     f"(pending evictions: {self.pending_evictions})")
            page = free[len(free) - 1 - len(taken)]
            taken.append(page)
            return page

        evict = 0
        if store:
            if not phase1 and self.deferred and self.pending_evictions + 1 > self.max_pending_evictions:
                raise CacheFullError(f"deferred eviction already holds {self.pending_evictions} frame(s), the "
                                     f"limit (max_pending_evictions={self.max_pending_evictions}); commit or "
                                     "roll back first")
            frame_pages = tuple(take() for _ in range(num_frames))
            if phase1:
                patch_read = list(frame_pages)
            else:
                window = [p for _, p in st.window] + list(frame_pages)
                if not self.deferred:
                    evict = max(0, len(window) - self.sliding_window)
                patch_read = [p for _, p in st.scale] + window[evict:]
        else:
            frame_pages = (self.scratch_patch_page,)
            patch_read = [p for _, p in st.scale] + [p for _, p in st.window] + list(frame_pages)

        # special stream: slots for the step's 6*S tokens after the current tail
        special_pages = list(st.special_pages)
        new_special: list[int] = []
        start = st.special_count
        end = start + SPECIAL_TOKENS * num_frames
        overflow_page = None
        slots = []
        for pos in range(start, end):
            index, offset = divmod(pos, ps)
            if index >= len(special_pages):
                if store:
                    page = self.first_special_page + len(special_pages)  # in range below the horizon
                    special_pages.append(page)
                    new_special.append(page)
                else:
                    overflow_page = self.scratch_special_page
                    slots.append(overflow_page * ps + pos - len(special_pages) * ps)
                    continue
            slots.append(special_pages[index] * ps + offset)
        used_special = special_pages[:-(-end // ps)] if overflow_page is None else special_pages
        read_pages = patch_read + used_special + ([overflow_page] if overflow_page is not None else [])
        last_len = (end - 1) % ps + 1 if overflow_page is None else end - len(special_pages) * ps
        return StepPlan(num_frames=num_frames, store=store, phase1=phase1, first_position=st.stored,
                        frame_pages=frame_pages, special_slots=tuple(slots), read_pages=tuple(read_pages),
                        last_page_len=last_len, new_pages=tuple(taken), evict=evict, page_size=ps,
                        new_special_pages=tuple(new_special))

    # ------------------------------------------------------------------ transitions
    def apply(self, plan: StepPlan) -> None:
        """Make a planned step's effect permanent (call after the model step succeeded)."""
        if not plan.store:
            return
        st = self._state
        if plan.first_position != st.stored or tuple(st.free[len(st.free) - len(plan.new_pages):][::-1]) \
                != plan.new_pages:
            raise CacheError("stale plan: the cache changed since the step was planned")
        self._undo = st.copy()
        del st.free[len(st.free) - len(plan.new_pages):]
        positions = range(plan.first_position, plan.first_position + plan.num_frames)
        if plan.phase1:
            st.scale.extend(zip(positions, plan.frame_pages))
        else:
            st.window.extend(zip(positions, plan.frame_pages))
        st.special_pages.extend(plan.new_special_pages)
        st.special_count += SPECIAL_TOKENS * plan.num_frames
        st.stored += plan.num_frames
        self._evict(plan.evict)

    def _evict(self, count: int) -> int:
        st = self._state
        for _ in range(count):
            _, page = st.window.popleft()
            st.free.append(page)
        return count

    def set_deferred(self, deferred: bool) -> None:
        """While deferred, stored frames do not evict; pending evictions wait for ``commit``."""
        self.deferred = bool(deferred)

    def commit(self) -> int:
        """Run the pending evictions; returns the number of pages freed."""
        return self._evict(self.pending_evictions)

    def rollback_last(self) -> int:
        """Undo the most recent store exactly; returns the temporal index of the removed frame.

        Pages it took go back to the free list, pages it (or a later commit) evicted come
        back into the window (their contents are intact: nothing was allocated since).
        """
        if self._undo is None:
            raise CacheError("nothing to roll back: no frame was stored since the last reset or rollback")
        removed = self._state.stored - 1
        self._state, self._undo = self._undo, None
        return removed

    def reset(self) -> None:
        self._state = self._fresh()
        self._undo = None
