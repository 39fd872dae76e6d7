"""Engram's table gather (V4.1): the FP8 E4M3 rows a step's n-grams hash to, each multiplied by
its UE8M0 scales (one per 32 values), written side by side in fp32.

The tables are hundreds of millions of rows per layer, so DeepSeek's engine keeps them in host
memory. This kernel reads them where they are: from device memory, or straight from pinned host
memory through unified virtual addressing (a pinned CPU tensor's pointer is valid on the GPU; Triton
accepts it). The row ids are computed on the device and never leave it, so a step that gathers
from host-resident tables neither copies them nor waits for the host.

Reference: `deepinfer_core.ops.portable_pointwise.gather_rows` (index, then
`fp8.float() * 2^(e-127)`).
The FP8 and scale bytes are decoded from their bits (exact, and the same in the interpreter):
E4M3 normal values are 2^(e-7) * (1 + m/8), subnormal ones m * 2^-9; the E4M3 NaN code is not
expected in a table and decodes as 480.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_args, pdl_gate

SCALE_BLOCK = 32      # values of a row per UE8M0 scale


@triton.jit
def _gather_kernel(w_ptr, s_ptr, rows_ptr, out_ptr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_gate(PDL)
    pid = tl.program_id(0).to(tl.int64)                  # one (token, hashed row) pair
    row = tl.load(rows_ptr + pid).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keep = offs < DIM
    b = tl.load(w_ptr + row * DIM + offs, mask=keep, other=0).to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    val = tl.where((b & 0x80) != 0, -mag, mag)
    s = tl.load(s_ptr + row * (DIM // 32) + offs // 32, mask=keep, other=127).to(tl.int32)
    scale = (s << 23).to(tl.float32, bitcast=True)       # 2^(s - 127)
    tl.store(out_ptr + pid * DIM + offs, val * scale, mask=keep)


def engram_gather(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weight [R, dim] float8_e4m3fn and scale [R, dim / 32] float8_e8m0fnu (device memory, or
    pinned host memory), rows [T, K] int64 on the device -> [T, K * dim] fp32 on rows' device."""
    R, dim = weight.shape
    bad_scale = scale.shape != (R, dim // SCALE_BLOCK)
    if weight.dtype != torch.float8_e4m3fn or bad_scale or dim % SCALE_BLOCK:
        raise ValueError(f"engram_gather: weight [R, dim] float8_e4m3fn with dim a multiple of "
                         f"{SCALE_BLOCK} and scale [R, dim/{SCALE_BLOCK}], got {weight.dtype} "
                         f"{tuple(weight.shape)} and {tuple(scale.shape)}")
    if weight.device.type == "cpu" and rows.device.type == "cuda" and not weight.is_pinned():
        raise ValueError("engram_gather: a host-resident table must be in pinned memory")
    T, K = rows.shape
    out = torch.empty((T, K * dim), dtype=torch.float32, device=rows.device)
    if rows.numel():
        _gather_kernel[(T * K,)](weight.view(torch.uint8), scale.view(torch.uint8),
                                 rows.contiguous(), out, DIM=dim, BLOCK=triton.next_power_of_2(dim),
                                 **launch_args(rows))
    return out
