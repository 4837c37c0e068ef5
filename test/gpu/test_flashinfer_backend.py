"""FlashInfer attention (FA2 and FA3 ragged over the pool's runs, FA2 and FA3 paged) against the
SDPA reference, one layer at a time.

Every case draws a pool of bf16 pages, lists the visible pages in a shuffled,
non-contiguous order, and fills every slot that is NOT visible (other pages, the tail
of the last page) with large values, so a kernel that read past the plan would be far
off. The reference is ``SdpaBackend`` in float32 over the same bf16 values upcast.
Run on the GPU machine: ``pytest -m gpu test/gpu``.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from lingbot_map_ros.cache.attention import SdpaBackend
from lingbot_map_ros.cache.pages import StepPlan
from lingbot_map_ros.cache.pool import DevicePlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="flashinfer is not installed (carry its wheels to the GPU machine, see GPU.md)"),
]

VARIANTS = ["fa2", "fa2-paged", "fa3", "fa3-paged", "fa3-stock"]  # fa2/fa3: over the runs; fa3: 128-row tiles
ABS_TOL = 2e-2
MIN_COSINE = 0.999
GARBAGE = 1e3  # in every slot the plan does not make visible

# (page_size, visible pages, tokens in the last page, qo_len, heads); head_dim is 64 throughout
CASES = [
    (999, 20, 500, 1005, 16),  # 518x378 frames, partial last page
    (999, 9, 999, 2 * 1005, 16),  # two frames of queries (phase 1), full last page
    (999, 1, 6, 1005, 16),  # a single, partial page
    (777, 13, 1, 1005, 16),  # 518x294 frames, one token in the last page
    (777, 5, 300, 2 * 1005, 16),
    (28, 40, 13, 1005, 2),  # the tiny fixture's page size and head count
    (28, 3, 28, 2 * 1005, 2),
]


def make_step(page_size: int, num_pages: int, last_page_len: int, qo_len: int, heads: int,
              seed: int) -> tuple[DevicePlan, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step plan over shuffled pages of a random pool; returns (plan, q fp32, k_pages, v_pages) on CUDA."""
    gen = torch.Generator().manual_seed(seed)
    pool_pages = 2 * num_pages + 3
    read = torch.randperm(pool_pages, generator=gen)[:num_pages]
    shape = (pool_pages, page_size, heads, 64)
    k = torch.full(shape, GARBAGE)
    v = torch.full(shape, GARBAGE)
    k[read] = torch.randn((num_pages, *shape[1:]), generator=gen)
    v[read] = torch.randn((num_pages, *shape[1:]), generator=gen)
    k[read[-1], last_page_len:] = GARBAGE
    v[read[-1], last_page_len:] = GARBAGE
    q = torch.randn(qo_len, heads, 64, generator=gen)
    step = StepPlan(num_frames=1, store=False, phase1=False, first_position=0, frame_pages=(), special_slots=(),
                    read_pages=tuple(read.tolist()), last_page_len=last_page_len, new_pages=(), evict=0,
                    page_size=page_size)
    slots = (read[:, None] * page_size + torch.arange(page_size)[None]).flatten()[:step.kv_len]
    plan = DevicePlan(plan=step, write_slots=torch.empty(0, dtype=torch.long, device="cuda"),
                      read_pages=read.to(torch.int32).cuda(), read_slots=slots.cuda(), tokens_per_frame=qo_len)
    return plan, q.cuda(), k.to("cuda", torch.bfloat16), v.to("cuda", torch.bfloat16)


