"""The project-built FA3 kernel with 128-query tiles (``kernels.fa3_tiles``) on a Hopper GPU.

It must: build (a silent fallback to FlashInfer's module would hide a regression, so the
default backend is checked to really use it), schedule exactly like its Python twin, match
float32 attention over the visible keys (garbage everywhere else) with and without
log-sum-exps, agree with FlashInfer's packaged module, and work inside a CUDA graph whose
schedule is re-planned between replays. Run on the GPU machine: ``pytest -m gpu test/gpu``.
"""
from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="flashinfer is not installed (carry its wheels to the GPU machine, see GPU.md)"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                       reason="the tiled FA3 kernel is built for Hopper (SM90)"),
]

GARBAGE = 1e3


@pytest.fixture(scope="module")
def fa3():
    from lingbot_map_ros.kernels import fa3_tiles

    return fa3_tiles


def attention_fp32(q, k, v):
    """q [n, H, D], k/v [m, H, D] -> (out [n, H, D], natural-log lse [n, H]) in float32."""
    s = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1), v.float()), s.logsumexp(-1).transpose(0, 1)


@pytest.mark.parametrize("qo,kv,heads", [
    ([0, 1005, 2010, 2010, 3015], [0, 7000, 14000, 20000, 26500], 16),
    ([0, 0, 783, 783, 1566, 1566, 1566], [0, 999, 5000, 5000, 9000, 9000, 9000], 16),
    ([0, 34], [0, 56], 2),
])
def test_compiled_plan_equals_its_python_twin(fa3, qo, kv, heads):
    module = fa3.load()
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    capacity = fa3.work_items(qo, heads) + 3
    host = torch.full((fa3.schedule_size(ctas, capacity),), -7, dtype=torch.int32, pin_memory=True)
    works = module.plan(torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32), heads, ctas,
                        capacity, host)
    assert works == fa3.work_items(qo, heads)
    twin = fa3.plan_reference(qo, kv, heads, ctas, capacity)
    used = np.concatenate([np.arange(ctas + 1)] + [ctas + 1 + a * capacity + np.arange(works)
                                                   for a in range(fa3.ITEM_ARRAYS)])
    assert np.array_equal(host.numpy()[used], twin[used])


def test_compiled_plan_refuses_too_small_a_schedule(fa3):
    module = fa3.load()
    host = torch.zeros(fa3.schedule_size(132, 10), dtype=torch.int32)
    with pytest.raises(Exception, match="capacity"):
        module.plan(torch.tensor([0, 1005], dtype=torch.int32), torch.tensor([0, 50], dtype=torch.int32), 16, 132,
                    10, host)


@pytest.mark.parametrize("rows,heads", [(1005, 16), (783, 16), (34, 2), (128, 4), (1, 16)])
def test_ragged_batch_matches_fp32_attention(fa3, rows, heads):
    """Three requests over three runs of one key tensor (garbage around them, plus a request
    without queries over garbage), with log-sum-exps."""
    gen = torch.Generator().manual_seed(rows + heads)
    keys = 6000
    k = torch.full((keys, heads, 64), GARBAGE)
    v = torch.full((keys, heads, 64), GARBAGE)
    spans = [(100, 1300), (1300, 1301), (4000, 5999)]  # a single-key request included
    for a, b in spans:
        k[a:b] = torch.randn(b - a, heads, 64, generator=gen)
        v[a:b] = torch.randn(b - a, heads, 64, generator=gen)
    q = torch.randn(3 * rows, heads, 64, generator=gen)
    qo = [0, 0, rows, 2 * rows, 2 * rows, 3 * rows]
    kv = [0, 100, 1300, 1301, 4000, 5999]  # request 0 and 3: no queries over garbage
    qb, kb, vb = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    attn = fa3.TiledRaggedAttention("cuda")
    attn.plan(torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32), heads, heads, 64)
    out, lse = attn.run(qb, kb, vb, return_lse=True)
    plain = attn.run(qb, kb, vb)
    assert torch.equal(out, plain)
    for j, (a, b) in enumerate(spans):
        ref, ref_lse = attention_fp32(qb[j * rows:(j + 1) * rows], kb[a:b], vb[a:b])
        err = (out[j * rows:(j + 1) * rows].float() - ref).abs().max().item()
        assert err < 2e-2, f"request {j}: max abs err {err:.3e}"
        # FlashInfer's kernels write the log-sum-exp in base 2
        got = lse[j * rows:(j + 1) * rows] * math.log(2.0)
        assert (got - ref_lse).abs().max().item() < 2e-2


