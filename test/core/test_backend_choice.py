"""Which attention backend ``auto`` picks per GPU architecture (faked capabilities, CPU), and
the bookkeeping of the ``sdpa`` backend's FlashAttention varlen form (its requests over the
pool's runs, the log-sum-exp conversion and the merge) with PyTorch ops in place of the kernel."""
from __future__ import annotations

import logging

import pytest
import torch

from lingbot_map_ros.cache import attention
from lingbot_map_ros.cache.attention import SdpaBackend, choose_backend, make_backend
from lingbot_map_ros.cache.flashinfer_backend import FragmentedPool
from lingbot_map_ros.cache.pages import PageTable, StepPlan
from lingbot_map_ros.cache.pool import DevicePlan
from lingbot_map_ros.cache.varlen import FlashVarlenBackend, attention_reference, auto_splits, flash_varlen_supported

BF16 = torch.bfloat16


@pytest.mark.parametrize("cap, flashinfer, expected", [
    ((9, 0), True, "flashinfer-fa3"),  # H100 / H200 / GH200
    ((9, 0), False, "sdpa"),
    ((8, 0), True, attention.FA2_CLASS_BACKEND),  # A100
    ((8, 6), True, attention.FA2_CLASS_BACKEND),  # RTX 30xx, A10, A40
    ((8, 7), True, attention.FA2_CLASS_BACKEND),  # Jetson AGX Orin
    ((8, 9), True, attention.FA2_CLASS_BACKEND),  # RTX 40xx, L4, L40
    ((8, 9), False, "sdpa"),
    ((7, 5), True, "sdpa"),  # Turing: no FlashAttention-2, no FlashInfer FA2 build of ours
    ((10, 0), True, attention.FA2_CLASS_BACKEND),  # Blackwell: not Hopper's FA3 either
])
def test_auto_choice_per_capability(cap, flashinfer, expected):
    name, why = choose_backend("cuda", cap, flashinfer, BF16)
    assert name == expected
    assert f"sm_{cap[0]}{cap[1]}" in why


def test_auto_choice_without_a_gpu_or_with_float32():
    assert choose_backend("cpu", None, True, None)[0] == "sdpa"
    assert choose_backend("cuda", (9, 0), True, torch.float32)[0] == "sdpa"
    assert choose_backend("cuda", (8, 9), True, torch.float32)[0] == "sdpa"


def test_the_fa2_class_path_is_a_real_backend():
    assert attention.FA2_CLASS_BACKEND in ("sdpa", "flashinfer-fa2")


