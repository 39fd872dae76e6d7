"""The grouped GEMMs' K loops with their operands swapped (`moe_w13` / `moe_w2` with
`swap_ab=True`, opt-in, FP8 activations only): y^T = w a^T. At decode sizes a tile has 16 rows; as
the dots' second operand they are Hopper wgmma's N (8 or more), where as the first they would be its
M (64), so Triton compiles the unswapped form to f16 `mma.sync` instead (`benchmarks/aot_sm90.py
--swap` shows both). Not yet run on a GPU: speed and the compiled bits are the next measurement
(`benchmarks/fp4_moe_bench.py --swap-ab`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fp4_experts import fp4_tile


@triton.jit
def _block_swapped(rowsT, r_ok, K, kb, offs_k, offs_n, n_ok, w_ptr, p_ptr, g_ptr, scale, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE_ACC: tl.constexpr, FP4: tl.constexpr,
                   SUB: tl.constexpr, PRMT: tl.constexpr):
    """w x^T over the 128-deep block kb of one expert weight [N, K] and the tile's rows (`rowsT`: each
    row's first input, [1, BLOCK_M]): [BLOCK_N, BLOCK_M] fp32, before the block's scales. FP8: rows of
    `w_ptr`; FP4: decoded from `p_ptr` / `g_ptr` SUB inputs at a time (`scale`: the outputs' block
    scales, which the decode needs), the dots chained in the 128-deep dot's MMA order."""
    if FP4:
        dT = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for j in tl.static_range(BLOCK_K // SUB):
            k0 = kb * BLOCK_K + j * SUB
            offs_s = k0 + tl.arange(0, SUB)
            xT = tl.load(rowsT + offs_s[:, None], mask=(offs_s < K)[:, None] & r_ok[None, :], other=0.0)
            w = fp4_tile(p_ptr, g_ptr, offs_n, n_ok, k0, K, scale, BLOCK_N, SUB, PRMT)
            dT = tl.dot(tl.trans(w), xT, dT, max_num_imprecise_acc=PRECISE_ACC)
    else:
        k_ok = offs_k < K - kb * BLOCK_K
        xT = tl.load(rowsT + kb * BLOCK_K + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        wT = tl.load(w_ptr + offs_n[:, None] * K + kb * BLOCK_K + offs_k[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        dT = tl.dot(wT, xT, max_num_imprecise_acc=PRECISE_ACC)
    return dT


@triton.jit
def _w2_loop_swapped(a_ptr, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, w_ptr, p_ptr, g_ptr, s_ptrs, I, stride_a,
                     N_KG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISE_ACC: tl.constexpr, FP4: tl.constexpr, SUB: tl.constexpr, PRMT: tl.constexpr):
    """`_w2_loop` with FP8 activations and the operands swapped: y^T = w a^T, the weights first (wgmma's
    A operand, which may sit in registers; the tile's rows become its N, 8 or more, instead of its M,
    64) and the rows second. The same products and the same 32-deep chain per 128-deep block; the
    block's scales multiply in the same order."""
    aT_rows = a_ptr + offs_r[None, :] * stride_a
    accT = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(0, N_KG):
        sw = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
        sa = tl.load(as_ptr + offs_r * N_KG + kb, mask=r_ok, other=0.0)
        dT = _block_swapped(aT_rows, r_ok, I, kb, offs_k, offs_n, n_ok, w_ptr, p_ptr, g_ptr, sw, BLOCK_M, BLOCK_N,
                            BLOCK_K, PRECISE_ACC, FP4, SUB, PRMT)
        accT += dT * sa[None, :] * sw[:, None]
    return tl.trans(accT)


@triton.jit
def _w13_loop_swapped(x_ptr, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, w_ptr, pg_ptr, gg_ptr, sg_ptrs, I, D, stride_x,
                      N_KG: tl.constexpr, NB_I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISE_ACC: tl.constexpr, FP4: tl.constexpr, SUB: tl.constexpr,
                      PRMT: tl.constexpr):
    """`_w13_loop` with FP8 activations and the operands swapped (as `_w2_loop_swapped`): the w1 (gate)
    and w3 (up) accumulators of one tile, [BLOCK_M, BLOCK_N] each. `w_ptr`: the expert's FP8 w1 rows
    (its w3 rows follow, I * D further; FP4 codes and scale bytes likewise after pg_ptr / gg_ptr)."""
    xT_rows = x_ptr + tok[None, :] * stride_x
    su_ptrs = sg_ptrs + NB_I * N_KG
    accT_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    accT_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(0, N_KG):
        sg = tl.load(sg_ptrs + kb, mask=n_ok, other=0.0)
        su = tl.load(su_ptrs + kb, mask=n_ok, other=0.0)
        sa = tl.load(xs_ptr + tok * N_KG + kb, mask=r_ok, other=0.0)
        dg = _block_swapped(xT_rows, r_ok, D, kb, offs_k, offs_n, n_ok, w_ptr, pg_ptr, gg_ptr, sg, BLOCK_M,
                            BLOCK_N, BLOCK_K, PRECISE_ACC, FP4, SUB, PRMT)
        du = _block_swapped(xT_rows, r_ok, D, kb, offs_k, offs_n, n_ok, w_ptr + I * D, pg_ptr + I * (D // 2),
                            gg_ptr + I * (D // 32), su, BLOCK_M, BLOCK_N, BLOCK_K, PRECISE_ACC, FP4, SUB, PRMT)
        accT_g += dg * sa[None, :] * sg[:, None]
        accT_u += du * sa[None, :] * su[:, None]
    return tl.trans(accT_g), tl.trans(accT_u)
