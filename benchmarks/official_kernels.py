"""CPU stand-ins for the kernels DeepSeek's official V4 `inference/model.py` imports from its
`kernel.py` (TileLang, CUDA only), and for `fast_hadamard_transform.hadamard_transform`, so that
model.py runs on the CPU (benchmarks/official_agreement.py).

Written from the arithmetic the kernels describe, in plain PyTorch, independent of deepinfer_core:
the tests (tests/benchmarks/test_official_kernels.py) hold them against the engine's ops and against
direct formulations. Each follows its kernel's rounding points:

- act_quant: fp32 amax per block of `block_size`, floored at 1e-4; scale = amax * fp32(1/448),
  rounded up to a power of two (bit arithmetic on the fp32 pattern) when `scale_fmt` is set;
  e4m3(clamp(x / s, +-448)); in place: fp32(e4m3) * s cast back to x's dtype.
- fp4_act_quant: blocks of 32, amax floored at 6 * 2^-126, power-of-two scale of amax * fp32(1/6),
  e2m1 round-to-nearest-even of clamp(x / s, +-6); in place: the dequantised values.
- fp8_gemm / fp4_gemm: exact products (the operands are decoded exactly to fp32), an fp32 sum per
  K block of the activation's (128) or weight's (32) scale group, scaled by both block scales and
  added to an fp32 accumulator block by block, as the kernels do; output in torch's default dtype.
  Inside a block the sum is torch's fp32 matmul (the GPU's tensor-core accumulation order differs).
- sparse_attn: gathered keys, fp32 scores times the scale, online softmax over blocks of 64 keys:
  running max over real keys, p = exp(s - max), the fp32 sum of p unrounded, bf16(p) @ V accumulated
  in fp32, both rescaled by exp(old max - new max); at the end sum += exp(sink - max), out = acc / sum
  cast to bf16.
- hc_split_sinkhorn: the kernel's fp32 sigmoids, exp/row-sum softmax + eps, then column, row,
  column ... normalisations with + eps.
- hadamard_transform: the Sylvester (natural-order) Walsh-Hadamard transform of the last dim in
  fp32 (butterflies at strides 1, 2, 4, ..., as the CUDA kernel's in-thread, in-warp, cross-warp
  stages), times `scale` in fp32, cast back to x's dtype.
"""
from __future__ import annotations

import types

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)     # code 0..7; bit 3 is the sign
KERNEL_NAMES = ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn", "hc_split_sinkhorn")


# ---- scales --------------------------------------------------------------------------------------
def _ceil_pow2(v: torch.Tensor) -> torch.Tensor:
    """2^(exponent field - 127 + [mantissa != 0]) of positive normal fp32 values, from the bits."""
    bits = v.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def _block_scale(x: torch.Tensor, block: int, floor: float, qmax: float, pow2: bool):
    """(fp32 blocks [..., nb, block], fp32 scale [..., nb, 1])."""
    if x.size(-1) % block:
        raise ValueError(f"last dim {x.size(-1)} is not a multiple of block_size {block}")
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(floor)
    s = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)          # the kernel's fp32 inverse
    return xb, (_ceil_pow2(s) if pow2 else s)