def test_make_backend_auto_logs_its_choice_once_with_the_capability(monkeypatch, caplog):
    seen = []
    monkeypatch.setattr(attention.torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(attention, "flashinfer_available", lambda: False)
    monkeypatch.setattr(attention, "_auto_logged", set())

    class Fake:
        def __init__(self, device, dtype, **kwargs):
            seen.append((device.type, dtype, kwargs))

    import lingbot_map_ros.cache.varlen as varlen
    monkeypatch.setattr(varlen, "FlashVarlenBackend", Fake)
    monkeypatch.setattr(varlen, "flash_varlen_supported", lambda device, dtype: None)
    with caplog.at_level(logging.INFO, logger="lingbot_map_ros.cache.attention"):
        make_backend("auto", torch.device("cuda"), BF16, kv_splits=5)
        make_backend("auto", torch.device("cuda"), BF16)
    assert seen and seen[0][:2] == ("cuda", BF16) and seen[0][2]["kv_splits"] == 5
    lines = [r.getMessage() for r in caplog.records if "auto ->" in r.getMessage()]
    assert lines == ["attention backend auto -> sdpa (sm_89, FlashInfer not installed: PyTorch's FlashAttention-2 "
                     "over the pool's runs)"]


def test_make_backend_auto_takes_the_fa2_class_path_on_ada_with_flashinfer(monkeypatch, caplog):
    made = []
    monkeypatch.setattr(attention.torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(attention, "flashinfer_available", lambda: True)
    monkeypatch.setattr(attention, "_auto_logged", set())
    import lingbot_map_ros.cache.flashinfer_backend as fib

    class Fake:
        def __init__(self, device, variant, dtype, **kwargs):
            made.append(variant)

    monkeypatch.setattr(fib, "FlashInferBackend", Fake)
    with caplog.at_level(logging.INFO, logger="lingbot_map_ros.cache.attention"):
        make_backend("auto", torch.device("cuda"), BF16)
        make_backend("flashinfer", torch.device("cuda"), BF16)  # plain flashinfer: FA2 off Hopper too
        make_backend("flashinfer-fa2-paged", torch.device("cuda"), BF16)
    assert made == ["fa2", "fa2", "fa2-paged"]
    assert [r.getMessage() for r in caplog.records if "auto ->" in r.getMessage()] == [
        "attention backend auto -> flashinfer-fa2 (sm_89: FA3 needs Hopper; the FA2-class path (flashinfer-fa2))"]


def test_fa2_over_the_runs_splits_like_fa3_and_the_paged_form_does_not():
    from lingbot_map_ros.cache.flashinfer_backend import auto_kv_splits

    assert auto_kv_splits(1005, 16, 64, 74, 132, "fa2") == 8  # measured best on an H200
    assert auto_kv_splits(1005, 16, 64, 74, 16, "fa2") == 1  # Orin-sized: 128 items already fill it
    assert auto_kv_splits(1005, 16, 64, 74, 132, "fa2-paged") == 1


def test_sdpa_on_cpu_or_float32_is_the_gather_form():
    assert isinstance(make_backend("sdpa", torch.device("cpu"), torch.float32), SdpaBackend)
    assert isinstance(make_backend("sdpa", torch.device("cpu"), BF16), SdpaBackend)
    assert isinstance(make_backend("auto", torch.device("cpu"), torch.float32), SdpaBackend)
    assert flash_varlen_supported(torch.device("cpu"), BF16) is not None


def test_varlen_backend_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="CUDA"):
        FlashVarlenBackend(torch.device("cpu"), BF16)
    with pytest.raises(ValueError, match="kv_splits"):
        FlashVarlenBackend(torch.device("cpu"), BF16, kv_splits=0, reference=True)


def test_auto_splits_fill_the_gpu():
    assert auto_splits(1005, 16, 132) == 8  # 128 items per request, 3.5 waves of 264 resident blocks
    assert auto_splits(1005, 16, 58) == 4  # an RTX 4090-sized GPU needs fewer
    assert auto_splits(8 * 1005, 16, 132) == 1  # phase 1: eight frames of queries fill the GPU
    assert auto_splits(100, 1, 10_000) == 32  # capped


def _plan(read_pages, last, page_size, qo_len):
    step = StepPlan(num_frames=1, store=False, phase1=False, first_position=0, frame_pages=(), special_slots=(),
                    read_pages=tuple(read_pages), last_page_len=last, new_pages=(), evict=0, page_size=page_size)
    return DevicePlan(plan=step, write_slots=torch.empty(0, dtype=torch.long),
                      read_pages=torch.tensor(read_pages, dtype=torch.int32), tokens_per_frame=qo_len)


def _pool(pages, page_size, heads, dim, seed, read, last):
    gen = torch.Generator().manual_seed(seed)
    k = torch.full((pages, page_size, heads, dim), 1e3)
    v = torch.full((pages, page_size, heads, dim), 1e3)
    idx = torch.tensor(read)
    k[idx] = torch.randn(len(read), page_size, heads, dim, generator=gen)
    v[idx] = torch.randn(len(read), page_size, heads, dim, generator=gen)
    k[read[-1], last:] = 1e3  # past the last page's tokens: never read
    v[read[-1], last:] = 1e3
    return k, v


@pytest.mark.parametrize("read, last, splits", [
    ([2, 3, 5, 6, 7, 9, 10], 3, None),  # three runs, a partial last page
    ([7, 2, 3, 10], 5, 6),  # out of order: the runs are what matters
    ([4], 1, 1),  # one token
    ([2, 3, 4, 5, 9, 10], 8, 11),  # more splits than pages
])
def test_varlen_requests_match_attention_over_the_gathered_keys(read, last, splits):
    page_size, heads, dim, qo = 8, 2, 16, 13
    k, v = _pool(12, page_size, heads, dim, 1, read, last)
    q = torch.randn(qo, heads, dim, generator=torch.Generator().manual_seed(2))
    plan = _plan(read, last, page_size, qo)
    ref = SdpaBackend()
    ref.begin_step(plan)
    expected = ref.attend(q, k, v)
    b = FlashVarlenBackend(torch.device("cpu"), torch.float32, kv_splits=splits, reference=True)
    b.begin_step(plan)
    out = b.attend(q, k, v)
    assert b.splits >= 1
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    # queries written straight into the backend's buffer give the same result
    buf = b.query_buffer(k)
    buf.copy_(q.expand(b.splits, -1, -1, -1))
    torch.testing.assert_close(b.attend(buf, k, v), out, atol=0, rtol=0)


def test_graph_mode_keeps_its_buffers_and_refuses_a_pool_fragmented_past_its_splits():
    page_size, heads, dim, qo = 8, 2, 16, 5
    read = [2, 3, 4, 6, 7, 9]
    k, v = _pool(12, page_size, heads, dim, 3, read, 4)
    q = torch.randn(qo, heads, dim)
    b = FlashVarlenBackend(torch.device("cpu"), torch.float32, graph_pages=12, min_graph_pages=4, reference=True)
    b.begin_step(_plan(read, 4, page_size, qo))
    qbuf = b.query_buffer(k)
    index = b._buffers[("index", (2, 2 * b.splits + 1), torch.int32)]
    first = b.attend(q, k, v)
    assert b.splits == 4 and b._max_k == 12 * page_size  # fixed for a capture
    ref = SdpaBackend()
    ref.begin_step(_plan(read, 4, page_size, qo))
    torch.testing.assert_close(first, ref.attend(q, k, v), atol=2e-5, rtol=1e-4)
    # the next step: other pages, the same buffers (addresses a captured graph holds)
    read2 = [3, 4, 5, 6, 9, 10]
    k2, v2 = _pool(12, page_size, heads, dim, 4, read2, 8)
    b.begin_step(_plan(read2, 8, page_size, qo))
    out = b.attend(q, k2, v2)
    assert b.query_buffer(k2).data_ptr() == qbuf.data_ptr()
    assert b._buffers[("index", (2, 2 * b.splits + 1), torch.int32)].data_ptr() == index.data_ptr()
    ref.begin_step(_plan(read2, 8, page_size, qo))
    torch.testing.assert_close(out, ref.attend(q, k2, v2), atol=2e-5, rtol=1e-4)
    # five runs for four splits: refused before anything ran (the session runs it eagerly)
    b.begin_step(_plan([0, 2, 4, 6, 8, 10], 8, page_size, qo))
    with pytest.raises(FragmentedPool):
        b.prepare(k)


def test_a_full_window_of_the_page_table_fits_a_graph_step():
    """The runs of real plans (free page in the window, special stream, scratch pages) stay
    within the graph's minimum split count."""
    table = PageTable(page_size=999, num_scale_frames=8, sliding_window=64, max_frames=1024)
    from lingbot_map_ros.cache.flashinfer_backend import visible_runs
    table.apply(table.plan_step(8, True))
    worst = 0
    for i in range(150):
        plan = table.plan_step(1, store=i % 3 != 2)
        worst = max(worst, len(visible_runs(plan.read_pages, plan.last_page_len, 999)))
        table.apply(plan)
    assert worst <= 4


def test_reference_kernel_log_sum_exp_is_natural_log_per_head_and_query():
    q, k, v = torch.randn(3, 2, 4), torch.randn(7, 2, 4), torch.randn(7, 2, 4)
    out, lse = attention_reference(q, k, v, [0, 3], [0, 7])
    s = torch.einsum("qhd,khd->hqk", q, k) / 2
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", s.softmax(-1), v))


def test_sdpa_gather_form_reads_one_run_as_a_view_and_several_without_an_index_gather():
    page_size, heads, dim, qo = 8, 2, 16, 5
    k, v = _pool(12, page_size, heads, dim, 5, [3, 4, 5], 6)
    q = torch.randn(qo, heads, dim)
    b = SdpaBackend()
    b.begin_step(_plan([3, 4, 5], 6, page_size, qo))
    one = b._visible(k)
    assert one.data_ptr() == k[3].data_ptr() and one.shape == (2 * 8 + 6, heads, dim)  # a view, no copy
    slots = torch.cat([torch.arange(3 * 8, 5 * 8 + 6)])
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.view(-1, heads, dim)[slots].transpose(0, 1)[None],
        v.view(-1, heads, dim)[slots].transpose(0, 1)[None])[0].transpose(0, 1)
    torch.testing.assert_close(b.attend(q, k, v), expected)
    read = [9, 2, 3, 7]  # three runs in the listed order; the last listed page is partial
    k, v = _pool(12, page_size, heads, dim, 6, read, 3)
    b.begin_step(_plan(read, 3, page_size, qo))
    slots = torch.cat([torch.arange(p * 8, p * 8 + (3 if p == 7 else 8)) for p in read])
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.view(-1, heads, dim)[slots].transpose(0, 1)[None],
        v.view(-1, heads, dim)[slots].transpose(0, 1)[None])[0].transpose(0, 1)
    torch.testing.assert_close(b.attend(q, k, v), expected, atol=1e-5, rtol=1e-4)


def test_ordered_runs_keep_the_listed_order_and_merge_neighbours():
    from lingbot_map_ros.cache.attention import ordered_runs

    assert ordered_runs([3, 4, 5, 9, 2, 10], 4, 8) == [(24, 48), (72, 80), (16, 24), (80, 84)]
    assert ordered_runs([7], 1, 8) == [(56, 57)]
    assert ordered_runs([5, 4], 8, 8) == [(40, 48), (32, 40)]  # descending neighbours stay apart
