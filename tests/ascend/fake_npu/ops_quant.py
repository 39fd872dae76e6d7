"""MX quantization and the MXFP8 quantized matmul: `npu_dynamic_mx_quant`, `npu_quant_matmul`.

`npu_dynamic_mx_quant` follows `torch_npu-npu_dynamic_mx_quant.md` (the docstring carried in the
2.13.0 wheel; Ascend 950PR/950DT only): per `block_size` elements along `axis`, an E8M0 scale
(OCP MX, scale_alg 0: 2^(floor(log2(amax)) - emax of the target type)), y = x / scale cast with
round_mode "rint" (FP8 allows only "rint"). mxscale: uint8 E8M0 codes, rank(input) + 1, last dim
2, the axis dim = ceil(ceil(n / block_size) / 2) (scale of group g at [..., g // 2, g % 2]).
dst_type codes documented: 291 e5m2, 292 e4m3fn, 296 fp4 e2m1, 297 fp4 e1m2; the native torch
codes 23 / 24 (what `dst_type=torch.float8_e4m3fn` becomes) are accepted as the same types, as
the wheel's meta registration maps both. [UNCONFIRMED] the fill of a padded odd group (here
code 0), the pair order for a non-tail axis, an all-zero group's scale (here code 0). The fake
implements FP8 targets and scale_alg 0 only (FP4 targets raise NotImplementedError).

`npu_quant_matmul`: the doc page (`torch_npu-npu_quant_matmul.md`) lists only A2/A3 int8/int4
forms; the fake implements only the A5 **MXFP8** form used by vllm-ascend (spec §2.4), with the
layout rules of the wheel's meta registration: x1 fp8 [M, K]; x2 fp8 [K, N] (typically the
transposed view of a contiguous [N, K] weight); scale_dtype = pertoken_scale_dtype = 293
(torch_npu.float8_e8m0fnu); pertoken_scale [M, ceil(K/64), 2] and scale [ceil(K/64), N, 2] as
1-byte E8M0 tensors (uint8 or torch.float8_e8m0fnu); group_sizes = [1, 1, 32]; output_dtype
bfloat16 (or float16). out[m, n] = sum_k x1[m,k] * 2^(ps[m,k/32]-127) * x2[k,n] * 2^(s[k/32,n]-127)
(+ bias), fp32 accumulation. [UNCONFIRMED] on hardware: the whole MX form (no doc page).
"""
from __future__ import annotations

import math

import torch

from . import schema as S
from .schema import check, check_dim, check_dtype, fail, register

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = {S.FLOAT8_E4M3FN: torch.float8_e4m3fn, 24: torch.float8_e4m3fn,
        S.FLOAT8_E5M2: torch.float8_e5m2, 23: torch.float8_e5m2}