def _as_float(s: torch.Tensor) -> torch.Tensor:
    """fp32 values of float32 or float8_e8m0fnu scales (2^(byte - 127), exact)."""
    if s.dtype == torch.float8_e8m0fnu:
        return (s.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return s.float()


def _to_scale_dtype(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float8_e8m0fnu:           # s is a power of two: its exponent byte
        return ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)
    return s.to(dtype)


# ---- FP8 / FP4 activation quantisation -----------------------------------------------------------
def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None,
              scale_dtype: torch.dtype = torch.float32, inplace: bool = False):
    """In place: x holds fp32(e4m3(x/s)) * s in its dtype and is returned. Otherwise
    (e4m3 tensor shaped like x, scales [..., N/block_size] in scale_dtype)."""
    xb, s = _block_scale(x, block_size, 1e-4, FP8_MAX, scale_fmt is not None)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((q.float() * s).flatten(-2).to(x.dtype))
        return x
    return q.flatten(-2), _to_scale_dtype(s.squeeze(-1), scale_dtype)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] to the nearest e2m1 value, ties to the even code. The grid's spacing
    is 0.5 below 2, 1 below 4, 2 up to 6; on each of those the code's parity is the parity of
    value / spacing, so rounding value / spacing half-to-even is the even-code tie rule."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False):
    """In place: x holds e2m1(x/s) * s in its dtype. Otherwise (float4_e2m1fn_x2 [..., N/2], even
    element in the low nibble, scales float8_e8m0fnu [..., N/block_size])."""
    xb, s = _block_scale(x, block_size, FP4_MAX * 2.0 ** -126, FP4_MAX, True)
    q = round_e2m1((xb / s).clamp(-FP4_MAX, FP4_MAX))
    if inplace:
        x.copy_((q * s).flatten(-2).to(x.dtype))
        return x
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    code = (q.abs().unsqueeze(-1) == grid).int().argmax(-1) | (torch.signbit(q).int() << 3)
    code = code.flatten(-2).unflatten(-1, (-1, 2))
    packed = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), _to_scale_dtype(s.squeeze(-1), torch.float8_e8m0fnu)


