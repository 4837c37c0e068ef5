"""The work schedule of the project-built FA3 kernel (``kernels.fa3_tiles.plan_reference``,
the Python twin of the compiled plan; the GPU tests compare the two).

The kernel runs one CTA per SM; CTA c walks items work_indptr[c]..work_indptr[c + 1] of
seven item arrays. A wrong schedule is silent (a tile computed twice or never), so these
tests check the cover exactly and the balance, at the released sizes.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

from lingbot_map_ros.cache.flashinfer_backend import TILED_WAVES, auto_kv_splits, ragged_requests
from lingbot_map_ros.kernels.fa3_tiles import (ITEM_ARRAYS, TILE_Q, plan_reference, schedule_size,
                                               work_items)


def unpack(schedule: np.ndarray, num_ctas: int, capacity: int):
    indptr = schedule[:num_ctas + 1]
    items = schedule[num_ctas + 1:].reshape(ITEM_ARRAYS, capacity)
    return indptr, items


def check_cover(qo, kv, heads, num_ctas, tile_q=TILE_Q):
    """Every (request, head, query tile) exactly once, with its request's rows and keys."""
    capacity = work_items(qo, heads, tile_q) + 5  # room to spare: entries past the works stay 0
    schedule = plan_reference(qo, kv, heads, num_ctas, capacity, tile_q)
    assert schedule.dtype == np.int32 and schedule.shape == (schedule_size(num_ctas, capacity),)
    indptr, items = unpack(schedule, num_ctas, capacity)
    works = int(indptr[-1])
    assert indptr[0] == 0 and np.all(np.diff(indptr) >= 0) and works == work_items(qo, heads, tile_q)
    seen = collections.Counter()
    for tile, q0, k0, qn, kn, head, r in items[:, :works].T:
        assert (q0, k0, qn, kn) == (qo[r], kv[r], qo[r + 1] - qo[r], kv[r + 1] - kv[r])
        assert 0 <= tile < -(-qn // tile_q) and 0 <= head < heads
        seen[(r, head, tile)] += 1
    expected = {(r, h, t) for r in range(len(qo) - 1) for h in range(heads)
                for t in range(-(-(qo[r + 1] - qo[r]) // tile_q))}
    assert set(seen) == expected and set(seen.values()) <= {1}
    assert not items[:, works:].any()
    return indptr, items, works


def loads(indptr, items, tile_q=TILE_Q):
    cost = items[4] + 2 * tile_q  # keys + fixed part, as the plan estimates
    return np.array([cost[a:b].sum() for a, b in zip(indptr[:-1], indptr[1:])])


@pytest.mark.parametrize("qo_len,splits", [(1005, 12), (1005, 9), (783, 12), (2 * 1005, 4)])
def test_released_step_is_covered_once_and_balanced(qo_len, splits):
    """A 518x378 / 518x294 step over three runs of the pool (the allocator's usual shape),
    as ``ragged_requests`` builds it for the CUDA graph (2 x splits requests, padded)."""
    runs = [(0, 8 * 999), (20 * 999, 64 * 999 + 400), (80 * 999, 80 * 999 + 6 * 72)]
    qo, kv = ragged_requests(runs, splits, qo_len, 2 * splits)
    indptr, items, works = check_cover(qo, kv, 16, 132)
    load = loads(indptr, items)
    biggest = int(max(np.diff(kv))) + 2 * TILE_Q
    assert load.max() - load.min() <= biggest  # list scheduling: within one item of level
    assert works == splits * 16 * -(-qo_len // TILE_Q)


def test_requests_without_queries_get_no_work_and_long_requests_go_first():
    qo = [0, 0, 300, 300, 428]  # request 0 and 2 have no queries (skipped keys)
    kv = [0, 50, 5050, 5100, 5200]  # request 1 has the most keys of those with queries
    indptr, items, works = check_cover(qo, kv, 2, 3)
    assert set(items[6, :works]) == {1, 3}
    first = items[6, indptr[:-1][np.diff(indptr) > 0]]
    assert set(first) == {1}  # request 1 has the most keys: every CTA starts with it


def test_ties_go_to_the_lowest_cta_and_the_plan_is_deterministic():
    qo, kv = [0, 128], [0, 10]
    schedule = plan_reference(qo, kv, 3, 5, 3)
    indptr, items = unpack(schedule, 5, 3)
    assert indptr.tolist() == [0, 1, 2, 3, 3, 3]  # heads 0, 1, 2 -> CTAs 0, 1, 2
    assert items[5].tolist() == [0, 1, 2]
    assert np.array_equal(schedule, plan_reference(qo, kv, 3, 5, 3))


def test_more_work_than_capacity_and_bad_indptr_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        plan_reference([0, 1005], [0, 10], 16, 132, 16 * 7)  # needs 8 tiles x 16 heads
    with pytest.raises(ValueError, match="decrease"):
        plan_reference([0, 5, 3], [0, 1, 2], 1, 4, 10)
    with pytest.raises(ValueError, match="equal length"):
        plan_reference([0, 5], [0, 1, 2], 1, 4, 10)


def test_split_count_follows_the_tile():
    """With 128-row tiles a 518x378 step has 8 x 16 = 128 items per split (not 6 x 16 = 96):
    the automatic split count is computed from the tile in use."""
    assert auto_kv_splits(1005, 16, 64, 74, 132, "fa3", tile_q=128) < auto_kv_splits(1005, 16, 64, 74, 132, "fa3")
    assert auto_kv_splits(1005, 16, 64, 74, 132, "fa3", tile_q=192) == auto_kv_splits(1005, 16, 64, 74, 132, "fa3")
    # the released sizes with the tiled kernel's measured target (results/nvidia_h200_fa3_tiles_ab.txt)
    assert auto_kv_splits(1005, 16, 64, 74, 132, "fa3", tile_q=128, waves=TILED_WAVES) == 8
    assert auto_kv_splits(783, 16, 64, 74, 132, "fa3", tile_q=128, waves=TILED_WAVES) == 9


def test_tile_shape_is_a_checked_setting():
    """The FA3 tile shape is data: a StreamConfig field (benchmarks parse their flag with
    parse_fa3_tiles); no environment variable changes it behind the caller's back."""
    from lingbot_map_ros.config import FA3_TILES, ConfigError, StreamConfig, parse_fa3_tiles
    from lingbot_map_ros.kernels import fa3_tiles

    assert StreamConfig().fa3_tiles == FA3_TILES == fa3_tiles.TILES == (128, 192, 2)
    assert StreamConfig.from_dict({"fa3_tiles": [128, 256, 3]}).fa3_tiles == (128, 256, 3)  # JSON lists
    assert parse_fa3_tiles("128X256x3") == (128, 256, 3)
    for bad in ("128x192", "abc", "100x192x2", "128x192x4", "128x320x2", "1.5x192x2"):
        with pytest.raises(ConfigError, match="128x192x2|fa3_tiles"):
            parse_fa3_tiles(bad)
    for bad in ((128, 192), (128.0, 192, 2), (100, 192, 2), "128x192x2"):
        with pytest.raises(ConfigError, match="fa3_tiles"):
            StreamConfig(fa3_tiles=bad)
    with pytest.raises(ConfigError, match="fa3_tiles"):
        fa3_tiles.load((128, 192, 4))  # refused before anything is built
