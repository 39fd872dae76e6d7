"""FP8 storage of V4 KV rows (DeepSeek's "MODEL1" format, the one FlashMLA's V4
kernels read).

A KV row of width D = nope + rope is stored as one uint8 row of `kv_row_bytes(D, rope)` bytes:

    [ nope e4m3 codes | rope dims as bf16 (2 B each) | one UE8M0 exponent per 64-tile | zero pad to 8 B ]

For D = 512, rope 64 that is 448 + 128 + 7 + 1 = 584 bytes (1024 in bf16). Each 64-wide tile of the
nope dims has the power-of-two scale s = pow2_ceil(max(amax, 1e-4) / 448), exactly as
`ops.quant.fake_quant_fp8(x, 64)` computes it, and the dequantised value float(e4m3) * s is exact in
bf16, so `unpack(pack(x))` equals the fake-quantised row bit for bit.

Why storing is lossless for the model: with the QAT simulation on, the model fake-quantises
kv[..., :nope] per 64 before caching (`Attention.forward`, `Compressor.finalize`). Re-quantising such
a row gives back the same values: its new amax is max|q|*s with max|q| in [224, 448], so the new scale
is s (same codes) or s/2 (codes doubled, still e4m3 since |2q| <= 448); the amax floor keeps tiny and
all-zero tiles at the floored scale. (Proved by tests/kernels/test_fp8_kv.py.)

These pure-torch functions are the reference for the Triton pack/dequant in `deepinfer_kernels`.
"""
from __future__ import annotations

import torch

from .quant import e8m0_to_float, quant_fp8_act

KV_TILE = 64        # nope dims per UE8M0 scale
ROW_ALIGN = 8       # packed rows are padded to a multiple of this many bytes


def _nope(D: int, rope_dim: int) -> int:
    nope = D - rope_dim
    if rope_dim < 0 or nope <= 0 or nope % KV_TILE:
        raise ValueError(f"kv_fp8: D={D} minus rope_dim={rope_dim} must be a positive multiple of {KV_TILE}")
    return nope


def kv_row_bytes(D: int, rope_dim: int) -> int:
    """Bytes of one packed row: nope codes + 2 per rope dim + one scale per 64-tile, padded to 8."""
    nope = _nope(D, rope_dim)
    raw = nope + 2 * rope_dim + nope // KV_TILE
    return -(-raw // ROW_ALIGN) * ROW_ALIGN


def packed_rope_dim(D: int, row_bytes: int) -> int | None:
    """The rope_dim r with kv_row_bytes(D, r) == row_bytes, or None. Unique: every 64 rope dims more
    add 64 bytes less one scale byte, so the row size grows strictly with r."""
    for r in range(D % KV_TILE, D, KV_TILE):
        if kv_row_bytes(D, r) == row_bytes:
            return r
    return None


def pack_kv_fp8(rows: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """rows [..., D] (bf16 or fp32) -> uint8 [..., kv_row_bytes(D, rope_dim)]."""
    if not rows.is_floating_point():
        raise ValueError(f"pack_kv_fp8: rows must be floating point, got {rows.dtype}")
    D = rows.shape[-1]
    nope, rb = _nope(D, rope_dim), kv_row_bytes(D, rope_dim)
    nt = nope // KV_TILE
    q, s = quant_fp8_act(rows[..., :nope], KV_TILE)          # the fake_quant_fp8 math, scales kept
    exp = (s.contiguous().view(torch.int32) >> 23) & 0xFF     # exact powers of two: the exponent field
    out = torch.zeros(*rows.shape[:-1], rb, dtype=torch.uint8, device=rows.device)
    out[..., :nope] = q.view(torch.uint8)
    out[..., nope:nope + 2 * rope_dim] = rows[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[..., nope + 2 * rope_dim:nope + 2 * rope_dim + nt] = exp.to(torch.uint8)
    return out


def unpack_kv_fp8(packed: torch.Tensor, D: int, rope_dim: int,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 [..., kv_row_bytes(D, rope_dim)] -> [..., D] in `dtype` (exact for bf16 and fp32)."""
    nope, rb = _nope(D, rope_dim), kv_row_bytes(D, rope_dim)
    if packed.dtype != torch.uint8 or packed.shape[-1] != rb:
        raise ValueError(f"unpack_kv_fp8: packed must be uint8 [..., {rb}] for D={D}, rope_dim={rope_dim}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    nt, lead = nope // KV_TILE, packed.shape[:-1]
    codes = packed[..., :nope].contiguous().view(torch.float8_e4m3fn).float()
    scale = e8m0_to_float(packed[..., nope + 2 * rope_dim:nope + 2 * rope_dim + nt].contiguous())
    nope_v = (codes.reshape(*lead, nt, KV_TILE) * scale[..., None]).reshape(*lead, nope)
    rope_v = packed[..., nope:nope + 2 * rope_dim].contiguous().view(torch.bfloat16)
    return torch.cat([nope_v.to(dtype), rope_v.to(dtype)], dim=-1)