def decode_fp4(w: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 (or int8/uint8 bytes) [..., K/2] -> fp32 [..., K], low nibble first."""
    b = w.view(torch.uint8).to(torch.int64)
    code = torch.stack((b & 0xF, b >> 4), -1).flatten(-2)
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)[code & 7]
    return torch.where(code >= 8, -mag, mag)


# ---- GEMMs ---------------------------------------------------------------------------------------
_DECODED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}     # id(weight) -> (weight, fp32 values)


def _weight_values(w: torch.Tensor, decode) -> torch.Tensor:
    """decode(w), computed once per weight tensor (the entry keeps w alive, so its id stays its own)."""
    hit = _DECODED.get(id(w))
    if hit is None or hit[0] is not w:
        hit = _DECODED[id(w)] = (w, decode(w))
    return hit[1]


def _block_gemm(a: torch.Tensor, a_s: torch.Tensor, a_block: int, b: torch.Tensor, b_s: torch.Tensor,
                b_block: int, k_block: int) -> torch.Tensor:
    """sum over K blocks of (a_blk @ b_blk^T) * sa * sb in fp32; a [M,K], b [N,K] fp32 exact."""
    M, K = a.shape
    acc = torch.zeros(M, b.size(0), dtype=torch.float32, device=a.device)
    for k0 in range(0, K, k_block):
        part = a[:, k0:k0 + k_block] @ b[:, k0:k0 + k_block].T
        sa = a_s[:, k0 // a_block].unsqueeze(1)
        sb = b_s[:, k0 // b_block].unsqueeze(0)
        acc += part * sa * sb
    return acc


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C = A @ B^T; A e4m3 [..., K] with one scale per 128 of K, B e4m3 [N, K] with one scale per
    128 x 128 block; output in torch.get_default_dtype()."""
    K, N = a.size(-1), b.size(0)
    sb = _as_float(b_s).repeat_interleave(128, 0)[:N]                 # [N, K/128]
    c = _block_gemm(a.reshape(-1, K).float(), _as_float(a_s).reshape(-1, a_s.size(-1)), 128,
                    _weight_values(b, torch.Tensor.float), sb, 128, 128)
    return c.to(torch.get_default_dtype()).reshape(*a.shape[:-1], N)


def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C = A @ B^T; A e4m3 [..., K] with one scale per 128 of K, B e2m1 packed [N, K/2] with one
    UE8M0 scale per 32 of K; output in torch.get_default_dtype()."""
    K, N = a.size(-1), b.size(0)
    c = _block_gemm(a.reshape(-1, K).float(), _as_float(a_s).reshape(-1, a_s.size(-1)), 128,
                    _weight_values(b, decode_fp4), _as_float(b_s), 32, 32)
    return c.to(torch.get_default_dtype()).reshape(*a.shape[:-1], N)


# ---- attention -----------------------------------------------------------------------------------
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """q [b, m, h, d] bf16, kv [b, n, d] bf16, attn_sink [h] fp32, topk_idxs [b, m, k] (-1: none)
    -> [b, m, h, d] bf16: each query attends to its k gathered rows (keys = values) and the sink."""
    b, m, h, d = q.shape
    idx = topk_idxs.long()
    real = idx >= 0                                                         # [b, m, k]
    rows = torch.gather(kv.unsqueeze(1).expand(b, m, -1, d), 2,
                        idx.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, d))
    rows = torch.where(real.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype))   # [b, m, k, d]
    qf, scale = q.float(), torch.tensor(softmax_scale, dtype=torch.float32)
    f32 = {"dtype": torch.float32, "device": q.device}   # model.py's default dtype is bf16
    run_max = torch.full((b, m, h, 1), float("-inf"), **f32)
    run_sum = torch.zeros(b, m, h, 1, **f32)
    acc = torch.zeros(b, m, h, d, **f32)
    for t in range(0, idx.size(-1), 64):
        vals = rows[:, :, t:t + 64].float()
        s = (qf @ vals.transpose(-1, -2)) * scale                              # [b, m, h, keys]
        s = s.masked_fill(~real[:, :, None, t:t + 64], float("-inf"))
        new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
        alpha = torch.exp(run_max - new_max)
        p = torch.exp(s - new_max)
        run_sum = run_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p.to(torch.bfloat16).float() @ vals
        run_max = new_max
    run_sum = run_sum + torch.exp(attn_sink.float()[:, None] - run_max)
    return (acc / run_sum).to(torch.bfloat16)


# ---- mHC -----------------------------------------------------------------------------------------
def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      hc_mult: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6):
    """mixes [b, s, (2 + hc) * hc] fp32 -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc]."""
    hc = hc_mult
    z = mixes.float()
    pre = torch.sigmoid(z[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(z[..., hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    c = (z[..., 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


# ---- Hadamard ------------------------------------------------------------------------------------
def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Natural-order Walsh-Hadamard transform of the last dim (a power of two) in fp32, times scale."""
    n = x.size(-1)
    if n & (n - 1):
        raise ValueError(f"hadamard_transform: last dim {n} is not a power of two")
    y = x.float().reshape(-1, n)
    stride = 1
    while stride < n:
        pairs = y.unflatten(-1, (n // (2 * stride), 2, stride))
        lo, hi = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((lo + hi, lo - hi), 2).flatten(1)
        stride *= 2
    return (y * torch.tensor(scale, dtype=torch.float32)).reshape(x.shape).to(x.dtype)


def fake_modules() -> dict[str, types.ModuleType]:
    """The modules model.py imports, as sys.modules entries: `kernel` and `fast_hadamard_transform`."""
    kernel = types.ModuleType("kernel", "CPU stand-ins for DeepSeek's inference/kernel.py")
    for name in KERNEL_NAMES:
        setattr(kernel, name, globals()[name])
    fht = types.ModuleType("fast_hadamard_transform", "CPU stand-in for fast_hadamard_transform")
    fht.hadamard_transform = hadamard_transform
    return {"kernel": kernel, "fast_hadamard_transform": fht}


class CudaBf16Rsqrt(torch.overrides.TorchFunctionMode):
    """torch.rsqrt of a bf16 tensor as CUDA computes it: in fp32, rounded once to bf16. model.py's
    per-head query norm takes a bf16 rsqrt; torch's CPU kernel rounds in bf16 arithmetic on the
    elements its vector loop leaves over, so short tensors get values a GPU never gives."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.rsqrt, torch.Tensor.rsqrt) and args[0].dtype == torch.bfloat16:
            return torch.rsqrt(args[0].float()).to(torch.bfloat16)
        return func(*args, **(kwargs or {}))
