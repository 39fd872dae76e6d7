"""Batch-invariant dense GEMM: C[g] = X[g] @ W[g]^T for bf16 or fp32 operands, fp32 accumulation.

cuBLAS picks its algorithm (tile shape, split-K) by the problem's M, so a row's bits change with the
number of rows in the launch. This kernel fixes everything that decides a row's summation order
from the weight shape alone: the tile (`INVARIANT_CONFIG`, never a function of M), the K loop order,
and a split-K count `splits_for(N, K)` (decode layers with few output tiles still spread over the
SMs) whose partials are added in split order by `fp8_gemm.sum_splits`. fp32 inputs multiply
in IEEE fp32 (no tf32); bf16 x bf16 products are exact in fp32.

`g` is an optional group axis (V4's block-diagonal wo_a): X [M, G, K] strided, W [G, N, K].
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_gemm import _num_sms, _tile_ids, split_partials, sum_splits
from .pdl import launch_args, pdl_gate

if os.environ.get("TRITON_INTERPRET") == "1":
    from . import sparse_attention  # noqa: F401  (installs the interpreter's loop-bound fix)

INVARIANT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
FP32_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)   # fp32 tiles: shared memory


@triton.jit(do_not_specialize=["M", "K_PER_SPLIT"])
def _dense_gemm_kernel(x_ptr, w_ptr, c_ptr, M, N, K, s_xm, s_xg, s_wg, s_wn, s_cs, s_cm, s_cg,
                       K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    pid = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_base = x_ptr + g.to(tl.int64) * s_xg + offs_m.to(tl.int64)[:, None] * s_xm
    w_base = w_ptr + g.to(tl.int64) * s_wg + offs_n.to(tl.int64)[None, :] * s_wn
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_hi
        x = tl.load(x_base + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:      # the interpreter multiplies bf16 tiles wrongly; the products are exact in fp32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    c = c_ptr + split * s_cs + g.to(tl.int64) * s_cg + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def splits_for(N: int, K: int, groups: int, cfg: dict, num_sms: int) -> int:
    """Split-K count from the weight shape only (never M): enough programs for one row to use about
    half the SMs, each split at least 4 K tiles deep."""
    tiles = triton.cdiv(N, cfg["BLOCK_N"]) * groups
    if tiles >= num_sms // 2:
        return 1
    return max(1, min(triton.cdiv(K, 4 * cfg["BLOCK_K"]), (num_sms // 2) // tiles))


def dense_gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N]; or grouped x [M, G, K] @ w [G, N, K] -> [M, G, N].
    x and w share a dtype (bf16 or fp32); fp32 accumulation; out_dtype defaults to x's."""
    grouped = x.dim() == 3
    if grouped != (w.dim() == 3) or x.dim() not in (2, 3) or x.shape[-1] != w.shape[-1] or \
            (grouped and x.shape[1] != w.shape[0]):
        raise ValueError(f"dense_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit "
                         f"([M, K] x [N, K] or [M, G, K] x [G, N, K])")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dense_gemm: x and w must both be bfloat16 or float32, got {x.dtype}, {w.dtype}")
    M, K = x.shape[0], x.shape[-1]
    G = x.shape[1] if grouped else 1
    N = w.shape[-2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w.contiguous()
    out_dtype = out_dtype or x.dtype
    c = torch.empty((M, G, N) if grouped else (M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return c
    cfg = dict(FP32_CONFIG if x.dtype == torch.float32 else INVARIANT_CONFIG)
    splits = splits_for(N, K, G, cfg, _num_sms(x.device))
    per = triton.cdiv(triton.cdiv(K, splits), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    splits = triton.cdiv(K, per)
    dest, s_cs = split_partials(c, splits)
    s_xg = x.stride(1) if grouped else 0
    s_wg = w.stride(0) if grouped else 0
    s_cg = N if grouped else 0
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), G, splits)
    _dense_gemm_kernel[grid](x, w, dest, M, N, K, x.stride(0), s_xg, s_wg, w.stride(-2), s_cs, G * N, s_cg,
                             per, GROUP_M=8, IEEE=x.dtype == torch.float32,
                             UPCAST=os.environ.get("TRITON_INTERPRET") == "1", **cfg, **launch_args(x))
    if splits > 1:
        sum_splits(dest, s_cs, c, splits)
    return c
