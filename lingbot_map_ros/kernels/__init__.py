"""Fused GPU kernels (Triton) for the hot path, each with a PyTorch twin.

Every kernel here replaces a chain of small PyTorch ops whose launches and
memory round trips dominate a one-frame step once attention is fast. The PyTorch
twin (same arguments, same maths) runs where Triton or CUDA is absent and is the
reference the GPU tests compare the kernel with. ``available()`` says whether the
Triton versions can run on a device, ``self_check()`` whether they compile and agree
with their twins there. Whether to use them is the caller's value, decided once (the
session: ``StreamingSession.step_options.fused``) and passed to whatever launches them; nothing
here keeps a process-wide switch.
"""
from __future__ import annotations

import importlib.util

import torch


def available(device: torch.device | str) -> bool:
    """True when the Triton kernels can run on ``device`` (CUDA, Triton importable)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return importlib.util.find_spec("triton") is not None


def self_check(device: torch.device | str, heads: int, head_dim: int, widths: tuple[int, ...]) -> str | None:
    """Compile and run each kernel once on small inputs of the model's sizes and compare it
    with its PyTorch twin. Returns None when all agree, else the reason (e.g. Triton cannot
    compile on this machine), so the caller can fall back to the PyTorch path instead of
    failing on the first frame. ``widths``: the channel counts LayerNorm runs on."""
    from torch import nn

    from .layer_norm import layer_norm, layer_norm_reference
    from .merge import merge_reference, merge_states
    from .mlp import gelu_epilogue_mlp, gelu_epilogue_mlp_reference
    from .qk_rope import XOR_HALVES, XOR_INTERLEAVED, qk_norm_rope, qk_norm_rope_reference
    from .residual import residual_add, residual_add_reference

    device = torch.device(device)
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def close(a, b) -> bool:
        return bool(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2))

    try:
        for width in sorted(set(widths)):
            ln = nn.LayerNorm(width).to(device, bf16)
            x = torch.randn(5, width, generator=gen).to(device)
            if not close(layer_norm(x, ln, bf16), layer_norm_reference(x, ln, bf16)):
                return f"layer_norm disagrees with PyTorch at width {width}"
            branch = torch.randn(5, width, generator=gen).to(device, bf16)
            gamma = torch.rand(width, generator=gen).to(device, bf16)
            got, want = residual_add(x, branch, gamma, ln, bf16), residual_add_reference(x, branch, gamma, ln, bf16)
            if not (close(got[0], want[0]) and close(got[1], want[1])):
                return f"the residual update + LayerNorm kernel disagrees with PyTorch at width {width}"
        n = 7
        qkv = torch.randn(n, 3 * heads * head_dim, generator=gen).to(device, bf16)
        qn, kn = nn.LayerNorm(head_dim).to(device, bf16), nn.LayerNorm(head_dim).to(device, bf16)
        ang = torch.randn(n, head_dim, generator=gen).to(device)
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        slots = torch.arange(n, device=device).flip(0)
        for xor in (XOR_HALVES, XOR_INTERLEAVED):
            outs = []
            for fn in (qk_norm_rope, qk_norm_rope_reference):
                q = torch.zeros(2, n, heads, head_dim, dtype=bf16, device=device)
                k = torch.zeros(n, heads, head_dim, dtype=bf16, device=device)
                v = torch.zeros_like(k)
                fn(qkv, heads, qn, kn, cos, sin, xor, q, k, v, slots)
                outs.append((q, k, v))
            if not all(close(a, b) for a, b in zip(*outs)):
                return "the q/k norm + RoPE kernel disagrees with PyTorch"
        o = torch.randn(2, n, heads, head_dim, generator=gen).to(device, bf16)
        lse = torch.randn(2, n, heads, generator=gen).to(device)
        out = torch.empty(n, heads, head_dim, dtype=bf16, device=device)
        if not close(merge_states(o, lse, out), merge_reference(o, lse, torch.empty_like(out))):
            return "the split-KV merge kernel disagrees with PyTorch"
        with torch.random.fork_rng(devices=[]):  # their default init must not move the caller's RNG
            mlp = nn.Module()  # what gelu_epilogue_mlp reads of the model's Mlp: fc1, fc2
            mlp.fc1, mlp.fc2 = nn.Linear(widths[0], 4 * widths[0]), nn.Linear(4 * widths[0], widths[0])
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        mlp = mlp.to(device, bf16)
        x = torch.randn(3, 5, widths[0], generator=gen).to(device, bf16)
        # two bf16 GEMMs in a row: compare relative to the output's scale (rounding of the
        # hidden layer differs, the epilogue applies the GELU before it rounds)
        a, b = gelu_epilogue_mlp(mlp, x).float(), gelu_epilogue_mlp_reference(mlp, x).float()
        if not bool((a - b).abs().max() <= 3e-2 * b.abs().max()):
            return "fc1 with the GELU epilogue disagrees with PyTorch"
        from .gemv import gemv, gemv_reference

        lin = nn.Linear(2 * widths[0], 3 * widths[0]).to(device)
        lin.weight.data = lin.weight.data.to(bf16)
        ln32 = nn.LayerNorm(2 * widths[0]).to(device)
        x = torch.randn(2, 2 * widths[0], generator=gen).to(device)
        res = torch.randn(2, 3 * widths[0], generator=gen).to(device)
        for kw in ({"norm": ln32, "gelu": True}, {"silu": True}, {"residual": res, "gamma": res[0]}):
            a, b = gemv(x, lin, **kw), gemv_reference(x, lin, **kw)
            if not bool((a - b).abs().max() <= 1e-3 * b.abs().max()):
                return f"the camera head's matrix-vector kernel disagrees with PyTorch ({sorted(kw)})"
        from .camera_attention import camera_attention, camera_attention_reference

        cache_k = torch.randn(9, 2, 32, generator=gen).to(device)
        cache_v = torch.randn(9, 2, 32, generator=gen).to(device)
        qkv = [torch.randn(1, 2, 32, generator=gen).to(device) for _ in range(3)]
        slot = torch.tensor([6], device=device)
        a = camera_attention(*qkv, cache_k.clone(), cache_v.clone(), slot)
        b = camera_attention_reference(*qkv, cache_k.clone(), cache_v.clone(), slot)
        if not bool((a - b).abs().max() <= 1e-4 * b.abs().max()):
            return "the camera head's cache attention kernel disagrees with PyTorch"
        from .upsample import upsample_bilinear, upsample_bilinear_reference

        img = torch.randn(1, 12, 3, 5, generator=gen).to(device, bf16).contiguous(memory_format=torch.channels_last)
        if not close(upsample_bilinear(img, (7, 9)), upsample_bilinear_reference(img, (7, 9))):
            return "the bilinear upsampling kernel disagrees with PyTorch"
    except Exception as exc:  # a compiler or driver problem: report it, the caller falls back
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return None
