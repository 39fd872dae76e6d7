"""The fused MoE's grouped GEMMs at decode sizes, on the CUDA cores (`moe_tile_config` picks them
when an expert gets a row or two and the activations are not FP8: FP4 experts without the QAT
simulation; with it, `moe_mma`'s kernels are faster).

At those sizes the tensor-core tiles pad each expert's one or two rows to 16, and FP4 experts'
decoded tiles must pass through shared memory into the MMA's operand layout (3x the FP8 path's time;
docs/performance.md). Here a program takes M rows of one expert (M = 1, 2 or 4) and BLOCK_N outputs;
each weight is decoded (FP4) or widened (FP8) once in registers and multiplied into its M rows with
fused multiply-adds: no shared memory in the loop, no padding to 16.

Numerics: the activations come in as float32 values with their QAT scale applied
(`fp8_quant.act_quant_values`: e4m3 x 2^s, exact), every product of an e4m3 weight and such a value
is exact in float32, and the weight block's scale (a power of two) multiplies each 128-deep block's
partial sums, exactly. Each lane accumulates elementwise over the K loop and a fixed pairwise tree
sums the lanes at the end (`_tree_sum`): an order that does not depend on how Triton lays out the
tiles, so FP4 experts give exactly the bits of their FP8 re-encoding here (the tensor-core tiles
cannot promise that: their dots' operand layouts differ between the two forms). The sums' order
differs from the tensor-core tiles', so the two paths agree to float32 rounding, not bit for bit.

`gemv_w13` runs the tensor-core epilogue's steps up to its act_quant and writes w2's input
unquantised; the caller quantises it with `fp8_quant.act_quant_values` (the epilogue's exact steps; the
w2 programs are narrower than one 128-channel group, so none could do it alone).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp4_experts import fp4_rows
from .moe_gemm import TL_DTYPES, Experts, _check_experts, _find_tile, _interpreted, _round, swiglu, w2_output
from .moe_routing import TILE1_BEGIN, TILE2_BEGIN
from .pdl import launch_args, pdl_gate

BLOCK_K = 128           # the quantisation block
SUB = 32                # inputs per step: one FP4 scale group
_TILE1 = tl.constexpr(TILE1_BEGIN)
_TILE2 = tl.constexpr(TILE2_BEGIN)
_BK = tl.constexpr(BLOCK_K)
_SUB = tl.constexpr(SUB)


@triton.jit
def _halve(x, N: tl.constexpr, W: tl.constexpr):
    """[N, W] -> [N, W/2]: neighbours (2i, 2i+1) added."""
    a, b = tl.split(tl.reshape(x, (N, W // 2, 2)))
    return a + b


@triton.jit
def _tree_sum(x, N: tl.constexpr):
    """[N, 32] -> [N]: a fixed pairwise tree over the last axis (the same bits for any layout)."""
    x = _halve(x, N, 32)
    x = _halve(x, N, 16)
    x = _halve(x, N, 8)
    x = _halve(x, N, 4)
    x = _halve(x, N, 2)
    return tl.reshape(x, (N,))


@triton.jit
def _weights(w_ptr, p_ptr, g_ptr, offs_n, k0, K, scale, BLOCK_N: tl.constexpr, FP4: tl.constexpr,
             PRMT: tl.constexpr):
    """[BLOCK_N, 32] float32 e4m3 values (before the block scale) of one expert's rows offs_n, inputs
    k0.. (FP8: rows of `w_ptr` [N, K]; FP4: decoded from `p_ptr` / `g_ptr`; `scale` the block scale 2^S
    the decode needs)."""
    if FP4:
        w = fp4_rows(p_ptr, g_ptr, offs_n, offs_n >= 0, k0, K, tl.zeros([BLOCK_N], tl.float32) + scale, BLOCK_N,
                     _SUB, PRMT)
    else:
        w = tl.load(w_ptr + offs_n[:, None] * K + k0 + tl.arange(0, _SUB)[None, :])
    return w.to(tl.float32)


@triton.jit
def _row(x_ptr, r, ok, stride, k0):
    """[32] float32 activations of one row at inputs k0..; zeros for a row past the tile."""
    offs = tl.arange(0, _SUB)
    return tl.load(x_ptr + r * stride + k0 + offs, mask=offs < tl.where(ok, _SUB, 0), other=0.0).to(tl.float32)


@triton.jit
def _w13_loop(x_ptr, tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, stride_x, we_ptr, pe_ptr, ge_ptr, s_ptr, offs_n, I,
              D, N_KG: tl.constexpr, NB_I: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, FP4: tl.constexpr,
              PRMT: tl.constexpr, STAGES: tl.constexpr):
    """Per row of the tile (up to 4; rows past M stay zero and are compiled out), the gate and up
    products [BLOCK_N, 32] accumulated lane by lane over all of D, each 128-deep block's partials
    times its weight scale."""
    zero = tl.zeros((BLOCK_N, _SUB), dtype=tl.float32)
    g0, g1, g2, g3, u0, u1, u2, u3 = zero, zero, zero, zero, zero, zero, zero, zero
    for kb in tl.range(0, N_KG, num_stages=STAGES):
        sg = tl.load(s_ptr + kb)
        su = tl.load(s_ptr + NB_I * N_KG + kb)
        pg0, pg1, pg2, pg3, pu0, pu1, pu2, pu3 = zero, zero, zero, zero, zero, zero, zero, zero
        for j in tl.static_range(_BK // _SUB):
            k0 = kb * _BK + j * _SUB
            wg = _weights(we_ptr, pe_ptr, ge_ptr, offs_n, k0, D, sg, BLOCK_N, FP4, PRMT)
            wu = _weights(we_ptr + I * D, pe_ptr + I * (D // 2), ge_ptr + I * (D // 32), offs_n, k0, D, su, BLOCK_N,
                          FP4, PRMT)
            a = _row(x_ptr, tok0, ok0, stride_x, k0)[None, :]
            pg0 += wg * a
            pu0 += wu * a
            if M > 1:
                a = _row(x_ptr, tok1, ok1, stride_x, k0)[None, :]
                pg1 += wg * a
                pu1 += wu * a
            if M > 2:
                a = _row(x_ptr, tok2, ok2, stride_x, k0)[None, :]
                pg2 += wg * a
                pu2 += wu * a
                a = _row(x_ptr, tok3, ok3, stride_x, k0)[None, :]
                pg3 += wg * a
                pu3 += wu * a
        g0 += pg0 * sg
        u0 += pu0 * su
        if M > 1:
            g1 += pg1 * sg
            u1 += pu1 * su
        if M > 2:
            g2 += pg2 * sg
            u2 += pu2 * su
            g3 += pg3 * sg
            u3 += pu3 * su
    return g0, g1, g2, g3, u0, u1, u2, u3


@triton.jit
def _w2_loop(a_ptr, r0, r1, r2, r3, ok0, ok1, ok2, ok3, stride_a, we_ptr, pe_ptr, ge_ptr, s_ptr, offs_n, I,
             N_KG: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, FP4: tl.constexpr, PRMT: tl.constexpr,
             STAGES: tl.constexpr):
    """As `_w13_loop`, for one w2 tile over all of I."""
    zero = tl.zeros((BLOCK_N, _SUB), dtype=tl.float32)
    y0, y1, y2, y3 = zero, zero, zero, zero
    for kb in tl.range(0, N_KG, num_stages=STAGES):
        sw = tl.load(s_ptr + kb)
        p0, p1, p2, p3 = zero, zero, zero, zero
        for j in tl.static_range(_BK // _SUB):
            k0 = kb * _BK + j * _SUB
            w = _weights(we_ptr, pe_ptr, ge_ptr, offs_n, k0, I, sw, BLOCK_N, FP4, PRMT)
            p0 += w * _row(a_ptr, r0, ok0, stride_a, k0)[None, :]
            if M > 1:
                p1 += w * _row(a_ptr, r1, ok1, stride_a, k0)[None, :]
            if M > 2:
                p2 += w * _row(a_ptr, r2, ok2, stride_a, k0)[None, :]
                p3 += w * _row(a_ptr, r3, ok3, stride_a, k0)[None, :]
        y0 += p0 * sw
        if M > 1:
            y1 += p1 * sw
        if M > 2:
            y2 += p2 * sw
            y3 += p3 * sw
    return y0, y1, y2, y3


@triton.jit
def _tile_row(order_ptr, first, row_end, m: tl.constexpr, M: tl.constexpr):
    """(row, in the tile, source (token * K1 + slot)) of the tile's row m."""
    r = first + m
    if m < M:
        ok = r < row_end
    else:                   # a row this tile size does not have
        ok = r < first
    return r, ok, tl.load(order_ptr + r, mask=ok, other=0)


