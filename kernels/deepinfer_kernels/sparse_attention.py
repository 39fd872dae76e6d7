"""DeepSeek-V4 sparse attention: the sliding window (ring + new tokens), the selected compressed rows
(CSA indices or the HCA prefix) and a per-head sink in one online softmax. Core reference:
`deepinfer_core.ops.portable_attention.PortableAttentionBackend.attend`.

MQA: every head attends to the same key rows and the key row is also the value row (K = V), so a
program takes one query token x BLOCK_H heads and multiplies [BLOCK_H, D] by each gathered key tile
[BLOCK_N, D] on the tensor cores, loading every row once for all its heads. A query's keys form one
list, [window positions lo..t | compressed rows], walked in BLOCK_N tiles in a fixed order; the fp32
online softmax runs in base 2 with a finite sentinel (no -inf - -inf = NaN): the running max m is
over the keys alone, the unnormalised exp(s - m) are rounded to the key dtype for the product with
the values (fp32 accumulation) and summed unrounded into l, and the sink joins the denominator only
at the end. `official=True` (the QAT numerics) ends as DeepSeek's kernel does, out = acc / (l +
exp(sink - m)); otherwise the sink may raise the final max first (m' = max(m, sink), acc and l
rescaled by exp(m - m')), which cannot overflow whatever the sink.

Decode at small batch leaves most SMs idle with one program per (token, head block), so there the
key list is cut into splits of a fixed size (a function of the key-list bound only, so a row's
result does not depend on the other rows of the batch) whose partial (m, l, acc) a second kernel
merges in split order, rescaled to the largest split max (official: the sink's term added once, at
the end; one split merges to the fused epilogue's bits). Nothing uses atomics: results are
run-to-run deterministic.

A kv_fp8 cache gives uint8 pools (ring and/or comp_rows) of packed FP8 rows (core reference
`deepinfer_core.ops.kv_fp8`): the kernel loads the e4m3 codes, their UE8M0 scales and the bf16 RoPE
dims and dequantises each key tile to the kv dtype (exact: codes x powers of two fit bf16), so the
result is bit-identical to attending over a float pool holding the fake-quantised rows. The new keys
`kv` of this batch are never packed.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .compressor import packed_rope_dim
from .pdl import launch_args, pdl_gate

NEG = tl.constexpr(-1.0e30)   # finite "-inf": masked logits and the empty running max
LOG2E = 1.4426950408889634
MAX_SPLITS = 16               # split-KV: at most this many partial results per (token, head block)
MIN_SPLIT_KEYS = 128          # ... each covering at least this many keys
# Batch-invariant mode: keys per split. V4's CSA list (window 128 + top-512) and HCA lists up to ~114k
# tokens of context fit one split, so the fused epilogue (equal, bit for bit, to merging one split)
# serves them; longer lists split at the same key indices in prefill, chunks and decode.
INVARIANT_SPLIT_KEYS = 1024


def _fix_interpreter_loop_bounds() -> None:
    """triton-lang/triton#9171: under TRITON_INTERPRET=1 with numpy >= 2.4, `range(lo, hi)` over
    bounds computed in the kernel fails (int() of a 1-element array is refused). Install upstream's
    fix (squeeze before int()); compiled kernels are untouched."""
    from triton.runtime import interpreter as ti
    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "squeezes_index", False):
        return

    def patched(tensor, scope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    ti._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_loop_bounds()


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bfloat16 value (ties to even), still in fp32: the compiled cast's
    rounding, which Triton's interpreter (it truncates) does not give."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _round_out(o, DT: tl.constexpr):
    """The output in DT, rounded to nearest even under the interpreter too."""
    if DT == tl.bfloat16:
        o = _round_bf16(o)
    return o.to(DT)


@triton.jit
def _attend_tile(q, k, ok, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Fold one key tile k [BLOCK_N, D] (rows with ok=False are ignored) into the running state."""
    if UPCAST:        # the interpreter multiplies bf16 tiles wrongly; bf16 products are exact in fp32
        kd = k.to(tl.float32)
        s = tl.dot(q, tl.trans(kd), input_precision="ieee")
    elif IEEE:        # fp32 inputs: IEEE fp32 like the reference, no tf32
        kd = k
        s = tl.dot(q, tl.trans(kd), input_precision="ieee")
    else:
        kd = k
        s = tl.dot(q, tl.trans(kd))
    s = tl.where(ok[None, :], s * qk_scale, NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    # explicit zero: while every key so far is masked, m_new is the sentinel and s - m_new = 0
    p = tl.where(ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:               # the interpreter, bf16 keys: the rounding a compiled cast does
        pv = _round_bf16(p)
    else:
        pv = p.to(k.dtype)   # unnormalised probabilities in the key dtype
    if UPCAST or IEEE:
        acc = acc * alpha[:, None] + tl.dot(pv, kd, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pv, kd)
    return m_new, l_i, acc


@triton.jit
def _load_packed(u8_ptr, b16_ptr, off, ok, BLOCK_N: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                 dtype: tl.constexpr):
    """[BLOCK_N, D] `dtype` key rows of a packed FP8 pool, row i starting at byte off[i] (rows with
    ok=False are zero): e4m3 code * 2^(e-127) on the nope dims, the stored bf16 on the RoPE dims.
    b16_ptr is the same pool viewed as bf16. Layout: [NOPE codes | D-NOPE bf16 | NOPE/64 exponents].
    Built as [BLOCK_N, D/64, 64] (a row's 64-dim groups) so each group's exponent byte is loaded once
    and broadcast, not gathered per element."""
    G: tl.constexpr = D // 64
    g = tl.arange(0, G)
    j = tl.arange(0, 64)
    d3 = (g * 64)[None, :, None] + j[None, None, :]
    nope_g = g < NOPE // 64                   # the groups of e4m3 codes; the rest hold the bf16 RoPE dims
    is_q = nope_g[None, :, None]
    ok3 = ok[:, None, None]
    code = tl.load(u8_ptr + off[:, None, None] + d3, mask=ok3 & is_q, other=0)
    e = tl.load(u8_ptr + off[:, None] + (2 * D - NOPE) + g[None, :], mask=ok[:, None] & nope_g[None, :], other=0)
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    rope = tl.load(b16_ptr + (off // 2 - NOPE // 2)[:, None, None] + d3, mask=ok3 & ~is_q, other=0.0)
    return tl.reshape(tl.where(is_q, v.to(dtype), rope.to(dtype)), (BLOCK_N, D))


@triton.jit(do_not_specialize=["n_idx", "chunk", "s_bt", "s_idx"])
def _sparse_attn_kernel(q_ptr, kv_ptr, ring_ptr, ring16_ptr, sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
                        cu_ptr, start_ptr, tseq_ptr, pos_ptr, slots_ptr, comp_ptr, comp16_ptr, bt_ptr, idx_ptr,
                        H, R, window, n_idx, ratio, qk_scale, chunk,
                        s_qt, s_qh, s_kv, s_rs, s_rr, s_cb, s_cr, s_bt, s_idx, s_ot, s_oh,
                        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RPB: tl.constexpr,
                        COMP: tl.constexpr, CLAMP: tl.constexpr, SPLIT: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr, RING_NOPE: tl.constexpr, COMP_NOPE: tl.constexpr,
                        OFFICIAL: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    seq = tl.load(tseq_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    start = tl.load(start_ptr + seq).to(tl.int64)
    cu = tl.load(cu_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)

    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    q = tl.load(q_ptr + row.to(tl.int64) * s_qt + heads[:, None] * s_qh + offs_d[None, :],
                mask=h_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # this query's key list: window positions lo..pos, then n_c compressed rows
    lo = tl.maximum(pos - window + 1, 0)
    n_w = pos - lo + 1
    if COMP == 1:
        n_c = n_idx + 0 * pos
    elif COMP == 2:
        n_c = (pos + 1) // ratio
    else:
        n_c = 0 * pos
    a = sp * chunk + 0 * pos                   # this program's slice [a, b) of the key list
    b = tl.minimum(a + chunk, n_w + n_c)

    m_i = tl.full((BLOCK_H,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)

    # window: positions before `start` are in the ring (written after this kernel), the rest in kv
    w_hi = tl.minimum(b, n_w)
    ring_base = ring_ptr + slot * s_rs
    for i0 in range(a, w_hi, BLOCK_N):
        i = i0 + offs_n
        ok = i < w_hi
        p = lo + i
        in_ring = ok & (p < start)
        if RING_NOPE > 0:     # packed FP8 ring (kv_fp8)
            kr = _load_packed(ring_ptr, ring16_ptr, slot * s_rs + (p % R) * s_rr, in_ring, BLOCK_N, D, RING_NOPE,
                              kv_ptr.dtype.element_ty)
        else:
            kr = tl.load(ring_base + ((p % R) * s_rr)[:, None] + offs_d[None, :], mask=in_ring[:, None], other=0.0)
        kn = tl.load(kv_ptr + ((cu + p - start) * s_kv)[:, None] + offs_d[None, :],
                     mask=(ok & (p >= start))[:, None], other=0.0)
        k = tl.where(in_ring[:, None], kr, kn)
        m_i, l_i, acc = _attend_tile(q, k, ok, m_i, l_i, acc, qk_scale, UPCAST, IEEE)

    if COMP != 0:
        c_lo = tl.maximum(a, n_w) - n_w
        c_hi = b - n_w
        if CLAMP:
            vis = (pos + 1) // ratio           # CSA: also drop indices of rows not yet complete
        for j0 in range(c_lo, c_hi, BLOCK_N):
            j = j0 + offs_n
            ok = j < c_hi
            if COMP == 1:
                r = tl.load(idx_ptr + row.to(tl.int64) * s_idx + j, mask=ok, other=-1).to(tl.int64)
                ok = ok & (r >= 0)
                if CLAMP:
                    ok = ok & (r < vis)
            else:
                r = j
            blk = tl.load(bt_ptr + seq * s_bt + r // RPB, mask=ok, other=0).to(tl.int64)
            if COMP_NOPE > 0:     # packed FP8 rows (kv_fp8)
                k = _load_packed(comp_ptr, comp16_ptr, blk * s_cb + (r % RPB) * s_cr, ok, BLOCK_N, D, COMP_NOPE,
                                 kv_ptr.dtype.element_ty)
            else:
                k = tl.load(comp_ptr + (blk * s_cb + (r % RPB) * s_cr)[:, None] + offs_d[None, :],
                            mask=ok[:, None], other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, ok, m_i, l_i, acc, qk_scale, UPCAST, IEEE)

    if SPLIT:         # partial state; _combine_kernel adds the sink and normalises
        nsp = tl.num_programs(2)
        base = (row.to(tl.int64) * nsp + sp) * H + heads
        tl.store(ws_acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=h_ok[:, None])
        tl.store(ws_ml_ptr + base * 2, m_i, mask=h_ok)
        tl.store(ws_ml_ptr + base * 2 + 1, l_i, mask=h_ok)
    else:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0) * 1.4426950408889634
        # the same roundings as _combine_kernel on one split
        if OFFICIAL:      # the max stays the keys'; the sink's term joins the sum last
            l_f = l_i + tl.exp2(sink - m_i)
            l_f = tl.where(l_f > 0, l_f, 1.0)
            o = acc / l_f[:, None]
        else:
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_f)
            l_f = l_i * alpha + tl.exp2(sink - m_f)
            l_f = tl.where(l_f > 0, l_f, 1.0)
            o = (acc * alpha[:, None]) / l_f[:, None]
        tl.store(out_ptr + row.to(tl.int64) * s_ot + heads[:, None] * s_oh + offs_d[None, :],
                 _round_out(o, out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit(do_not_specialize=["NSPLIT"])
def _combine_kernel(ws_acc_ptr, ws_ml_ptr, sink_ptr, out_ptr, H, NSPLIT, s_ot, s_oh,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, OFFICIAL: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Merge the splits of one (token, head block) in split order, with the sink (OFFICIAL: the
    max over the splits' key maxima alone, the sink's term added after the splits)."""
    pdl_gate(PDL)
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_d = tl.arange(0, D)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0) * 1.4426950408889634
    if OFFICIAL:
        m_f = tl.full((BLOCK_H,), NEG, tl.float32)
    else:
        m_f = sink
    base = row.to(tl.int64) * NSPLIT * H + heads
    for sp in range(0, NSPLIT):
        m_f = tl.maximum(m_f, tl.load(ws_ml_ptr + (base + sp * H) * 2, mask=h_ok, other=NEG))
    if OFFICIAL:
        l_f = tl.zeros((BLOCK_H,), tl.float32)
    else:
        l_f = tl.exp2(sink - m_f)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    for sp in range(0, NSPLIT):
        m_j = tl.load(ws_ml_ptr + (base + sp * H) * 2, mask=h_ok, other=NEG)
        l_j = tl.load(ws_ml_ptr + (base + sp * H) * 2 + 1, mask=h_ok, other=0.0)
        w = tl.exp2(m_j - m_f)
        l_f += l_j * w
        acc += tl.load(ws_acc_ptr + (base + sp * H)[:, None] * D + offs_d[None, :],
                       mask=h_ok[:, None], other=0.0) * w[:, None]
    if OFFICIAL:      # (padding heads kept at m_f = NEG: no exp2 of 1e30)
        l_f = l_f + tl.exp2(tl.where(h_ok, sink - m_f, 0.0))
    l_f = tl.where(l_f > 0, l_f, 1.0)
    o = acc / l_f[:, None]
    tl.store(out_ptr + row.to(tl.int64) * s_ot + heads[:, None] * s_oh + offs_d[None, :],
             _round_out(o, out_ptr.dtype.element_ty), mask=h_ok[:, None])


def tile_config(D: int, H: int, dtype: torch.dtype, rows: int = 0, num_sms: int = 132) -> dict:
    """Head tile x key tile. With enough query rows to fill the GPU (prefill, large decode batches),
    all 64 heads of a row share one program on 8 warps: every key tile is loaded once for all heads
    (tuned on the H200, benchmarks/tune_kernels.py: 1.7x faster prefill than 16 heads). Otherwise 16
    heads on 4 warps give 4x the programs (and with split-KV, more still). A BLOCK_H x D fp32
    accumulator of 8192 values is 64 registers per thread at 4 warps; fp32 key tiles are twice as
    large in shared memory."""
    if dtype == torch.bfloat16 and D == 512 and H >= 64 and rows * triton.cdiv(H, 64) >= num_sms:
        return dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)
    block_h = min(64, max(16, 8192 // D), max(16, triton.next_power_of_2(H)))
    block_n = 32 if D >= 256 else 64
    if dtype == torch.float32 and D >= 512:
        block_n = 16
    return dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=4, num_stages=2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132          # the interpreter: an H100/H200's count, so CI exercises the split path


def split_plan(max_keys: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split) for a key list of at most max_keys: fixed by max_keys alone."""
    chunk = max(MIN_SPLIT_KEYS, triton.cdiv(max_keys, MAX_SPLITS))
    chunk = triton.cdiv(chunk, block_n) * block_n
    return triton.cdiv(max(max_keys, 1), chunk), chunk


def _pool_nope(name: str, pool, D: int, dt: torch.dtype, dev, dims: str) -> int:
    """0 for a float pool [dims, D] of q's dtype; the nope width of a packed kv_fp8 pool, uint8
    [dims, kv_row_bytes(D, rope_dim)] (the row size identifies rope_dim)."""
    if isinstance(pool, torch.Tensor) and pool.dim() == 3 and pool.device == dev:
        if pool.dtype == dt and pool.shape[2] == D:
            return 0
        rope = packed_rope_dim(D, pool.shape[2]) if pool.dtype == torch.uint8 else None
        if rope is not None and pool.stride(0) % 2 == 0 and pool.stride(1) % 2 == 0 and pool.stride(2) == 1:
            return D - rope
    raise ValueError(f"sparse_attention: {name} must be [{dims}, {D}] {dt} or packed kv_fp8 rows (uint8 "
                     f"[{dims}, kv_row_bytes({D}, rope_dim)], contiguous rows) on {dev}")


def _check_int(name: str, t, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attention: {name} must be an int32/int64 tensor")
    if tuple(t.shape) != shape:
        raise ValueError(f"sparse_attention: {name} has shape {tuple(t.shape)}, expected {shape}")
    if t.device != device:
        raise ValueError(f"sparse_attention: {name} is on {t.device}, q on {device}")


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, sink: torch.Tensor, *,
                     scale: float, window: int, cu_seqlens: torch.Tensor, seq_start: torch.Tensor,
                     token_seq: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     comp_rows: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     comp_idx: torch.Tensor | None = None, comp_ratio: int = 0,
                     batch_invariant: bool = False, official: bool = False) -> torch.Tensor:
    """q [T, H, D], kv [T, D] (new keys = values), ring [NUM_SLOTS, R, D], sink [H] -> out [T, H, D].
    ring and comp_rows may instead be uint8 pools of packed FP8 rows (kv_fp8, `compressor.kv_row_bytes`).

    Compressed rows (comp_rows [NUM_BLOCKS, RPB, D], logical row r of sequence s at
    comp_rows[block_table[s, r // RPB], r % RPB]): CSA gives comp_idx [T, K] (row ids, < 0 = padding,
    each id at most once; with comp_ratio > 0, ids >= (t+1)//comp_ratio are dropped too); HCA gives
    comp_idx=None and comp_ratio > 0 (query at t sees rows 0 .. (t+1)//comp_ratio - 1).

    `batch_invariant`: one tile shape for every batch and splits of INVARIANT_SPLIT_KEYS keys (a fixed
    split size, not a fixed number of splits), so a query's result does not depend on the batch.
    `official`: the sink's term joins the denominator as in DeepSeek's kernel (the QAT numerics;
    `PortableAttentionBackend(official=True)`), see the module docstring."""
    return _sparse_attention(q, kv, ring, sink, scale=scale, window=window, cu_seqlens=cu_seqlens,
                             seq_start=seq_start, token_seq=token_seq, positions=positions, slots=slots,
                             comp_rows=comp_rows, block_table=block_table, comp_idx=comp_idx,
                             comp_ratio=comp_ratio, batch_invariant=batch_invariant,
                             official=official)


def _sparse_attention(q, kv, ring, sink, *, scale, window, cu_seqlens, seq_start, token_seq, positions,
                      slots, comp_rows=None, block_table=None, comp_idx=None, comp_ratio=0,
                      split: bool | None = None, config: dict | None = None,
                      batch_invariant: bool = False, official: bool = False) -> torch.Tensor:
    """sparse_attention with test hooks: split forces (True/False) the split-KV path, config the tiles."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("sparse_attention: q must be a [T, H, D] tensor")
    T, H, D = q.shape
    dev, dt = q.device, q.dtype
    if dt not in (torch.bfloat16, torch.float32):
        raise ValueError(f"sparse_attention: q dtype {dt} is not bfloat16 or float32")
    if D < 16 or D > 512 or D & (D - 1):
        raise ValueError(f"sparse_attention: head dim D={D} must be a power of 2 in [16, 512]")
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (T, D) or kv.dtype != dt or kv.device != dev:
        raise ValueError(f"sparse_attention: kv must be [T, D] = {(T, D)} {dt} on {dev}")
    ring_nope = _pool_nope("ring", ring, D, dt, dev, "NUM_SLOTS, R")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sparse_attention: window={window!r} must be a positive int")
    if ring.shape[1] < window:
        raise ValueError(f"sparse_attention: ring length R={ring.shape[1]} is shorter than window={window}")
    if not isinstance(sink, torch.Tensor) or tuple(sink.shape) != (H,) or not sink.is_floating_point() \
            or sink.device != dev:
        raise ValueError(f"sparse_attention: sink must be a float tensor of shape ({H},) on {dev}")
    if not isinstance(scale, (int, float)) or not float("-inf") < float(scale) < float("inf"):
        raise ValueError(f"sparse_attention: scale={scale!r} must be a finite number")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("sparse_attention: cu_seqlens must be a [S+1] tensor with S >= 1")
    S = cu_seqlens.shape[0] - 1
    _check_int("cu_seqlens", cu_seqlens, (S + 1,), dev)
    _check_int("seq_start", seq_start, (S,), dev)
    _check_int("slots", slots, (S,), dev)
    _check_int("token_seq", token_seq, (T,), dev)
    _check_int("positions", positions, (T,), dev)
    if not isinstance(comp_ratio, int) or comp_ratio < 0:
        raise ValueError(f"sparse_attention: comp_ratio={comp_ratio!r} must be an int >= 0")
    mode = comp_nope = 0
    if comp_rows is None:          # window only (block_table and comp_ratio are then unused)
        if comp_idx is not None:
            raise ValueError("sparse_attention: comp_idx given without comp_rows")
    else:
        comp_nope = _pool_nope("comp_rows", comp_rows, D, dt, dev, "NUM_BLOCKS, RPB")
        if block_table is None or block_table.dim() != 2:
            raise ValueError("sparse_attention: comp_rows needs a [S, MAXB] block_table")
        _check_int("block_table", block_table, (S, block_table.shape[1]), dev)
        if comp_idx is not None:
            if comp_idx.dim() != 2:
                raise ValueError("sparse_attention: comp_idx must be [T, K]")
            _check_int("comp_idx", comp_idx, (T, comp_idx.shape[1]), dev)
            mode = 1
        elif comp_ratio > 0:
            mode = 2
        else:
            raise ValueError("sparse_attention: comp_rows without comp_idx (CSA) needs comp_ratio > 0 (HCA)")

    out = torch.empty((T, H, D), dtype=dt, device=dev)
    if T == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    ring = ring if ring.stride(-1) == 1 else ring.contiguous()
    sink = sink.float().contiguous()
    meta = [t.contiguous() for t in (cu_seqlens, seq_start, token_seq, positions, slots)]
    if batch_invariant:          # tiles for every T: the prefill tiles (a function of the model only)
        config = config or tile_config(D, H, dt, rows=1 << 30)
    cfg = dict(config or tile_config(D, H, dt, T, _num_sms(dev)))
    block_h, block_n = cfg.pop("BLOCK_H"), cfg.pop("BLOCK_N")
    n_hb = triton.cdiv(H, block_h)

    if mode:
        comp_rows = comp_rows if comp_rows.stride(-1) == 1 else comp_rows.contiguous()
        block_table = block_table.contiguous()
        rpb = comp_rows.shape[1]
        comp16 = comp_rows.view(torch.bfloat16) if comp_nope else comp_rows
        comp_args = (comp_rows, comp16, block_table)
        comp_strides = (comp_rows.stride(0), comp_rows.stride(1), block_table.stride(0))
    else:
        rpb, comp_args, comp_strides = 1, (ring, ring, meta[0]), (0, 0, 0)    # never read
    if mode == 1:
        comp_idx = comp_idx.contiguous()
        n_idx, idx_arg, s_idx = comp_idx.shape[1], comp_idx, comp_idx.stride(0)
        max_keys = window + n_idx
    else:
        n_idx, idx_arg, s_idx = 0, meta[0], 0
        max_keys = window + (block_table.shape[1] * rpb if mode == 2 else 0)

    nsplit, chunk = split_plan(max_keys, block_n)
    if batch_invariant:          # a split is one fixed-size slice of every query's own key list
        chunk = triton.cdiv(INVARIANT_SPLIT_KEYS, block_n) * block_n
        nsplit = triton.cdiv(max(max_keys, 1), chunk)
        split = bool(split) or nsplit > 1     # never cut a key list short
    if split is None:
        split = nsplit > 1 and T * n_hb < _num_sms(dev)
    if not split:
        nsplit, chunk = 1, max_keys
    ws_acc = ws_ml = out
    if split:
        ws_acc = torch.empty((T, nsplit, H, D), dtype=torch.float32, device=dev)
        ws_ml = torch.empty((T, nsplit, H, 2), dtype=torch.float32, device=dev)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    ring16 = ring.view(torch.bfloat16) if ring_nope else ring
    _sparse_attn_kernel[(T, n_hb, nsplit)](
        q, kv, ring, ring16, sink, out, ws_acc, ws_ml, *meta, *comp_args, idx_arg,
        H, ring.shape[1], window, n_idx, max(comp_ratio, 1), float(scale) * LOG2E, chunk,
        q.stride(0), q.stride(1), kv.stride(0), ring.stride(0), ring.stride(1), *comp_strides[:2],
        comp_strides[2], s_idx, out.stride(0), out.stride(1),
        D=D, BLOCK_H=block_h, BLOCK_N=block_n, RPB=rpb, COMP=mode, CLAMP=mode == 1 and comp_ratio > 0,
        SPLIT=bool(split), UPCAST=interp and dt != torch.float32, IEEE=dt == torch.float32,
        RING_NOPE=ring_nope, COMP_NOPE=comp_nope, OFFICIAL=bool(official), **cfg, **launch_args(q))
    if split:
        _combine_kernel[(T, n_hb)](ws_acc, ws_ml, sink, out, H, nsplit, out.stride(0), out.stride(1),
                                   D=D, BLOCK_H=block_h, OFFICIAL=bool(official), num_warps=4,
                                   **launch_args(ws_acc))
    return out
