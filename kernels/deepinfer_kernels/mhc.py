"""Manifold-constrained hyper-connections (mHC) as fused Triton kernels.
Core reference: `deepinfer_core.ops.portable_mhc.PortableMHC` (everything in fp32).

The residual stream x [T, hc, D] is hc times the hidden size, so the kernels are built around reading
it as few times as possible:

* `mhc_pre` / `mhc_head`, stage 1 (`_mix_partials_kernel`): one pass over x computes the projection
  x_flat @ fn^T [T, N] (N = (2+hc)*hc, or hc for the head) and the sum of squares for the RMS factor.
  Programs own BLOCK_M tokens (so fn, 1.5 MB at V4-Flash width and L2-resident, is read once per 64
  tokens) and one SPLIT_K slice of hc*D (so a decode step still spreads over K/SPLIT_K SMs). The
  product runs on the tensor cores as 3xTF32 ("tf32x3": bf16 inputs are exact in tf32 and fn is split
  into a high and a low tf32 part, ~1e-7 relative, not plain tf32's 1e-3).
* stage 2 (`_mhc_coeff_kernel`), BLOCK_T tokens per program: adds the split partials in split order,
  folds in the RMS factor, and computes pre / post and the hc x hc softmax + Sinkhorn in registers
  (tiny outputs: pre, post, comb).
* stage 3 (`_mhc_collapse_kernel`): y = sum_j pre[j] * x[j] over (token, D-chunk) programs (the second
  read of x; a separate launch so a decode step spreads over D / 512 programs).
* `mhc_post`: one elementwise pass over f and res: out[k] = post[k] * f + sum_j comb[j, k] * res[j].

Batch invariance: tile sizes and the split are fixed functions of the model shape, never of T, and
the token count is not specialised on, so a token's outputs are bitwise the same alone or in any
batch. No atomics: every reduction has a fixed order. Under Triton's interpreter the stage-1 product
is a broadcast multiply + sum instead of tl.dot (the interpreter's tl.dot is numpy's matmul, whose
row results depend on the row's position in the tile); compiled, the tensor-core path runs.
bf16 outputs are rounded to nearest even in fp32 first (the interpreter's cast truncates).

Order of operations: the projection's product comes first and the RMS factor after, the combination
softmax is exp(c - max) / sum, and post adds post * f to the stream mix summed j = 0..hc-1: the
order of DeepSeek's inference code, which `PortableMHC(official=True)` transcribes. `official=True`
(the QAT numerics) also compiles stages 2 and 3 and post without fp contraction (no FMA), so every
product and sum rounds as torch's separate ops do; the stage-1 GEMM keeps its own accumulation.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import launch_args, pdl_gate

BLOCK_M = 64        # tokens per stage-1 program (fixed: changing it per T would break batch invariance)
BLOCK_K = 64        # K step of the stage-1 loop
SPLIT_K = 512       # K slice per stage-1 program: hc*D = 16384 -> 32 slices at V4-Flash width
BLOCK_T = 4         # tokens per coefficient program (softmax + Sinkhorn on [BLOCK_T, hc, hc] tiles;
#                     4 is the fastest at every token count, benchmarks/tune_mhc.py on the H200)
EW_BLOCK_T = 8      # tokens per collapse / post program
COLLAPSE_BLOCK_D = 512   # D chunk of a collapse program: a [8, 512] tile per stream
POST_BLOCK_D = 128       # D chunk of a post program: a [8, hc, 128] fp32 accumulator
COEFF_WARPS = 4          # warps of a coefficient program (its tiles are [BLOCK_T, hc, hc]: tiny)
FUSE_COEFF = False       # stages 2 and 3 in one launch (`_mhc_coeff_collapse_kernel`): one launch less
PRECISION = "tf32x3"  # stage-1 product; "ieee" = CUDA-core fp32 FMA (slower, exact fp32 products)
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bfloat16 value (ties to even), still in fp32, so the final cast is exact.
    The compiled cast rounds this way itself; Triton's interpreter truncates."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v == v, bits.to(tl.float32, bitcast=True), v)     # NaN stays NaN


@triton.jit(do_not_specialize=["T"])
def _mix_partials_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, K, N, stride_xt, stride_fn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, PRECISION: tl.constexpr, BROADCAST: tl.constexpr,
                         PDL: tl.constexpr = False):
    """part[t, s, n] = sum_{k in slice s} x[t, k] * fn[n, k];  sq[t, s] = sum_{k in slice s} x[t, k]^2."""
    pdl_gate(PDL)
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < T
    n_ok = offs_n < N
    rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)   # reduced once at the end (fixed tree)
    for i in range(0, SPLIT_K // BLOCK_K):
        k = split * SPLIT_K + i * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        # fn [N, K] read as a K-major [BLOCK_K, BLOCK_N] tile: what the tf32 MMA wants
        w = tl.load(fn_ptr + offs_n[None, :] * stride_fn + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)
        if BROADCAST:   # Triton's interpreter: its tl.dot is numpy's matmul, whose rows are not
            acc += tl.sum(a[:, None, :] * tl.trans(w)[None, :, :], axis=2)   # independent of each other
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        sq += a * a
    out = (offs_m.to(tl.int64)[:, None] * nsplit + split) * N + offs_n[None, :]
    tl.store(part_ptr + out, acc, mask=m_ok[:, None] & n_ok[None, :])
    tl.store(sq_ptr + offs_m.to(tl.int64) * nsplit + split, tl.sum(sq, axis=1), mask=m_ok)


@triton.jit
def _coefficients(part_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t, T, K, N, hc_eps, norm_eps,
                  ITERS: tl.constexpr, NSPLIT: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr,
                  BLOCK_T: tl.constexpr, HEAD: tl.constexpr, WRITE: tl.constexpr):
    """Tokens t [BLOCK_T]: mix = (partials summed over the splits) * rsqrt(mean square + eps) -> pre
    [BLOCK_T, HC_P], returned; with WRITE it is stored, and unless HEAD post and the softmax + Sinkhorn
    comb are computed and stored too. Every reduction runs within one token."""
    t_ok = t < T
    t64 = t.to(tl.int64)
    j = tl.arange(0, HC_P)
    j_ok = j < HC
    ok_tj = t_ok[:, None] & j_ok[None, :]
    # comb[j, k]: row j (source stream), column k, at mix index 2*HC + j*HC + k; [BLOCK_T, HC_P, HC_P] tiles
    jk = j[:, None] * HC + j[None, :]
    ok2 = j_ok[:, None] & j_ok[None, :]
    ok_tjk = t_ok[:, None, None] & ok2[None, :, :]
    FULL: tl.constexpr = WRITE and not HEAD
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    m_pre = tl.zeros((BLOCK_T, HC_P), dtype=tl.float32)
    m_post = tl.zeros((BLOCK_T, HC_P), dtype=tl.float32)
    m_c = tl.zeros((BLOCK_T, HC_P, HC_P), dtype=tl.float32)
    for s in tl.static_range(NSPLIT):     # unrolled: the loads overlap; the adds keep split order
        prow = part_ptr + (t64 * NSPLIT + s) * N
        sumsq += tl.load(sq_ptr + t64 * NSPLIT + s, mask=t_ok, other=0.0)
        m_pre += tl.load(prow[:, None] + j[None, :], mask=ok_tj, other=0.0)
        if FULL:
            m_post += tl.load(prow[:, None] + HC + j[None, :], mask=ok_tj, other=0.0)
            m_c += tl.load(prow[:, None, None] + 2 * HC + jk[None, :, :], mask=ok_tjk, other=0.0)
    r = tl.rsqrt(sumsq / K + norm_eps)[:, None]
    b_pre = tl.load(base_ptr + j, mask=j_ok, other=0.0)
    pre = tl.sigmoid(m_pre * r * tl.load(scale_ptr) + b_pre[None, :]) + hc_eps
    if WRITE:
        tl.store(pre_ptr + t64[:, None] * HC + j[None, :], pre, mask=ok_tj)
    if FULL:
        b_post = tl.load(base_ptr + HC + j, mask=j_ok, other=0.0)
        post = 2.0 * tl.sigmoid(m_post * r * tl.load(scale_ptr + 1) + b_post[None, :])
        tl.store(post_ptr + t64[:, None] * HC + j[None, :], post, mask=ok_tj)

        b_c = tl.load(base_ptr + 2 * HC + jk, mask=ok2, other=0.0)
        logit = m_c * r[:, :, None] * tl.load(scale_ptr + 2) + b_c[None, :, :]
        logit = tl.where(ok2[None, :, :], logit, -1.0e30)            # padding (hc not 2^n) drops out
        e = tl.exp(logit - tl.max(logit, axis=2)[:, :, None])
        c = tl.where(ok2[None, :, :], e / tl.sum(e, axis=2)[:, :, None] + hc_eps, 0.0)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)              # column step
        for _ in range(ITERS - 1):                                    # ITERS: a model constant
            c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)          # row
            c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)          # column (the last step)
        tl.store(comb_ptr + t64[:, None, None] * HC * HC + jk[None, :, :], c, mask=ok_tjk)
    return pre


@triton.jit(do_not_specialize=["T"])
def _mhc_coeff_kernel(part_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, K, N, hc_eps,
                      norm_eps, ITERS: tl.constexpr, NSPLIT: tl.constexpr, HC: tl.constexpr,
                      HC_P: tl.constexpr, BLOCK_T: tl.constexpr, HEAD: tl.constexpr, PDL: tl.constexpr = False):
    """Stage 2 alone: BLOCK_T tokens' pre, and unless HEAD their post and comb (`_coefficients`)."""
    pdl_gate(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _coefficients(part_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t, T, K, N, hc_eps, norm_eps,
                  ITERS, NSPLIT, HC, HC_P, BLOCK_T, HEAD, True)


@triton.jit
def _collapse_tile(x_ptr, y_ptr, pre, t, d, T, D, stride_xt, stride_xj, stride_yt, HC: tl.constexpr,
                   HC_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr):
    """y[t, d] = sum_j pre[t, j] * x[t, j, d], j in order, fp32; pre a [BLOCK_T, HC_P] tile."""
    t = t.to(tl.int64)
    ok = (t < T)[:, None] & (d < D)[None, :]
    jj = tl.arange(0, HC_P)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(HC):
        xj = tl.load(x_ptr + t[:, None] * stride_xt + j * stride_xj + d[None, :], mask=ok, other=0.0)
        pre_j = tl.sum(tl.where(jj == j, pre, 0.0), axis=1)          # column j, exactly (the rest adds 0)
        acc += pre_j[:, None] * xj.to(tl.float32)
    if OUT_BF16:
        acc = _round_bf16(acc)
    tl.store(y_ptr + t[:, None] * stride_yt + d[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _mhc_collapse_kernel(x_ptr, pre_ptr, y_ptr, T, D, stride_xt, stride_xj, stride_yt, HC: tl.constexpr,
                         HC_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Stage 3 alone, on the pre stage 2 stored."""
    pdl_gate(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, HC_P)
    pre = tl.load(pre_ptr + t.to(tl.int64)[:, None] * HC + j[None, :], mask=(t < T)[:, None] & (j < HC)[None, :],
                  other=0.0)
    _collapse_tile(x_ptr, y_ptr, pre, t, d, T, D, stride_xt, stride_xj, stride_yt, HC, HC_P, BLOCK_T, BLOCK_D,
                   OUT_BF16)


@triton.jit(do_not_specialize=["T"])
def _mhc_coeff_collapse_kernel(x_ptr, part_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, y_ptr,
                               T, K, N, D, hc_eps, norm_eps, stride_xt, stride_xj, stride_yt, ITERS: tl.constexpr,
                               NSPLIT: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, BLOCK_T: tl.constexpr,
                               BLOCK_D: tl.constexpr, HEAD: tl.constexpr, OUT_BF16: tl.constexpr,
                               PDL: tl.constexpr = False):
    """Stages 2 and 3 in one launch (FUSE_COEFF): each (token block, D chunk) program sums its tokens'
    partials into pre itself; the first D chunk's programs also store pre, post and comb."""
    pdl_gate(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if tl.program_id(1) == 0:
        pre = _coefficients(part_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t, T, K, N, hc_eps,
                            norm_eps, ITERS, NSPLIT, HC, HC_P, BLOCK_T, HEAD, True)
    else:
        pre = _coefficients(part_ptr, sq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t, T, K, N, hc_eps,
                            norm_eps, ITERS, NSPLIT, HC, HC_P, BLOCK_T, HEAD, False)
    _collapse_tile(x_ptr, y_ptr, pre, t, d, T, D, stride_xt, stride_xj, stride_yt, HC, HC_P, BLOCK_T, BLOCK_D,
                   OUT_BF16)


@triton.jit(do_not_specialize=["T"])
def _mhc_post_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, T, D, stride_ft, stride_rt, stride_rj,
                     stride_ot, stride_oj, HC: tl.constexpr, HC_P: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, k, d] = post[t, k] * f[t, d] + sum_j comb[t, j, k] * res[t, j, d] (fp32)."""
    pdl_gate(PDL)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, HC_P)
    t_ok = t < T
    ok = t_ok[:, None] & (d < D)[None, :]
    ok_tk = t_ok[:, None] & (k < HC)[None, :]
    acc = tl.zeros((BLOCK_T, HC_P, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(HC):                      # each res stream is read once
        rj = tl.load(res_ptr + t[:, None] * stride_rt + j * stride_rj + d[None, :], mask=ok, other=0.0)
        cj = tl.load(comb_ptr + t[:, None] * HC * HC + j * HC + k[None, :], mask=ok_tk, other=0.0)
        acc += cj[:, :, None] * rj.to(tl.float32)[:, None, :]
    f = tl.load(f_ptr + t[:, None] * stride_ft + d[None, :], mask=ok, other=0.0).to(tl.float32)
    p = tl.load(post_ptr + t[:, None] * HC + k[None, :], mask=ok_tk, other=0.0)
    out = p[:, :, None] * f[:, None, :] + acc
    if OUT_BF16:
        out = _round_bf16(out)
    ptrs = out_ptr + t[:, None, None] * stride_ot + k[None, :, None] * stride_oj + d[None, None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=ok_tk[:, :, None] & ok[:, None, :])


def _check_streams(name: str, x: torch.Tensor, hc: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != hc:
        raise ValueError(f"{name} must be a [T, hc={hc}, D] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.shape[2] == 0:
        raise ValueError(f"{name} has an empty hidden dimension")
    # the flattened token row (hc*D values) must be one contiguous run
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _check_params(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                  n_out: int, n_scale: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    K = x.shape[1] * x.shape[2]
    for name, p in (("fn", fn), ("scale", scale), ("base", base)):
        if not isinstance(p, torch.Tensor) or p.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor, got "
                             f"{p.dtype if isinstance(p, torch.Tensor) else type(p).__name__}")
        if p.device != x.device:
            raise ValueError(f"{name} is on {p.device} but x is on {x.device}")
    if tuple(fn.shape) != (n_out, K):
        raise ValueError(f"fn must be [{n_out}, hc*D={K}], got {tuple(fn.shape)}")
    if scale.numel() != n_scale:
        raise ValueError(f"scale must have {n_scale} elements, got {scale.numel()}")
    if base.numel() != n_out:
        raise ValueError(f"base must have {n_out} elements, got {base.numel()}")
    fn = fn if fn.stride(1) == 1 else fn.contiguous()
    return fn, scale.reshape(-1).contiguous(), base.reshape(-1).contiguous()


def _collapse(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
              iters: int, hc_eps: float, norm_eps: float, head: bool, official: bool,
              pre_prev: torch.Tensor | None = None):
    """(y, post, comb), x collapsed with its own pre; with `pre_prev` (shifted mHC) x is collapsed
    with those weights instead and the result is (y, pre, post, comb)."""
    T, _, D = x.shape
    K, N = hc * D, fn.shape[0]
    dev = x.device
    y = torch.empty((T, D), dtype=x.dtype, device=dev)
    pre = torch.empty((T, hc), dtype=torch.float32, device=dev)
    post = torch.empty((T, hc), dtype=torch.float32, device=dev)
    comb = torch.empty((T, hc, hc), dtype=torch.float32, device=dev)
    if T == 0:
        return (y, post, comb) if pre_prev is None else (y, pre, post, comb)
    nsplit = triton.cdiv(K, SPLIT_K)
    part = torch.empty((T, nsplit, N), dtype=torch.float32, device=dev)
    sq = torch.empty((T, nsplit), dtype=torch.float32, device=dev)
    _mix_partials_kernel[(triton.cdiv(T, BLOCK_M), nsplit)](
        x, fn, part, sq, T, K, N, x.stride(0), fn.stride(0), BLOCK_M=BLOCK_M,
        BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, PRECISION=PRECISION,
        BROADCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=4, **launch_args(x))
    block_d = min(triton.next_power_of_2(D), COLLAPSE_BLOCK_D)
    hc_p = triton.next_power_of_2(hc)
    stage2 = dict(ITERS=max(iters, 1), NSPLIT=nsplit, HC=hc, HC_P=hc_p, HEAD=head)
    fusion = {"enable_fp_fusion": not official}     # official: products and sums round apart
    collapse_grid = (triton.cdiv(T, EW_BLOCK_T), triton.cdiv(D, block_d))
    if FUSE_COEFF and pre_prev is None:
        _mhc_coeff_collapse_kernel[collapse_grid](
            x, part, sq, scale, base, pre, post, comb, y, T, K, N, D, hc_eps, norm_eps, x.stride(0), x.stride(1),
            y.stride(0), **stage2, BLOCK_T=EW_BLOCK_T, BLOCK_D=block_d, OUT_BF16=x.dtype == torch.bfloat16,
            num_warps=4, **fusion, **launch_args(x))
        return y, post, comb
    _mhc_coeff_kernel[(triton.cdiv(T, BLOCK_T),)](
        part, sq, scale, base, pre, post, comb, T, K, N, hc_eps, norm_eps, **stage2, BLOCK_T=BLOCK_T,
        num_warps=COEFF_WARPS, **fusion, **launch_args(part))
    _mhc_collapse_kernel[collapse_grid](
        x, pre if pre_prev is None else pre_prev, y, T, D, x.stride(0), x.stride(1), y.stride(0), HC=hc,
        HC_P=hc_p, BLOCK_T=EW_BLOCK_T, BLOCK_D=block_d, OUT_BF16=x.dtype == torch.bfloat16, num_warps=4,
        **fusion, **launch_args(x))
    return (y, post, comb) if pre_prev is None else (y, pre, post, comb)


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
            sinkhorn_iters: int, hc_eps: float, norm_eps: float, official: bool = False):
    """x [T, hc, D] -> (y [T, D] in x.dtype, post [T, hc] fp32, comb [T, hc, hc] fp32); fn
    [(2+hc)*hc, hc*D], scale [3], base [(2+hc)*hc], all fp32. `official`: no fp contraction."""
    x = _check_streams("x", x, hc_mult)
    fn, scale, base = _check_params(x, fn, scale, base, (2 + hc_mult) * hc_mult, 3)
    return _collapse(x, fn, scale, base, hc_mult, int(sinkhorn_iters), float(hc_eps),
                     float(norm_eps), False, official)


def mhc_pre_shifted(x: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                    base: torch.Tensor, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                    official: bool = False):
    """Shifted mHC (V4.1): x [T, hc, D] collapsed with the previous site's pre_prev [T, hc] fp32, and
    this site's coefficients -> (y [T, D] in x.dtype, pre [T, hc], post [T, hc], comb [T, hc, hc])."""
    x = _check_streams("x", x, hc_mult)
    fn, scale, base = _check_params(x, fn, scale, base, (2 + hc_mult) * hc_mult, 3)
    if not isinstance(pre_prev, torch.Tensor) or tuple(pre_prev.shape) != (x.shape[0], hc_mult) or \
            pre_prev.dtype != torch.float32 or pre_prev.device != x.device:
        got = (f"{tuple(pre_prev.shape)} {pre_prev.dtype} on {pre_prev.device}"
               if isinstance(pre_prev, torch.Tensor) else type(pre_prev).__name__)
        raise ValueError(f"pre_prev must be a float32 [T={x.shape[0]}, hc={hc_mult}] tensor on {x.device}, "
                         f"got {got}")
    return _collapse(x, fn, scale, base, hc_mult, int(sinkhorn_iters), float(hc_eps), float(norm_eps), False,
                     official, pre_prev.contiguous())


def mhc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
             hc_eps: float, norm_eps: float, official: bool = False) -> torch.Tensor:
    """Final collapse x [T, hc, D] -> y [T, D] in x.dtype; fn [hc, hc*D], scale [1], base [hc] fp32.
    `official`: no fp contraction."""
    x = _check_streams("x", x, hc_mult)
    fn, scale, base = _check_params(x, fn, scale, base, hc_mult, 1)
    return _collapse(x, fn, scale, base, hc_mult, 1, float(hc_eps), float(norm_eps), True,
                     official)[0]


def mhc_post(f: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             official: bool = False) -> torch.Tensor:
    """f [T, D] (sub-layer output), res [T, hc, D] (block-input streams), post [T, hc], comb [T, hc, hc]
    -> out [T, hc, D] in res.dtype, out[:, k] = post[:, k] * f + sum_j comb[:, j, k] * res[:, j].
    `official`: no fp contraction (each product and sum rounded, as torch's separate ops)."""
    if not isinstance(res, torch.Tensor) or res.dim() != 3:
        raise ValueError(f"res must be a [T, hc, D] tensor, got "
                         f"{tuple(res.shape) if isinstance(res, torch.Tensor) else type(res).__name__}")
    T, hc, D = res.shape
    res = _check_streams("res", res, hc)
    if not isinstance(f, torch.Tensor) or tuple(f.shape) != (T, D) or f.dtype not in _X_DTYPES:
        raise ValueError(f"f must be a float [T={T}, D={D}] tensor, got "
                         f"{(tuple(f.shape), f.dtype) if isinstance(f, torch.Tensor) else type(f).__name__}")
    for name, p, shape in (("post", post, (T, hc)), ("comb", comb, (T, hc, hc))):
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != shape or not p.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float {list(shape)} tensor, got "
                             f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
    for name, p in (("f", f), ("post", post), ("comb", comb)):
        if p.device != res.device:
            raise ValueError(f"{name} is on {p.device} but res is on {res.device}")
    f = f if f.stride(1) == 1 else f.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty((T, hc, D), dtype=res.dtype, device=res.device)
    if T == 0:
        return out
    block_d = min(triton.next_power_of_2(D), POST_BLOCK_D)
    _mhc_post_kernel[(triton.cdiv(T, EW_BLOCK_T), triton.cdiv(D, block_d))](
        f, res, post, comb, out, T, D, f.stride(0), res.stride(0), res.stride(1), out.stride(0), out.stride(1),
        HC=hc, HC_P=triton.next_power_of_2(hc), BLOCK_T=EW_BLOCK_T, BLOCK_D=block_d,
        OUT_BF16=res.dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=not official,
        **launch_args(f))
    return out
