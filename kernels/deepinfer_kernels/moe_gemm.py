"""Grouped block-scaled FP8 GEMMs over the routed (and shared) experts of a V4 MoE layer, and the
combine (core reference: `deepinfer_core.model.moe.Expert` run by `PortableMoE.apply`).

Rows are the (token, slot) pairs sorted by expert (`order[r]` = token * K1 + slot); every program
takes one BLOCK_M tile of one expert's rows (found from the device-side schedule of
`moe_routing.expert_schedule`) times one N tile, so empty experts cost nothing and the grid is a
host-known bound.

`moe_w13`: g = w1 x, u = w3 x from the gathered token rows (no permutation copy), rounded to the
compute dtype as the reference's linear layers return it; routed experts clamp u to +-limit and g
to <= limit; a = route_weight * silu(g) * u, rounded to x's dtype, then (QAT) quantised per row and
128 channels to FP8 in the epilogue exactly like `fp8_quant.act_quant` (BLOCK_N = 128 = one group).
`moe_w2`: y = w2 a, written back to (token, slot) order (moe_swapped.py: its opt-in form with the
operands swapped). The combine of the slots' outputs: moe_combine.py.

The FP8 recipe is fp8_gemm's: per 128-deep K step a fresh dot, then the activation and weight scale
multiply into the fp32 accumulator. Without QAT the activations stay bf16/fp32 and the FP8 weights are
widened tile by tile (w8a16_gemm's recipe).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp4_experts import Fp4Experts, fp4_tile
from .fp8_quant import AMAX_FLOOR, FP8_MAX, _pow2_ceil, _round_to_e4m3_grid
from .moe_routing import TILE1_BEGIN, TILE2_BEGIN
from .moe_swapped import _w2_loop_swapped, _w13_loop_swapped
from .pdl import launch_args, pdl_gate

BLOCK_K = 128          # = the weight and activation quantisation block
# globals a kernel reads must be constexpr (compiled Triton refuses plain Python numbers)
_QMAX = tl.constexpr(FP8_MAX)
_FLOOR = tl.constexpr(AMAX_FLOOR)
_TILE1 = tl.constexpr(TILE1_BEGIN)
_TILE2 = tl.constexpr(TILE2_BEGIN)
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _find_tile(sched_ptr, t, E1, EB: tl.constexpr, BEGIN_ROW: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, row end) of tile slot t; expert == E1 when t is past the last tile."""
    lanes = tl.arange(0, EB)
    ends = tl.load(sched_ptr + (BEGIN_ROW + 1) * EB + lanes, mask=lanes < E1, other=2147483647)
    e = tl.sum((ends <= t).to(tl.int32), axis=0)
    safe = tl.minimum(e, E1 - 1)
    first = tl.load(sched_ptr + safe) + (t - tl.load(sched_ptr + BEGIN_ROW * EB + safe)) * BLOCK_M
    return e, first, tl.load(sched_ptr + EB + safe)


