"""DeepSeek-V4 MoE on the FP8 tensor cores, end to end after routing: permutation by expert, the
grouped w13 GEMM with SwiGLU (+clamp, + routing weight, + FP8 quantisation) in its epilogue, the
grouped w2 GEMM, and the fixed-order combine (core reference: `PortableMoE.apply` over
`deepinfer_core.model.moe.Expert`).

Everything stays on the device and every launch size is a host-known bound (tokens, top-k, experts,
tile sizes), so the whole call can be captured in a CUDA graph. The permutation is torch's stable
sort of the expert ids (deterministic); a row's GEMM result does not depend on which rows share its
tile, and the combine adds each token's experts in slot order, so permuting the batch permutes the
output exactly. Kernels: `moe_routing` (top-k, schedule) and `moe_gemm` (GEMMs, combine).
"""
from __future__ import annotations

import torch

from .fp4_experts import Fp4Experts, decode_experts
from .fp8_quant import act_quant, act_quant_values
from .moe_combine import moe_combine
from .moe_gemm import Experts, moe_w2, moe_w13
from .moe_gemv import gemv_fits, gemv_w2, gemv_w13
from .moe_mma import ROWS as MMA_ROWS
from .moe_mma import mma_fits, mma_w2, mma_w13
from .moe_routing import expert_schedule, max_tiles, route_topk

# The mma.sync kernels (moe_mma, FP8 activations only) by weight form: up to how many mean rows per
# expert they take the sizes, with which setting. Measured with benchmarks/fp4_moe_bench.py on an
# H100 (docs/performance.md, "Decode sizes on mma.sync"): with FP4 experts 0.81-0.84x the FP8
# tensor-core tiles' time at batch 8-256 of V4-Flash (6 rows per expert at 256: 8-row tiles still
# read most experts once) and on par at batch 1; with FP8 experts within 1-6% of the tensor-core
# tiles, which they keep.
MMA_TILES: dict[str, tuple[float, dict]] = {"fp4": (16.0, dict(mma_warps=4, mma_prefetch=False)), "fp8": (0.0, {})}
# The CUDA-core kernels (moe_gemv) by weight form: (mean rows per expert up to which, tile config), the
# first that fits, where the mma.sync kernels do not apply (unquantised activations: FP4 experts without
# the QAT simulation). Measured with benchmarks/fp4_moe_bench.py on an H100: with FP4 experts they beat the
# tensor-core tiles up to batch 64 of V4-Flash (about 1.7 rows per expert); with FP8 experts the
# tensor-core tiles stay ahead at every size.
GEMV_TILES: dict[str, tuple[tuple[float, dict], ...]] = {
    "fp4": ((0.5, dict(gemv_rows=1, block_n1=32, block_n2=32, num_warps1=2, num_warps2=2, gemv_stages=1)),
            (3.0, dict(gemv_rows=2, block_n1=32, block_n2=32, num_warps1=4, num_warps2=4, gemv_stages=1))),
    "fp8": (),
}
# Above FP8_CHUNK_ROWS mean rows per expert, FP4 experts are decoded to their FP8 re-encoding a chunk of
# experts at a time (`decode_experts`, about FP8_CHUNK_BYTES of scratch) and each chunk runs the FP8
# tensor-core tiles: the same bits as FP8 experts, where the FP4 tensor-core tiles (their decode passing
# through shared memory) take 2.2x the FP8 tiles' time at batch 256 and 4.3x at a 4k prefill. The decode
# pass moves ~2.3 TB/s on an H200 (benchmarks/decode_experts_bench.py): about 4 ms per V4-Flash layer,
# against the FP4 tiles' ~18 ms extra over the FP8 ones at a 4k prefill (96 rows per expert, H100), so
# the chunks pay from about 40 rows per expert on (docs/performance.md).
FP8_CHUNK_ROWS = 48.0
FP8_CHUNK_BYTES = 1 << 30
# An override for both forms (benchmarks' --cuda-core-moe ROWS): None = MMA_TILES, then GEMV_TILES; 0 = the
# tensor-core tiles only; > 0 = the CUDA-core kernels up to that many mean rows per expert, with
# GEMV_TILES["fp4"]'s settings (then 4 rows per program).
GEMV_MAX_ROWS: float | None = None

__all__ = ["expert_outputs", "fused_moe", "invariant_moe_config", "moe_tile_config", "route_topk"]


