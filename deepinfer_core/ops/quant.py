"""Exact FP8 / FP4 numerics of DeepSeek-V4 in plain PyTorch: the QAT simulation of the
reference kernels and the checkpoint's dequantisation.

Everything here is bit-exact by construction: scales are powers of two built from fp32 bit patterns,
divisions by a power of two are exact, E4M3 rounding is torch's RNE cast to float8_e4m3fn, and E2M1
rounding is done on integers with torch.round (half-to-even). These functions are the portable
reference that faster kernels are tested against.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4               # act_quant: amax = max(amax, 1e-4)
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126  # fp4_act_quant: amax = max(amax, 6 * 2^-126)

# E2M1 code -> value; code bit 3 is the sign, so codes 8..15 mirror 0..7 (8 is -0).
FP4_LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ---- scales ------------------------------------------------------------------------------------

def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale (float8_e8m0fnu or uint8 bytes) -> float32 2^(b-127), built from bits."""
    if s.dtype == torch.float8_e8m0fnu:
        s = s.view(torch.uint8)
    if s.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"e8m0_to_float expects float8_e8m0fnu or uint8 bytes, got {s.dtype}")
    b = s.view(torch.uint8).to(torch.int32)
    bits = b << 23
    # b = 0 is 2^-127, an fp32 subnormal (mantissa 0x400000); b = 255 is NaN.
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 x) for positive float32 x, exactly as the reference kernel computes it.

    Take the fp32 exponent field and add one if any mantissa bit is set. Normals give the true
    power-of-two ceiling; subnormals (exponent field 0) give 2^-126, the smallest normal, and 0 gives 0
    -- the bit-pattern semantics of the reference, which callers avoid with their amax floors.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"pow2_ceil expects float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def _float_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Exact power-of-two float32 scale (normal) -> float8_e8m0fnu byte (its exponent field)."""
    exp = (s.contiguous().view(torch.int32) >> 23) & 0xFF
    return exp.to(torch.uint8).view(torch.float8_e8m0fnu)


# ---- block helpers -----------------------------------------------------------------------------

