"""FP8 x FP8 GEMM with DeepSeek block scales on the tensor cores (core reference: dequantise both
operands with `deepinfer_core.ops.quant` and multiply in float32).

    C[m, n] = sum over K-groups g of ( sum_{k in g} qa[m, k] * qw[n, k] ) * sa[m, g] * sw[n // 128, g]

qa: activations e4m3 [M, K] with per-token, per-128-channel scales sa [M, K/128] (`fp8_quant`);
qw: weights e4m3 [N, K] with block scales sw [N/bn, K/bk] as stored in the checkpoint: 128x128
(V4) or 32x32 (V4.1). BLOCK_K is the weight block's K (128 or 32), so each K step multiplies one
fp32 partial product by one scale pair (with 32x32 blocks, four K steps share an activation scale). Decode shapes
with few output tiles split K (a fixed function of N and K) and add the slices in a fixed order, so a
row's result does not depend on how many other rows share the launch.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .pdl import launch_args, pdl_gate, prefetch_l2

BLOCK_K = 128
WEIGHT_BLOCK = 128
# Channels the FP8 MMAs sum before their partial product is promoted to fp32: 128, once per
# 128-channel scale group (one 128-deep MMA chain, then the scale multiply), as DeepSeek's kernel
# does. 32 (a promotion after every Hopper FP8 MMA) adds four partial products per group and took
# twice as long at prefill sizes on an H100 (docs/performance.md, "FP8 GEMM promotion").
# A K block narrower than that (32x32 weight blocks) promotes once per block.
PROMOTE_EVERY = 128


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(m tile, n tile) of program `pid` in grouped order: neighbouring programs share weight tiles
    in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _weights_to_l2(w_ptr, rows, kg0, N_KG: tl.constexpr, BLOCK_K: tl.constexpr, KG: tl.constexpr,
                   PREFETCH: tl.constexpr):
    """With PREFETCH: L2 prefetches of weight rows `rows` (element offsets of the rows' starts, already
    clamped in bounds) over K groups kg0 .. kg0 + KG; a group of e4m3 weights is one 128-byte line."""
    if PREFETCH:
        for j in range(0, KG, 8):
            g = tl.minimum(kg0 + j + tl.arange(0, 8), N_KG - 1)
            prefetch_l2(w_ptr + rows[:, None] + (g * BLOCK_K)[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm, stride_cs,
                     N_KG: tl.constexpr, N_AG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, WB: tl.constexpr, PRECISE_ACC: tl.constexpr,
                     KG_PER_SPLIT: tl.constexpr, FOLD: tl.constexpr = False, PDL: tl.constexpr = False,
                     PREFETCH: tl.constexpr = False):
    pid = tl.program_id(0)
    split = tl.program_id(1)              # split-K slice: K groups split*KG_PER_SPLIT ..
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # the weights are written by no kernel: their slice may stream into L2 before the gate
    _weights_to_l2(w_ptr, tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64) * stride_wn,
                   split * KG_PER_SPLIT, N_KG, BLOCK_K, KG_PER_SPLIT, PREFETCH)
    pdl_gate(PDL)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    sa_ptrs = as_ptr + offs_m * N_AG          # activation scales: one per 128 channels
    sw_ptrs = ws_ptr + (offs_n // WB) * N_KG   # weight scales: one per BLOCK_K channels
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, KG_PER_SPLIT):     # constexpr trip count: one compile per K and split
        kb = split * KG_PER_SPLIT + i
        # The last split may run past the last K group (kb >= N_KG = cdiv(K, BLOCK_K)): then k_ok is
        # all false, a and w load as zeros and the slice adds +0.0, whatever scale it multiplies.
        # So the scales load from a clamped group, masked by row only (no scalar-bool mask: Triton
        # 3.9's interpreter splats one into an int32 mask and refuses the load).
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + (kb * BLOCK_K + offs_k)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (kb * BLOCK_K + offs_k)[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        kb_scale = tl.minimum(kb, N_KG - 1)
        sa = tl.load(sa_ptrs + kb_scale // (128 // BLOCK_K), mask=m_ok, other=0.0)
        # The FP8 MMAs' sums are promoted to fp32 every PRECISE_ACC channels (PROMOTE_EVERY), and
        # the K group's partial product is scaled here.
        part = tl.dot(a, w, max_num_imprecise_acc=PRECISE_ACC)
        if FOLD:     # the tile's columns share a weight block: one scale per row, sa * sw (theirs too)
            sw1 = tl.load(ws_ptr + (pid_n * BLOCK_N // WB) * N_KG + kb_scale)
            acc += part * (sa * sw1)[:, None]
        else:
            sw = tl.load(sw_ptrs + kb_scale, mask=n_ok, other=0.0)
            acc += part * sa[:, None] * sw[None, :]
    c_ptrs = c_ptr + split * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(p_ptr, c_ptr, numel, stride_s, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """c = p[0] + p[1] + ... in this fixed order (torch.sum may reorder by shape); split s at p + s * stride_s."""
    pdl_gate(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(p_ptr + s * stride_s + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


# With PDL, GEMMs of up to this many rows prefetch their weight slice into L2 before the gate (decode:
# the weights are most of the bytes; a prefill launch would prefetch each slice once per row tile).
PREFETCH_MAX_ROWS = 256


def _launch_args(t: torch.Tensor, M: int) -> dict:
    pdl = launch_args(t)
    return dict(pdl, PREFETCH=pdl["PDL"] and M <= PREFETCH_MAX_ROWS)


def split_partials(c: torch.Tensor, splits: int) -> tuple[torch.Tensor, int]:
    """(where a split-K GEMM writes, the stride between its splits): `c` itself and 0 for one split, else
    fp32 partials whose per-split stride is padded to a multiple of 16 elements. Either way the stride is
    a multiple of 16, so Triton's specialisation of it never changes (no late compile) and is the one
    that vectorises the output stores. Unspecialised (`do_not_specialize`, as from 4f16d2b until this),
    a 128x128 prefill tile's epilogue stores 2-byte scalars: `benchmarks/aot_sm90.py --kernels fp8_gemm
    --configs 8x3 --block-m 128 [--unspecialise stride_cs]`, Triton 3.6 for sm_90: 8 global stores
    against 64, SASS 1080 against 1560."""
    if splits == 1:
        return c, 0
    stride = triton.cdiv(c.numel(), 16) * 16
    return torch.empty(splits * stride, dtype=torch.float32, device=c.device), stride


def sum_splits(partials: torch.Tensor, stride: int, c: torch.Tensor, splits: int) -> None:
    """c = the splits' partials added in split order (`split_partials`' buffer)."""
    _sum_splits_kernel[(triton.cdiv(c.numel(), 1024),)](partials, c, c.numel(), stride, SPLITS=splits, BLOCK=1024,
                                                         **launch_args(partials))


def split_k(N: int, K: int, cfg: dict, M: int, num_sms: int) -> int:
    """Decode GEMMs with few output tiles (wkv: N=512 -> 8 tiles for 132 SMs) split K so that every
    SM streams weights. The split depends on N and K only for all M <= 64, so a row's summation order
    does not change with the batch there."""
    if M > 64:
        return 1
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    n_kg = triton.cdiv(K, BLOCK_K)
    if tiles >= num_sms // 2:
        return 1
    return max(1, min(n_kg, num_sms // tiles))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132          # the interpreter: an H100/H200's count, so CI exercises the split path


def tile_config(M: int) -> dict:
    """Tile shape by the number of rows: small M (decode) is weight-bandwidth bound, so narrow M tiles
    and many N tiles; large M (prefill) uses 128x128 tiles."""
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    if M <= 32:
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


# Batch-invariant mode: split-K from N and K alone (split_k as for a one-row batch) and a tile from one
# *row-equivalent family*. Tiles that run the same MMA instruction over the same K order round every
# output identically; on SM90 the wgmma tiles (64 rows and up) are one such family, measured by
# benchmarks/tile_equivalence.py and checked by tests/gpu/test_batch_invariant_cuda.py, so decode takes
# 64x64 and prefill 128x128 tiles. Elsewhere (SM100, the interpreter: not measured) one tile for all M.
INVARIANT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
INVARIANT_WIDE_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)   # same family on SM90


def wgmma_family(device: torch.device) -> bool:
    """Whether the 64-row-and-up tiles are known to be row-equivalent on this device (SM90)."""
    return device.type == "cuda" and _capability_major(device.index) == 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int | None) -> int:
    """Asked once per device: invariant_plan runs for every linear layer of every forward."""
    return torch.cuda.get_device_capability(index)[0]


def invariant_plan(N: int, K: int, device: torch.device, M: int = 1) -> tuple[dict, int]:
    """(tile config, split-K count) of the batch-invariant mode for an [N, K] weight and M rows; the
    rows' bits do not depend on M (see above)."""
    wide = M > 64 and wgmma_family(device)
    cfg = dict(INVARIANT_WIDE_CONFIG if wide else INVARIANT_CONFIG)
    return cfg, split_k(N, K, INVARIANT_CONFIG, 1, _num_sms(device))


WEIGHT_BLOCKS = ((128, 128), (32, 32))      # V4's and V4.1's FP8 weight blocks (rows, K)


def _weight_block(block, who: str) -> tuple[int, int]:
    block = tuple(block)
    if block not in WEIGHT_BLOCKS:
        raise ValueError(f"{who}: weight_block={block}; allowed: {', '.join(map(str, WEIGHT_BLOCKS))}")
    return block


def fp8_gemm(qa: torch.Tensor, sa: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None,
             precise_acc: int = PROMOTE_EVERY, splits: int | None = None,
             weight_block: tuple[int, int] = (WEIGHT_BLOCK, BLOCK_K)) -> torch.Tensor:
    """qa [M, K] e4m3, sa [M, ceil(K/128)] fp32, qw [N, K] e4m3, sw [ceil(N/bn), ceil(K/bk)] fp32
    for `weight_block` (bn, bk) -> C [M, N] in out_dtype."""
    bn, bk = _weight_block(weight_block, "fp8_gemm")
    M, K = qa.shape
    N, K2 = qw.shape
    n_kg = triton.cdiv(K, bk)
    if K2 != K or tuple(sa.shape) != (M, triton.cdiv(K, BLOCK_K)) or tuple(sw.shape) != (triton.cdiv(N, bn), n_kg):
        raise ValueError(f"fp8_gemm: shapes qa {tuple(qa.shape)}, sa {tuple(sa.shape)}, qw {tuple(qw.shape)}, "
                         f"sw {tuple(sw.shape)} do not fit (activation groups of {BLOCK_K}, weight blocks of "
                         f"{bn}x{bk})")
    qa, qw = qa.contiguous(), qw.contiguous()
    sa, sw = sa.contiguous().float(), sw.contiguous().float()
    c = torch.empty((M, N), dtype=out_dtype, device=qa.device)
    if M == 0:
        return c
    cfg = dict(config or tile_config(M))
    if bn == WEIGHT_BLOCK and (cfg["BLOCK_N"] > bn or bn % cfg["BLOCK_N"]):
        raise ValueError(f"fp8_gemm: BLOCK_N={cfg['BLOCK_N']} must divide the weight block {bn}")
    if splits is None:
        splits = split_k(N, K, cfg, M, _num_sms(qa.device))
    per = triton.cdiv(n_kg, splits)
    splits = triton.cdiv(n_kg, per)
    dest, stride_cs = split_partials(c, splits)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), splits)
    _fp8_gemm_kernel[grid](qa, sa, qw, sw, dest, M, N, K, qa.stride(0), qw.stride(0), N, stride_cs, N_KG=n_kg,
                           N_AG=sa.shape[1], BLOCK_K=bk, GROUP_M=8, WB=bn, PRECISE_ACC=min(precise_acc, bk),
                           KG_PER_SPLIT=per, FOLD=bn % cfg["BLOCK_N"] == 0, **cfg, **_launch_args(qa, M))
    if splits > 1:
        sum_splits(dest, stride_cs, c, splits)
    return c


@triton.jit(do_not_specialize=["M"])
def _w8a16_gemm_kernel(x_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, stride_xm, stride_wn, stride_cm, stride_xg, stride_cg,
                       N_KG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, WB: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                       PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    pid = tl.program_id(0)
    g = tl.program_id(1)                  # group of a block-diagonal (grouped) product: weight rows g*N..
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    _weights_to_l2(w_ptr, (g * N + tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)).to(tl.int64)
                   * stride_wn, 0, N_KG, BLOCK_K, N_KG, PREFETCH)
    pdl_gate(PDL)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = g * N + offs_n                 # this group's weight rows (N % WB == 0 when grouped)
    x_ptrs = x_ptr + g * stride_xg + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    sw_ptrs = ws_ptr + (rows // WB) * N_KG
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, N_KG):
        k_ok = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        w = w.to(tl.float32).to(x.dtype)       # e4m3 is exact in bf16 (via fp32: the interpreter needs it)
        sw = tl.load(sw_ptrs + kb, mask=n_ok, other=0.0)
        if UPCAST:        # Triton's interpreter multiplies bf16 tiles wrongly; bf16 products are exact in fp32
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        acc += part * sw[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + g * stride_cg + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a16_gemm(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: dict | None = None,
               weight_block: tuple[int, int] = (WEIGHT_BLOCK, BLOCK_K)) -> torch.Tensor:
    """x [M, K] bf16 or fp32 (not quantised) times FP8 weights qw [N, K] with block scales sw
    [ceil(N/bn), ceil(K/bk)] for `weight_block` (bn, bk): the weights stay FP8 in memory and are
    widened tile by tile. fp32 inputs multiply in IEEE fp32 (no tf32), matching the core's float32
    path. Grouped (V4's wo_a): x [M, G, K] times the block-diagonal qw [G*N, K] (group g: rows
    g*N..(g+1)*N, N a multiple of bn) -> [M, G, N], one launch for all groups."""
    bn, bk = _weight_block(weight_block, "w8a16_gemm")
    grouped = x.dim() == 3
    M, K = x.shape[0], x.shape[-1]
    G = x.shape[1] if grouped else 1
    N = qw.shape[0] // G
    n_kg = triton.cdiv(K, bk)
    if qw.shape[1] != K or tuple(sw.shape) != (triton.cdiv(qw.shape[0], bn), n_kg) or \
            (grouped and (qw.shape[0] % G or N % bn)):
        raise ValueError(f"w8a16_gemm: shapes x {tuple(x.shape)}, qw {tuple(qw.shape)}, sw {tuple(sw.shape)} "
                         f"do not fit (blocks of {bn}x{bk}; grouped: G*N rows, N a multiple of {bn})")
    x = x if x.stride(-1) == 1 else x.contiguous()
    qw, sw = qw.contiguous(), sw.contiguous().float()
    c = torch.empty((M, G, N) if grouped else (M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return c
    cfg = dict(config or tile_config(M))
    if x.dtype == torch.float32:            # fp32 tiles: halve the tile to fit shared memory
        cfg.update(BLOCK_M=min(cfg["BLOCK_M"], 64), BLOCK_N=min(cfg["BLOCK_N"], 64), num_stages=2)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), G)
    _w8a16_gemm_kernel[grid](x, qw, sw, c, M, N, K, x.stride(0), qw.stride(0), c.stride(0),
                             x.stride(1) if grouped else 0, c.stride(1) if grouped else 0, N_KG=n_kg,
                             BLOCK_K=bk, GROUP_M=8, WB=bn, IEEE=x.dtype == torch.float32,
                             UPCAST=os.environ.get("TRITON_INTERPRET") == "1", **cfg, **_launch_args(x, M))
    return c