@triton.jit
def _tile_rows(order_ptr, first, row_end, M: tl.constexpr):
    """Rows, in-tile flags and sources of the tile's rows 0..3 (`_tile_row`)."""
    r0, ok0, s0 = _tile_row(order_ptr, first, row_end, 0, M)
    r1, ok1, s1 = _tile_row(order_ptr, first, row_end, 1, M)
    r2, ok2, s2 = _tile_row(order_ptr, first, row_end, 2, M)
    r3, ok3, s3 = _tile_row(order_ptr, first, row_end, 3, M)
    return r0, r1, r2, r3, ok0, ok1, ok2, ok3, s0, s1, s2, s3


@triton.jit
def _w13_out(g, u, e, r, ok, src, rw_ptr, a_ptr, stride_a, offs_n, n_clamped, limit, BLOCK_N: tl.constexpr,
             QAT_OUT: tl.constexpr, CDT: tl.constexpr, XDT: tl.constexpr):
    """One row's epilogue: the tensor-core kernel's (moe_gemm.swiglu) up to its act_quant."""
    rw = tl.load(rw_ptr + src, mask=ok, other=0.0)
    act = swiglu(_tree_sum(g, BLOCK_N), _tree_sum(u, BLOCK_N), e < n_clamped, limit, rw, CDT, XDT)
    if not QAT_OUT and CDT != XDT:
        act = _round(act, CDT)
    tl.store(a_ptr + r * stride_a + offs_n, act.to(a_ptr.dtype.element_ty), mask=offs_n < tl.where(ok, 1 << 30, 0))