def reference(plan: DevicePlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    sdpa = SdpaBackend()
    sdpa.begin_step(plan)
    return sdpa.attend(q.to(torch.bfloat16).float(), k.float(), v.float())


@pytest.fixture(scope="module", params=VARIANTS)
def backend(request):
    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(torch.device("cuda"), request.param, torch.bfloat16)


@pytest.mark.parametrize("case", CASES, ids=[f"ps{c[0]}-n{c[1]}-last{c[2]}-q{c[3]}-h{c[4]}" for c in CASES])
def test_matches_sdpa_over_shuffled_pages(backend, case):
    plan, q, k, v = make_step(*case, seed=sum(case))
    backend.begin_step(plan)
    out = backend.attend(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    ref = reference(plan, q, k, v)
    err = (out.float() - ref).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    print(f"ATTN {backend.name} {case}: max abs err {err:.2e}, cosine {cos:.6f}")
    assert err < ABS_TOL and cos > MIN_COSINE, f"{backend.name} {case}: max abs err {err:.3e}, cosine {cos:.6f}"


def test_plans_once_per_step_for_all_layers(backend, monkeypatch):
    """Three layers of one step share one plan(); a new step plans again."""
    plan, q, k, v = make_step(999, 4, 17, 1005, 16, seed=1)
    backend.begin_step(plan)
    backend.prepare(k)  # the wrapper is made at the first plan
    calls = []
    real_plan = backend._wrapper.plan
    monkeypatch.setattr(backend._wrapper, "plan", lambda *a, **kw: calls.append(1) or real_plan(*a, **kw))
    layers = torch.stack([k, k.flip(-1), k.roll(1, dims=-1)]), torch.stack([v, v.flip(-1), v.roll(1, dims=-1)])
    for step in range(2):
        backend.begin_step(plan)
        for layer in range(3):
            out = backend.attend(q, layers[0][layer], layers[1][layer])
            ref = reference(plan, q, layers[0][layer], layers[1][layer])
            assert (out.float() - ref).abs().max().item() < ABS_TOL
        assert len(calls) == step + 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_pool_is_refused_with_a_clear_error(variant):
    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend

    with pytest.raises(ValueError, match="bf16"):
        FlashInferBackend(torch.device("cuda"), variant, torch.float32)
    backend = FlashInferBackend(torch.device("cuda"), variant)  # dtype unknown until the first attend
    plan, q, k, v = make_step(28, 2, 5, 34, 2, seed=2)
    backend.begin_step(plan)
    with pytest.raises(ValueError, match="bf16"):
        backend.attend(q, k.float(), v.float())


@pytest.mark.parametrize("variant", ["fa2", "fa2-paged", "fa3", "fa3-paged", "fa3-stock"])
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("case", CASES[:4], ids=[f"ps{c[0]}-n{c[1]}-last{c[2]}-q{c[3]}" for c in CASES[:4]])
def test_split_kv_matches_sdpa(case, splits, variant):
    """FA3 with the keys split over ``splits`` requests, merged by LSE: runs of pages (at most
    one per page) for the paged kernel; for the ragged one at least one split per run of
    adjacent visible pages, the keys between runs skipped (they hold garbage here)."""
    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend, visible_runs

    backend = FlashInferBackend(torch.device("cuda"), variant, torch.bfloat16, kv_splits=splits)
    plan, q, k, v = make_step(*case, seed=sum(case) + splits)
    backend.begin_step(plan)
    out = backend.attend(q, k, v)
    if not variant.endswith("-paged"):
        runs = visible_runs(plan.plan.read_pages, plan.plan.last_page_len, plan.plan.page_size)
        assert backend.splits == max(min(splits, case[1]), len(runs))
    else:
        assert backend.splits == min(splits, case[1])
    ref = reference(plan, q, k, v)
    err = (out.float() - ref).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    print(f"ATTN split {splits} {case}: max abs err {err:.2e}, cosine {cos:.6f}")
    assert err < ABS_TOL and cos > MIN_COSINE
    # queries handed over in the backend's own buffer give the same result without a copy
    buf = backend.query_buffer(k)
    buf.copy_(q.to(torch.bfloat16).unsqueeze(0).expand_as(buf))
    torch.testing.assert_close(backend.attend(buf, k, v), out, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["fa3", "fa3-paged", "fa3-stock"])
def test_auto_split_is_used_for_a_full_window_step(variant):
    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(torch.device("cuda"), variant, torch.bfloat16)
    plan, q, k, v = make_step(999, 74, 300, 1005, 16, seed=5)
    backend.begin_step(plan)
    out = backend.attend(q, k, v)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"auto split on {sms} SMs: {backend.splits}")
    assert backend.splits >= (2 if sms > 96 else 1)
    ref = reference(plan, q, k, v)
    assert (out.float() - ref).abs().max().item() < ABS_TOL


def test_ragged_graph_wrapper_pads_to_its_batch_and_refuses_a_fragmented_pool():
    """CUDA-graph mode: a fixed batch of 2 x splits requests, whatever the runs; more runs than
    splits raise FragmentedPool before anything is launched."""
    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend, FragmentedPool

    backend = FlashInferBackend(torch.device("cuda"), "fa3", torch.bfloat16, graph_pages=64, kv_splits=2,
                                min_graph_pages=2)
    read = (3, 4, 5, 9, 10)  # two runs
    k = torch.full((12, 28, 2, 64), GARBAGE)
    v = torch.full((12, 28, 2, 64), GARBAGE)
    gen = torch.Generator().manual_seed(3)
    for p in read:
        k[p], v[p] = torch.randn(28, 2, 64, generator=gen), torch.randn(28, 2, 64, generator=gen)
    k, v = k.to("cuda", torch.bfloat16), v.to("cuda", torch.bfloat16)
    q = torch.randn(34, 2, 64, generator=gen).cuda()

    def plan_of(pages):
        step = StepPlan(num_frames=1, store=False, phase1=False, first_position=0, frame_pages=(), special_slots=(),
                        read_pages=pages, last_page_len=28, new_pages=(), evict=0, page_size=28)
        slots = torch.cat([torch.arange(p * 28, p * 28 + 28) for p in pages])
        return DevicePlan(plan=step, write_slots=torch.empty(0, dtype=torch.long, device="cuda"),
                          read_pages=torch.tensor(pages, dtype=torch.int32).cuda(), read_slots=slots.cuda(),
                          tokens_per_frame=34)

    plan = plan_of(read)
    backend.begin_step(plan)
    backend.prepare(k)
    out = backend.attend(q, k, v)
    assert (out.float() - reference(plan, q, k, v)).abs().max().item() < ABS_TOL
    backend.begin_step(plan_of((3, 5, 9)))  # three runs for two splits
    with pytest.raises(FragmentedPool):
        backend.prepare(k)


def test_ragged_graph_wrapper_takes_more_splits_than_visible_pages():
    """The ragged kernel's splits are runs of keys, not pages: a CUDA-graph backend with 7
    splits attends correctly over 3 visible pages (the paged kernel would need 7)."""
    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(torch.device("cuda"), "fa3", torch.bfloat16, graph_pages=64, kv_splits=7,
                                min_graph_pages=2)
    gen = torch.Generator().manual_seed(4)
    read = (2, 3, 7)
    k = torch.full((9, 28, 2, 64), GARBAGE)
    v = torch.full((9, 28, 2, 64), GARBAGE)
    for p in read:
        k[p], v[p] = torch.randn(28, 2, 64, generator=gen), torch.randn(28, 2, 64, generator=gen)
    k, v = k.to("cuda", torch.bfloat16), v.to("cuda", torch.bfloat16)
    q = torch.randn(34, 2, 64, generator=gen).cuda()
    step = StepPlan(num_frames=1, store=False, phase1=False, first_position=0, frame_pages=(), special_slots=(),
                    read_pages=read, last_page_len=20, new_pages=(), evict=0, page_size=28)
    slots = torch.cat([torch.arange(p * 28, p * 28 + (20 if p == 7 else 28)) for p in read])
    plan = DevicePlan(plan=step, write_slots=torch.empty(0, dtype=torch.long, device="cuda"),
                      read_pages=torch.tensor(read, dtype=torch.int32).cuda(), read_slots=slots.cuda(),
                      tokens_per_frame=34)
    backend.begin_step(plan)
    backend.prepare(k)
    assert backend.splits == 7
    out = backend.attend(q, k, v)
    assert (out.float() - reference(plan, q, k, v)).abs().max().item() < ABS_TOL