def moe_tile_config(tokens: int, topk: int, num_experts: int, wide_fp32: bool = False,
                    cuda_cores: bool = True, fp4: bool = False, fp8_activations: bool = True) -> dict:
    """Tiles by the mean rows per routed expert. At decode sizes, by the weight form (`fp4`: routed
    experts kept FP4): with `fp8_activations` (the QAT simulation) the mma.sync kernels where
    `MMA_TILES` takes them (`moe_mma`: 8 rows per tile, operands built in registers), else the CUDA-core
    kernels where `GEMV_TILES` does (`moe_gemv`: `gemv_rows` rows per program, no padding to 16); above
    that, decode is still weight-bandwidth bound, so BLOCK_M 16 and narrow w2 tiles give many programs;
    prefill takes 64-row tiles. `wide_fp32`: unquantised fp32 activations (test numerics) need smaller
    tensor-core tiles in shared memory. `cuda_cores=False`: the grouped tensor-core tiles only (the
    batch-invariant modes)."""
    # (warps chosen so that ptxas reports no or only tiny spills for sm_90 at V4-Flash sizes)
    rows = tokens * topk / max(num_experts, 1)
    if cuda_cores:
        limit, mma = MMA_TILES["fp4" if fp4 else "fp8"]
        if GEMV_MAX_ROWS is None and fp8_activations and rows <= limit:
            return dict(mma)
        gemv = _gemv_config(rows, fp4)
        if gemv is not None:
            return gemv
        if fp4 and rows > FP8_CHUNK_ROWS:
            return dict(moe_tile_config(tokens, topk, num_experts, wide_fp32, cuda_cores=False), fp8_chunks=True)
    if rows <= 16:
        cfg = dict(block_m1=16, block_m2=16, block_n2=64, num_warps1=4, num_stages1=4, num_warps2=4, num_stages2=4)
    elif rows <= 48:
        cfg = dict(block_m1=32, block_m2=32, block_n2=64, num_warps1=8, num_stages1=3, num_warps2=4, num_stages2=4)
    else:
        cfg = dict(block_m1=64, block_m2=64, block_n2=128, num_warps1=8, num_stages1=3, num_warps2=8, num_stages2=3)
    if wide_fp32:
        cfg.update(block_m1=min(cfg["block_m1"], 32), block_m2=min(cfg["block_m2"], 32), num_stages1=2,
                   num_stages2=2)
    return cfg


def _gemv_config(rows: float, fp4: bool) -> dict | None:
    if GEMV_MAX_ROWS is None:
        table = GEMV_TILES["fp4" if fp4 else "fp8"]
    elif 0 < rows <= GEMV_MAX_ROWS:       # the override: FP4's settings, 4 rows per program beyond them
        table = GEMV_TILES["fp4"] + ((float("inf"), {**GEMV_TILES["fp4"][-1][1], "gemv_rows": 4}),)
    else:
        return None
    return next((dict(cfg) for limit, cfg in table if rows <= limit), None)


def invariant_moe_config(tokens: int, topk: int, num_experts: int, wide_fp32: bool = False,
                         mma_v2_family: bool = False) -> dict:
    """Batch-invariant mode: tiles whose rows round identically for every batch. The 16- and 32-row
    tile sets (mma.sync) are one row-equivalent family on SM90 (`mma_v2_family`, measured by
    benchmarks/tile_equivalence.py, checked by the GPU tests), so decode keeps its 16-row tiles there;
    the 64-row set (wgmma) rounds differently and is never used. Elsewhere: the 32-row set for all."""
    if mma_v2_family and not wide_fp32 and tokens * topk / max(num_experts, 1) <= 16:
        return moe_tile_config(16, 1, 1, cuda_cores=False)
    return moe_tile_config(32, 1, 1, wide_fp32, cuda_cores=False)


def fused_moe(x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w13: Experts, s13: torch.Tensor,
              w2: Experts, s2: torch.Tensor, *, n_clamped: int, swiglu_limit: float, quant_in: bool,
              quant_mid: bool, compute_dtype: torch.dtype, shared_last: bool = True,
              config: dict | None = None) -> torch.Tensor:
    """x [T, D]; ids [T, K1] int32 expert of each (token, slot) and route_w [T, K1] fp32 its weight
    (`route_topk`); w13 [E1, 2, I, D] e4m3 (w1 then w3) + s13 fp32 [E1, 2, I/128, D/128]; w2 [E1, D, I]
    + s2 [E1, D/128, I/128]; either weight may be `Fp4Experts` (its routed experts decoded from FP4 in
    registers: the same bits). Experts < `n_clamped` get the SwiGLU clamp at `swiglu_limit`.
    `quant_in` / `quant_mid`: FP8 act_quant of the w13 / w2 inputs (QAT simulation), else the
    activations stay in `compute_dtype`. Returns [T, D] in x's dtype: the slots' outputs
    (`expert_outputs`) summed in fp32 (the last slot first when `shared_last`)."""
    y = expert_outputs(x, ids, route_w, w13, s13, w2, s2, n_clamped=n_clamped, swiglu_limit=swiglu_limit,
                       quant_in=quant_in, quant_mid=quant_mid, compute_dtype=compute_dtype, config=config)
    return moe_combine(y, x.dtype, shared_last=shared_last)