def _blocks_last(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """float32 view [..., nblk, block] of x, zero padded (zeros never change a block's amax)."""
    n = x.shape[-1]
    pad = (-n) % block
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.reshape(*x.shape[:-1], (n + pad) // block, block), n


def _unblock(y: torch.Tensor, n: int) -> torch.Tensor:
    return y.reshape(*y.shape[:-2], -1)[..., :n]


# ---- activation fake-quant ---------------------------------------------------------------------

def quant_fp8_act(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant, non-in-place: (q float8_e4m3fn like x, scales float32 [..., ceil(n/block)])."""
    xb, n = _blocks_last(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    s = pow2_ceil(amax / FP8_MAX)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return _unblock(q, n), s.squeeze(-1)


def fake_quant_fp8(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """act_quant in fake ("in place") mode: float(e4m3(x/s)) * s, returned in x.dtype."""
    xb, n = _blocks_last(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    s = pow2_ceil(amax / FP8_MAX)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return _unblock(q.float() * s, n).to(x.dtype)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to the E2M1 grid, nearest with ties to the even code.

    The grid is uniform per binade: step 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]. Scaling by the
    step makes grid points integers whose parity equals the code's parity, so torch.round (half to
    even) gives exactly the ties-to-even-code rule (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4).
    """
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    r = torch.round(a / step) * step
    return torch.copysign(r.clamp_max(FP4_MAX), v)


def fake_quant_fp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp4_act_quant (always fake in the model): e2m1(x/s) * s in x.dtype, s = pow2ceil(amax/6)."""
    xb, n = _blocks_last(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    s = pow2_ceil(amax / FP4_MAX)
    q = round_to_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return _unblock(q * s, n).to(x.dtype)


def fake_quant_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 E2M1 values with one E4M3 scale per `block` (V4.1's compressed KV with
    `use_fp4_sparse_kv`): e2m1(x/s) * s in x.dtype, s = e4m3(amax/6) of each block.

    Choices (DeepSeek's source gives the storage format, not the rounding):
    * the scale is amax/6 (fp32) rounded to the nearest E4M3 value -- torch's round-to-nearest-even
      cast to float8_e4m3fn -- after saturating at E4M3's largest value 448; there is no per-tensor
      second-level scale (288 B/token = 256 B of codes + 32 E4M3 scales);
    * x/s is clamped to [-6, 6] (a scale rounded down can put amax/s a little above 6) and rounded
      by `round_to_e2m1` (nearest, ties to the even code, as `fake_quant_fp4`);
    * a block whose scale is 0 -- all zeros, or amax/6 at most 2^-10 (half of E4M3's smallest
      subnormal 2^-9) -- gives zeros, never NaN.
    The result e2m1 * s has at most 6 significant bits and magnitude in [2^-10, 2688], so it is
    exact in float32, bfloat16 and float16.
    """
    xb, n = _blocks_last(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s = (amax / FP4_MAX).clamp_max(FP8_MAX).to(torch.float8_e4m3fn).float()
    q = round_to_e2m1((xb / s.masked_fill(s == 0, 1.0)).clamp(-FP4_MAX, FP4_MAX))
    return _unblock(q * s, n).to(x.dtype)


# ---- Hadamard ----------------------------------------------------------------------------------

def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform over the last dim (Sylvester order) times dim^-0.5; fp32 inside.

    Butterfly: at stride h, pairs (i, i+h) inside each 2h chunk become (a+b, a-b), which builds
    H_2n = [[H_n, H_n], [H_n, -H_n]] -- the natural-order Sylvester matrix. No random signs.
    """
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard_transform needs a power-of-two last dim, got {n}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        h *= 2
    return (y * n ** -0.5).reshape(*lead, n).to(x.dtype)


# ---- weight dequantisation ---------------------------------------------------------------------

def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W[o,i] = float(e4m3[o,i]) * 2^(S[o//bo, i//bi] - 127); partial edge blocks allowed."""
    out_f, in_f = w.shape
    bo, bi = block
    want = (-(-out_f // bo), -(-in_f // bi))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8 scale shape {tuple(scale.shape)} does not fit weight {tuple(w.shape)} "
                         f"with block {block}; expected {want}")
    s = e8m0_to_float(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
    s = s.repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
    return (w.float() * s).to(dtype)


def unpack_fp4(w_packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [out, in/2] -> float32 [out, in]; the LOW nibble holds the even column."""
    b = w_packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    lut = torch.tensor(FP4_LUT, dtype=torch.float32, device=w_packed.device)
    return lut[codes]


def dequant_fp4(w_packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W[o,k] = LUT[nibble] * 2^(S[o, k//block] - 127)."""
    w = unpack_fp4(w_packed)
    want = (w.shape[0], -(-w.shape[1] // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp4 scale shape {tuple(scale.shape)} does not fit packed weight "
                         f"{tuple(w_packed.shape)} (logical {tuple(w.shape)}); expected {want}")
    s = e8m0_to_float(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
    return (w * s.repeat_interleave(block, 1)[:, :w.shape[1]]).to(dtype)


def fp4_to_fp8_block(w_packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                     out_block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Re-encode FP4 weights (e2m1, one UE8M0 scale per `block` inputs) as FP8 e4m3 with one UE8M0
    scale per `out_block`, exactly, or None when that is impossible.

    An e2m1 value has at most 2 significant bits, so v * 2^(s - S) fits e4m3 whenever it stays inside
    e4m3's exponent range. S = (largest group scale in the 128x128 block) - 6 keeps 6 * 2^6 = 384 <= 448;
    the smallest non-zero, 0.5 * 2^(s_min - S), must stay >= 2^-9 (e4m3's smallest subnormal), i.e. the
    group scales of one block may span 14 binades at most. The result is checked bit for bit.
    """
    if w_packed.is_meta:        # shapes only (weight accounting on the meta device): nothing to check
        O, K, (bo, bi) = w_packed.shape[0], w_packed.shape[1] * 2, out_block
        return (torch.empty((O, K), dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty((-(-O // bo), -(-K // bi)), dtype=torch.float8_e8m0fnu, device="meta"))
    v = unpack_fp4(w_packed)                                     # [O, K] e2m1 values (float32)
    O, K = v.shape
    bo, bi = out_block
    e = (e8m0_to_float(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float())
    e = e.repeat_interleave(block, 1)[:, :K]                     # per-element group scale
    exp = torch.log2(e).round().to(torch.int32)
    nbo, nbi = -(-O // bo), -(-K // bi)
    padded = torch.full((nbo * bo, nbi * bi), -1000, dtype=torch.int32, device=v.device)
    padded[:O, :K] = torch.where(v != 0, exp, torch.full_like(exp, -1000))   # zeros do not constrain
    blk_max = padded.view(nbo, bo, nbi, bi).amax(dim=(1, 3))     # [nbo, nbi]
    blk_max = torch.where(blk_max < -500, torch.zeros_like(blk_max), blk_max)   # all-zero block
    S = (blk_max - 6).clamp(-127, 127)
    S_full = S.repeat_interleave(bo, 0)[:O].repeat_interleave(bi, 1)[:, :K]
    q = (v * torch.exp2((exp - S_full).float())).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s8 = _float_to_e8m0(torch.exp2(S.float()))
    if not torch.equal(dequant_fp8_block(q, s8, out_block, torch.float32), v * e):
        return None
    return q, s8


# ---- encoders (tiny checkpoints, tests) --------------------------------------------------------

def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [out, in] -> (float8_e4m3fn weight, float8_e8m0fnu scale [ceil(out/bo), ceil(in/bi)])."""
    out_f, in_f = w.shape
    bo, bi = block
    po, pi = (-out_f) % bo, (-in_f) % bi
    wf = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    nbo, nbi = (out_f + po) // bo, (in_f + pi) // bi
    blk = wf.reshape(nbo, bo, nbi, bi)
    # Floor keeps all-zero blocks away from a zero scale (which would divide by zero).
    amax = blk.abs().amax(dim=(1, 3), keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    s = pow2_ceil(amax / FP8_MAX)
    q = (blk / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(nbo * bo, nbi * bi)[:out_f, :in_f].contiguous()
    return q, _float_to_e8m0(s.reshape(nbo, nbi))


def quantize_fp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [out, in] (in even) -> (int8 packed [out, in/2], float8_e8m0fnu scale [out, in/block])."""
    out_f, in_f = w.shape
    if in_f % 2:
        raise ValueError(f"quantize_fp4 needs an even input dim, got {in_f}")
    wb, n = _blocks_last(w, block)
    amax = wb.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    s = pow2_ceil(amax / FP4_MAX)
    q = _unblock(round_to_e2m1((wb / s).clamp(-FP4_MAX, FP4_MAX)), n)
    # Grid value -> magnitude code: 2r on [0, 2) (codes 0..3), r + 2 for 2, 3, 4 (codes 4..6),
    # 7 for 6; sign -> bit 3.
    r = q.abs()
    code = torch.where(r < 2, 2 * r, torch.where(r < 5, r + 2, 7.0)).to(torch.int64)
    code = code | (torch.signbit(q).to(torch.int64) << 3)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed.contiguous(), _float_to_e8m0(s.squeeze(-1))