@triton.jit
def _round(x, DT: tl.constexpr):
    """fp32 x rounded to DT (nearest, ties to even) and kept in fp32, so the cast that follows is exact
    (Triton's interpreter does not round fp32 -> bf16 to nearest; the compiled cast does)."""
    if DT == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _wide_dot(a, w, CDT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Unquantised activations times FP8 weights widened in registers (e4m3 is exact in bf16)."""
    a = a.to(CDT)
    w = w.to(tl.float32).to(CDT)          # via fp32: the interpreter needs it
    if UPCAST:        # Triton's interpreter multiplies bf16 tiles wrongly; bf16 products are exact in fp32
        part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    elif IEEE:
        part = tl.dot(a, w, input_precision="ieee")
    else:
        part = tl.dot(a, w)
    return part


@triton.jit
def _w13_loop(x_rows, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, wg_ptrs, pg_ptr, gg_ptr, sg_ptrs, I, D,
              N_KG: tl.constexpr, NB_I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, QAT_IN: tl.constexpr, CDT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
              PRECISE_ACC: tl.constexpr, FP4: tl.constexpr, SUB: tl.constexpr, PRMT: tl.constexpr):
    """The w1 (gate) and w3 (up) accumulators of one tile over all of D; FP4: the expert's weights are
    decoded from its codes (`fp4_tile`) SUB inputs at a time (the decoded tiles live in registers: a
    whole 128-deep block spills), the dots of one 128-block chained in order as the FP8 tile's are."""
    x_ptrs = x_rows + offs_k[None, :]
    wu_ptrs = wg_ptrs + I * D
    su_ptrs = sg_ptrs + NB_I * N_KG
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, N_KG):
        k_ok = offs_k < D - kb * BLOCK_K
        if not FP4:
            a = tl.load(x_ptrs + kb * BLOCK_K, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        sg = tl.load(sg_ptrs + kb, mask=n_ok, other=0.0)
        su = tl.load(su_ptrs + kb, mask=n_ok, other=0.0)
        if FP4:
            dg = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            du = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(BLOCK_K // SUB):
                k0 = kb * BLOCK_K + j * SUB
                offs_s = k0 + tl.arange(0, SUB)
                a_s = tl.load(x_rows + offs_s[None, :], mask=r_ok[:, None] & (offs_s < D)[None, :], other=0.0)
                wg = fp4_tile(pg_ptr, gg_ptr, offs_n, n_ok, k0, D, sg, BLOCK_N, SUB, PRMT)
                dg = _chain_dot(a_s, wg, dg, QAT_IN, CDT, IEEE, UPCAST, PRECISE_ACC)
                wu = fp4_tile(pg_ptr + I * (D // 2), gg_ptr + I * (D // 32), offs_n, n_ok, k0, D, su, BLOCK_N,
                              SUB, PRMT)
                du = _chain_dot(a_s, wu, du, QAT_IN, CDT, IEEE, UPCAST, PRECISE_ACC)
            if QAT_IN:
                sa = tl.load(xs_ptr + tok * N_KG + kb, mask=r_ok, other=0.0)
                acc_g += dg * sa[:, None] * sg[None, :]
                acc_u += du * sa[:, None] * su[None, :]
            else:
                acc_g += dg * sg[None, :]
                acc_u += du * su[None, :]
        else:
            wg = tl.load(wg_ptrs + kb * BLOCK_K, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            wu = tl.load(wu_ptrs + kb * BLOCK_K, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if QAT_IN:
                sa = tl.load(xs_ptr + tok * N_KG + kb, mask=r_ok, other=0.0)
                acc_g += tl.dot(a, wg, max_num_imprecise_acc=PRECISE_ACC) * sa[:, None] * sg[None, :]
                acc_u += tl.dot(a, wu, max_num_imprecise_acc=PRECISE_ACC) * sa[:, None] * su[None, :]
            else:
                acc_g += _wide_dot(a, wg, CDT, IEEE, UPCAST) * sg[None, :]
                acc_u += _wide_dot(a, wu, CDT, IEEE, UPCAST) * su[None, :]
    return acc_g, acc_u


@triton.jit
def _w2_loop(a_rows, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, w_ptrs, p_ptr, g_ptr, s_ptrs, I,
             N_KG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             QAT: tl.constexpr, CDT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
             PRECISE_ACC: tl.constexpr, FP4: tl.constexpr, SUB: tl.constexpr, PRMT: tl.constexpr):
    """One w2 tile's accumulator over all of I (FP4 as in `_w13_loop`)."""
    a_ptrs = a_rows + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, N_KG):
        k_ok = offs_k < I - kb * BLOCK_K
        sw = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
        if FP4:
            d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(BLOCK_K // SUB):
                k0 = kb * BLOCK_K + j * SUB
                offs_s = k0 + tl.arange(0, SUB)
                a_s = tl.load(a_rows + offs_s[None, :], mask=r_ok[:, None] & (offs_s < I)[None, :], other=0.0)
                w = fp4_tile(p_ptr, g_ptr, offs_n, n_ok, k0, I, sw, BLOCK_N, SUB, PRMT)
                d = _chain_dot(a_s, w, d, QAT, CDT, IEEE, UPCAST, PRECISE_ACC)
            if QAT:
                sa = tl.load(as_ptr + offs_r * N_KG + kb, mask=r_ok, other=0.0)
                acc += d * sa[:, None] * sw[None, :]
            else:
                acc += d * sw[None, :]
        else:
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + kb * BLOCK_K, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if QAT:
                sa = tl.load(as_ptr + offs_r * N_KG + kb, mask=r_ok, other=0.0)
                acc += tl.dot(a, w, max_num_imprecise_acc=PRECISE_ACC) * sa[:, None] * sw[None, :]
            else:
                acc += _wide_dot(a, w, CDT, IEEE, UPCAST) * sw[None, :]
    return acc


@triton.jit
def _chain_dot(a, w, acc, QAT: tl.constexpr, CDT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
               PRECISE_ACC: tl.constexpr):
    """acc + a @ w as one link of a chain of dots over a 128-deep block: the MMAs of a single 128-deep
    dot, in the same order (FP8 activations, or unquantised ones as `_wide_dot` widens them)."""
    if QAT:
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=PRECISE_ACC)
    elif UPCAST:
        acc = tl.dot(a.to(CDT).to(tl.float32), w.to(tl.float32).to(CDT).to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a.to(CDT), w.to(tl.float32).to(CDT), acc, input_precision="ieee")
    else:
        acc = tl.dot(a.to(CDT), w.to(tl.float32).to(CDT), acc)
    return acc


@triton.jit
def swiglu(g, u, clamp, limit, rw, CDT: tl.constexpr, XDT: tl.constexpr):
    """w13's epilogue before act_quant, from the gate and up sums: both rounded to the compute dtype (the
    reference's w1/w3 return it), then in fp32 the routed experts' clamp (`clamp`: u to +-limit, g to
    <= limit; the shared expert has none) and rw * silu(g) * u, rounded to x's dtype (a.to(x.dtype))."""
    if CDT != tl.float32:
        g = _round(g, CDT)
        u = _round(u, CDT)
    u = tl.where(clamp, tl.minimum(tl.maximum(u, -limit), limit), u)
    g = tl.where(clamp, tl.minimum(g, limit), g)
    act = rw * (g * tl.sigmoid(g) * u)
    if XDT != tl.float32:
        act = _round(act, XDT)
    return act


@triton.jit
def _moe_w13_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, p_ptr, g_ptr, order_ptr, rw_ptr, sched_ptr, a_ptr, as_ptr,
                    I, D, E1, E4, n_clamped, limit, stride_x, stride_a,
                    K1: tl.constexpr, EB: tl.constexpr, N_KG: tl.constexpr, NB_I: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    QAT_IN: tl.constexpr, QAT_OUT: tl.constexpr, CDT: tl.constexpr, XDT: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr, PRECISE_ACC: tl.constexpr, W4: tl.constexpr,
                    SUB: tl.constexpr, PRMT: tl.constexpr, SWAP: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, first, row_end = _find_tile(sched_ptr, t, E1, EB, _TILE1, BLOCK_M)
    if e >= E1:
        return
    offs_r = first + tl.arange(0, BLOCK_M)
    r_ok = offs_r < row_end
    src = tl.load(order_ptr + offs_r, mask=r_ok, other=0)        # token * K1 + slot
    tok = src // K1
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < I
    e64 = e.to(tl.int64)
    # w13 [E1, 2, I, D]: w1 rows then w3 rows; scales [E1, 2, NB_I, N_KG]. With W4 the first E4 experts
    # are FP4 (codes [E4, 2, I, D/2], scale bytes [E4, 2, I, D/32]) and w_ptr holds the rest from E4 on.
    wg_ptrs = w_ptr + (e64 - E4) * 2 * I * D + offs_n[None, :] * D + offs_k[:, None]
    pg_ptr = p_ptr + e64 * 2 * I * (D // 2)
    gg_ptr = g_ptr + e64 * 2 * I * (D // 32)
    sg_ptrs = ws_ptr + e64 * 2 * NB_I * N_KG + (offs_n // BLOCK_K) * N_KG
    x_rows = x_ptr + tok[:, None] * stride_x
    # the branch sits outside the K loops (one loop per weight form) so that each loop's loads pipeline
    we_ptr = w_ptr + (e64 - E4) * 2 * I * D
    if SWAP:            # FP8 activations (QAT) only: moe_swapped.py
        if W4:
            if e < E4:
                acc_g, acc_u = _w13_loop_swapped(x_ptr, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, we_ptr, pg_ptr,
                                                 gg_ptr, sg_ptrs, I, D, stride_x, N_KG, NB_I, BLOCK_M, BLOCK_N,
                                                 BLOCK_K, PRECISE_ACC, True, SUB, PRMT)
            else:
                acc_g, acc_u = _w13_loop_swapped(x_ptr, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, we_ptr, pg_ptr,
                                                 gg_ptr, sg_ptrs, I, D, stride_x, N_KG, NB_I, BLOCK_M, BLOCK_N,
                                                 BLOCK_K, PRECISE_ACC, False, SUB, PRMT)
        else:
            acc_g, acc_u = _w13_loop_swapped(x_ptr, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, we_ptr, pg_ptr,
                                             gg_ptr, sg_ptrs, I, D, stride_x, N_KG, NB_I, BLOCK_M, BLOCK_N,
                                             BLOCK_K, PRECISE_ACC, False, SUB, PRMT)
    elif W4:            # a compile-time branch: the FP8 kernels stay exactly what they were
        if e < E4:
            acc_g, acc_u = _w13_loop(x_rows, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, wg_ptrs, pg_ptr, gg_ptr,
                                     sg_ptrs, I, D, N_KG, NB_I, BLOCK_M, BLOCK_N, BLOCK_K, QAT_IN, CDT, IEEE,
                                     UPCAST, PRECISE_ACC, True, SUB, PRMT)
        else:
            acc_g, acc_u = _w13_loop(x_rows, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, wg_ptrs, pg_ptr, gg_ptr,
                                     sg_ptrs, I, D, N_KG, NB_I, BLOCK_M, BLOCK_N, BLOCK_K, QAT_IN, CDT, IEEE,
                                     UPCAST, PRECISE_ACC, False, SUB, PRMT)
    else:
        acc_g, acc_u = _w13_loop(x_rows, xs_ptr, tok, r_ok, offs_k, offs_n, n_ok, wg_ptrs, pg_ptr, gg_ptr, sg_ptrs,
                                 I, D, N_KG, NB_I, BLOCK_M, BLOCK_N, BLOCK_K, QAT_IN, CDT, IEEE, UPCAST, PRECISE_ACC,
                                 False, SUB, PRMT)
    rw = tl.load(rw_ptr + src, mask=r_ok, other=0.0)
    act = swiglu(acc_g, acc_u, e < n_clamped, limit, rw[:, None], CDT, XDT)
    ok = r_ok[:, None] & n_ok[None, :]
    a_ptrs = a_ptr + offs_r[:, None] * stride_a + offs_n[None, :]
    if QAT_OUT:           # act_quant of w2's input: this N tile is exactly one 128-channel group
        act = tl.where(ok, act, 0.0)
        s = _pow2_ceil(tl.maximum(tl.max(tl.abs(act), axis=1), _FLOOR) / _QMAX)
        q = _round_to_e4m3_grid(tl.clamp(act / s[:, None], -_QMAX, _QMAX))
        tl.store(a_ptrs, q.to(tl.float8e4nv), mask=ok)
        tl.store(as_ptr + offs_r * NB_I + pid_n, s, mask=r_ok)
    else:
        if CDT != XDT:
            act = _round(act, CDT)
        tl.store(a_ptrs, act.to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_w2_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, p_ptr, g_ptr, order_ptr, sched_ptr, y_ptr, D, I, E1, E4,
                   stride_a, stride_y, EB: tl.constexpr, N_KG: tl.constexpr, NB_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   QAT: tl.constexpr, CDT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISE_ACC: tl.constexpr, W4: tl.constexpr, SUB: tl.constexpr,
                   PRMT: tl.constexpr, SWAP: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, first, row_end = _find_tile(sched_ptr, t, E1, EB, _TILE2, BLOCK_M)
    if e >= E1:
        return
    offs_r = first + tl.arange(0, BLOCK_M)
    r_ok = offs_r < row_end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < D
    e64 = e.to(tl.int64)
    a_rows = a_ptr + offs_r[:, None] * stride_a
    w_ptrs = w_ptr + (e64 - E4) * D * I + offs_n[None, :] * I + offs_k[:, None]     # w2 [E1, D, I]
    s_ptrs = ws_ptr + e64 * NB_D * N_KG + (offs_n // BLOCK_K) * N_KG
    pe_ptr = p_ptr + e64 * D * (I // 2)
    ge_ptr = g_ptr + e64 * D * (I // 32)
    we_ptr = w_ptr + (e64 - E4) * D * I
    if SWAP:            # FP8 activations (QAT) only: see _w2_loop_swapped
        if W4:
            if e < E4:
                acc = _w2_loop_swapped(a_ptr, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, we_ptr, pe_ptr, ge_ptr,
                                       s_ptrs, I, stride_a, N_KG, BLOCK_M, BLOCK_N, BLOCK_K, PRECISE_ACC, True,
                                       SUB, PRMT)
            else:
                acc = _w2_loop_swapped(a_ptr, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, we_ptr, pe_ptr, ge_ptr,
                                       s_ptrs, I, stride_a, N_KG, BLOCK_M, BLOCK_N, BLOCK_K, PRECISE_ACC, False,
                                       SUB, PRMT)
        else:
            acc = _w2_loop_swapped(a_ptr, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, we_ptr, pe_ptr, ge_ptr,
                                   s_ptrs, I, stride_a, N_KG, BLOCK_M, BLOCK_N, BLOCK_K, PRECISE_ACC, False, SUB,
                                   PRMT)
    elif W4:            # compile-time, as in _moe_w13_kernel
        if e < E4:
            acc = _w2_loop(a_rows, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, w_ptrs, pe_ptr, ge_ptr, s_ptrs, I,
                           N_KG, BLOCK_M, BLOCK_N, BLOCK_K, QAT, CDT, IEEE, UPCAST, PRECISE_ACC, True, SUB, PRMT)
        else:
            acc = _w2_loop(a_rows, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, w_ptrs, pe_ptr, ge_ptr, s_ptrs, I,
                           N_KG, BLOCK_M, BLOCK_N, BLOCK_K, QAT, CDT, IEEE, UPCAST, PRECISE_ACC, False, SUB, PRMT)
    else:
        acc = _w2_loop(a_rows, as_ptr, offs_r, r_ok, offs_k, offs_n, n_ok, w_ptrs, pe_ptr, ge_ptr, s_ptrs, I,
                       N_KG, BLOCK_M, BLOCK_N, BLOCK_K, QAT, CDT, IEEE, UPCAST, PRECISE_ACC, False, SUB, PRMT)
    dest = tl.load(order_ptr + offs_r, mask=r_ok, other=0)
    y_ptrs = y_ptr + dest[:, None] * stride_y + offs_n[None, :]
    if y_ptr.dtype.element_ty != tl.float32:
        acc = _round(acc, y_ptr.dtype.element_ty)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fp4_sub() -> int:
    """Inputs decoded per step from FP4 experts: 32 (one scale group) on the GPU, where a 128-deep block
    of decoded weights would not fit the registers; the whole block under the interpreter, whose fp32
    dot (numpy) rounds a chain of dots unlike one dot, so that CI checks the decode bit for bit."""
    return BLOCK_K if _interpreted() else 32


Experts = torch.Tensor | Fp4Experts      # e4m3 [E1, *rows, N, K], or its first experts kept FP4


def _check_experts(w: Experts, s: torch.Tensor, shape: tuple, name: str) -> dict:
    """The kernel arguments of a stacked expert weight (`w_ptr`, `p_ptr`, `g_ptr`, `E4`, `W4`) after
    checking it and its float32 128x128 block scales against the logical `shape`."""
    if isinstance(w, Fp4Experts):
        if w.shape != shape:
            raise ValueError(f"{name}: expected {shape}, got FP4 experts of {w.shape}")
        # every expert FP4 (V4.1's stacks, without the shared expert): the FP8 pointer is never
        # read, but the FP8 branch is compiled all the same and its dot wants e4m3 weights
        fp8 = w.fp8 if w.fp8.numel() else w.packed.view(torch.float8_e4m3fn)
        args = dict(w_ptr=fp8, p_ptr=w.packed, g_ptr=w.groups, E4=w.num_fp4, W4=True)
    elif w.dtype != torch.float8_e4m3fn or tuple(w.shape) != shape or not w.is_contiguous():
        raise ValueError(f"{name}: expected contiguous float8_e4m3fn {shape}, got {w.dtype} {tuple(w.shape)}")
    else:
        args = dict(w_ptr=w, p_ptr=w, g_ptr=w, E4=0, W4=False)
    want = shape[:-2] + (triton.cdiv(shape[-2], BLOCK_K), triton.cdiv(shape[-1], BLOCK_K))
    if s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
        raise ValueError(f"{name} scales: expected contiguous float32 {want}, got {s.dtype} {tuple(s.shape)}")
    return args


def moe_w13(x: torch.Tensor, x_scale: torch.Tensor | None, w13: Experts, s13: torch.Tensor,
            order: torch.Tensor, route_w: torch.Tensor, sched: torch.Tensor, n_tiles: int, *, k1: int,
            n_clamped: int, limit: float, compute_dtype: torch.dtype, x_dtype: torch.dtype, quant_out: bool,
            block_m: int, num_warps: int = 4, num_stages: int = 3, precise_acc: int = 32, swap_ab: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, D]: e4m3 with per-128 scales `x_scale` [T, D/128] (QAT) or unquantised (bf16/fp32, x_scale
    None); w13 [E1, 2, I, D] e4m3 (or `Fp4Experts`) + s13 [E1, 2, I/128, D/128]; order [n] (token*k1 + slot, sorted by
    expert); route_w [n] fp32 by (token, slot). Returns w2's input in sorted row order: (e4m3 [n, I],
    scales [n, I/128]) with `quant_out`, else ([n, I] compute_dtype, None). `swap_ab`: as `moe_w2`'s."""
    T, D = x.shape
    E1, _, I, _ = w13.shape
    n = order.numel()
    weights = _check_experts(w13, s13, (E1, 2, I, D), "moe_w13: w13")
    if (x_scale is not None) != (x.dtype == torch.float8_e4m3fn):
        raise ValueError(f"moe_w13: x_scale must be given exactly when x is FP8 (x is {x.dtype})")
    if x_scale is not None and tuple(x_scale.shape) != (T, triton.cdiv(D, BLOCK_K)):
        raise ValueError(f"moe_w13: x_scale {tuple(x_scale.shape)} does not fit x {tuple(x.shape)}")
    if n != T * k1 or route_w.numel() != n or route_w.dtype != torch.float32:
        raise ValueError(f"moe_w13: order ({n}) and route_w ({route_w.numel()}, {route_w.dtype}) must both "
                         f"hold T*k1 = {T * k1} entries (route_w float32)")
    if swap_ab and x_scale is None:
        raise ValueError(f"moe_w13: swap_ab=True needs FP8 activations (x_scale given: the QAT simulation); x is "
                         f"{x.dtype}")
    if compute_dtype not in TL_DTYPES or x_dtype not in TL_DTYPES:
        raise ValueError(f"moe_w13: compute_dtype {compute_dtype} / x_dtype {x_dtype} not one of {list(TL_DTYPES)}")
    block_n = 128           # one act_quant group per program (and g, u of the same 128 channels)
    if quant_out:
        a = torch.empty((n, I), dtype=torch.float8_e4m3fn, device=x.device)
        a_s = torch.empty((n, triton.cdiv(I, BLOCK_K)), dtype=torch.float32, device=x.device)
    else:
        a, a_s = torch.empty((n, I), dtype=compute_dtype, device=x.device), None
    if n == 0:
        return a, a_s
    x = x if x.stride(1) == 1 else x.contiguous()
    grid = (n_tiles, triton.cdiv(I, block_n))
    _moe_w13_kernel[grid](x_ptr=x, xs_ptr=x_scale if x_scale is not None else x, ws_ptr=s13, order_ptr=order,
                          rw_ptr=route_w.reshape(-1), sched_ptr=sched, a_ptr=a, as_ptr=a_s if a_s is not None else a,
                          I=I, D=D, E1=E1, n_clamped=n_clamped, limit=float(limit), stride_x=x.stride(0),
                          stride_a=a.stride(0), **weights, K1=k1, EB=sched.shape[1], N_KG=triton.cdiv(D, BLOCK_K),
                          NB_I=triton.cdiv(I, BLOCK_K), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                          QAT_IN=x_scale is not None, QAT_OUT=quant_out, CDT=TL_DTYPES[compute_dtype],
                          XDT=TL_DTYPES[x_dtype], IEEE=compute_dtype == torch.float32, UPCAST=_interpreted(),
                          PRECISE_ACC=precise_acc, SUB=_fp4_sub(), PRMT=not _interpreted(), SWAP=swap_ab,
                          num_warps=num_warps, num_stages=num_stages, **launch_args(x))
    return a, a_s


def w2_output(out: torch.Tensor | None, n: int, D: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The w2 kernels' y [n, D]: `out` (its rows that no tile computes, those of ids outside every
    expert, are left as they are) or a new tensor."""
    if out is None:
        return torch.empty((n, D), dtype=dtype, device=device)
    if tuple(out.shape) != (n, D) or out.dtype != dtype or out.device != torch.device(device) \
            or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} [{n}, {D}] tensor on {device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    return out


def moe_w2(a: torch.Tensor, a_scale: torch.Tensor | None, w2: Experts, s2: torch.Tensor, order: torch.Tensor,
           sched: torch.Tensor, n_tiles: int, *, out_dtype: torch.dtype, block_m: int, block_n: int,
           num_warps: int = 4, num_stages: int = 3, precise_acc: int = 32, swap_ab: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """a [n, I] in sorted row order (e4m3 + a_scale [n, I/128], or unquantised); w2 [E1, D, I] e4m3 +
    s2 [E1, D/128, I/128] -> y [n, D] out_dtype in (token, slot) order (row order[r] gets row r), into
    `out` if given (`w2_output`).
    `swap_ab` (FP8 activations only; experimental, see `_w2_loop_swapped`): the weights as the dots'
    first operand."""
    n, I = a.shape
    E1, D, _ = w2.shape
    weights = _check_experts(w2, s2, (E1, D, I), "moe_w2: w2")
    if (a_scale is not None) != (a.dtype == torch.float8_e4m3fn):
        raise ValueError(f"moe_w2: a_scale must be given exactly when a is FP8 (a is {a.dtype})")
    if order.numel() != n:
        raise ValueError(f"moe_w2: order has {order.numel()} entries for {n} rows of a")
    if block_n > BLOCK_K or BLOCK_K % block_n:
        raise ValueError(f"moe_w2: block_n={block_n} must divide the weight block {BLOCK_K}")
    if swap_ab and a_scale is None:
        raise ValueError("moe_w2: swap_ab=True needs FP8 activations (a_scale given: the QAT simulation); "
                         f"a is {a.dtype}")
    y = w2_output(out, n, D, out_dtype, a.device)
    if n == 0:
        return y
    cdt = a.dtype if a_scale is None else out_dtype
    if cdt not in TL_DTYPES:
        raise ValueError(f"moe_w2: activation dtype {cdt} not one of {list(TL_DTYPES)}")
    grid = (n_tiles, triton.cdiv(D, block_n))
    _moe_w2_kernel[grid](a_ptr=a, as_ptr=a_scale if a_scale is not None else a, ws_ptr=s2, order_ptr=order,
                         sched_ptr=sched, y_ptr=y, D=D, I=I, E1=E1, stride_a=a.stride(0), stride_y=y.stride(0),
                         **weights, EB=sched.shape[1], N_KG=triton.cdiv(I, BLOCK_K), NB_D=triton.cdiv(D, BLOCK_K),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, QAT=a_scale is not None,
                         CDT=TL_DTYPES[cdt], IEEE=cdt == torch.float32, UPCAST=_interpreted(),
                         PRECISE_ACC=precise_acc, SUB=_fp4_sub(), PRMT=not _interpreted(), SWAP=swap_ab,
                         num_warps=num_warps, num_stages=num_stages, **launch_args(a))
    return y