def expert_outputs(x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w13: Experts, s13: torch.Tensor,
                   w2: Experts, s2: torch.Tensor, *, n_clamped: int, swiglu_limit: float, quant_in: bool,
                   quant_mid: bool, compute_dtype: torch.dtype, config: dict | None = None,
                   out: torch.Tensor | None = None,
                   x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`fused_moe` before its combine (arguments as there): y [T, K1, D] in `compute_dtype` (`out` if
    given: a contiguous tensor of that shape and dtype), the weighted output of each (token, slot)'s
    expert. An expert-parallel rank calls it on the (row, slot) pairs it received (K1 = 1) and on the
    shared expert alone, and combines across ranks itself.
    An id outside [0, E1) (-1: a pair another rank computes) sorts outside every expert's rows: no
    tile computes it and its y entry is left unwritten. `config` None: the tile heuristic for T * K1
    rows over E1 experts. `x_quant`: `act_quant(x)` where the caller has it already (the FP8 chunks
    quantise x once for all of them)."""
    if x.dim() != 2:
        raise ValueError(f"expert_outputs: x must be [T, D], got {tuple(x.shape)}")
    T, D = x.shape
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype != torch.int32:
        raise ValueError(f"expert_outputs: ids must be int32 [T={T}, K1], got {tuple(ids.shape)} {ids.dtype}")
    if route_w.shape != ids.shape or route_w.dtype != torch.float32:
        raise ValueError(f"expert_outputs: route_w must be float32 {tuple(ids.shape)}, got {tuple(route_w.shape)} "
                         f"{route_w.dtype}")
    w13_shape, w2_shape = tuple(w13.shape), tuple(w2.shape)
    if len(w13_shape) != 4 or w13_shape[3] != D or len(w2_shape) != 3 or w2_shape[:2] != (w13_shape[0], D) \
            or w2_shape[2] != w13_shape[2]:
        raise ValueError(f"expert_outputs: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit D={D} "
                         f"(want [E1, 2, I, D] and [E1, D, I])")
    K1, E1 = ids.shape[1], w13.shape[0]
    n = T * K1
    fp4, fp8_in = isinstance(w13, Fp4Experts), quant_in and quant_mid
    wide = compute_dtype == torch.float32 and not fp8_in
    cfg = dict(config or moe_tile_config(T, K1, E1, wide_fp32=wide, fp4=fp4, fp8_activations=fp8_in))
    if "mma_warps" in cfg and not (fp8_in and mma_fits(D, w13.shape[2])):      # FP8 activations only
        cfg = moe_tile_config(T, K1, E1, wide_fp32=wide, fp4=fp4, fp8_activations=False)
    if "gemv_rows" in cfg and not gemv_fits(D, w13.shape[2], cfg["block_n1"], cfg["block_n2"]):
        cfg = moe_tile_config(T, K1, E1, wide_fp32=wide, cuda_cores=False)
    if cfg.pop("fp8_chunks", False) and fp4:
        return _by_fp8_chunks(x, ids, route_w, w13, s13, w2, s2, cfg, n_clamped=n_clamped, swiglu_limit=swiglu_limit,
                              quant_in=quant_in, quant_mid=quant_mid, compute_dtype=compute_dtype, out=out)
    if out is not None and (tuple(out.shape) != (T, K1, D) or not out.is_contiguous()):
        raise ValueError(f"expert_outputs: out must be a contiguous [T={T}, K1={K1}, D={D}] tensor, got "
                         f"{tuple(out.shape)}")
    y_rows = None if out is None else out.view(n, D)
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)     # stable: deterministic rows
    if "mma_warps" in cfg:      # FP8 activations on mma.sync fragments built in registers
        sched = expert_schedule(sorted_ids, E1, (MMA_ROWS, MMA_ROWS))
        tiles, warps, ahead = max_tiles(n, E1, MMA_ROWS), cfg["mma_warps"], cfg.get("mma_prefetch", False)
        a = mma_w13(*(x_quant or act_quant(x)), w13, s13, order, route_w, sched, tiles, k1=K1, n_clamped=n_clamped
                    if swiglu_limit > 0 else 0, limit=swiglu_limit, compute_dtype=compute_dtype, x_dtype=x.dtype,
                    num_warps=warps, prefetch=ahead)
        y = mma_w2(*act_quant(a), w2, s2, order, sched, tiles, out_dtype=compute_dtype, num_warps=warps,
                   prefetch=ahead, out=y_rows)
        return y.view(T, K1, D)
    if "gemv_rows" in cfg:      # float32 activations, QAT applied in the quantising launch itself
        m = cfg["gemv_rows"]
        sched = expert_schedule(sorted_ids, E1, (m, m))
        a = gemv_w13(act_quant_values(x) if quant_in else x.to(compute_dtype), w13, s13, order, route_w, sched,
                     max_tiles(n, E1, m), k1=K1, n_clamped=n_clamped if swiglu_limit > 0 else 0, limit=swiglu_limit,
                     compute_dtype=compute_dtype, x_dtype=x.dtype, quant_out=quant_mid, rows=m,
                     block_n=cfg["block_n1"], num_warps=cfg["num_warps1"], stages=cfg.get("gemv_stages", 1))
        if quant_mid:
            a = act_quant_values(a)
        y = gemv_w2(a, w2, s2, order, sched, max_tiles(n, E1, m), out_dtype=compute_dtype, rows=m,
                    block_n=cfg["block_n2"], num_warps=cfg["num_warps2"], stages=cfg.get("gemv_stages", 1), out=y_rows)
        return y.view(T, K1, D)
    if quant_in:
        xq, xs = x_quant or act_quant(x)
    else:
        xq, xs = x.to(compute_dtype), None
    bm1, bm2 = cfg["block_m1"], cfg["block_m2"]
    sched = expert_schedule(sorted_ids, E1, (bm1, bm2))
    a, a_s = moe_w13(xq, xs, w13, s13, order, route_w, sched, max_tiles(n, E1, bm1), k1=K1, n_clamped=n_clamped
                     if swiglu_limit > 0 else 0, limit=swiglu_limit, compute_dtype=compute_dtype,
                     x_dtype=x.dtype, quant_out=quant_mid, block_m=bm1, num_warps=cfg["num_warps1"],
                     num_stages=cfg["num_stages1"], swap_ab=cfg.get("swap_ab1", False))
    y = moe_w2(a, a_s, w2, s2, order, sched, max_tiles(n, E1, bm2), out_dtype=compute_dtype, block_m=bm2,
               block_n=cfg["block_n2"], num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"],
               swap_ab=cfg.get("swap_ab2", False), out=y_rows)
    return y.view(T, K1, D)


def _by_fp8_chunks(x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, w13: Fp4Experts, s13: torch.Tensor,
                   w2: Fp4Experts, s2: torch.Tensor, tiles: dict, *, n_clamped: int, compute_dtype: torch.dtype,
                   out: torch.Tensor | None, **kw) -> torch.Tensor:
    """`expert_outputs` with FP4 experts decoded to FP8 a chunk at a time (`FP8_CHUNK_BYTES` of
    scratch), then the FP8-kept experts (the shared one): each chunk's (token, slot) pairs through the
    FP8 tensor-core `tiles` into the one output, the others' ids set outside its experts (their rows
    left to the other chunks)."""
    E4, E1 = w13.num_fp4, w13.shape[0]
    _, _, I, D = w13.shape
    chunk = max(1, FP8_CHUNK_BYTES // (3 * I * D))
    y = out if out is not None else torch.empty((*ids.shape, D), dtype=compute_dtype, device=x.device)
    x_quant = act_quant(x) if kw["quant_in"] else None
    for first, end in [(e, min(e + chunk, E4)) for e in range(0, E4, chunk)] + [(E4, E1)]:
        if end <= first:
            continue
        inside = (ids >= first) & (ids < end)
        if first < E4:
            c13, c2 = decode_experts(w13, s13, first, end), decode_experts(w2, s2, first, end)
        else:
            c13, c2 = w13.fp8, w2.fp8
        expert_outputs(x, torch.where(inside, ids - first, -1), route_w, c13, s13[first:end], c2, s2[first:end],
                       n_clamped=min(max(n_clamped - first, 0), end - first), config=tiles, compute_dtype=compute_dtype,
                       out=y, x_quant=x_quant, **kw)
    return y
