"""DeepSeek-V4's KV compressor and the per-sequence state writes, batched over a ragged batch.

Core reference: `deepinfer_core.ops.portable_attention.PortableAttentionBackend.compress` (pooling
and tails) and `.write_ring`; state layout in `deepinfer_core.cache.state_cache`.

* `compress_blocks`: a program pools a tile of closed blocks x channels (one block per program at
  the real widths, several for narrow rows). Block b pools `ratio` token slots per channel with a
  softmax over z (fp32). Ratio-4 compressors overlap (C = 2): block b also pools
  the previous block's positions (b-1)*4 .. (b-1)*4+3 on channels [:d] (nothing for b == 0), its
  own positions on channels [d:]. A position p is read from this batch's rows when p >= seq_start,
  else from the sequence's tail slot p % L (the tails hold the inputs of blocks not yet closed).
* `write_rows`: pooled (and finalized) rows into the paged pool through the block table.
* `update_tails` / `write_ring`: the last L (R) new tokens of each sequence into slot p % L (p % R).
  Only those tokens are written, so no two stores hit the same place: plain, deterministic stores.

With a kv_fp8 cache (a uint8 pool / ring) `write_rows` and `write_ring` store packed FP8 rows (core
reference `deepinfer_core.ops.kv_fp8.pack_kv_fp8`, same bytes): per 64-tile of the nope dims the
UE8M0 scale is built from amax's bits (no fp32 division: Triton's `/` is not IEEE-rounded on
NVIDIA, and the boundary amax = 224 * 2^k is common in fake-quantised rows), codes e4m3, RoPE bf16.

Everything reads device metadata (no host sync, CUDA-graph safe); blocks with blk_idx < 0 are padding
(output row zero, nothing written). All offsets into pools are computed in int64. Stores into bf16
pools round to nearest even explicitly, so they equal torch's `.to` compiled and interpreted alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import _round_to_e4m3_grid
from .pdl import launch_args, pdl_gate

BLOCK_SIZE = 128          # positions per paged block (deepinfer_core.cache.state_cache.BLOCK_SIZE)
TILE_ELEMS = 4096         # elements of one [slots, channels] tile: bounds registers at ratio 128
SCATTER_BLOCK = 1024      # most channels per program of the tail/ring scatter
STORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # pool / ring dtypes (stores exact vs torch)
KV_TILE = 64              # packed FP8 rows: nope dims per UE8M0 scale (deepinfer_core.ops.kv_fp8)


def kv_row_bytes(D: int, rope_dim: int) -> int:
    """Bytes of a packed FP8 row: [nope e4m3 | rope bf16 | nope/64 UE8M0 | zero pad to 8]."""
    nope = D - rope_dim
    if rope_dim < 0 or nope <= 0 or nope % KV_TILE:
        raise ValueError(f"kv_fp8: D={D} minus rope_dim={rope_dim} must be a positive multiple of {KV_TILE}")
    return -(-(nope + 2 * rope_dim + nope // KV_TILE) // 8) * 8


def packed_rope_dim(D: int, row_bytes: int) -> int | None:
    """The rope_dim whose packed D-wide row is row_bytes long (unique: rows grow with rope_dim), or None."""
    for r in range(D % KV_TILE, D, KV_TILE):
        if kv_row_bytes(D, r) == row_bytes:
            return r
    return None


def _coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def new_blocks(starts: list[int], lens: list[int], ratio: int) -> tuple[list[int], list[int]]:
    """(blk_seq, blk_idx) of every block this batch closes: block b closes when its last position
    b*ratio + ratio - 1 is among positions start .. start+len-1; sequence by sequence, in order."""
    if ratio < 1:
        raise ValueError(f"new_blocks: ratio must be >= 1, got {ratio}")
    if len(starts) != len(lens):
        raise ValueError(f"new_blocks: starts has {len(starts)} entries, lens {len(lens)}")
    seq, idx = [], []
    for s, (start, n) in enumerate(zip(starts, lens)):
        if start < 0 or n < 0:
            raise ValueError(f"new_blocks: sequence {s} has start={start}, len={n}; both must be >= 0")
        for b in range(start // ratio, (start + n) // ratio):
            seq.append(s)
            idx.append(b)
    return seq, idx


# ---- kernels -----------------------------------------------------------------------------------
@triton.jit
def _cast_rtne(x, dtype: tl.constexpr):
    """x in `dtype`, rounded to nearest even like torch's `.to`. For bf16 the 16 result bits are
    built from the fp32 bits (the compiled cast rounds to nearest even, but Triton's interpreter
    truncates and flushes subnormals). Other targets cast directly (fp16/fp32 agree everywhere)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        hi = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
        return tl.where(x == x, hi.to(tl.bfloat16, bitcast=True), x.to(tl.bfloat16))   # NaN stays NaN
    else:
        return x.to(dtype)


