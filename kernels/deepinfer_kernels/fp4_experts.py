"""Routed experts kept as the checkpoint ships them (W4A8 / W4A16 MoE): e2m1 codes packed two per
byte (the low nibble holds the even input) with one UE8M0 scale byte per 32 inputs, decoded tile by
tile in registers into exactly the e4m3 values that the load-time re-encoding
(`deepinfer_core.ops.quant.fp4_to_fp8_block`) would store. The grouped GEMMs then run the FP8 path's
dots and scale multiplies unchanged, so results are bit for bit the re-encoded path's while a decode
step reads ~0.53 bytes per weight instead of 1.

Element (n, k) of an expert is v * 2^(g - 127), v its e2m1 value and g its group's scale byte. Its
128x128 block keeps the FP8 path's float32 scale 2^S (S = the block's largest non-zero group
exponent - 6, as the re-encoding picks it), so its e4m3 value is v * 2^(g - 127 - S): exact
wherever the re-encoding is (the loader takes S from it and keeps FP8 where it fails).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GROUP = 32          # inputs per UE8M0 scale byte


@dataclass(frozen=True)
class Fp4Experts:
    """One stacked expert weight (w13 [E1, 2, I, D] or w2 [E1, D, I] in the FP8 form's terms) whose
    first E4 experts are FP4 and the rest (the shared expert) FP8."""

    packed: torch.Tensor        # [E4, *rows, N, K // 2] uint8: two e2m1 codes per byte
    groups: torch.Tensor        # [E4, *rows, N, K // 32] uint8: the UE8M0 scale bytes
    fp8: torch.Tensor           # [E1 - E4, *rows, N, K] float8_e4m3fn: the experts kept FP8

    def __post_init__(self) -> None:
        p, g, f = self.packed, self.groups, self.fp8
        if p.dtype != torch.uint8 or g.dtype != torch.uint8 or f.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp4Experts: want uint8 codes, uint8 scale bytes and e4m3 experts, got "
                             f"{p.dtype}, {g.dtype}, {f.dtype}")
        K = f.shape[-1]
        if (K % GROUP or p.shape[1:] != f.shape[1:-1] + (K // 2,) or g.shape != p.shape[:-1] + (K // GROUP,)
                or not (p.is_contiguous() and g.is_contiguous() and f.is_contiguous())):
            raise ValueError(f"Fp4Experts: codes {tuple(p.shape)} / scale bytes {tuple(g.shape)} do not fit "
                             f"the FP8 experts {tuple(f.shape)} (contiguous, K a multiple of {GROUP})")

    @property
    def num_fp4(self) -> int:
        return self.packed.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [E1, *rows, N, K] of the stacked weight."""
        return (self.num_fp4 + self.fp8.shape[0],) + tuple(self.fp8.shape[1:])


@triton.jit
def fp4_tile(p_ptr, g_ptr, offs_n, n_ok, k0, K, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] e4m3 tile (inputs k0..k0+BLOCK_K, outputs offs_n: the transposed weight
    tile the FP8 loads give) of one expert whose codes start at p_ptr ([N, K/2] bytes) and scale bytes
    at g_ptr ([N, K/32]); `scale` [BLOCK_N]: the outputs' float32 128x128 block scales 2^S.

    Integer work only, no branch and no reduction (float conversions and a per-tile test both cost
    more than they save here): an e2m1 magnitude's e4m3 bits at scale 1 are u (0.5 -> 0x30, then 4
    per code step from 1.0 = 0x38); scaling by 2^t adds 8t while the exponent field f = (u >> 3) + t
    stays >= 1, below that the value is an e4m3 subnormal: the mantissa with its implicit bit,
    shifted right by 1 - f (exact: the loader keeps FP4 only where the re-encoding is exact)."""
    offs_h = tl.arange(0, BLOCK_K // 2)
    h_ok = n_ok[:, None] & (offs_h < (K - k0) // 2)[None, :]
    b = tl.load(p_ptr + offs_n[:, None] * (K // 2) + k0 // 2 + offs_h[None, :], mask=h_ok, other=0).to(tl.int16)
    codes = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K))    # input 2j: low nibble of byte j
    offs_g = tl.arange(0, BLOCK_K // 32)
    g_ok = n_ok[:, None] & (offs_g < (K - k0) // 32)[None, :]
    g = tl.load(g_ptr + offs_n[:, None] * (K // 32) + k0 // 32 + offs_g[None, :], mask=g_ok, other=127)
    block_exp = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF          # S + 127
    shift = tl.where(g_ok, g.to(tl.int32) - block_exp[:, None], 0).to(tl.int16)      # t = g - 127 - S
    t = tl.reshape(tl.broadcast_to(shift[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    c7 = codes & 7
    u = tl.where(c7 < 2, c7 * 48, c7 * 4 + 48)       # e4m3 bits of 0, .5, 1, 1.5, 2, 3, 4, 6
    f = (u >> 3) + t
    bits = tl.where(f >= 1, u + t * 8, (8 + (u & 7)) >> tl.minimum(tl.maximum(1 - f, 0), 4).to(tl.int16))
    bits = tl.where(c7 == 0, 0, bits) | ((codes & 8) << 4)
    return tl.trans(bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True))
