"""Routed experts kept as the checkpoint ships them (W4A8 / W4A16 MoE): e2m1 codes, 4 bits per weight,
with one UE8M0 scale byte per 32 inputs, decoded tile by tile in registers into exactly the e4m3
values that the load-time re-encoding (`deepinfer_core.ops.quant.fp4_to_fp8_block`) would store. The
grouped GEMMs then run the FP8 path's dots and scale multiplies unchanged, so results are bit for bit
the re-encoded path's while a decode step reads ~0.53 bytes per weight instead of 1.

Element (n, k) of an expert is v * 2^(g - 127), v its e2m1 value and g its group's scale byte. Its
128x128 block keeps the FP8 path's float32 scale 2^S (S = the block's largest non-zero group
exponent - 6, as the re-encoding picks it), so its e4m3 value is v * 2^(g - 127 - S): exact
wherever the re-encoding is (the loader takes S from it and keeps FP8 where it fails).

The codes are resident in their own order (`to_resident`, done once at load). Each 32-bit word holds
the same eight inputs as the checkpoint's word (k..k+7, two per byte) with its bits moved so that the
byte-permute decode needs 7 instructions per word instead of 13 (`decode_ptx`, `to_word_order`). The
words are tiled 16 rows x 128 inputs (1 KB, `code_row`), as a warp's MMA fragments read them: a
warp's 16-byte loads of one block cover 512 contiguous bytes, where rows K/2 bytes apart cost a
DRAM page per 64 bytes. The scale bytes are tiled the same way (64 bytes a tile, `group_row`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_args, pdl_gate

GROUP = 32          # inputs per UE8M0 scale byte
TILE_N = 16         # rows per resident tile (one warp's MMA rows n, n + 8)
TILE_K = 128        # inputs per resident tile (the quantisation block)


def fp4_fits(N: int, K: int) -> bool:
    """Whether an [N, K] expert matrix can be resident as FP4 tiles (V4's always can)."""
    return N % TILE_N == 0 and K % TILE_K == 0


@dataclass(frozen=True)
class Fp4Experts:
    """One stacked expert weight (w13 [E1, 2, I, D] or w2 [E1, D, I] in the FP8 form's terms) whose
    first E4 experts are FP4 and the rest (the shared expert) FP8."""

    packed: torch.Tensor        # [E4, *rows, N, K // 2] uint8: the e2m1 codes, `to_resident` order
    groups: torch.Tensor        # [E4, *rows, N, K // 32] uint8: the UE8M0 scale bytes, `to_resident` order
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
        if not fp4_fits(f.shape[-2], K):
            raise ValueError(f"Fp4Experts: [N, K] = [{f.shape[-2]}, {K}] cannot be resident as FP4 tiles (N a "
                             f"multiple of {TILE_N}, K of {TILE_K})")

    @property
    def num_fp4(self) -> int:
        return self.packed.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [E1, *rows, N, K] of the stacked weight."""
        return (self.num_fp4 + self.fp8.shape[0],) + tuple(self.fp8.shape[1:])


# The decode order of one 32-bit word of codes (inputs k..k+7; `to_word_order` builds it): the magnitudes
# (low 3 bits of each code) of the even inputs k, k+2, k+4, k+6 in nibbles 0-3 and of the odd ones in
# nibbles 4-7 (the prmt selectors of the even word, and of the odd one after a shift by 16); the sign of
# even input k + 2i at bit 8i + 7 (where its e4m3 byte wants it) and of odd input k + 2i + 1 at bit 8i + 3
# (4 below: one shift). Per input j of the word: where its magnitude and its sign bit sit.
MAG_SHIFT = tuple(4 * (j // 2) + 16 * (j % 2) for j in range(8))
SIGN_SHIFT = tuple(8 * (j // 2) + 7 - 4 * (j % 2) for j in range(8))


def to_word_order(codes: torch.Tensor) -> torch.Tensor:
    """Checkpoint-order code bytes [..., K/2] (two e2m1 codes per byte, the low nibble the even input)
    to the decode order (same shape and dtype uint8, the same 8 inputs per 4-byte word)."""
    if codes.dtype not in (torch.uint8, torch.int8) or codes.shape[-1] % 4:
        raise ValueError(f"to_word_order: want uint8 code bytes in whole 4-byte words, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    words = codes.contiguous().view(torch.int32)
    out = torch.zeros_like(words)
    for j in range(8):
        code = words >> (4 * j)        # the checkpoint's nibble j is input j
        out |= ((code & 7) << MAG_SHIFT[j]) | (((code >> 3) & 1) << SIGN_SHIFT[j])
    return out.view(torch.uint8).view(codes.shape)


def to_resident(codes: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint code bytes [..., N, K/2] and scale bytes [..., N, K/32] to the resident order (same
    shapes): words in `to_word_order`, tiles of 16 rows x 128 inputs one after another along K, then
    along N; inside a tile the rows n % 16 < 8, then the rest, each row's 4 groups of 16 bytes (scale
    bytes: 4 per row) in turn. `code_row` / `group_row` address them."""
    *lead, N, H = codes.shape
    if groups.shape != (*lead, N, 2 * H // GROUP) or groups.dtype != torch.uint8 or not fp4_fits(N, 2 * H):
        raise ValueError(f"to_resident: codes {tuple(codes.shape)} and scale bytes {tuple(groups.shape)} "
                         f"{groups.dtype} must be [..., N, K/2] / [..., N, K/32] uint8, N a multiple of "
                         f"{TILE_N} and K of {TILE_K}")
    words = to_word_order(codes).reshape(*lead, N // TILE_N, 2, 8, H // 64, 64)
    tiled = words.movedim(-2, -4).contiguous().view(codes.shape)
    g = groups.reshape(*lead, N // TILE_N, 2, 8, 2 * H // TILE_K, 4)
    return tiled, g.movedim(-2, -4).contiguous().view(groups.shape)


@triton.jit
def code_row(n, K):
    """Byte offset of row n's codes in a resident [N, K/2] matrix: its code byte h (inputs 2h, 2h + 1)
    lies (h // 64) * 1024 + h % 64 further."""
    return (n // 16) * (K * 8) + ((n % 16) // 8) * 512 + (n % 8) * 64


@triton.jit
def group_row(n, K):
    """Offset of row n's scale bytes in a resident [N, K/32] matrix: its byte G (inputs 32G..32G + 31)
    lies (G // 4) * 64 + G % 4 further."""
    return (n // 16) * (K // 2) + ((n % 16) // 8) * 32 + (n % 8) * 4


@triton.jit
def word_codes(words):
    """[R, W] int32 words in the decode order -> [R, W, 8] int16 e2m1 codes (sign << 3 | magnitude) in
    input order (the interpreter's unpacking; `MAG_SHIFT` / `SIGN_SHIFT` as tensors)."""
    j = tl.arange(0, 8)
    mag_shift = (j // 2) * 4 + (j % 2) * 16
    sign_shift = (j // 2) * 8 + 7 - (j % 2) * 4
    w = words.to(tl.int32)[:, :, None]
    return (((w >> mag_shift[None, None, :]) & 7) | (((w >> sign_shift[None, None, :]) & 1) << 3)).to(tl.int16)


# The e4m3 bytes of the eight e2m1 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6) times 2^t, as two words (magnitudes
# 0-3, 4-7). Where every non-zero magnitude stays an e4m3 normal (t >= -5; a group the loader keeps FP4 with
# any non-zero code has t <= 6) the bytes are 0 and 0x30 / 0x38 / ... / 0x4C + 8t: two multiply-adds (no
# byte borrows or carries in that range; byte 0 stays 0 for any t, so an all-zero group is right too).
# Below, a branch builds them the general way: 2^t as f16 bits (a subnormal below 2^-14), the products in
# f16 (exact: every group the loader keeps FP4 has its values in e4m3, which f16 holds) and rounded to e4m3
# by the hardware's cvt (exact for the same reason, subnormals included); t clamped to [-24, 15]: a group
# whose t lies outside holds only zeros, whose entry 0 is 0 for every t.
_LUT_ASM = tl.constexpr("""
{
.reg .s32 tc, nb, sb;
.reg .b32 h, c, v0, v1, v2, v3;
.reg .b16 q0, q1, q2, q3;
.reg .pred p;
mad.lo.s32 $0, $2, 0x08080800, 0x3C383000;
mad.lo.s32 $1, $2, 0x08080808, 0x4C484440;
setp.ge.s32 p, $2, -5;
@p bra LUT_DONE;
max.s32 tc, $2, -24;
min.s32 tc, tc, 15;
add.s32 nb, tc, 15;
shl.b32 nb, nb, 10;
add.s32 sb, tc, 24;
shl.b32 sb, 1, sb;
setp.lt.s32 p, tc, -14;
selp.b32 h, sb, nb, p;
prmt.b32 h, h, h, 0x1010;
mov.b32 c, 0x38000000;
mul.rn.f16x2 v0, h, c;
mov.b32 c, 0x3E003C00;
mul.rn.f16x2 v1, h, c;
mov.b32 c, 0x42004000;
mul.rn.f16x2 v2, h, c;
mov.b32 c, 0x46004400;
mul.rn.f16x2 v3, h, c;
cvt.rn.satfinite.e4m3x2.f16x2 q0, v0;
cvt.rn.satfinite.e4m3x2.f16x2 q1, v1;
cvt.rn.satfinite.e4m3x2.f16x2 q2, v2;
cvt.rn.satfinite.e4m3x2.f16x2 q3, v3;
mov.b32 $0, {q0, q1};
mov.b32 $1, {q2, q3};
LUT_DONE:
}
""")


# One code word in the decode order to the e4m3 bytes of its four even and four odd inputs: mask the
# magnitudes (nibble bit 3 would switch prmt to sign replication), look the even ones up (prmt reads the
# selector's low 16 bits), or in their signs; shift the odd magnitudes down, look up, or in their signs
# moved up by 4. 7 instructions for eight weights.
def decode_ptx(code: str, lut_a: str, lut_b: str, even: str, odd: str) -> str:
    """The byte-permute decode of one code word into its even / odd e4m3 words, as PTX over the named
    registers (temporaries a, s, o: the caller declares them)."""
    return f"""
and.b32 a, {code}, 0x77777777;
prmt.b32 o, {lut_a}, {lut_b}, a;
lop3.b32 {even}, o, {code}, 0x80808080, 0xF8;
shr.b32 a, a, 16;
prmt.b32 o, {lut_a}, {lut_b}, a;
shl.b32 s, {code}, 4;
lop3.b32 {odd}, o, s, 0x80808080, 0xF8;
"""


# Four code bytes (one word: Triton packs a thread's consecutive bytes, and each thread holds a whole
# 16-byte group row, see `_load_codes`) to the even / odd inputs' e4m3 bytes, output byte i of the
# word's even (odd) inputs in place of input byte i.
_DECODE_ASM = tl.constexpr("{\n.reg .b32 a, s, o;" + decode_ptx("$2", "$3", "$7", "$0", "$1") + "}\n")
# The same to the output words in input order: bytes e0 o0 e1 o1 and e2 o2 e3 o3.
_DECODE_WORDS_ASM = tl.constexpr("{\n.reg .b32 a, s, o, ev, od;" + decode_ptx("$2", "$3", "$4", "ev", "od")
                                 + "prmt.b32 $0, ev, od, 0x5140;\nprmt.b32 $1, ev, od, 0x7362;\n}\n")


@triton.jit
def _load_codes(p_ptr, g_ptr, offs_n, n_ok, k0, K, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ROW_MASK: tl.constexpr):
    """The code bytes [BLOCK_N, BLOCK_K // 2] of a tile (k0 a multiple of BLOCK_K, a power of two up to
    128: inside one resident tile along K) and each group's shift t = g - 127 - S [BLOCK_N, BLOCK_K // 32]
    against the outputs' float32 128x128 block scales 2^S (`scale`). ROW_MASK (compiled one-group
    tiles: the tile is all in or all out along K): mask the rows only, so that each thread loads a
    whole 16-byte row, as the byte permutes need (the interpreter takes no scalar mask)."""
    tl.static_assert(BLOCK_K <= 128, "a tile of codes lies inside one resident tile along K")
    offs_h = tl.arange(0, BLOCK_K // 2)
    if ROW_MASK:
        h_ok = tl.broadcast_to(n_ok[:, None] & (k0 < K), (BLOCK_N, BLOCK_K // 2))
    else:
        h_ok = n_ok[:, None] & (offs_h < (K - k0) // 2)[None, :]
    col = tl.multiple_of((k0 // 128) * 1024 + (k0 % 128) // 2, BLOCK_K // 2)
    b = tl.load(p_ptr + code_row(offs_n, K)[:, None] + col + offs_h[None, :], mask=h_ok, other=0)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    g_ok = n_ok[:, None] & (offs_g < K // 32)[None, :]
    g = tl.load(g_ptr + group_row(offs_n, K)[:, None] + ((offs_g // 4) * 64 + offs_g % 4)[None, :], mask=g_ok,
                other=127)
    block_exp = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF          # S + 127
    return b, tl.where(g_ok, g.to(tl.int32) - block_exp[:, None], 0)


@triton.jit
def fp4_tile(p_ptr, g_ptr, offs_n, n_ok, k0, K, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PRMT: tl.constexpr = False):
    """The [BLOCK_K, BLOCK_N] e4m3 tile (inputs k0..k0+BLOCK_K, outputs offs_n: the transposed weight
    tile the FP8 loads give) of one expert: `fp4_rows` transposed."""
    return tl.trans(fp4_rows(p_ptr, g_ptr, offs_n, n_ok, k0, K, scale, BLOCK_N, BLOCK_K, PRMT))


@triton.jit
def fp4_rows(p_ptr, g_ptr, offs_n, n_ok, k0, K, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PRMT: tl.constexpr = False):
    """The [BLOCK_N, BLOCK_K] e4m3 weights (outputs offs_n, inputs k0..k0+BLOCK_K) of one expert whose
    codes start at p_ptr ([N, K/2] bytes) and scale bytes at g_ptr ([N, K/32]), both resident;
    `scale` [BLOCK_N]: the outputs' float32 128x128 block scales 2^S.

    PRMT (compiled kernels on sm_89+): a lookup table per group (`_LUT_ASM`) and byte permutes
    (`_DECODE_ASM`), ~1 integer instruction per weight. Otherwise (the interpreter) integer work
    on each code, no branch: an e2m1 magnitude's e4m3 bits at scale 1 are u (0.5 -> 0x30, then 4
    per code step from 1.0 = 0x38); scaling by 2^t adds 8t while the exponent field f = (u >> 3) + t
    stays >= 1, below that the value is an e4m3 subnormal: the mantissa with its implicit bit,
    shifted right by 1 - f (exact: the loader keeps FP4 only where the re-encoding is exact)."""
    b, shift = _load_codes(p_ptr, g_ptr, offs_n, n_ok, k0, K, scale, BLOCK_N, BLOCK_K, PRMT and BLOCK_K == 32)
    if PRMT:
        tl.static_assert(BLOCK_K == 32, "the byte permutes decode one 32-input group per tile")
        lut_a, lut_b = tl.inline_asm_elementwise(_LUT_ASM, "=r,=r,r", [shift], dtype=(tl.uint32, tl.uint32),
                                                 is_pure=True, pack=1)
        lut_a = tl.reshape(tl.broadcast_to(lut_a[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
        lut_b = tl.reshape(tl.broadcast_to(lut_b[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
        even, odd = tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [b, lut_a, lut_b],
                                              dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
        bits = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
        return bits.to(tl.float8e4nv, bitcast=True)
    words = tl.sum(tl.reshape(b, (BLOCK_N, BLOCK_K // 8, 4)).to(tl.int32) << (tl.arange(0, 4) * 8)[None, None, :],
                   axis=2)
    codes = tl.reshape(word_codes(words), (BLOCK_N, BLOCK_K))
    t16 = shift.to(tl.int16)
    t = tl.reshape(tl.broadcast_to(t16[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    return code_e4m3(codes, t)


@triton.jit
def code_e4m3(codes, t):
    """e2m1 codes (int16) times 2^t (int16, same shape) as e4m3, by integer work on each code (the
    interpreter's decode; `fp4_rows` says how)."""
    c7 = codes & 7
    u = tl.where(c7 < 2, c7 * 48, c7 * 4 + 48)       # e4m3 bits of 0, .5, 1, 1.5, 2, 3, 4, 6
    f = (u >> 3) + t
    bits = tl.where(f >= 1, u + t * 8, (8 + (u & 7)) >> tl.minimum(tl.maximum(1 - f, 0), 4).to(tl.int16))
    bits = tl.where(c7 == 0, 0, bits) | ((codes & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _decode_kernel(p_ptr, g_ptr, s_ptr, out_ptr, N, K, NB_N, NB_K, PRMT: tl.constexpr, PDL: tl.constexpr = False):
    """One 128x128 block of matrix m as its e4m3 re-encoding: [128 rows, 16 code words] (eight whole
    resident tiles) loaded four consecutive words (one group) per thread, the lookup table built per
    word (two multiply-adds where no value is subnormal, cheaper than handing a group's table to its
    four words), two output words per code word."""
    pdl_gate(PDL)
    pid, kb = tl.program_id(0), tl.program_id(1)
    m = (pid // NB_N).to(tl.int64)
    offs_n = (pid % NB_N) * 128 + tl.arange(0, 128)
    offs_w = tl.arange(0, 16)                             # code words of the block (8 inputs each)
    ok = (offs_n < N)[:, None] & (kb * 16 + offs_w < K // 8)[None, :]
    row_w = code_row(offs_n, K) // 4 + kb * 256
    words = tl.load(p_ptr.to(tl.pointer_type(tl.int32)) + m * N * (K // 8) + row_w[:, None] + offs_w[None, :],
                    mask=ok, other=0)
    g = tl.load(g_ptr + m * N * (K // 32) + (group_row(offs_n, K) + kb * 64)[:, None] + offs_w[None, :] // 4,
                mask=ok, other=0)
    block_exp = (tl.load(s_ptr + (m * NB_N + pid % NB_N) * NB_K + kb).to(tl.int32, bitcast=True) >> 23) & 0xFF
    t = g.to(tl.int32) - block_exp
    out32 = out_ptr.to(tl.pointer_type(tl.int32)) + m * N * (K // 4) + offs_n[:, None] * (K // 4)
    if PRMT:
        lut_a, lut_b = tl.inline_asm_elementwise(_LUT_ASM, "=r,=r,r", [t], dtype=(tl.int32, tl.int32), is_pure=True,
                                                 pack=1)
        lo, hi = tl.inline_asm_elementwise(_DECODE_WORDS_ASM, "=r,=r,r,r,r", [words, lut_a, lut_b],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        out = tl.reshape(tl.join(lo, hi), (128, 32))
        offs_o = kb * 32 + tl.arange(0, 32)
        tl.store(out32 + offs_o[None, :], out, mask=(offs_n < N)[:, None] & (offs_o < K // 4)[None, :])
    else:
        codes = tl.reshape(word_codes(words), (128, 128))
        bits = code_e4m3(codes, tl.reshape(tl.broadcast_to(t.to(tl.int16)[:, :, None], (128, 16, 8)), (128, 128)))
        offs_k = kb * 128 + tl.arange(0, 128)
        tl.store(out_ptr + m * N * K + offs_n[:, None] * K + offs_k[None, :], bits,
                 mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


def decode_experts(w: Fp4Experts, scales: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """FP4 experts [first, end) of `w` as their FP8 re-encoding ([end - first, *rows, N, K] e4m3, the
    bytes the load-time re-encoding stores), given the stack's float32 128x128 block scales `scales`."""
    if not 0 <= first < end <= w.num_fp4:
        raise ValueError(f"decode_experts: experts [{first}, {end}) must lie in the {w.num_fp4} FP4 experts")
    *lead, N, K = w.shape[1:]
    M = (end - first) * math.prod(lead)
    out = torch.empty((end - first, *lead, N, K), dtype=torch.float8_e4m3fn, device=w.packed.device)
    nb_n, nb_k = triton.cdiv(N, 128), triton.cdiv(K, 128)
    _decode_kernel[(M * nb_n, nb_k)](w.packed[first:end], w.groups[first:end], scales[first:end].contiguous(), out,
                                     N, K, nb_n, nb_k, PRMT=os.environ.get("TRITON_INTERPRET") != "1",
                                     **launch_args(out))
    return out