def test_default_fa3_backend_uses_the_tiled_kernel_and_agrees_with_flashinfers_module():
    from test_flashinfer_backend import make_step, reference

    from lingbot_map_ros.cache.flashinfer_backend import FlashInferBackend

    plan, q, k, v = make_step(999, 20, 500, 1005, 16, seed=11)
    outs = {}
    for variant in ("fa3", "fa3-stock"):
        backend = FlashInferBackend(torch.device("cuda"), variant, torch.bfloat16, kv_splits=6)
        backend.begin_step(plan)
        outs[variant] = backend.attend(q, k, v).float()
        assert backend.tiles == ((128, 192, 2) if variant == "fa3" else None)
    ref = reference(plan, q, k, v)
    for variant, out in outs.items():
        assert (out - ref).abs().max().item() < 2e-2, variant
    assert (outs["fa3"] - outs["fa3-stock"]).abs().max().item() < 2e-2


def test_graph_replays_read_the_new_schedule(fa3):
    """A captured run reads the schedule buffer: re-planning (other key spans, same request
    shape) between replays changes what the graph computes, and a plan with more work than
    the graph was sized for is refused."""
    heads, rows = 4, 300
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(4000, heads, 64, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(4000, heads, 64, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(2 * rows, heads, 64, generator=gen).to("cuda", torch.bfloat16)
    attn = fa3.TiledRaggedAttention("cuda", fixed=True)
    qo = torch.tensor([0, rows, 2 * rows, 2 * rows], dtype=torch.int32)

    def plan(kv):
        attn.plan(qo, torch.tensor(kv, dtype=torch.int32), heads, heads, 64)

    plan([0, 1000, 1500, 1500])
    out = torch.empty_like(q)
    lse = torch.empty(2 * rows, heads, dtype=torch.float32, device="cuda")
    attn.run(q, k, v, out=out, lse=lse, return_lse=True)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out, lse=lse, return_lse=True)
    for kv in ([0, 1000, 1500, 1500], [0, 10, 3900, 4000], [0, 2000, 2001, 4000]):
        plan(kv)
        graph.replay()
        torch.cuda.synchronize()
        for j in range(2):
            ref, _ = attention_fp32(q[j * rows:(j + 1) * rows], k[kv[j]:kv[j + 1]], v[kv[j]:kv[j + 1]])
            assert (out[j * rows:(j + 1) * rows].float() - ref).abs().max().item() < 2e-2, (kv, j)
    with pytest.raises(ValueError, match="sized for"):
        attn.plan(torch.tensor([0, rows, 3 * rows, 3 * rows], dtype=torch.int32),
                  torch.tensor([0, 10, 20, 30], dtype=torch.int32), heads, heads, 64)


def test_unsupported_inputs_are_named(fa3):
    assert "bf16" in fa3.unsupported(torch.device("cuda"), torch.float16, 64)
    assert "head_dim" in fa3.unsupported(torch.device("cuda"), torch.bfloat16, 128)
    assert fa3.unsupported(torch.device("cuda"), torch.bfloat16, 64) is None
    attn = fa3.TiledRaggedAttention("cuda")
    with pytest.raises(ValueError, match="causal"):
        attn.plan(torch.tensor([0, 4]), torch.tensor([0, 4]), 2, 2, 64, causal=True)
    with pytest.raises(ValueError, match="bf16"):
        attn.plan(torch.tensor([0, 4]), torch.tensor([0, 4]), 2, 2, 64, q_data_type=torch.float16,
                  kv_data_type=torch.float16)
