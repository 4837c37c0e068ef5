"""FP8 (e4m3) matrix multiplies for the transformer's projections and MLPs (``precision: fp8``).

``Fp8Linear`` replaces an ``nn.Linear``: its weight is stored in float8_e4m3fn with one
scale per output channel (the row's amax / 448), and each call quantises its input with one
scale per token (row), then runs ``torch._scaled_mm`` (cuBLASLt FP8 GEMM on Hopper and
Ada, fp32 accumulation, the two scale vectors applied in the epilogue, bias added, output
in bf16). Row-wise scales on both sides keep the error of one product near e4m3's
rounding (about 2^-4 of each row's largest value, averaging down over the sum); the
output is bf16 as before.

Where ``torch._scaled_mm`` cannot run (CPU, GPUs before Ada, a shape it refuses) the same
quantised maths runs as a bf16/fp32 matmul of the dequantised operands (the twin, used by
CPU tests): the numbers match up to the accumulation order.

``quantize_linears_(module, names)`` swaps, in place, the ``nn.Linear`` children named
``names`` (default: the blocks' ``qkv``, ``proj``, ``fc1``, ``fc2``) of every block of
``module`` and returns how many it swapped; the weights' memory halves with them.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEAR_NAMES = ("qkv", "proj", "fc1", "fc2")


def quantize_per_row(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (x8 [M, K] float8_e4m3fn, scale [M, 1] float32) with x8 * scale ~= x."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 GEMMs run natively (CUDA, compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an FP8 weight (per-output-channel scales) and per-token FP8 inputs."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        out_dtype = out_dtype or linear.weight.dtype
        w8, ws = quantize_per_row(linear.weight.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", w8)  # [out, in] fp8
        self.register_buffer("weight_scale", ws.view(1, -1).contiguous())  # [1, out] float32
        bias = linear.bias.detach().to(out_dtype) if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.out_dtype = out_dtype
        self.native = scaled_mm_supported(linear.weight.device) and self.in_features % 16 == 0 \
            and self.out_features % 16 == 0

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x8, xs = quantize_per_row(x.reshape(-1, self.in_features))
        if self.native:
            out = torch._scaled_mm(x8, self.weight.t(), scale_a=xs, scale_b=self.weight_scale, bias=self.bias,
                                   out_dtype=self.out_dtype)
        else:
            out = forward_reference(x8, xs, self.weight, self.weight_scale, self.bias, self.out_dtype)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, row-wise scales"


def forward_reference(x8: Tensor, xs: Tensor, w8: Tensor, ws: Tensor, bias: Tensor | None,
                      out_dtype: torch.dtype) -> Tensor:
    """The FP8 GEMM's maths with dequantised operands in float32 (twin of ``torch._scaled_mm``)."""
    out = (x8.float() @ w8.float().t()) * xs * ws
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def quantize_linears_(module: nn.Module, names: tuple[str, ...] = LINEAR_NAMES,
                      out_dtype: torch.dtype | None = None) -> int:
    """Replace every ``nn.Linear`` child called one of ``names`` under ``module`` by an
    ``Fp8Linear`` (in place); returns the number replaced."""
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if name in names and isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, Fp8Linear(child, out_dtype))
    return len(swaps)


__all__ = ["Fp8Linear", "quantize_linears_", "quantize_per_row", "forward_reference", "scaled_mm_supported",
           "LINEAR_NAMES"]
