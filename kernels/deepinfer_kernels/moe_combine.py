"""The combine of a V4 MoE layer: per token, the shared expert's output first and then slots 0..k-1
in that fixed order, summed in fp32, so a token's result never depends on how the batch was permuted.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_gemm import _round
from .pdl import launch_args, pdl_gate


@triton.jit(do_not_specialize=["T"])
def _moe_combine_kernel(y_ptr, out_ptr, T, D, K1: tl.constexpr, SHARED_LAST: tl.constexpr, BT: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (rows < T)[:, None] & (offs < D)[None, :]
    ptrs = y_ptr + rows.to(tl.int64)[:, None] * K1 * D + offs[None, :]
    acc = tl.zeros((BT, BLOCK), dtype=tl.float32)
    for i in tl.static_range(K1):
        j = (i + K1 - SHARED_LAST) % K1        # shared expert (last slot) first, then slots 0..k-1
        acc += tl.load(ptrs + j * D, mask=ok, other=0.0).to(tl.float32)
    if out_ptr.dtype.element_ty != tl.float32:
        acc = _round(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + offs[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_combine(y: torch.Tensor, out_dtype: torch.dtype, shared_last: bool = True) -> torch.Tensor:
    """y [T, K1, D] expert outputs by (token, slot) -> [T, D]: fp32 sum in a fixed order (the last
    slot, the shared expert, first when `shared_last`, then slots 0, 1, ...), cast to out_dtype."""
    if y.dim() != 3 or not y.is_contiguous():
        raise ValueError(f"moe_combine: y must be a contiguous [T, K1, D] tensor, got {tuple(y.shape)}")
    T, K1, D = y.shape
    out = torch.empty((T, D), dtype=out_dtype, device=y.device)
    if T:
        block = min(512, triton.next_power_of_2(D))
        bt = 4096 // block                                 # [bt, block] tiles: 4096 elements a program
        _moe_combine_kernel[(triton.cdiv(T, bt), triton.cdiv(D, block))](
            y, out, T, D, K1=K1, SHARED_LAST=int(shared_last), BT=bt, BLOCK=block, **launch_args(y))
    return out