@triton.jit
def _gather_slots(kv_ptr, z_ptr, tkv_ptr, tz_ptr, pos, ok, cols, cmask, row0, start, slot, L,
                  s_kv, s_z, s_tkv0, s_tkv1, s_tz0, s_tz1):
    """kv, z [BLOCK_B, SLOTS, BLOCK_D] of positions pos [BLOCK_B, SLOTS] (where ok is False: kv 0,
    z -inf): from this batch's rows when pos >= start, else from the tail slot pos % L."""
    new = pos >= start[:, None]
    c = cols[None, None, :]
    cm = cmask[None, None, :]
    m_new = (ok & new)[:, :, None] & cm
    m_old = (ok & (pos >= 0) & ~new)[:, :, None] & cm
    r_new = (row0[:, None] + pos - start[:, None]).to(tl.int64)[:, :, None]
    r_old = (pos % L).to(tl.int64)[:, :, None]
    base = slot[:, None, None]
    kv_n = tl.load(kv_ptr + r_new * s_kv + c, mask=m_new, other=0.0)
    z_n = tl.load(z_ptr + r_new * s_z + c, mask=m_new, other=0.0)
    kv_o = tl.load(tkv_ptr + base * s_tkv0 + r_old * s_tkv1 + c, mask=m_old, other=0.0)
    z_o = tl.load(tz_ptr + base * s_tz0 + r_old * s_tz1 + c, mask=m_old, other=0.0)
    kv = tl.where(new[:, :, None], kv_n, kv_o)
    z = tl.where(new[:, :, None], z_n, z_o)
    z = tl.where(ok[:, :, None], z, float("-inf"))
    return kv, z


