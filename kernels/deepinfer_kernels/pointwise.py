"""Fused memory-bound glue of the V4 attention block: RMSNorm, per-head norm + RoPE + QAT fake-quant,
and in-place inverse RoPE.

Torch runs each step (norm, rope, fp8/fp4 fake-quant, Hadamard) as several elementwise kernels, each a
full pass over memory; here every element is read once and written once. Core references (the
composition is exactly theirs, in this order):
  norm   deepinfer_core.model.layers.RMSNorm.forward / head_rms_norm (official_head_rms_norm with
         `official`: the QAT numerics, every step of the head norm rounded to x.dtype)
  rope   deepinfer_core.model.rope.RotaryTable.apply (interleaved pairs on the last rd channels)
  quant  deepinfer_core.ops.quant.fake_quant_fp8 (blocks of 64 on the nope channels) or
         fake_quant_fp4(hadamard_transform(.), 32)

Exactness: every intermediate the reference rounds to x.dtype is rounded here too (by integer RNE,
because Triton's interpreter truncates fp32->bf16 casts); quant scales are pow2 from bits, x / s is an
exact multiply by 1/s, e4m3 / e2m1 rounding is done in fp32 (ties to even), and the Hadamard is the
reference's butterfly. fp-contraction is switched off so (a*c - b*s) rounds like torch. What can differ
from torch is cos/sin (libdevice / numpy vs torch, an ulp) and the order of the norm's sum of squares.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant import _pow2_ceil, _round_to_e4m3_grid
from .pdl import launch_args, pdl_gate

FP8_MAX, FP8_FLOOR, FP8_BLOCK = 448.0, 1e-4, 64
FP4_MAX, FP4_FLOOR, FP4_BLOCK = 6.0, 6.0 * 2.0 ** -126, 32
# The same constants for jit code (Triton reads only constexpr globals).
_FP8_MAX, _FP8_FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(FP8_FLOOR)
_FP4_MAX, _FP4_FLOOR = tl.constexpr(FP4_MAX), tl.constexpr(FP4_FLOOR)
_NORMS = {"none": 0, "head": 1, "weighted": 2}
_QUANTS = {"none": 0, "fp8_nope": 1, "hadamard_fp4": 2}
_DTYPES = (torch.bfloat16, torch.float32)
MAX_RMS_DIM = 8192


# ---- jit helpers -------------------------------------------------------------------------------

@triton.jit
def _round_dt(y, DT: tl.constexpr):
    """fp32 -> the nearest DT value (ties to even), still held in fp32. Done on the bits for bf16 so
    the interpreter (which truncates) and compiled code agree; a later .to(DT) is then exact."""
    if DT == tl.bfloat16:
        b = y.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        y = b.to(tl.float32, bitcast=True)
    return y


@triton.jit
def _pow2_recip(s):
    """1/s for a normal power of two s (exact, so x * (1/s) == x / s bit for bit)."""
    e = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rotate(ev, od, pos, f_ptr, PAIR0: tl.constexpr, NPAIR: tl.constexpr, RH: tl.constexpr,
            INVERSE: tl.constexpr):
    """Rotate pairs j in [PAIR0, PAIR0 + RH) of ev/od [HB, NPAIR] (fp32) by pos * inv_freq[j - PAIR0];
    other pairs pass through. Angles are one fp32 product, like the reference table."""
    k = tl.arange(0, NPAIR) - PAIR0
    on = (k >= 0) & (k < RH)
    f = tl.load(f_ptr + k, mask=on, other=0.0)
    ang = pos.to(tl.float32) * f
    c = tl.cos(ang)[None, :]
    s = tl.sin(ang)[None, :]
    if INVERSE:
        s = -s
    re = ev * c - od * s
    ro = ev * s + od * c
    on2 = on[None, :]
    return tl.where(on2, re, ev), tl.where(on2, ro, od)


@triton.jit
def _fake_fp8_head(y, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, QB: tl.constexpr):
    """fake_quant_fp8 in blocks of QB on channels < NOPE of y [HB, D]; the rest pass through."""
    yb = tl.reshape(y, (HB, D // QB, QB))
    inq = (tl.reshape(tl.arange(0, D), (D // QB, QB)) < NOPE)[None, :, :]
    amax = tl.maximum(tl.max(tl.where(inq, tl.abs(yb), 0.0), axis=2), _FP8_FLOOR)
    s = _pow2_ceil(tl.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32)))
    v = tl.clamp(yb * _pow2_recip(s)[:, :, None], -_FP8_MAX, _FP8_MAX)
    q = _round_to_e4m3_grid(v) * s[:, :, None]
    return tl.reshape(tl.where(inq, q, yb), (HB, D))


@triton.jit
def _hadamard(y, HB: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """The reference butterfly over the last dim of y [HB, D], in fixed-shape (Pease) form: each stage
    combines adjacent channels (2m, 2m + 1) -> (a + b, a - b) and writes them to (m, m + D/2), which
    rotates the index bits right by one. Stage k so acts on original bit k, i.e. stride h = 2^k in
    the reference's order h = 1, 2, 4, ..., with the same adds: bitwise equal; after LOG_D stages
    the bits are back in place."""
    for _ in tl.static_range(LOG_D):
        a, b = tl.split(tl.reshape(y, (HB, D // 2, 2)))
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (HB, D))
    return y


@triton.jit
def _fake_fp4(y, HB: tl.constexpr, D: tl.constexpr, QB: tl.constexpr):
    """fake_quant_fp4 of y [HB, D] in blocks of QB: e2m1(y / s) * s, s = pow2ceil(max(amax, floor) / 6)."""
    yb = tl.reshape(y, (HB, D // QB, QB))
    amax = tl.maximum(tl.max(tl.abs(yb), axis=2), _FP4_FLOOR)
    s = _pow2_ceil(tl.div_rn(amax, tl.full(amax.shape, _FP4_MAX, tl.float32)))
    v = tl.clamp(yb * _pow2_recip(s)[:, :, None], -_FP4_MAX, _FP4_MAX)
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    big = step * 12582912.0                     # 1.5 * 2^23 * step: fp32 add rounds to the step, RNE
    r = tl.minimum((a + big) - big, _FP4_MAX)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    q = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)   # copysign
    return tl.reshape(q * s[:, :, None], (HB, D))


# ---- kernels -----------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, eps, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # One row per program, the whole row in one tile: the reduction tree depends on BLOCK and
    # num_warps only (both fixed by N), never on the number of rows -> batch invariant.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round_dt(w * (xf * r), x.dtype)
    tl.store(y_ptr + row * N + offs, y.to(x.dtype), mask=mask)


@triton.jit
def _norm_rope_quant_kernel(x_ptr, y_ptr, pos_ptr, f_ptr, w_ptr, H, stride_t, stride_h, eps, had_scale,
                            D: tl.constexpr, LOG_D: tl.constexpr, RH: tl.constexpr, HB: tl.constexpr,
                            NORM: tl.constexpr, INVERSE: tl.constexpr, QUANT: tl.constexpr,
                            NOPE: tl.constexpr, QB8: tl.constexpr, QB4: tl.constexpr,
                            OFFICIAL: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    cols = tl.arange(0, D)
    hmask = (heads < H)[:, None]
    x = tl.load(x_ptr + t * stride_t + heads[:, None] * stride_h + cols[None, :], mask=hmask, other=0.0)
    DT: tl.constexpr = x.dtype
    y = x.to(tl.float32)
    if NORM == 1 and OFFICIAL:   # official_head_rms_norm: square, mean, + eps, rsqrt each in DT
        ms = _round_dt(tl.sum(_round_dt(y * y, DT), axis=1) * (1.0 / D), DT)
        r = _round_dt(tl.rsqrt(_round_dt(ms + eps, DT)), DT)
        y = _round_dt(y * r[:, None], DT)
    elif NORM == 1:  # head_rms_norm: rsqrt in fp32, cast to x.dtype, product in x.dtype
        r = _round_dt(tl.rsqrt(tl.sum(y * y, axis=1) * (1.0 / D) + eps), DT)
        y = _round_dt(y * r[:, None], DT)
    elif NORM == 2:  # RMSNorm: (w * (x * r)) in fp32, then x.dtype
        r = tl.rsqrt(tl.sum(y * y, axis=1) * (1.0 / D) + eps)
        w = tl.load(w_ptr + cols).to(tl.float32)
        y = _round_dt(w[None, :] * (y * r[:, None]), DT)
    pos = tl.load(pos_ptr + t)
    ev, od = tl.split(tl.reshape(y, (HB, D // 2, 2)))
    ev, od = _rotate(ev, od, pos, f_ptr, D // 2 - RH, D // 2, RH, INVERSE)
    y = _round_dt(tl.reshape(tl.join(ev, od), (HB, D)), DT)
    if QUANT == 1:
        y = _fake_fp8_head(y, HB, D, NOPE, QB8)
    elif QUANT == 2:
        y = _round_dt(_hadamard(y, HB, D, LOG_D) * had_scale, DT)
        y = _fake_fp4(y, HB, D, QB4)
    out = y_ptr + (t * H + heads[:, None]) * D + cols[None, :]
    tl.store(out, y.to(DT), mask=hmask)


@triton.jit
def _rope_inplace_kernel(x_ptr, pos_ptr, f_ptr, H, stride_t, stride_h, rope_off,
                         RH: tl.constexpr, BLOCK_P: tl.constexpr, HB: tl.constexpr, INVERSE: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    cols = tl.arange(0, 2 * BLOCK_P)
    # The rope span of each head as one contiguous [HB, 2*BLOCK_P] tile (vector loads), split into
    # (even, odd) pairs in registers.
    ptrs = x_ptr + t * stride_t + heads[:, None] * stride_h + rope_off + cols[None, :]
    mask = (heads < H)[:, None] & (cols < 2 * RH)[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    ev, od = tl.split(tl.reshape(x.to(tl.float32), (HB, BLOCK_P, 2)))
    ev, od = _rotate(ev, od, tl.load(pos_ptr + t), f_ptr, 0, BLOCK_P, RH, INVERSE)
    y = _round_dt(tl.reshape(tl.join(ev, od), (HB, 2 * BLOCK_P)), x.dtype)
    tl.store(ptrs, y.to(x.dtype), mask=mask)


# ---- wrappers ----------------------------------------------------------------------------------

def _check_x(x: torch.Tensor, name: str, dims: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} needs a unit stride on its last dim, got strides {x.stride()}")


def _check_rope_args(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> int:
    """Validates positions / inv_freq against x [T, (H,) D]; returns rd/2."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"positions must be a 1-D tensor of length T={x.shape[0]}, got "
                         f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions!r}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 (or int32), got {positions.dtype}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError("inv_freq must be a 1-D float32 tensor [rope_dim / 2]")
    rh = inv_freq.shape[0]
    if rh < 1 or 2 * rh > x.shape[-1]:
        raise ValueError(f"inv_freq length {rh} gives rope_dim {2 * rh}, which must be in [2, D={x.shape[-1]}]")
    for name, t in (("positions", positions), ("inv_freq", inv_freq)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return rh


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int | None = None) -> torch.Tensor:
    """RMSNorm.forward over the last dim of x [..., D] (D <= 8192): fp32 statistics, weight applied in
    fp32, output in x.dtype. Batch invariant (a row's result never depends on the other rows)."""
    _check_x(x, "x", tuple(range(1, 9)))
    D = x.shape[-1]
    if not 1 <= D <= MAX_RMS_DIM:
        raise ValueError(f"x's last dim must be in [1, {MAX_RMS_DIM}], got {D}")
    if not isinstance(weight, torch.Tensor) or weight.shape != (D,) or weight.dtype not in _DTYPES:
        raise ValueError(f"weight must be a bfloat16/float32 tensor of shape ({D},), got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    x2 = x.reshape(-1, D)      # a view when the rows are evenly strided
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        nw = num_warps or max(1, min(16, block // 512))   # a function of D only (batch invariance)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, D, x2.stride(0), float(eps),
                                         BLOCK=block, num_warps=nw, enable_fp_fusion=False, **launch_args(x2))
    return y


def _heads_view(x: torch.Tensor) -> tuple[int, int, int]:
    """(H, stride_t, stride_h) of x [T, D] or [T, H, D]."""
    if x.dim() == 2:
        return 1, x.stride(0), 0
    return x.shape[1], x.stride(0), x.stride(1)


def norm_rope_quant(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, norm: str = "none",
                    weight: torch.Tensor | None = None, eps: float = 1e-6, inverse: bool = False,
                    quant: str = "none", nope_dim: int | None = None, official: bool = False,
                    block_h: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """norm -> RoPE (last 2*len(inv_freq) channels) -> fake-quant, fused; x [T, D] or [T, H, D], D a power
    of two <= 512. norm: "none" | "head" (head_rms_norm) | "weighted" (RMSNorm with `weight` [D]);
    quant: "none" | "fp8_nope" (fake_quant_fp8 in blocks of 64 on channels < nope_dim, default D - rd;
    the other modes ignore nope_dim) | "hadamard_fp4" (fake_quant_fp4(hadamard_transform(.), 32) over
    all D). `official`: the head norm rounds each step to x.dtype (`official_head_rms_norm`, the QAT
    numerics). Returns a new contiguous tensor like x. `block_h` (heads per program, a power of two)
    and `num_warps` are tuning knobs."""
    _check_x(x, "x", (2, 3))
    T, D = x.shape[0], x.shape[-1]
    if D < 2 or D > 512 or D & (D - 1):
        raise ValueError(f"x's last dim must be a power of two in [2, 512], got {D}")
    rh = _check_rope_args(x, positions, inv_freq)
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {sorted(_NORMS)}, got {norm!r}")
    if quant not in _QUANTS:
        raise ValueError(f"quant must be one of {sorted(_QUANTS)}, got {quant!r}")
    if norm == "weighted":
        if not isinstance(weight, torch.Tensor) or weight.shape != (D,) or weight.dtype not in _DTYPES:
            raise ValueError(f"weight must be a bfloat16/float32 tensor of shape ({D},) for norm='weighted'")
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    elif weight is not None:
        raise ValueError(f"weight is only used with norm='weighted', got norm={norm!r}")
    # nope_dim matters only for "fp8_nope"; other modes accept and ignore it (as the portable op does,
    # so a caller may pass its layer's nope_dim whatever the quant mode).
    if nope_dim is None:
        nope_dim = D - 2 * rh
    if not isinstance(nope_dim, int) or not 0 <= nope_dim <= D:
        raise ValueError(f"nope_dim must be an int in [0, {D}], got {nope_dim!r}")
    H, stride_t, stride_h = _heads_view(x)
    if block_h is not None and (block_h < 1 or block_h & (block_h - 1)):
        raise ValueError(f"block_h must be a power of two, got {block_h}")
    hb = block_h or min(triton.next_power_of_2(H), max(1, 2048 // D))
    nw = num_warps or max(1, min(8, hb * D // 512))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return y
    w = weight.contiguous() if weight is not None else inv_freq   # dummy pointer when unused
    _norm_rope_quant_kernel[(T, triton.cdiv(H, hb))](
        x, y, positions.contiguous(), inv_freq.contiguous(), w, H, stride_t, stride_h, float(eps), D ** -0.5,
        D=D, LOG_D=D.bit_length() - 1, RH=rh, HB=hb, NORM=_NORMS[norm], INVERSE=bool(inverse),
        QUANT=_QUANTS[quant], NOPE=nope_dim if quant == "fp8_nope" else 0,
        QB8=min(FP8_BLOCK, D), QB4=min(FP4_BLOCK, D), OFFICIAL=bool(official), num_warps=nw,
        enable_fp_fusion=False, **launch_args(x))
    return y


def rope_inplace(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, *,
                 block_h: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """RotaryTable.apply on the last 2*len(inv_freq) channels of x [T, D] / [T, H, D], IN PLACE (only
    those channels are read and written); returns x. Any strides except a unit last-dim stride."""
    _check_x(x, "x", (2, 3))
    rh = _check_rope_args(x, positions, inv_freq)
    T, D = x.shape[0], x.shape[-1]
    H, stride_t, stride_h = _heads_view(x)
    if block_h is not None and (block_h < 1 or block_h & (block_h - 1)):
        raise ValueError(f"block_h must be a power of two, got {block_h}")
    bp = triton.next_power_of_2(rh)
    hb = block_h or min(triton.next_power_of_2(H), max(1, 1024 // (2 * bp)))
    nw = num_warps or max(1, min(4, hb * bp // 256))
    if T and H:
        _rope_inplace_kernel[(T, triton.cdiv(H, hb))](
            x, positions.contiguous(), inv_freq.contiguous(), H, stride_t, stride_h, D - 2 * rh,
            RH=rh, BLOCK_P=bp, HB=hb, INVERSE=bool(inverse), num_warps=nw, enable_fp_fusion=False, **launch_args(x))
    return x
