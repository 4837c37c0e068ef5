"""Bookkeeping of the two-stream paged cache, checked with exact page ids."""
from __future__ import annotations

import pytest

from lingbot_map_ros.cache.pages import CacheError, CacheFullError, PageTable

PS = 8  # page size (patch tokens per frame); 6 special tokens per frame


def table(**kw):
    args = dict(page_size=PS, num_scale_frames=2, sliding_window=3, max_frames=64, max_pending_evictions=2)
    args.update(kw)
    return PageTable(**args)


def step(t, store=True, n=None):
    plan = t.plan_step(n or (t.num_scale_frames if t.in_phase1 else 1), store)
    t.apply(plan)
    return plan


def test_pool_size_and_initial_free_list():
    t = table()
    # 2 scratch + (2 scale + 3 window + 2 pending + 1) patch + ceil(6*64/8)=48 special
    assert t.num_pages == 2 + 8 + 48
    s = t.stats()
    assert (s.free_pages, s.temporal_index, s.special_tokens) == (8, 0, 0)  # patch pages
    assert t.first_special_page == 2 + 8


def test_phase1_pins_scale_pages_and_packs_specials():
    t = table()
    plan = step(t)
    assert plan.phase1 and plan.frame_pages == (2, 3)
    # 12 special tokens: the special range's first page (10) full (8), page 11 holds 4
    assert plan.read_pages == (2, 3, 10, 11) and plan.last_page_len == 4
    assert plan.special_slots == tuple([10 * PS + i for i in range(8)] + [11 * PS + i for i in range(4)])
    assert plan.new_special_pages == (10, 11) and plan.new_pages == (2, 3)
    assert plan.kv_len == 2 * PS + 12
    assert t.resident_positions() == [0, 1]


def test_fifo_eviction_order_and_page_reuse():
    t = table()
    step(t)  # pages 2,3 scale; specials in 10,11
    pages = [step(t).frame_pages[0] for _ in range(3)]  # window frames 2,3,4
    assert pages == [4, 5, 6]  # ascending: the special stream has its own range
    assert t.resident_positions() == [0, 1, 2, 3, 4]
    plan = step(t)  # frame 5 stored, frame 2 (page 4) evicted
    assert plan.evict == 1 and plan.frame_pages == (7,)
    assert t.resident_positions() == [0, 1, 3, 4, 5]
    assert plan.read_pages[:5] == (2, 3, 5, 6, 7) and 4 not in plan.read_pages
    plan = step(t)  # frame 6 reuses the freed page 4
    assert plan.frame_pages == (4,) and t.resident_positions() == [0, 1, 4, 5, 6]


def test_scale_pages_never_evicted():
    t = table()
    step(t)
    for _ in range(20):
        step(t)
    assert t.resident_positions()[:2] == [0, 1]
    assert t.stats().window_pages == 3


def test_special_stream_crosses_page_boundaries():
    t = table()
    step(t)
    specials = []
    for _ in range(5):
        specials.append(step(t).special_slots)
    # 12 + 5*6 = 42 tokens -> 6 pages, last holds 2
    s = t.stats()
    assert s.special_tokens == 42 and s.special_pages == 6
    # frame 2's tokens 12..17 land at offsets 4..7 of page 11 and 0..1 of page 12: the
    # stream is one contiguous run of slots
    assert specials[0] == tuple(11 * PS + i for i in range(4, 10))
    flat = [slot for slots in specials for slot in slots]
    assert flat == list(range(10 * PS + 12, 10 * PS + 42))


def test_attend_only_step_changes_nothing():
    t = table()
    step(t)
    step(t)
    before = t.state_signature()
    plan = t.plan_step(1, store=False)
    assert plan.frame_pages == (t.scratch_patch_page,)
    assert plan.positions == (3,)
    assert plan.read_pages[:4] == (2, 3, 4, t.scratch_patch_page)
    # 18 stored specials + 6 own = 24 tokens = 3 full pages exactly
    assert plan.kv_len == 4 * PS + 24
    t.apply(plan)
    assert t.state_signature() == before