_FP4 = (S.FLOAT4_E2M1FN_X2, S.FLOAT4_E1M2FN_X2, 45)
_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
_E8M0 = (torch.uint8, torch.float8_e8m0fnu)


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8 or float8_e8m0fnu tensor) -> fp32 powers of two (255 -> NaN)."""
    codes = (t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t).float()
    return torch.where(codes == 255, torch.nan, torch.exp2(codes - 127))


def _require_a5(op, soc):
    check(soc == 260, op, "soc_version", f"is {soc}", "Ascend 950PR/950DT (SoC 260) only")


def _validate_dynamic_mx_quant(a, soc):
    op, x = "npu_dynamic_mx_quant", a.input
    _require_a5(op, soc)
    check_dtype(op, "input", x, _FLOATS, "float16, bfloat16 or float32")
    check(1 <= x.dim() <= 7, op, "input", f"has {x.dim()} dimensions", "1-7 dimensions")
    check(-x.dim() <= a.axis < x.dim(), op, "axis", f"is {a.axis}",
          f"in [-D, D-1] = [{-x.dim()}, {x.dim() - 1}]")
    check(a.dst_type in _FP8 or a.dst_type in _FP4, op, "dst_type", f"is {a.dst_type}",
          "291 (float8_e5m2), 292 (float8_e4m3fn), 296 (float4_e2m1fn_x2), 297 (float4_e1m2fn_x2)")
    check(a.block_size % 32 == 0 and 0 < a.block_size <= 1024, op, "block_size",
          f"is {a.block_size}", "a positive multiple of 32, at most 1024")
    check(a.scale_alg in (0, 1, 2), op, "scale_alg", f"is {a.scale_alg}", "0, 1 or 2")
    if a.dst_type in _FP8:
        check(a.round_mode == "rint", op, "round_mode", f"is {a.round_mode!r}",
              'FP8 targets support only "rint"')
        check(a.scale_alg in (0, 1), op, "scale_alg", f"is {a.scale_alg} for an FP8 target",
              "FP8 targets: 0 or 1")
        check(a.dst_type_max == 0.0, op, "dst_type_max", f"is {a.dst_type_max}",
              "only with dst_type float4_e2m1fn_x2 and block_size 32 (else 0.0)")
    else:
        check(a.round_mode in ("rint", "floor", "round"), op, "round_mode",
              f"is {a.round_mode!r}", 'FP4 targets: "rint", "floor" or "round"')
        check(x.shape[-1] % 2 == 0, op, "input", f"has an odd last dim {x.shape[-1]}",
              "FP4 targets need an even last dimension")
    if x.dtype == torch.float32:
        check(a.block_size == 32, op, "block_size", f"is {a.block_size} for float32 input",
              "float32 input needs block_size 32")
        check(x.shape[a.axis] >= 32, op, "input", f"has {x.shape[a.axis]} elements on axis",
              "float32 input: at least 32 on the quantized axis")
    if a.scale_alg != 1:
        check(a.max_low_bound == 0.0, op, "max_low_bound", f"is {a.max_low_bound}",
              "must be 0.0 unless scale_alg is 1")
    check(a.max_low_bound >= 0.0, op, "max_low_bound", "is negative", "non-negative")


def mx_quantize(x: torch.Tensor, axis: int, block: int, dst: torch.dtype):
    """(q in dst, uint8 E8M0 codes shaped as documented) per OCP MX (scale_alg 0)."""
    xt = x.float().movedim(axis, -1)
    n = xt.shape[-1]
    groups = math.ceil(n / block)
    padded = torch.nn.functional.pad(xt, (0, groups * block - n)).unflatten(-1, (groups, block))
    amax = padded.abs().amax(dim=-1)
    exp = torch.floor(torch.log2(amax)) - _EMAX[dst]
    codes = torch.where(amax > 0, (exp + 127).clamp(0, 254), torch.zeros_like(amax))
    scale = torch.exp2(codes - 127).unsqueeze(-1)
    fmax = torch.finfo(dst).max
    q = (padded / scale).clamp(-fmax, fmax).flatten(-2)[..., :n].to(dst).movedim(-1, axis)
    codes = torch.nn.functional.pad(codes, (0, groups % 2)).to(torch.uint8)
    codes = codes.unflatten(-1, (-1, 2)).movedim(-2, axis % x.dim())
    return q, codes


def _ref_dynamic_mx_quant(a):
    """(y, mxscale): y = x / 2^(E8M0 scale) per block of `block_size` along `axis`."""
    if a.dst_type not in _FP8 or a.scale_alg != 0:
        raise NotImplementedError("fake npu_dynamic_mx_quant: FP8 targets with scale_alg 0 only")
    return mx_quantize(a.input, a.axis, a.block_size, _FP8[a.dst_type])


def _validate_quant_matmul(a, soc):
    op, x1, x2 = "npu_quant_matmul", a.x1, a.x2
    if a.scale_dtype is None and a.pertoken_scale_dtype is None:
        raise NotImplementedError("fake npu_quant_matmul implements only the MXFP8 form "
                                  "(scale_dtype = pertoken_scale_dtype = 293)")
    _require_a5(op, soc)
    for name in ("scale_dtype", "pertoken_scale_dtype"):
        v = getattr(a, name)
        check(v == S.FLOAT8_E8M0FNU, op, name, f"is {v}",
              "torch_npu.float8_e8m0fnu (293) in the MX form")
    check_dtype(op, "x1", x1, (torch.float8_e4m3fn, torch.float8_e5m2), "MX form: fp8 x1")
    check_dtype(op, "x2", x2, (torch.float8_e4m3fn, torch.float8_e5m2), "MX form: fp8 x2")
    check_dim(op, "x1", x1, 2, "2-D [M, K] (the fake's MX form)")
    check_dim(op, "x2", x2, 2, "2-D [K, N] (the fake's MX form)")
    m, k = x1.shape
    check(x2.shape[0] == k, op, "x2", f"has shape {tuple(x2.shape)} for x1 {tuple(x1.shape)}",
          "[K, N] with K = x1.size(-1) (pass a [N, K] weight as its .t() view)")
    check(x1.shape[-1] <= 65535 and x2.shape[-1] <= 65535, op, "x1", "has a last dim > 65535",
          "last dims of x1 and x2 at most 65535")
    n, kg = x2.shape[1], math.ceil(k / 64)
    check(a.group_sizes == [1, 1, 32], op, "group_sizes", f"is {a.group_sizes}",
          "[1, 1, 32] in the MX form")
    check(a.pertoken_scale is not None, op, "pertoken_scale", "is None", "required in MX form")
    for name, t, shape in (("scale", a.scale, (kg, n, 2)),
                           ("pertoken_scale", a.pertoken_scale, (m, kg, 2))):
        check_dtype(op, name, t, _E8M0, "1-byte E8M0 (uint8 or float8_e8m0fnu)")
        check(tuple(t.shape) == shape, op, name, f"has shape {tuple(t.shape)}",
              f"{shape} = ({'ceil(K/64), N' if name == 'scale' else 'M, ceil(K/64)'}, 2)")
    check(a.output_dtype in (15, 5), op, "output_dtype", f"is {a.output_dtype}",
          "bfloat16 (15) or float16 (5) in the MX form")
    for name in ("offset", "y_scale", "x1_dtype", "x2_dtype"):
        if getattr(a, name) is not None:
            fail(op, name, "is set", "None in the MXFP8 form")
    if a.bias is not None:
        check_dtype(op, "bias", a.bias, (torch.float32, torch.bfloat16))
        check(tuple(a.bias.shape) in ((n,), (1, n)), op, "bias",
              f"has shape {tuple(a.bias.shape)}", f"(n,) or (1, n) with n = {n}")


def _expand_k(scales_kpairs: torch.Tensor, k: int, k_axis: int) -> torch.Tensor:
    """[.., ceil(K/64), .., 2] E8M0 codes -> fp32 factors repeated to K along `k_axis`."""
    f = e8m0_to_float(scales_kpairs).movedim(k_axis, -2).flatten(-2)   # [.., 2*ceil(K/64)]
    return f.repeat_interleave(32, dim=-1)[..., :k]


def _ref_quant_matmul(a):
    """MXFP8: (x1 * pertoken scale per 32 along K) @ (x2 * scale per 32 along K), fp32 sums."""
    k = a.x1.shape[1]
    lhs = a.x1.float() * _expand_k(a.pertoken_scale, k, 1)                # [M, K]
    rhs = a.x2.float() * _expand_k(a.scale, k, 0).transpose(0, 1)         # [K, N]
    out = lhs @ rhs
    if a.bias is not None:
        out = out + a.bias.float()
    return out.to(S.CODE_TO_DTYPE[a.output_dtype])


register("npu_dynamic_mx_quant", _validate_dynamic_mx_quant, _ref_dynamic_mx_quant)
register("npu_quant_matmul", _validate_quant_matmul, _ref_quant_matmul)
