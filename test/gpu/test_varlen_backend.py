"""The ``sdpa`` backend's GPU form (PyTorch's FlashAttention-2 varlen kernel over the pool's
runs, ``cache.varlen``) and FlashInfer's FA2 kernel in CUDA-graph mode, against float32 attention
(FlashInfer's FA2 in eager mode, ragged and paged, with split-KV: ``test_flashinfer_backend.py``).

As in ``test_flashinfer_backend.py``: shuffled visible pages of a random bf16 pool, every
slot that is not visible filled with large values, the reference ``SdpaBackend`` in
float32 over the same bf16 values; the same bounds. Also: the CUDA-graph form captured
and replayed over another step's plan, and ``make_backend`` giving this form for sdpa.
Run on the GPU machine: ``pytest -m gpu test/gpu/test_varlen_backend.py``.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from lingbot_map_ros.cache.attention import SdpaBackend, make_backend
from lingbot_map_ros.cache.pages import StepPlan
from lingbot_map_ros.cache.pool import DevicePlan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ABS_TOL = 2e-2  # today's bounds of the FlashInfer backends (test_flashinfer_backend.py)
MIN_COSINE = 0.999
GARBAGE = 1e3

# (page_size, visible pages, tokens in the last page, qo_len, heads); head_dim 64
CASES = [
    (999, 20, 500, 1005, 16),
    (999, 9, 999, 2 * 1005, 16),
    (999, 1, 6, 1005, 16),
    (777, 13, 1, 1005, 16),
    (28, 40, 13, 1005, 2),
    (28, 3, 28, 2 * 1005, 2),
]


def make_step(page_size, num_pages, last_page_len, qo_len, heads, seed, pool_pages=None, read=None):
    gen = torch.Generator().manual_seed(seed)
    pool_pages = pool_pages or 2 * num_pages + 3
    if read is None:
        read = torch.randperm(pool_pages, generator=gen)[:num_pages]
    read = torch.as_tensor(read)
    shape = (pool_pages, page_size, heads, 64)
    k = torch.full(shape, GARBAGE)
    v = torch.full(shape, GARBAGE)
    k[read] = torch.randn((len(read), *shape[1:]), generator=gen)
    v[read] = torch.randn((len(read), *shape[1:]), generator=gen)
    k[read[-1], last_page_len:] = GARBAGE
    v[read[-1], last_page_len:] = GARBAGE
    q = torch.randn(qo_len, heads, 64, generator=gen)
    step = StepPlan(num_frames=1, store=False, phase1=False, first_position=0, frame_pages=(), special_slots=(),
                    read_pages=tuple(read.tolist()), last_page_len=last_page_len, new_pages=(), evict=0,
                    page_size=page_size)
    plan = DevicePlan(plan=step, write_slots=torch.empty(0, dtype=torch.long, device="cuda"),
                      read_pages=read.to(torch.int32).cuda(), tokens_per_frame=qo_len)
    return plan, q.cuda(), k.to("cuda", torch.bfloat16), v.to("cuda", torch.bfloat16)


def reference(plan, q, k, v):
    sdpa = SdpaBackend()
    sdpa.begin_step(plan)
    return sdpa.attend(q.to(torch.bfloat16).float(), k.float(), v.float())


def check(out, ref, what):
    err = (out.float() - ref).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    print(f"ATTN {what}: max abs err {err:.2e}, cosine {cos:.6f}")
    assert err < ABS_TOL and cos > MIN_COSINE, f"{what}: max abs err {err:.3e}, cosine {cos:.6f}"


@pytest.mark.parametrize("splits", [None, 1, 3, 16])
@pytest.mark.parametrize("case", CASES, ids=[f"ps{c[0]}-n{c[1]}-last{c[2]}-q{c[3]}" for c in CASES])
def test_varlen_matches_fp32(case, splits):
    from lingbot_map_ros.cache.varlen import FlashVarlenBackend

    backend = FlashVarlenBackend(torch.device("cuda"), torch.bfloat16, kv_splits=splits)
    plan, q, k, v = make_step(*case, seed=sum(case) + (splits or 0))
    backend.begin_step(plan)
    out = backend.attend(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    check(out, reference(plan, q, k, v), f"varlen splits {splits} -> {backend.splits} {case}")
    buf = backend.query_buffer(k)
    buf.copy_(q.to(torch.bfloat16).unsqueeze(0).expand_as(buf))
    torch.testing.assert_close(backend.attend(buf, k, v), out, rtol=0, atol=0)


def test_make_backend_gives_the_varlen_form_for_sdpa_on_a_gpu():
    from lingbot_map_ros.cache.varlen import FlashVarlenBackend

    assert isinstance(make_backend("sdpa", torch.device("cuda"), torch.bfloat16), FlashVarlenBackend)
    assert isinstance(make_backend("sdpa", torch.device("cuda"), torch.float32), SdpaBackend)


def graph_backend(kind):
    if kind == "varlen":
        from lingbot_map_ros.cache.varlen import FlashVarlenBackend

        return FlashVarlenBackend(torch.device("cuda"), torch.bfloat16, graph_pages=40, min_graph_pages=10)
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(torch.device("cuda"), kind, torch.bfloat16, graph_pages=40, min_graph_pages=10)


@pytest.mark.parametrize("kind", ["varlen", "fa2", "fa2-paged"])
def test_graph_mode_captures_once_and_replays_other_plans(kind):
    """Captured with one step's plan, replayed after ``prepare`` of others (a full-window-like
    layout: patch pages around a free one, the special pages after them): the sdpa backend's
    varlen form and FlashInfer's FA2 over the runs (the FA2-class path) and paged."""
    backend = graph_backend(kind)
    steps = [make_step(999, 0, last, 1005, 16, seed=s, pool_pages=40, read=read) for s, (read, last) in enumerate([
        (list(range(2, 12)) + list(range(13, 30)) + [31, 32], 300),
        (list(range(2, 7)) + list(range(8, 30)) + [31, 32, 33], 999),
        (list(range(3, 30)) + [31], 7),
    ])]
    plan, q, k, v = steps[0]
    backend.begin_step(plan)
    backend.prepare(k)
    kbuf, vbuf = k.clone(), v.clone()
    qbuf = q.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.attend(qbuf, kbuf, vbuf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(qbuf, kbuf, vbuf)
    for plan, q, k, v in steps[1:] + steps[:1]:
        backend.begin_step(plan)
        backend.prepare(kbuf)
        kbuf.copy_(k)
        vbuf.copy_(v)
        qbuf.copy_(q)
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(plan, q, k, v), f"{kind} graph, {backend.splits} splits, {len(plan.plan.read_pages)} pages")
