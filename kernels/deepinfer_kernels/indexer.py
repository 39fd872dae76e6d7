"""DeepSeek-V4 lightning indexer on the GPU: score every visible paged indexer-key row and keep each
query's top-k rows, deterministically (core reference: `PortableAttentionBackend.index_select`).

    score[t, r] = sum_h w[t, h] * relu(q[t, h, :] . k[r, :])     (fp32)
    visible rows of query t (position p, sequence s): r < (p + 1) // ratio
    keep the top min(topk, n_visible) rows; equal scores go to the lowest row id

w is the model's `Indexer.head_weights`, the 1/sqrt(Di) score scale already folded in.
`official=True` (the QAT numerics) rounds as DeepSeek's inference code does: each dot product (fp32
accumulation), each relu(dot) * w and the head sum (added in fp32) to q's dtype, so the top-k runs
on bf16 scores (held in fp32, exactly) whose many ties still go to the lowest row id.

Two kernels, neither of which reads anything back to the host, so a CUDA graph can capture them:

1. `_score_kernel`, one program per (query, tile of BLOCK_N rows): gathers key rows through the block
   table, multiplies [Hi, Di] x [Di, BLOCK_N] on the tensor cores, applies relu and the head weights
   and reduces over heads in registers (per-head scores never reach HBM). Tiles past the query's
   visible rows cost one comparison. The tile shape is fixed, never a function of the batch, so a
   query's scores (hence its ties) are the same bits whatever else shares the launch.
2. `_select_kernel`, one program per query: a radix select on the order-preserving uint32 image of
   the fp32 scores (4 passes of 8-bit histograms) finds the k-th largest value exactly; a last pass
   keeps every row above it plus the lowest-index rows equal to it, written in ascending row order
   through a running prefix count. torch.topk cannot be used: its order among ties is unspecified.
   A query with n_visible <= topk takes all its visible rows without reading scores, and the score
   kernel skips such queries altogether (decode below topk * ratio tokens of context).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import launch_args, pdl_gate

SCORE_BLOCK_N = 64     # key rows per scoring program; fixed so scores do not depend on the batch
SELECT_BLOCK = 1024    # scores per step of the selection passes
KEY_BLOCK = 128        # positions per paged block (block_table granularity)
_FLOAT_TYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_TYPES = (torch.int32, torch.int64)


@triton.jit
def _round_to(v, DT: tl.constexpr):
    """fp32 -> the nearest DT value (ties to even), still in fp32. bf16 on the bits: Triton's
    interpreter truncates that cast, and the compiled cast rounds like this."""
    if DT == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        v = v.to(tl.float16).to(tl.float32)
    return v


# skip_upto / fill_all: the same code for indexer_scores and the top-k path; the rest follow the batch
@triton.jit(do_not_specialize=["max_rows", "skip_upto", "fill_all", "stride_bt", "stride_st"])
def _score_kernel(q_ptr, w_ptr, k_ptr, bt_ptr, seq_ptr, pos_ptr, s_ptr,
                  max_rows, skip_upto, fill_all,
                  stride_qt, stride_qh, stride_wt, stride_wh, stride_kb, stride_kr, stride_bt, stride_st,
                  H: tl.constexpr, D: tl.constexpr, RATIO: tl.constexpr, RPB: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, OFFICIAL: tl.constexpr = False,
                  PDL: tl.constexpr = False):
    pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    n = tl.minimum(tl.maximum((pos + 1) // RATIO, 0), max_rows).to(tl.int32)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = s_ptr + t * stride_st + rows
    if n > skip_upto:               # the top-k path skips queries that keep all their rows
        if tile * BLOCK_N < n:
            seq = tl.load(seq_ptr + t).to(tl.int64)
            r_ok = rows < n
            blk = tl.load(bt_ptr + seq * stride_bt + rows // RPB, mask=r_ok, other=0).to(tl.int64)
            row_off = blk * stride_kb + (rows % RPB).to(tl.int64) * stride_kr
            offs_h = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, BLOCK_D)
            h_ok = offs_h < H
            acc = tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32)
            for d0 in tl.static_range(0, D, BLOCK_D):
                d_ok = offs_d < D - d0
                qt = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + (d0 + offs_d)[None, :],
                             mask=h_ok[:, None] & d_ok[None, :], other=0.0)
                kt = tl.load(k_ptr + row_off[None, :] + (d0 + offs_d)[:, None],
                             mask=r_ok[None, :] & d_ok[:, None], other=0.0)
                if UPCAST:  # fp32 or mixed inputs (and the interpreter): exact fp32 products, no tf32
                    acc += tl.dot(qt.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(qt, kt)
            wt = tl.load(w_ptr + t * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
            if OFFICIAL:     # every step rounded to q's dtype; the head sum added in fp32
                DT: tl.constexpr = q_ptr.dtype.element_ty
                dot = tl.maximum(_round_to(acc, DT), 0.0)
                head = _round_to(dot * _round_to(wt, DT)[:, None], DT)
                score = _round_to(tl.sum(head, axis=0), DT)
            else:
                score = tl.sum(tl.maximum(acc, 0.0) * wt[:, None], axis=0)
            tl.store(out_ptrs, tl.where(r_ok, score, float("-inf")), mask=rows < max_rows)
        elif fill_all:
            tl.store(out_ptrs, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=rows < max_rows)
    elif fill_all:
        tl.store(out_ptrs, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=rows < max_rows)


@triton.jit(do_not_specialize=["max_rows", "stride_st"])
def _select_kernel(s_ptr, pos_ptr, out_ptr, max_rows, stride_st, K: tl.constexpr,
                   RATIO: tl.constexpr, BLOCK: tl.constexpr, KBLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    n = tl.minimum(tl.maximum((pos + 1) // RATIO, 0), max_rows).to(tl.int32)
    out_row = out_ptr + t * K
    if n <= K:
        # every visible row is selected; no scores needed
        for j0 in tl.static_range(0, K, KBLOCK):
            j = j0 + tl.arange(0, KBLOCK)
            tl.store(out_row + j, tl.where(j < n, j, -1), mask=j < K)
    else:
        s_row = s_ptr + t * stride_st
        offs = tl.arange(0, BLOCK)
        bins = tl.arange(0, 256)
        k_rem = K          # how many of the rows matching the current prefix are still to take
        prefix = (n * 0).to(tl.uint32)
        # radix select, most significant byte first: after pass p the top 8(p+1) bits of the k-th
        # largest key are known and k_rem counts how many rows equal to that prefix are taken
        for p in tl.static_range(4):
            hist = tl.zeros((256,), dtype=tl.int32)
            r0 = n * 0
            while r0 < n:   # (a while loop: the interpreter cannot range() over a runtime bound)
                rows = r0 + offs
                ok = rows < n
                x = tl.load(s_row + rows, mask=ok, other=0.0)
                # uint32 image whose unsigned order is the float order; -0.0 joins +0.0 (the
                # reference's float sort calls them equal). Inlined: the interpreter is slow on calls
                bits = x.to(tl.uint32, bitcast=True)
                u = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
                u = tl.where(x == 0.0, 0x80000000, u)
                if p > 0:   # only rows whose higher bytes match the prefix found so far
                    ok = ok & ((u >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
                hist += tl.histogram(((u >> (24 - 8 * p)) & 0xFF).to(tl.int32), 256, mask=ok)
                r0 += BLOCK
            # ge[b] = rows in bins >= b, non-increasing with ge[0] >= k_rem: the k-th largest lies
            # in the highest bin with ge[b] >= k_rem, and the bins above it hold ge[digit + 1] rows
            ge = tl.cumsum(hist, axis=0, reverse=True)
            digit = tl.max(tl.where(ge >= k_rem, bins, 0), axis=0)
            k_rem -= tl.max(tl.where(ge < k_rem, ge, 0), axis=0)
            prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
        # keep the rows above the threshold and the first k_rem rows equal to it, in row order: a
        # row's output slot is (#above before it) + min(#equal before it, k_rem). One scan counts
        # both, packed as above + equal << 16 (BLOCK < 2**16)
        n_gt = n * 0
        n_eq = n * 0
        r0 = n * 0
        while r0 < n:
            rows = r0 + offs
            ok = rows < n
            x = tl.load(s_row + rows, mask=ok, other=0.0)
            bits = x.to(tl.uint32, bitcast=True)             # the same image as above
            u = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
            u = tl.where(x == 0.0, 0x80000000, u)
            gt = ok & (u > prefix)
            eq = ok & (u == prefix)
            packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
            before = tl.cumsum(packed, axis=0) - packed
            eq_before = n_eq + (before >> 16)
            slot = n_gt + (before & 0xFFFF) + tl.minimum(eq_before, k_rem)
            tl.store(out_row + slot, rows, mask=gt | (eq & (eq_before < k_rem)))
            total = tl.sum(packed, axis=0)
            n_gt += total & 0xFFFF
            n_eq += total >> 16
            r0 += BLOCK


def _check(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor,
           token_seq: torch.Tensor, positions: torch.Tensor, ratio: int, max_rows: int | None) -> int:
    """Validate shapes, dtypes and devices (host metadata only, never device values); return max_rows."""
    if not isinstance(ratio, int) or ratio < 1 or KEY_BLOCK % ratio:
        raise ValueError(f"indexer: ratio={ratio!r} must be a positive divisor of {KEY_BLOCK}")
    if q.dim() != 3 or q.dtype not in _FLOAT_TYPES:
        raise ValueError(f"indexer: q must be [T, Hi, Di] bf16/fp16/fp32, got {tuple(q.shape)} {q.dtype}")
    T, H, D = q.shape
    if H < 1 or D < 1:
        raise ValueError(f"indexer: q {tuple(q.shape)} has no heads or no channels")
    if tuple(w.shape) != (T, H) or not w.dtype.is_floating_point:
        raise ValueError(f"indexer: w must be a float [T, Hi] = {(T, H)} tensor, got {tuple(w.shape)} {w.dtype}")
    rpb = KEY_BLOCK // ratio
    if keys.dim() != 3 or keys.shape[1] != rpb or keys.shape[2] != D or keys.dtype not in _FLOAT_TYPES:
        raise ValueError(f"indexer: keys must be [NUM_BLOCKS, {rpb}, {D}] bf16/fp16/fp32 for ratio {ratio} "
                         f"and Di={D}, got {tuple(keys.shape)} {keys.dtype}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"indexer: block_table must be [S, MAXB] int32, got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    if tuple(token_seq.shape) != (T,) or token_seq.dtype not in _INT_TYPES:
        raise ValueError(f"indexer: token_seq must be [T] = [{T}] int32/int64, got {tuple(token_seq.shape)} "
                         f"{token_seq.dtype}")
    if tuple(positions.shape) != (T,) or positions.dtype not in _INT_TYPES:
        raise ValueError(f"indexer: positions must be [T] = [{T}] int32/int64, got {tuple(positions.shape)} "
                         f"{positions.dtype}")
    for name, x in (("w", w), ("keys", keys), ("block_table", block_table), ("token_seq", token_seq),
                    ("positions", positions)):
        if x.device != q.device:
            raise ValueError(f"indexer: {name} is on {x.device}, q on {q.device}")
    capacity = block_table.shape[1] * rpb
    if max_rows is None:
        return capacity
    if not isinstance(max_rows, int) or not 0 <= max_rows <= capacity:
        raise ValueError(f"indexer: max_rows={max_rows!r} must be an int in [0, {capacity}] (block_table "
                         f"width {block_table.shape[1]} x {rpb} rows per block)")
    return max_rows


def _scores(q, w, keys, block_table, token_seq, positions, ratio: int, max_rows: int,
            skip_upto: int, fill_all: bool, official: bool) -> torch.Tensor:
    T, H, D = q.shape
    scores = torch.empty((T, max(max_rows, 1)), dtype=torch.float32, device=q.device)
    if T == 0 or max_rows == 0:
        return scores[:, :max_rows].fill_(float("-inf"))
    if q.stride(2) != 1:
        q = q.contiguous()
    if keys.stride(2) != 1:
        keys = keys.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    # bf16 x bf16 (or fp16 x fp16) on the tensor cores with fp32 accumulation; anything else, and the
    # interpreter (whose bf16 dot is broken), multiplies exactly in fp32
    upcast = interp or q.dtype != keys.dtype or q.dtype == torch.float32
    block_d = min(128, max(16, triton.next_power_of_2(D)))
    grid = (T, triton.cdiv(max_rows, SCORE_BLOCK_N))
    _score_kernel[grid](q, w, keys, block_table, token_seq, positions, scores,
                        max_rows, skip_upto, int(fill_all),
                        q.stride(0), q.stride(1), w.stride(0), w.stride(1), keys.stride(0), keys.stride(1),
                        block_table.stride(0), scores.stride(0),
                        H=H, D=D, RATIO=ratio, RPB=KEY_BLOCK // ratio,
                        BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_D=block_d, BLOCK_N=SCORE_BLOCK_N,
                        UPCAST=upcast, OFFICIAL=bool(official), num_warps=4, **launch_args(q))
    return scores


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor,
                   token_seq: torch.Tensor, positions: torch.Tensor, *, ratio: int = 4,
                   max_rows: int | None = None, official: bool = False) -> torch.Tensor:
    """Indexer scores [T, max_rows] fp32, -inf for rows a query cannot see (what `indexer_topk` selects
    from; for tests and debugging)."""
    max_rows = _check(q, w, keys, block_table, token_seq, positions, ratio, max_rows)
    return _scores(q, w, keys, block_table, token_seq, positions, ratio, max_rows, -1, True,
                   official)[:, :max_rows]


def indexer_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor,
                 token_seq: torch.Tensor, positions: torch.Tensor, *, topk: int, ratio: int = 4,
                 max_rows: int | None = None, select_block: int | None = None,
                 official: bool = False) -> torch.Tensor:
    """Each query's top-k visible indexer-key rows: idx [T, topk] int32, logical row ids ascending,
    padded with -1. q [T, Hi, Di] bf16/fp16/fp32, w [T, Hi], keys [NUM_BLOCKS, 128 // ratio, Di] paged
    through block_table [S, MAXB] int32 by token_seq [T]; positions [T] absolute positions.
    max_rows bounds any query's visible rows (default: the block table's capacity); rows past it are
    never considered. `select_block` (a power of two in [16, 4096]) overrides the selection step.
    `official`: scores rounded as DeepSeek's inference code rounds them (module docstring)."""
    max_rows = _check(q, w, keys, block_table, token_seq, positions, ratio, max_rows)
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"indexer_topk: topk={topk!r} must be a positive int")
    block = SELECT_BLOCK if select_block is None else select_block
    if not isinstance(block, int) or not 16 <= block <= 4096 or block & (block - 1):
        raise ValueError(f"indexer_topk: select_block={select_block!r} must be a power of two in [16, 4096]")
    # not shrunk to the batch's max_rows: BLOCK is a constexpr, and a block that followed the batch
    # would compile a new kernel variant mid-serving whenever the longest context crossed a power of 2
    T = q.shape[0]
    idx = torch.empty((T, topk), dtype=torch.int32, device=q.device)
    if T == 0:
        return idx
    # queries with n_visible <= topk are skipped by the score kernel and never read by the selection
    scores = _scores(q, w, keys, block_table, token_seq, positions, ratio, max_rows, topk, False,
                     official)
    _select_kernel[(T,)](scores, positions, idx, max_rows, scores.stride(0), K=topk, RATIO=ratio, BLOCK=block,
                         KBLOCK=min(1024, max(16, triton.next_power_of_2(topk))),
                         num_warps=4 if block <= 1024 else 8, **launch_args(scores))
    return idx
