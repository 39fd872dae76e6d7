"""MoE routing and the expert schedule for DeepSeek-V4 (core reference:
`deepinfer_core.ops.portable_moe.PortableMoE.route`).

`route_topk`: scores = sqrt(softplus(logits)); a hash layer takes its experts from tid2eid[input_id],
a score layer the top-k of scores + bias with ties going to the lowest expert id (the reference's
stable sort), whatever else is in the batch. Weights are the scores at the picked experts,
renormalised if configured, times the routed scale. With `shared_expert` an extra column names the
shared expert (id E, weight exactly 1.0) so that it runs in the same grouped GEMM as the routed ones.

`expert_schedule`: from the (token, slot) pairs sorted by expert id, each expert's row range and its
range of BLOCK_M tiles, on the device; the grouped GEMMs launch `max_tiles` programs (a host-known
bound from T, k, E and BLOCK_M) and the ones past the last tile exit at once. No host sync anywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_args, pdl_gate

# rows of the schedule table (each EB int32 wide): row range of every expert, then its tile range
# for the first GEMM's BLOCK_M and for the second's
ROW_BEGIN, ROW_END, TILE1_BEGIN, TILE1_END, TILE2_BEGIN, TILE2_END = range(6)
SCHED_ROWS = 6


@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) as torch computes it (threshold 20); log1p(z) = log(1+z) * z / ((1+z) - 1)
    keeps full precision where 1 + z rounds (Goldberg)."""
    z = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + z
    d = u - 1.0
    log1p = tl.where(d == 0.0, z, tl.log(u) * (z / tl.where(d == 0.0, 1.0, d)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, log1p))


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logit_ptr, bias_ptr, tid_ptr, input_ptr, ids_ptr, w_ptr, T, E, stride_l, stride_tid,
                  routed_scale, TOPK: tl.constexpr, K1: tl.constexpr, EB: tl.constexpr, KB: tl.constexpr,
                  BT: tl.constexpr, HASH: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_gate(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)          # BT tokens per program
    r_ok = rows < T
    offs = tl.arange(0, EB)
    ok = offs < E
    l = tl.load(logit_ptr + rows[:, None] * stride_l + offs[None, :], mask=r_ok[:, None] & ok[None, :], other=0.0)
    s = _sqrt_softplus(l)
    slots = tl.arange(0, KB)[None, :]
    sel = tl.zeros((BT, KB), dtype=tl.int32)
    wts = tl.zeros((BT, KB), dtype=tl.float32)
    if HASH:
        tok = tl.load(input_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        for j in tl.static_range(TOPK):
            e = tl.load(tid_ptr + tok * stride_tid + j, mask=r_ok, other=0).to(tl.int32)
            sel = tl.where(slots == j, e[:, None], sel)
            w_j = tl.sum(tl.where(offs[None, :] == e[:, None], s, 0.0), axis=1)
            wts = tl.where(slots == j, w_j[:, None], wts)
    else:
        bias = tl.load(bias_ptr + offs, mask=ok, other=0.0)
        v = tl.where(ok[None, :], s + bias[None, :], -float("inf"))
        for j in tl.static_range(TOPK):
            best = tl.max(v, axis=1)
            e = tl.min(tl.where(v == best[:, None], offs[None, :], EB), axis=1)     # ties: the lowest id
            hit = offs[None, :] == e[:, None]
            sel = tl.where(slots == j, e[:, None], sel)
            wts = tl.where(slots == j, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], wts)
            v = tl.where(hit, -float("inf"), v)
    if RENORM:
        wts = wts / tl.sum(tl.where(slots < TOPK, wts, 0.0), axis=1)[:, None]
    wts = wts * routed_scale
    if SHARED:          # the shared expert rides along as expert E with weight 1 (exact: a * 1.0 = a)
        sel = tl.where(slots == TOPK, E, sel)
        wts = tl.where(slots == TOPK, 1.0, wts)
    out = rows[:, None] * K1 + slots
    st_ok = r_ok[:, None] & (slots < K1)
    tl.store(ids_ptr + out, sel, mask=st_ok)
    tl.store(w_ptr + out, wts, mask=st_ok)