def test_attend_only_overflow_uses_scratch_special_page():
    t = table(page_size=10)
    step(t)  # 12 specials: page full + 2
    step(t)  # 18
    plan = t.plan_step(1, store=False)  # 18..23: 2 fit in the tail page, 4 overflow
    tail = t.stats().special_pages
    assert plan.read_pages[-1] == t.scratch_special_page
    assert plan.last_page_len == 4
    assert plan.special_slots[:2] == tuple(plan.read_pages[-2] * 10 + i for i in (8, 9))
    assert plan.special_slots[2:] == tuple(t.scratch_special_page * 10 + i for i in range(4))
    assert t.stats().special_pages == tail


def test_deferred_eviction_commit_and_limit():
    t = table()
    step(t)
    for _ in range(3):
        step(t)
    t.set_deferred(True)
    step(t)
    step(t)
    s = t.stats()
    assert s.pending_evictions == 2 and s.window_pages == 5
    with pytest.raises(CacheFullError, match="max_pending_evictions"):
        t.plan_step(1, store=True)
    t.plan_step(1, store=False)  # attending is still fine
    assert t.commit() == 2
    assert t.resident_positions() == [0, 1, 4, 5, 6] and t.stats().pending_evictions == 0
    assert t.commit() == 0


def test_rollback_restores_exact_state_including_evicted_page():
    t = table()
    step(t)
    for _ in range(3):
        step(t)
    before = t.state_signature()
    plan = step(t)
    assert plan.evict == 1
    assert t.rollback_last() == 5
    assert t.state_signature() == before
    with pytest.raises(CacheError, match="nothing to roll back"):
        t.rollback_last()


def test_rollback_after_commit_restores_window():
    t = table()
    step(t)
    for _ in range(3):
        step(t)
    t.set_deferred(True)
    before = t.state_signature()
    step(t)
    t.commit()
    t.rollback_last()
    assert t.state_signature() == before


def test_reset_returns_to_fresh_state():
    fresh = table().state_signature()
    t = table()
    step(t)
    step(t)
    t.reset()
    assert t.state_signature() == fresh and not t.stats().can_rollback


def test_temporal_horizon_is_a_clear_error_and_keeps_state():
    t = table(max_frames=4)
    step(t)
    step(t)
    step(t)
    before = t.state_signature()
    with pytest.raises(CacheFullError, match="horizon"):
        t.plan_step(1, store=True)
    with pytest.raises(CacheFullError, match="horizon"):
        t.plan_step(1, store=False)
    assert t.state_signature() == before


def test_pool_is_sized_so_only_the_documented_limits_stop_a_store():
    """Deferred frames are bounded by max_pending_evictions; the pool never runs dry before it."""
    t = table(max_frames=64, max_pending_evictions=3, sliding_window=2)
    step(t)
    step(t)
    step(t)
    t.set_deferred(True)
    for _ in range(3):
        step(t)
    before = t.state_signature()
    with pytest.raises(CacheFullError, match="max_pending_evictions=3"):
        t.plan_step(1, store=True)
    assert t.state_signature() == before
    assert t.stats().free_pages > 0


def test_exhausted_free_list_is_a_clear_error():
    t = table()
    step(t)
    t._state.free.clear()  # simulate a pool smaller than the plan needs
    with pytest.raises(CacheFullError, match="no free page"):
        t.plan_step(1, store=True)


def test_phase1_must_be_the_scale_frames():
    t = table()
    with pytest.raises(CacheError, match="exactly 2"):
        t.plan_step(1, store=True)
    step(t)
    with pytest.raises(CacheError, match="one frame"):
        t.plan_step(2, store=True)


def test_stale_plan_is_refused():
    t = table()
    step(t)
    plan = t.plan_step(1, store=True)
    step(t)
    with pytest.raises(CacheError, match="stale"):
        t.apply(plan)


def test_page_size_smaller_than_specials_is_refused():
    with pytest.raises(ValueError, match="special"):
        PageTable(page_size=4, num_scale_frames=1, sliding_window=1, max_frames=8)
