"""The ragged FlashInfer path's index arithmetic, on CPU: runs of visible keys, the request
batch that covers them, and the page allocator keeping the runs few.

The GPU tests (test/gpu/test_flashinfer_backend.py) run the kernel over these requests;
here a PyTorch emulation of a ragged batch (request j with queries reads query copy j,
requests without queries do nothing) must equal attention over the visible keys.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from lingbot_map_ros.cache.flashinfer_backend import FragmentedPool, ragged_requests, visible_runs
from lingbot_map_ros.cache.pages import PageTable
from lingbot_map_ros.kernels.merge import merge_reference


def test_visible_runs_merge_adjacent_pages_and_stop_at_the_partial_one():
    # pages 5,6,7 adjacent; the partial page (listed last) is 3, followed by visible page 4
    runs = visible_runs([5, 6, 4, 9, 7, 3], last_page_len=2, page_size=10)
    assert runs == [(30, 32), (40, 80), (90, 100)]
    assert visible_runs([2], 7, 10) == [(20, 27)]
    assert visible_runs([1, 0], 10, 10) == [(0, 20)]


@pytest.mark.parametrize("runs,splits", [([(0, 100)], 4), ([(30, 32), (40, 80), (90, 100)], 8),
                                         ([(10, 20), (500, 9000)], 3), ([(0, 5), (5000, 5001)], 2)])
def test_requests_cover_every_visible_key_once_with_one_query_copy_per_split(runs, splits):
    qo_len = 7
    qo, kv = ragged_requests(runs, splits, qo_len)
    assert qo[0] == kv[0] == 0 and len(qo) == len(kv)
    assert qo[-1] == splits * qo_len  # every query copy used once
    covered = []
    for j in range(len(qo) - 1):
        nq, keys = qo[j + 1] - qo[j], range(kv[j], kv[j + 1])
        assert nq in (0, qo_len)
        if nq:
            assert len(keys) > 0
            covered += keys
        else:  # skipped keys lie outside every run
            assert not any(a <= key < b for key in keys for a, b in runs)
    assert covered == [key for a, b in runs for key in range(a, b)]
    # longer runs get more splits
    if len(runs) == 2 and splits == 3:
        assert sum(1 for j in range(len(qo) - 1) if qo[j + 1] > qo[j] and kv[j] >= 500) == 2


def test_requests_pad_to_a_fixed_batch_and_refuse_too_many_runs():
    qo, kv = ragged_requests([(10, 20), (30, 60)], 2, 5, num_requests=6)  # skip, chunk, skip, chunk + 2 empty
    assert qo == [0, 0, 5, 5, 10, 10, 10] and kv == [0, 10, 20, 30, 60, 60, 60]
    with pytest.raises(FragmentedPool, match="3 runs"):
        ragged_requests([(0, 5), (10, 15), (20, 25)], 2, 5)
    with pytest.raises(FragmentedPool, match="requests"):
        ragged_requests([(10, 20), (30, 60)], 2, 5, num_requests=3)  # needs 2 skips + 2 chunks
    with pytest.raises(ValueError, match="fill"):
        ragged_requests([(0, 3)], 4, 5)


def emulate_ragged(q_copies, k, v, qo, kv):
    """A ragged batch in PyTorch: outputs and base-2 log-sum-exps per query row."""
    outs, lses = [], []
    for j in range(len(qo) - 1):
        if qo[j + 1] == qo[j]:
            continue
        rows = q_copies[qo[j]:qo[j + 1]]
        keys, vals = k[kv[j]:kv[j + 1]], v[kv[j]:kv[j + 1]]
        scores = torch.einsum("nhd,mhd->hnm", rows, keys) / math.sqrt(rows.shape[-1])
        lses.append((torch.logsumexp(scores, -1) / math.log(2)).transpose(0, 1))
        outs.append(torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vals))
    return torch.stack(outs), torch.stack(lses)


def test_emulated_ragged_batch_equals_attention_over_the_visible_pages():
    gen = torch.Generator().manual_seed(0)
    ps, heads, dim, qo_len, splits = 6, 2, 8, 5, 4
    pages, last = [7, 2, 3, 9, 4], 4  # runs: pages 2-4, 7, and the partial page 9
    k = torch.randn(12 * ps, heads, dim, generator=gen)
    v = torch.randn(12 * ps, heads, dim, generator=gen)
    q = torch.randn(qo_len, heads, dim, generator=gen)
    qo, kv = ragged_requests(visible_runs(pages, last, ps), splits, qo_len)
    o, lse = emulate_ragged(q.repeat(splits, 1, 1), k, v, qo, kv)
    merged = merge_reference(o, lse, torch.empty(qo_len, heads, dim))
    slots = torch.cat([torch.arange(p * ps, p * ps + (last if i == len(pages) - 1 else ps))
                       for i, p in enumerate(pages)])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k[slots].transpose(0, 1), v[slots].transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(merged, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["every frame", "every 2nd frame", "deferred + rollback"])
def test_allocator_keeps_the_visible_keys_in_few_runs(policy):
    """The released sizes (999-token pages, 8 scale frames, window 64, 8 pending evictions,
    1024-frame horizon) over 600 frames: the runs stay within a graphed step's 8 splits."""
    t = PageTable(999, 8, 64, 1024, max_pending_evictions=8)
    rng = random.Random(0)
    t.apply(t.plan_step(8, True))
    worst = 0
    if policy == "deferred + rollback":
        t.set_deferred(True)
    for i in range(600):
        store = policy != "every 2nd frame" or i % 2 == 0
        if policy == "deferred + rollback" and t.pending_evictions >= 8:
            t.commit()
        plan = t.plan_step(1, store)
        worst = max(worst, len(visible_runs(plan.read_pages, plan.last_page_len, 999)))
        t.apply(plan)
        if policy == "deferred + rollback" and rng.random() < 0.3:
            t.rollback_last()
    print(f"{policy}: at most {worst} runs")
    assert worst <= (3 if policy == "every frame" else 8)