@triton.jit
def _gemv_w13_kernel(x_ptr, w_ptr, ws_ptr, p_ptr, g_ptr, order_ptr, rw_ptr, sched_ptr, a_ptr,
                     I, D, E1, E4, n_clamped, limit, stride_x, stride_a,
                     K1: tl.constexpr, EB: tl.constexpr, N_KG: tl.constexpr, NB_I: tl.constexpr,
                     M: tl.constexpr, BLOCK_N: tl.constexpr, QAT_OUT: tl.constexpr, CDT: tl.constexpr,
                     XDT: tl.constexpr, W4: tl.constexpr, PRMT: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_gate(PDL)
    tl.static_assert(M == 1 or M == 2 or M == 4, "rows per program: 1, 2 or 4")
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, first, row_end = _find_tile(sched_ptr, t, E1, EB, _TILE1, M)
    if e >= E1:
        return
    r0, r1, r2, r3, ok0, ok1, ok2, ok3, src0, src1, src2, src3 = _tile_rows(order_ptr, first, row_end, M)
    tok0, tok1, tok2, tok3 = src0 // K1, src1 // K1, src2 // K1, src3 // K1
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    e64 = e.to(tl.int64)
    we_ptr = w_ptr + (e64 - E4) * 2 * I * D            # w13 [E1, 2, I, D]: w1 rows, then w3 rows
    pe_ptr = p_ptr + e64 * 2 * I * (D // 2)
    ge_ptr = g_ptr + e64 * 2 * I * (D // 32)
    s_ptr = ws_ptr + e64 * 2 * NB_I * N_KG + (pid_n * BLOCK_N // _BK) * N_KG     # [E1, 2, NB_I, N_KG]
    # one loop per weight form, the branch outside it (the loads of each loop pipeline)
    if W4:
        if e < E4:
            g0, g1, g2, g3, u0, u1, u2, u3 = _w13_loop(
                x_ptr, tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, stride_x, we_ptr, pe_ptr, ge_ptr, s_ptr, offs_n,
                I, D, N_KG, NB_I, M, BLOCK_N, True, PRMT, STAGES)
        else:
            g0, g1, g2, g3, u0, u1, u2, u3 = _w13_loop(
                x_ptr, tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, stride_x, we_ptr, pe_ptr, ge_ptr, s_ptr, offs_n,
                I, D, N_KG, NB_I, M, BLOCK_N, False, PRMT, STAGES)
    else:
        g0, g1, g2, g3, u0, u1, u2, u3 = _w13_loop(
            x_ptr, tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, stride_x, we_ptr, pe_ptr, ge_ptr, s_ptr, offs_n, I,
            D, N_KG, NB_I, M, BLOCK_N, False, PRMT, STAGES)
    _w13_out(g0, u0, e, r0, ok0, src0, rw_ptr, a_ptr, stride_a, offs_n, n_clamped, limit, BLOCK_N, QAT_OUT, CDT, XDT)
    if M > 1:
        _w13_out(g1, u1, e, r1, ok1, src1, rw_ptr, a_ptr, stride_a, offs_n, n_clamped, limit, BLOCK_N, QAT_OUT, CDT,
                 XDT)
    if M > 2:
        _w13_out(g2, u2, e, r2, ok2, src2, rw_ptr, a_ptr, stride_a, offs_n, n_clamped, limit, BLOCK_N, QAT_OUT, CDT,
                 XDT)
        _w13_out(g3, u3, e, r3, ok3, src3, rw_ptr, a_ptr, stride_a, offs_n, n_clamped, limit, BLOCK_N, QAT_OUT, CDT,
                 XDT)


@triton.jit
def _y_out(y, ok, dest, y_ptr, stride_y, offs_n, BLOCK_N: tl.constexpr):
    y = _tree_sum(y, BLOCK_N)
    if y_ptr.dtype.element_ty != tl.float32:
        y = _round(y, y_ptr.dtype.element_ty)
    tl.store(y_ptr + dest * stride_y + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < tl.where(ok, 1 << 30, 0))


@triton.jit
def _gemv_w2_kernel(a_ptr, w_ptr, ws_ptr, p_ptr, g_ptr, order_ptr, sched_ptr, y_ptr, D, I, E1, E4, stride_a,
                    stride_y, EB: tl.constexpr, N_KG: tl.constexpr, NB_D: tl.constexpr, M: tl.constexpr,
                    BLOCK_N: tl.constexpr, W4: tl.constexpr, PRMT: tl.constexpr, STAGES: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_gate(PDL)
    tl.static_assert(M == 1 or M == 2 or M == 4, "rows per program: 1, 2 or 4")
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, first, row_end = _find_tile(sched_ptr, t, E1, EB, _TILE2, M)
    if e >= E1:
        return
    r0, r1, r2, r3, ok0, ok1, ok2, ok3, dest0, dest1, dest2, dest3 = _tile_rows(order_ptr, first, row_end, M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    e64 = e.to(tl.int64)
    we_ptr = w_ptr + (e64 - E4) * D * I                # w2 [E1, D, I]
    pe_ptr = p_ptr + e64 * D * (I // 2)
    ge_ptr = g_ptr + e64 * D * (I // 32)
    s_ptr = ws_ptr + e64 * NB_D * N_KG + (pid_n * BLOCK_N // _BK) * N_KG
    if W4:
        if e < E4:
            y0, y1, y2, y3 = _w2_loop(a_ptr, r0, r1, r2, r3, ok0, ok1, ok2, ok3, stride_a, we_ptr, pe_ptr, ge_ptr,
                                      s_ptr, offs_n, I, N_KG, M, BLOCK_N, True, PRMT, STAGES)
        else:
            y0, y1, y2, y3 = _w2_loop(a_ptr, r0, r1, r2, r3, ok0, ok1, ok2, ok3, stride_a, we_ptr, pe_ptr, ge_ptr,
                                      s_ptr, offs_n, I, N_KG, M, BLOCK_N, False, PRMT, STAGES)
    else:
        y0, y1, y2, y3 = _w2_loop(a_ptr, r0, r1, r2, r3, ok0, ok1, ok2, ok3, stride_a, we_ptr, pe_ptr, ge_ptr,
                                  s_ptr, offs_n, I, N_KG, M, BLOCK_N, False, PRMT, STAGES)
    _y_out(y0, ok0, dest0, y_ptr, stride_y, offs_n, BLOCK_N)
    if M > 1:
        _y_out(y1, ok1, dest1, y_ptr, stride_y, offs_n, BLOCK_N)
    if M > 2:
        _y_out(y2, ok2, dest2, y_ptr, stride_y, offs_n, BLOCK_N)
        _y_out(y3, ok3, dest3, y_ptr, stride_y, offs_n, BLOCK_N)


def gemv_fits(D: int, I: int, block_n1: int, block_n2: int) -> bool:
    """Whether the CUDA-core kernels take these sizes: whole 128-deep blocks, programs inside one
    128-output block (V4's D and I always are)."""
    return (D % BLOCK_K == 0 and I % BLOCK_K == 0 and BLOCK_K % block_n1 == 0 and BLOCK_K % block_n2 == 0
            and I % block_n1 == 0 and D % block_n2 == 0)


def _check_shape(name: str, rows: int, stages: int, D: int, I: int, block_n: int) -> None:
    if rows not in (1, 2, 4) or stages not in (1, 2, 3, 4) or not gemv_fits(D, I, block_n, block_n):
        raise ValueError(f"{name}: rows={rows} must be 1, 2 or 4; stages={stages} must be 1, 2, 3 or 4; D={D}, "
                         f"I={I} multiples of {BLOCK_K} and of block_n={block_n}, which must divide {BLOCK_K}")


def gemv_w13(x: torch.Tensor, w13: Experts, s13: torch.Tensor, order: torch.Tensor, route_w: torch.Tensor,
             sched: torch.Tensor, n_tiles: int, *, k1: int, n_clamped: int, limit: float, compute_dtype: torch.dtype,
             x_dtype: torch.dtype, quant_out: bool, rows: int, block_n: int, num_warps: int = 4,
             stages: int = 1) -> torch.Tensor:
    """`moe_w13` on the CUDA cores (arguments as there; `rows`: the tile's M, the schedule's block_m;
    x [T, D] float32 with its QAT scale applied (`act_quant_values`), or unquantised): w2's input [n, I],
    unquantised: in x_dtype with `quant_out` (the caller act_quant-s it), else in the compute dtype."""
    T, D = x.shape
    E1, _, I, _ = w13.shape
    n = order.numel()
    weights = _check_experts(w13, s13, (E1, 2, I, D), "gemv_w13: w13")
    _check_shape("gemv_w13", rows, stages, D, I, block_n)
    if compute_dtype not in TL_DTYPES or x_dtype not in TL_DTYPES or x.dtype not in TL_DTYPES:
        raise ValueError(f"gemv_w13: x {x.dtype}, compute_dtype {compute_dtype}, x_dtype {x_dtype}: each must be one "
                         f"of {list(TL_DTYPES)}")
    a = torch.empty((n, I), dtype=x_dtype if quant_out else compute_dtype, device=x.device)
    if n == 0:
        return a
    x = x if x.stride(1) == 1 else x.contiguous()
    _gemv_w13_kernel[(n_tiles, I // block_n)](
        x_ptr=x, ws_ptr=s13, order_ptr=order, rw_ptr=route_w.reshape(-1), sched_ptr=sched, a_ptr=a, I=I, D=D, E1=E1,
        n_clamped=n_clamped, limit=float(limit), stride_x=x.stride(0), stride_a=a.stride(0), **weights, K1=k1,
        EB=sched.shape[1], N_KG=D // BLOCK_K, NB_I=I // BLOCK_K, M=rows, BLOCK_N=block_n, QAT_OUT=quant_out,
        CDT=TL_DTYPES[compute_dtype], XDT=TL_DTYPES[x_dtype], PRMT=not _interpreted(), STAGES=stages,
        num_warps=num_warps, **launch_args(x))
    return a


def gemv_w2(a: torch.Tensor, w2: Experts, s2: torch.Tensor, order: torch.Tensor, sched: torch.Tensor, n_tiles: int, *,
            out_dtype: torch.dtype, rows: int, block_n: int, num_warps: int = 4, stages: int = 1,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """`moe_w2` on the CUDA cores: a [n, I] float32 with its QAT scale applied, or unquantised.
    Returns y [n, D] out_dtype in (token, slot) order (into `out` if given)."""
    n, I = a.shape
    E1, D, _ = w2.shape
    weights = _check_experts(w2, s2, (E1, D, I), "gemv_w2: w2")
    _check_shape("gemv_w2", rows, stages, D, I, block_n)
    y = w2_output(out, n, D, out_dtype, a.device)
    if n == 0:
        return y
    _gemv_w2_kernel[(n_tiles, D // block_n)](
        a_ptr=a, ws_ptr=s2, order_ptr=order, sched_ptr=sched, y_ptr=y, D=D, I=I, E1=E1, stride_a=a.stride(0),
        stride_y=y.stride(0), **weights, EB=sched.shape[1], N_KG=I // BLOCK_K, NB_D=D // BLOCK_K, M=rows,
        BLOCK_N=block_n, PRMT=not _interpreted(), STAGES=stages, num_warps=num_warps, **launch_args(a))
    return y