@triton.jit(do_not_specialize=["NB"])
def _compress_kernel(kv_ptr, z_ptr, tkv_ptr, tz_ptr, out_ptr, bseq_ptr, bidx_ptr, cu_ptr, start_ptr, slot_ptr,
                     NB, d, L, s_kv, s_z, s_tkv0, s_tkv1, s_tz0, s_tz1, s_out,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False):
    """BLOCK_B closed blocks x BLOCK_D channels per program."""
    pdl_gate(PDL)
    i = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    b = tl.load(bidx_ptr + i, mask=i < NB, other=-1)
    valid = b >= 0
    s = tl.load(bseq_ptr + i, mask=valid, other=0)          # padding never reads metadata
    row0 = tl.load(cu_ptr + s, mask=valid, other=0)
    start = tl.load(start_ptr + s, mask=valid, other=0)
    slot = tl.load(slot_ptr + s, mask=valid, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < d
    t = tl.arange(0, RATIO)[None, :]
    ok = valid[:, None] & (t >= 0)
    pos = b[:, None] * RATIO + t
    if OVERLAP:
        # own block on channels [d:2d], previous block on [0:d] (absent for block 0)
        kv_c, z_c = _gather_slots(kv_ptr, z_ptr, tkv_ptr, tz_ptr, pos, ok, cols + d, cmask,
                                  row0, start, slot, L, s_kv, s_z, s_tkv0, s_tkv1, s_tz0, s_tz1)
        kv_p, z_p = _gather_slots(kv_ptr, z_ptr, tkv_ptr, tz_ptr, pos - RATIO, ok & (b > 0)[:, None], cols,
                                  cmask, row0, start, slot, L, s_kv, s_z, s_tkv0, s_tkv1, s_tz0, s_tz1)
        mx = tl.where(valid[:, None], tl.maximum(tl.max(z_c, axis=1), tl.max(z_p, axis=1)), 0.0)
        e_c = tl.exp(z_c - mx[:, None, :])
        e_p = tl.exp(z_p - mx[:, None, :])
        # softmax first, then the weighted sum (the reference's order); padding rows (all z = -inf)
        # have their max and denominator pinned finite, so no NaN
        den = tl.where(valid[:, None], tl.sum(e_c, axis=1) + tl.sum(e_p, axis=1), 1.0)
        out = tl.sum(e_c / den[:, None, :] * kv_c, axis=1) + tl.sum(e_p / den[:, None, :] * kv_p, axis=1)
    else:
        kv_c, z_c = _gather_slots(kv_ptr, z_ptr, tkv_ptr, tz_ptr, pos, ok, cols, cmask,
                                  row0, start, slot, L, s_kv, s_z, s_tkv0, s_tkv1, s_tz0, s_tz1)
        mx = tl.where(valid[:, None], tl.max(z_c, axis=1), 0.0)
        e_c = tl.exp(z_c - mx[:, None, :])
        den = tl.where(valid[:, None], tl.sum(e_c, axis=1), 1.0)
        out = tl.sum(e_c / den[:, None, :] * kv_c, axis=1)
    out = tl.where(valid[:, None], out, 0.0)      # padding rows store zeros
    dst = out_ptr + i.to(tl.int64)[:, None] * s_out + cols[None, :]
    tl.store(dst, out, mask=(i < NB)[:, None] & cmask[None, :])


@triton.jit
def _closed_blocks(bseq_ptr, bidx_ptr, table_ptr, NB, s_tab, RPB: tl.constexpr, BLOCK_B: tl.constexpr):
    """This program's closed blocks: (list index i, row index b, valid = b >= 0, physical block)."""
    i = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    b = tl.load(bidx_ptr + i, mask=i < NB, other=-1)
    valid = b >= 0
    s = tl.load(bseq_ptr + i, mask=valid, other=0).to(tl.int64)
    phys = tl.load(table_ptr + s * s_tab + b // RPB, mask=valid, other=0).to(tl.int64)
    return i, b, valid, phys


@triton.jit(do_not_specialize=["NB", "s_tab"])
def _write_rows_kernel(rows_ptr, pool_ptr, table_ptr, bseq_ptr, bidx_ptr, NB, d, s_rows, s_p0, s_p1, s_tab,
                       RPB: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    i, b, valid, phys = _closed_blocks(bseq_ptr, bidx_ptr, table_ptr, NB, s_tab, RPB, BLOCK_B)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (cols < d)[None, :]
    x = tl.load(rows_ptr + i.to(tl.int64)[:, None] * s_rows + cols[None, :], mask=mask, other=0.0)
    dst = pool_ptr + (phys * s_p0 + (b % RPB).to(tl.int64) * s_p1)[:, None] + cols[None, :]
    tl.store(dst, _cast_rtne(x, pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quant_store_fp8(x_ptr, src_off, dst_ptr, dst16_ptr, dst_off, ok, NOPE: tl.constexpr, ROPE: tl.constexpr,
                     NT_P2: tl.constexpr, ROPE_P2: tl.constexpr, PAD: tl.constexpr):
    """Rows x[src_off + 0..D-1] (where ok) -> packed FP8 rows at byte offsets dst_off of a uint8 pool
    (dst16_ptr: the same pool viewed as bf16, for the RoPE dims). Bytes equal pack_kv_fp8's."""
    NT: tl.constexpr = NOPE // 64
    t = tl.arange(0, NT_P2)
    col = (t[:, None] * 64 + tl.arange(0, 64)[None, :])[None, :, :]
    m = ok[:, None, None] & (t < NT)[None, :, None]
    x = tl.load(x_ptr + src_off[:, None, None] + col, mask=m, other=0.0).to(tl.float32)
    # scale 2^(e-127) = pow2_ceil(max(amax, 1e-4) / 448): with amax = 1.f * 2^E and 448 = 1.75 * 2^8 it is
    # 2^(E-8), or 2^(E-7) when 1.f > 1.75 (no fp32 amax / 448 lies within rounding of a power of two)
    bits = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-4).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)            # 1 / scale, exact
    mag = _round_to_e4m3_grid(tl.minimum(tl.abs(x) * inv[:, :, None], 448.0))
    # the e4m3 code from the bits of the on-grid value (normal: exponent - 120 | top 3 mantissa bits;
    # subnormal: multiples of 2^-9). Not mag.to(float8e4nv): compiled for sm_90 on this [rows, 8, 64]
    # tile, that conversion zeroed every other byte (found by test_fp8_kv on the H200).
    mb = mag.to(tl.int32, bitcast=True)
    code = tl.where(mag >= 0.015625, (((mb >> 23) - 120) << 3) | ((mb >> 20) & 7),
                    (mag * 512.0).to(tl.int32)).to(tl.uint8)
    code = code | tl.where(x.to(tl.int32, bitcast=True) < 0, 0x80, 0).to(tl.uint8)   # sign, -0 included
    tl.store(dst_ptr + dst_off[:, None, None] + col, code, mask=m)
    tl.store(dst_ptr + dst_off[:, None] + (NOPE + 2 * ROPE) + t[None, :], e.to(tl.uint8),
             mask=ok[:, None] & (t < NT)[None, :])
    rc = tl.arange(0, ROPE_P2)[None, :]
    mr = ok[:, None] & (rc < ROPE)
    xr = tl.load(x_ptr + src_off[:, None] + NOPE + rc, mask=mr, other=0.0)
    tl.store(dst16_ptr + (dst_off // 2 + NOPE // 2)[:, None] + rc, _cast_rtne(xr, tl.bfloat16), mask=mr)
    pc = tl.arange(0, 8)[None, :]
    tl.store(dst_ptr + dst_off[:, None] + (NOPE + 2 * ROPE + NT) + pc, tl.zeros((1, 8), tl.uint8),
             mask=ok[:, None] & (pc < PAD))


@triton.jit(do_not_specialize=["NB", "s_tab"])
def _write_rows_fp8_kernel(rows_ptr, pool_ptr, pool16_ptr, table_ptr, bseq_ptr, bidx_ptr, NB, s_rows, s_p0, s_p1,
                           s_tab, RPB: tl.constexpr, BLOCK_B: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                           NT_P2: tl.constexpr, ROPE_P2: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    i, b, valid, phys = _closed_blocks(bseq_ptr, bidx_ptr, table_ptr, NB, s_tab, RPB, BLOCK_B)
    _quant_store_fp8(rows_ptr, i.to(tl.int64) * s_rows, pool_ptr, pool16_ptr,
                     phys * s_p0 + (b % RPB).to(tl.int64) * s_p1, valid, NOPE, ROPE, NT_P2, ROPE_P2, PAD)


@triton.jit
def _last_rows(tseq_ptr, pos_ptr, cu_ptr, start_ptr, slot_ptr, row, T, K):
    """(keep, slot, p) of token rows: keep = p is among the last K new positions of its sequence."""
    live = row < T
    s = tl.load(tseq_ptr + row, mask=live, other=0)
    p = tl.load(pos_ptr + row, mask=live, other=0).to(tl.int64)
    n = tl.load(cu_ptr + s + 1, mask=live, other=0) - tl.load(cu_ptr + s, mask=live, other=0)
    end = tl.load(start_ptr + s, mask=live, other=0).to(tl.int64) + n
    keep = live & (p >= end - K)
    slot = tl.load(slot_ptr + s, mask=keep, other=0).to(tl.int64)
    return keep, slot, p


@triton.jit(do_not_specialize=["T"])
def _ring_fp8_kernel(kv_ptr, ring_ptr, ring16_ptr, tseq_ptr, pos_ptr, cu_ptr, start_ptr, slot_ptr, T, K, s_kv,
                     s_r0, s_r1, BLOCK_T: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                     NT_P2: tl.constexpr, ROPE_P2: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    keep, slot, p = _last_rows(tseq_ptr, pos_ptr, cu_ptr, start_ptr, slot_ptr, row, T, K)
    _quant_store_fp8(kv_ptr, row.to(tl.int64) * s_kv, ring_ptr, ring16_ptr, slot * s_r0 + (p % K) * s_r1, keep,
                     NOPE, ROPE, NT_P2, ROPE_P2, PAD)


@triton.jit(do_not_specialize=["T"])
def _scatter_last_kernel(src_a, dst_a, src_b, dst_b, tseq_ptr, pos_ptr, cu_ptr, start_ptr, slot_ptr, T, D, K,
                         s_sa, s_da0, s_da1, s_sb, s_db0, s_db1,
                         TWO: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """Token rows -> dst[slot, p % K] for the rows whose p is among the last K new positions of their
    sequence; BLOCK_T rows x BLOCK_C channels per program."""
    pdl_gate(PDL)
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    keep, slot, p = _last_rows(tseq_ptr, pos_ptr, cu_ptr, start_ptr, slot_ptr, row, T, K)
    r = row.to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = keep[:, None] & (cols < D)
    a = tl.load(src_a + r * s_sa + cols, mask=mask, other=0.0)
    tl.store(dst_a + (slot * s_da0 + (p % K) * s_da1)[:, None] + cols,
             _cast_rtne(a, dst_a.dtype.element_ty), mask=mask)
    if TWO:
        v = tl.load(src_b + r * s_sb + cols, mask=mask, other=0.0)
        tl.store(dst_b + (slot * s_db0 + (p % K) * s_db1)[:, None] + cols,
                 _cast_rtne(v, dst_b.dtype.element_ty), mask=mask)


def _tile(width: int, depth: int, cap: int) -> tuple[int, int]:
    """(rows, channels) of a tile of at most TILE_ELEMS elements of `depth` slots each: channels up
    to `cap` first, then as many rows (blocks or tokens) as still fit, at most 64."""
    ch = min(triton.next_power_of_2(max(width, 1)), cap)
    return max(1, min(64, TILE_ELEMS // (ch * depth))), ch


# ---- validation ----------------------------------------------------------------------------------
def _check(name: str, t, ndim: int, dtype=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension")


def _check_store(src_name: str, src: torch.Tensor, dst_name: str, dst: torch.Tensor) -> dict | None:
    """A float [N, d] source stored into a [*, *, d'] cache pool of a cache dtype, same device. A uint8
    pool holds packed FP8 rows (kv_fp8): returns their kernel constants, else None."""
    _check(src_name, src, 2, None, dst.device)
    _check(dst_name, dst, 3, None, dst.device)
    if dst.dtype != torch.uint8 and dst.dtype not in STORE_DTYPES:
        raise ValueError(f"{dst_name} must be one of {STORE_DTYPES} (the cache dtype) or uint8 (packed "
                         f"kv_fp8 rows), got {dst.dtype}")
    if not src.is_floating_point():
        raise ValueError(f"{src_name} must be floating point, got {src.dtype}")
    if dst.dtype != torch.uint8:
        return None
    D, rb = src.shape[1], dst.shape[2]
    rope = packed_rope_dim(D, rb)
    if rope is None:
        raise ValueError(f"{dst_name} is uint8 (packed kv_fp8 rows) of {rb} bytes, which is no kv_row_bytes("
                         f"{D}, rope_dim) for {src_name} rows {D} wide")
    if dst.stride(0) % 2 or dst.stride(1) % 2:
        raise ValueError(f"{dst_name}: packed rows need even strides (the RoPE dims are read as bf16)")
    nope = D - rope
    return dict(NOPE=nope, ROPE=rope, NT_P2=triton.next_power_of_2(nope // KV_TILE),
                ROPE_P2=triton.next_power_of_2(max(rope, 1)), PAD=rb - nope - 2 * rope - nope // KV_TILE)


def _fp8_rows_per_program(fp8: dict) -> int:
    return max(1, min(64, TILE_ELEMS // (fp8["NT_P2"] * KV_TILE)))


def _check_ratio(ratio: int) -> None:
    if not isinstance(ratio, int) or ratio < 1 or BLOCK_SIZE % ratio:
        raise ValueError(f"ratio must be a positive divisor of {BLOCK_SIZE}, got {ratio!r}")


def _check_seq_meta(dev, cu_seqlens, seq_start, slots) -> None:
    _check("cu_seqlens", cu_seqlens, 1, torch.int32, dev)
    S = cu_seqlens.shape[0] - 1
    if S < 0:
        raise ValueError("cu_seqlens must hold S+1 >= 1 entries")
    _check("seq_start", seq_start, 1, torch.int32, dev)
    _check("slots", slots, 1, torch.int32, dev)
    if seq_start.shape[0] != S or slots.shape[0] != S:
        raise ValueError(f"seq_start {tuple(seq_start.shape)} and slots {tuple(slots.shape)} must have "
                         f"S={S} entries (cu_seqlens has S+1)")


def _check_blocks(dev, blk_seq, blk_idx) -> int:
    _check("blk_seq", blk_seq, 1, torch.int32, dev)
    _check("blk_idx", blk_idx, 1, torch.int32, dev)
    if blk_seq.shape != blk_idx.shape:
        raise ValueError(f"blk_seq {tuple(blk_seq.shape)} and blk_idx {tuple(blk_idx.shape)} differ in length")
    return blk_idx.shape[0]


def _check_tails(kv, z, tail_kv, tail_z, dev) -> None:
    _check("kv", kv, 2, torch.float32, dev)
    _check("z", z, 2, torch.float32, dev)
    if z.shape != kv.shape:
        raise ValueError(f"z {tuple(z.shape)} must match kv {tuple(kv.shape)}")
    _check("tail_kv", tail_kv, 3, torch.float32, dev)
    _check("tail_z", tail_z, 3, torch.float32, dev)
    if tail_z.shape != tail_kv.shape:
        raise ValueError(f"tail_z {tuple(tail_z.shape)} must match tail_kv {tuple(tail_kv.shape)}")
    if tail_kv.shape[2] != kv.shape[1]:
        raise ValueError(f"tail_kv has {tail_kv.shape[2]} channels, kv has {kv.shape[1]}")
    if tail_kv.shape[1] < 1:
        raise ValueError("tail_kv must hold at least one position per slot")


def _check_tokens(dev, token_seq, positions, T: int) -> None:
    _check("token_seq", token_seq, 1, torch.int32, dev)
    _check("positions", positions, 1, torch.int64, dev)
    if token_seq.shape[0] != T or positions.shape[0] != T:
        raise ValueError(f"token_seq {tuple(token_seq.shape)} and positions {tuple(positions.shape)} must "
                         f"have T={T} entries")


# ---- wrappers --------------------------------------------------------------------------------------
def compress_blocks(kv: torch.Tensor, z: torch.Tensor, tail_kv: torch.Tensor, tail_z: torch.Tensor, *,
                    ratio: int, blk_seq: torch.Tensor, blk_idx: torch.Tensor, cu_seqlens: torch.Tensor,
                    seq_start: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Pooled rows [NB, d] fp32 of the blocks (blk_seq, blk_idx); rows with blk_idx < 0 are zero.
    kv, z [T, C*d]; tails [NUM_SLOTS, L, C*d] (C = 2 for ratio 4, else 1). Run before `update_tails`."""
    _check_ratio(ratio)
    dev = kv.device
    _check_tails(kv, z, tail_kv, tail_z, dev)
    _check_seq_meta(dev, cu_seqlens, seq_start, slots)
    nb = _check_blocks(dev, blk_seq, blk_idx)
    c = _coff(ratio)
    if kv.shape[1] % c:
        raise ValueError(f"kv has {kv.shape[1]} channels, not a multiple of C={c} (ratio {ratio})")
    d, L = kv.shape[1] // c, tail_kv.shape[1]
    if L < c * ratio:
        raise ValueError(f"tail_kv holds {L} positions per slot, ratio {ratio} needs at least {c * ratio}")
    out = torch.empty((nb, d), dtype=torch.float32, device=dev)
    if nb and d:
        bb, bd = _tile(d, c * ratio, max(16, TILE_ELEMS // (c * ratio)))
        grid = (triton.cdiv(nb, bb), triton.cdiv(d, bd))
        _compress_kernel[grid](kv, z, tail_kv, tail_z, out, blk_seq, blk_idx, cu_seqlens, seq_start, slots,
                               nb, d, L, kv.stride(0), z.stride(0), tail_kv.stride(0), tail_kv.stride(1),
                               tail_z.stride(0), tail_z.stride(1), out.stride(0),
                               RATIO=ratio, OVERLAP=c == 2, BLOCK_B=bb, BLOCK_D=bd, **launch_args(kv))
    return out


def write_rows(rows: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, *,
               blk_seq: torch.Tensor, blk_idx: torch.Tensor) -> None:
    """rows [NB, d] -> pool[block_table[s, b // RPB], b % RPB] in the pool's dtype (RPB = pool.shape[1]);
    entries with blk_idx < 0 are skipped."""
    dev = pool.device
    fp8 = _check_store("rows", rows, "pool", pool)
    _check("block_table", block_table, 2, torch.int32, dev)
    nb = _check_blocks(dev, blk_seq, blk_idx)
    if rows.shape[0] != nb:
        raise ValueError(f"rows has {rows.shape[0]} rows, blk_idx {nb} entries")
    if fp8 is None and rows.shape[1] != pool.shape[2]:
        raise ValueError(f"rows are {rows.shape[1]} wide, pool rows {pool.shape[2]}")
    rpb, d = pool.shape[1], pool.shape[2]
    if rpb < 1 or BLOCK_SIZE % rpb:
        raise ValueError(f"pool holds {rpb} rows per block, which must divide {BLOCK_SIZE}")
    if fp8 is not None:
        if nb:
            bb = _fp8_rows_per_program(fp8)
            _write_rows_fp8_kernel[(triton.cdiv(nb, bb),)](
                rows, pool, pool.view(torch.bfloat16), block_table, blk_seq, blk_idx, nb, rows.stride(0),
                pool.stride(0), pool.stride(1), block_table.stride(0), RPB=rpb, BLOCK_B=bb, **fp8, **launch_args(rows))
    elif nb and d:
        bb, bd = _tile(d, 1, 1024)
        _write_rows_kernel[(triton.cdiv(nb, bb), triton.cdiv(d, bd))](
            rows, pool, block_table, blk_seq, blk_idx, nb, d, rows.stride(0), pool.stride(0), pool.stride(1),
            block_table.stride(0), RPB=rpb, BLOCK_B=bb, BLOCK_D=bd, **launch_args(rows))


def _scatter_last(a: torch.Tensor, dst_a: torch.Tensor, b, dst_b, cu_seqlens, seq_start, slots, token_seq,
                  positions) -> None:
    T, D = a.shape
    if T == 0 or D == 0:
        return
    two = b is not None
    b, dst_b = (b, dst_b) if two else (a, dst_a)
    bt, bc = _tile(D, 1, SCATTER_BLOCK)
    _scatter_last_kernel[(triton.cdiv(T, bt), triton.cdiv(D, bc))](
        a, dst_a, b, dst_b, token_seq, positions, cu_seqlens, seq_start, slots, T, D, dst_a.shape[1],
        a.stride(0), dst_a.stride(0), dst_a.stride(1), b.stride(0), dst_b.stride(0), dst_b.stride(1),
        TWO=two, BLOCK_T=bt, BLOCK_C=bc, **launch_args(a))


def update_tails(kv: torch.Tensor, z: torch.Tensor, tail_kv: torch.Tensor, tail_z: torch.Tensor, *,
                 cu_seqlens: torch.Tensor, seq_start: torch.Tensor, slots: torch.Tensor,
                 token_seq: torch.Tensor, positions: torch.Tensor) -> None:
    """The last L new tokens of each sequence -> tail_kv/tail_z[slot, p % L]. Run after
    `compress_blocks`: it overwrites tail entries the pooling may still read."""
    dev = kv.device
    _check_tails(kv, z, tail_kv, tail_z, dev)
    _check_seq_meta(dev, cu_seqlens, seq_start, slots)
    _check_tokens(dev, token_seq, positions, kv.shape[0])
    _scatter_last(kv, tail_kv, z, tail_z, cu_seqlens, seq_start, slots, token_seq, positions)


def write_ring(kv: torch.Tensor, ring: torch.Tensor, *, cu_seqlens: torch.Tensor, seq_start: torch.Tensor,
               slots: torch.Tensor, token_seq: torch.Tensor, positions: torch.Tensor) -> None:
    """The last R new tokens of each sequence -> ring[slot, p % R] in the ring's dtype (a uint8 ring:
    packed FP8 rows)."""
    dev = ring.device
    fp8 = _check_store("kv", kv, "ring", ring)
    if fp8 is None and ring.shape[2] != kv.shape[1]:
        raise ValueError(f"ring rows are {ring.shape[2]} wide, kv rows {kv.shape[1]}")
    if ring.shape[1] < 1:
        raise ValueError("ring must hold at least one position per slot")
    _check_seq_meta(dev, cu_seqlens, seq_start, slots)
    _check_tokens(dev, token_seq, positions, kv.shape[0])
    if fp8 is None:
        _scatter_last(kv, ring, None, None, cu_seqlens, seq_start, slots, token_seq, positions)
    elif kv.shape[0]:
        bt = _fp8_rows_per_program(fp8)
        _ring_fp8_kernel[(triton.cdiv(kv.shape[0], bt),)](
            kv, ring, ring.view(torch.bfloat16), token_seq, positions, cu_seqlens, seq_start, slots, kv.shape[0],
            ring.shape[1], kv.stride(0), ring.stride(0), ring.stride(1), BLOCK_T=bt, **fp8, **launch_args(kv))