def route_topk(logits: torch.Tensor, topk: int, *, bias: torch.Tensor | None = None,
               tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
               renormalize: bool = True, routed_scale: float = 1.0,
               shared_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 (x @ gate^T) -> (expert ids [T, K1] int32, weights [T, K1] fp32), K1 = topk
    (+1 with `shared_expert`: column topk = expert E, weight 1). Hash routing when `tid2eid` is given
    (then `input_ids` [T] is required), else top-k of scores + `bias` [E]."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"route_topk: logits must be [T, E] float32, got {tuple(logits.shape)} {logits.dtype}")
    T, E = logits.shape
    if not 1 <= topk <= E:
        raise ValueError(f"route_topk: topk={topk} must be in 1..{E} (the number of experts)")
    hashed = tid2eid is not None
    if hashed:
        if input_ids is None or input_ids.shape != (T,):
            raise ValueError(f"route_topk: input_ids must be [T={T}] for hash routing, got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        if tid2eid.dim() != 2 or tid2eid.shape[1] != topk or tid2eid.stride(1) != 1:
            raise ValueError(f"route_topk: tid2eid must be [vocab, topk={topk}] with unit column stride, "
                             f"got {tuple(tid2eid.shape)}")
    elif bias is None or bias.shape != (E,) or bias.dtype != torch.float32:
        raise ValueError(f"route_topk: bias must be float32 [E={E}] for score routing, got "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    K1 = topk + int(shared_expert)
    ids = torch.empty((T, K1), dtype=torch.int32, device=logits.device)
    w = torch.empty((T, K1), dtype=torch.float32, device=logits.device)
    if T:
        dummy = logits          # never read: the constexpr branch that uses it is compiled out
        EB = triton.next_power_of_2(E)
        BT = max(1, min(16, 2048 // EB))                 # tokens per program: a [BT, EB] tile
        _route_kernel[(triton.cdiv(T, BT),)](
            logits, dummy if hashed else bias.contiguous(), tid2eid if hashed else dummy,
            input_ids if hashed else dummy, ids, w, T, E, logits.stride(0), tid2eid.stride(0) if hashed else 0,
            float(routed_scale), TOPK=topk, K1=K1, EB=EB, KB=triton.next_power_of_2(K1), BT=BT, HASH=hashed,
            RENORM=bool(renormalize), SHARED=bool(shared_expert), **launch_args(logits))
    return ids, w


@triton.jit
def _lower_bound(sorted_ptr, target, n, N_ITER: tl.constexpr):
    """First index i in [0, n) with sorted[i] >= target, per lane (vectorised binary search)."""
    lo = tl.zeros_like(target)
    hi = tl.zeros_like(target) + n
    for _ in tl.static_range(N_ITER):
        live = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=live, other=0)
        right = live & (v < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(live & (v >= target), mid, hi)
    return lo


@triton.jit(do_not_specialize=["n"])
def _schedule_kernel(sorted_ptr, sched_ptr, n, E1, N_ITER: tl.constexpr, EB: tl.constexpr,
                     BM1: tl.constexpr, BM2: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    e = tl.arange(0, EB)
    live = e < E1
    begin = _lower_bound(sorted_ptr, e, n, N_ITER)
    end = _lower_bound(sorted_ptr, e + 1, n, N_ITER)
    count = tl.where(live, end - begin, 0)
    t1 = (count + BM1 - 1) // BM1
    t2 = (count + BM2 - 1) // BM2
    c1 = tl.cumsum(t1, axis=0)
    c2 = tl.cumsum(t2, axis=0)
    tl.store(sched_ptr + 0 * EB + e, begin)
    tl.store(sched_ptr + 1 * EB + e, begin + count)
    tl.store(sched_ptr + 2 * EB + e, c1 - t1)
    tl.store(sched_ptr + 3 * EB + e, c1)
    tl.store(sched_ptr + 4 * EB + e, c2 - t2)
    tl.store(sched_ptr + 5 * EB + e, c2)


def max_tiles(n: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m) over n rows: each of the (at most min(E, n))
    non-empty experts pads its last tile by < block_m rows."""
    return min(n, (n + min(num_experts, n) * (block_m - 1)) // block_m)


def expert_schedule(sorted_ids: torch.Tensor, num_experts: int, block_m: tuple[int, int]) -> torch.Tensor:
    """sorted_ids [n] int32 (expert ids in ascending order) -> int32 [SCHED_ROWS, EB] table,
    EB = next_power_of_2(num_experts): per expert its rows [ROW_BEGIN, ROW_END) in the sorted order
    and its tiles [TILEx_BEGIN, TILEx_END) for the two GEMMs' BLOCK_M (`block_m`)."""
    if sorted_ids.dim() != 1 or sorted_ids.dtype != torch.int32:
        raise ValueError(f"expert_schedule: sorted_ids must be 1-D int32, got {tuple(sorted_ids.shape)} "
                         f"{sorted_ids.dtype}")
    if num_experts < 1 or len(block_m) != 2 or min(block_m) < 1:
        raise ValueError(f"expert_schedule: num_experts={num_experts}, block_m={block_m} must be positive")
    n = sorted_ids.numel()
    EB = triton.next_power_of_2(num_experts)
    sched = torch.empty((SCHED_ROWS, EB), dtype=torch.int32, device=sorted_ids.device)
    # enough halvings for n + 1 outcomes: 16 up to 65535 rows (a few idle iterations for small batches,
    # but one compiled variant whatever the batch), then rounded up to a multiple of 4
    n_iter = max(16, -(-max(n, 1).bit_length() // 4) * 4)
    _schedule_kernel[(1,)](sorted_ids, sched, n, num_experts, N_ITER=n_iter, EB=EB, BM1=block_m[0],
                           BM2=block_m[1], **launch_args(sorted_ids))
    return sched
