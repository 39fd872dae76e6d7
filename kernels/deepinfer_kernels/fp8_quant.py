"""Per-token, per-128-channel FP8 (e4m3) activation quantisation with power-of-two scales: the
reference's `act_quant` (core reference: `deepinfer_core.ops.quant.fake_quant_fp8`).

For each row and each group of 128 channels: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(x / s).
Dividing by a power of two is exact, so q * s is bit-for-bit the core's fake-quantised value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_args, pdl_gate

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
GROUP = 128


@triton.jit
def _pow2_ceil(t):
    """2^ceil(log2 t) for positive normal fp32 t, from the exponent and mantissa bits."""
    bits = t.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3_grid(v):
    """Round |v| <= 448 to the nearest e4m3 value, ties to even, in fp32, so the cast that follows is
    exact (the compiled cast rounds to nearest even; Triton's interpreter rounds ties away from zero).
    The grid step is 2^(exponent - 3) for normals and 2^-9 below 2^-6; adding and subtracting
    1.5 * 2^23 * step rounds to a multiple of step in fp32's own round-to-nearest-even."""
    e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = ((tl.maximum(e, 121) - 3) << 23).to(tl.float32, bitcast=True)
    big = step * 12582912.0                           # 1.5 * 2^23 * step
    return (v + big) - big


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, n_groups,
                      GROUP_SIZE: tl.constexpr, FLOOR: tl.constexpr, QMAX: tl.constexpr, VALUES: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR)
    s = _pow2_ceil(amax / QMAX)
    q = _round_to_e4m3_grid(tl.clamp(x / s, -QMAX, QMAX))
    if VALUES:      # q is on the e4m3 grid, so q * s is the stored pair's exact float32 value
        tl.store(q_ptr + row * stride_q + offs, q * s, mask=mask)
    else:
        tl.store(q_ptr + row * stride_q + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row * n_groups + g, s)


def _quantise(x: torch.Tensor, values: bool, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise ValueError(f"{name} expects a 2-D tensor, got shape {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    M, K = x.shape
    n_groups = triton.cdiv(K, GROUP)
    q = torch.empty((M, K), dtype=torch.float32 if values else torch.float8_e4m3fn, device=x.device)
    s = q if values else torch.empty((M, n_groups), dtype=torch.float32, device=x.device)
    if M:
        _act_quant_kernel[(M, n_groups)](x, q, s, K, x.stride(0), q.stride(0), n_groups,
                                         GROUP_SIZE=GROUP, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, VALUES=values,
                                         **launch_args(x))
    return q, s


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32)."""
    return _quantise(x, False, "act_quant")


def act_quant_values(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float32 [M, K]: `act_quant`'s q * scale (exact: a power-of-two scale times an e4m3
    value) in one launch, for the CUDA-core MoE kernels, which take their activations as float32."""
    return _quantise(x, True, "act_quant_values")[0]
