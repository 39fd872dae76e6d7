"""Grouped matmul `npu_grouped_matmul`: the single-tensor m-grouped forms the backend needs.

Sources: the wheel's docstring (`torch_npu/_op_plugin_docs.py`, A2/A3 + 310P tables), its meta
registration and torchair converter (MX forms), spec sec. 2.3 / 3.1. Registered by ops_moe.py.

Common to every form the fake models: x = [x0] 2-D [M, K]; weight = [w] 3-D [E, K, N] (the doc's
C[m, n] = A[m, k] x B[k, n]; a [E, N, K] weight is passed as its .transpose(1, 2) view);
group_type 0 (m-grouped) with split_item 2 or 3 (one output tensor [M, N]); group_list an int64
1-D tensor of length E (<= 1024): group_list_type 0 = cumulative row ends (non-negative,
non-decreasing, last == M), 1 = per-group row counts (non-negative, sum == M). Rows of group e
are multiplied by weight[e]; fp32 accumulation. act_type 0 only; offset, antiquant_offset and
the activation_* lists must be None (documented: only None); bias, group_type -1 / 2,
group_list_type 2, split_item 0 / 1 lists, int8 / int4 / hifloat8 / FP4-activation forms raise
NotImplementedError. Value checks of group_list are skipped while an NPUGraph is capturing.

(a) plain: x and weight fp16 / bf16 / fp32 (same dtype), no scales, output_dtype None or x's.
(b) A5 (SoC 260) MX forms, x fp8 with per_token_scale = [ps], ps E8M0 [M, ceil(K/64), 2] and
    per_token_scale_dtype = 293 (torch_npu.float8_e8m0fnu); weight scales E8M0
    [E, ceil(K/64), N, 2]. The scale layouts follow the fake `npu_quant_matmul` MX convention
    (pertoken [M, ceil(K/64), 2], scale [ceil(K/64), N, 2], here with a leading E); the grouped
    op has no MX doc page: [UNCONFIRMED] (the torchair converter's 4-D antiquant_scale and its
    [0, 2, 1, 3] transpose are consistent with it). Scale of K-group g at [..., g // 2, .., g % 2].
    * W8A8 MXFP8: x fp8, weight fp8 [E, K, N], scale = [s], scale_dtype = 293, output_dtype
      bfloat16 (15) or float16 (5). out = sum_k x*2^ps * w*2^s.
    * W4A8 MXFP (spec sec. 2.3): x float8_e4m3fn, weight uint8 / int8 (or float4_e2m1fn_x2)
      [E, K/2, N] holding two FP4 E2M1 codes per byte along K (weight_dtype = 296), antiquant
      scale = [s] E8M0, scale / scale_dtype None, output_dtype bfloat16 (15).
      out = sum_k x*2^ps * fp4(w)*2^s. [UNCONFIRMED]: packing along K (from the converter's
      "k=64 -> weight.size(1) = 32" note), the low nibble holding the even k.
"""
from __future__ import annotations

import math

import torch

from . import schema as S
from .ops_quant import _expand_k
from .schema import active, check, check_dim, check_dtype, fail, register

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_E8M0 = (torch.uint8, torch.float8_e8m0fnu)
_FP4_CARRIERS = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_OP = "npu_grouped_matmul"


def _one(a, name):
    """The single tensor of the list argument `name` (None when the list is None)."""
    v = getattr(a, name)
    if v is None:
        return None
    check(len(v) == 1, _OP, name, f"has {len(v)} tensors", "one tensor in the single-tensor form")
    return v[0]


def _check_group_list(a, e, m):
    gl = a.group_list
    check(gl is not None, _OP, "group_list", "is None", "required with group_type 0")
    check_dtype(_OP, "group_list", gl, (torch.int64,), "int64")
    check(gl.dim() == 1 and gl.shape[0] == e, _OP, "group_list", f"has shape {tuple(gl.shape)}",
          f"1-D of length E = {e} (weight.size(0))")
    check(e <= 1024, _OP, "weight", f"has {e} groups", "at most 1024 groups")
    check(a.group_list_type in (0, 1, 2), _OP, "group_list_type", f"is {a.group_list_type}",
          "0 (cumsum), 1 (counts) or 2 (pairs)")
    if a.group_list_type == 2:
        raise NotImplementedError("fake npu_grouped_matmul: group_list_type 2 not modelled")
    if active().state.capturing:
        return
    check(bool((gl >= 0).all()), _OP, "group_list", "has a negative value", "non-negative")
    if a.group_list_type == 0:
        check(bool((gl[1:] >= gl[:-1]).all()), _OP, "group_list", "is not non-decreasing",
              "group_list_type 0: a non-decreasing cumulative sequence")
        check(int(gl[-1]) == m, _OP, "group_list", f"ends at {int(gl[-1])}",
              f"group_list_type 0: last value == x.size(0) = {m}")
    else:
        check(int(gl.sum()) == m, _OP, "group_list", f"sums to {int(gl.sum())}",
              f"group_list_type 1: sum == x.size(0) = {m}")


def _check_mx_scale(name, t, shape, dtype_arg=None, dtype_val=None):
    check(t is not None, _OP, name, "is None", "required in this MX form")
    check_dtype(_OP, name, t, _E8M0, "1-byte E8M0 (uint8 or float8_e8m0fnu)")
    check(tuple(t.shape) == shape, _OP, name, f"has shape {tuple(t.shape)}", f"{shape}")
    if dtype_arg is not None:
        check(dtype_val == S.FLOAT8_E8M0FNU, _OP, dtype_arg, f"is {dtype_val}",
              "torch_npu.float8_e8m0fnu (293) in the MX forms")


def _validate(a, soc):
    check(a.group_type in (-1, 0, 2), _OP, "group_type", f"is {a.group_type}",
          "-1, 0 or 2 with a tensor group_list")
    if a.group_type != 0 or len(a.x) != 1 or len(a.weight) != 1:
        raise NotImplementedError("fake npu_grouped_matmul: only group_type 0 with one x and one "
                                  "3-D weight tensor")
    check(a.split_item in (0, 1, 2, 3), _OP, "split_item", f"is {a.split_item}", "0, 1, 2 or 3")
    check(a.split_item in (2, 3), _OP, "split_item", f"is {a.split_item} with group_type 0",
          "group_type 0 supports only split_item 2 or 3")
    check(a.act_type in range(6), _OP, "act_type", f"is {a.act_type}", "0-5")
    for name in ("offset", "antiquant_offset", "activation_input", "activation_quant_scale",
                 "activation_quant_offset"):
        if getattr(a, name) is not None:
            fail(_OP, name, "is set", "only None is supported")
    if a.act_type != 0 or a.bias is not None:
        raise NotImplementedError("fake npu_grouped_matmul: act_type 0 without bias only")
    x, w = a.x[0], a.weight[0]
    check_dim(_OP, "x", x, 2, "2-D [M, K] with group_type 0")
    check_dim(_OP, "weight", w, 3, "3-D [E, K, N] with group_type 0")
    m, k = x.shape
    if a.x_dtype is not None:
        check(a.x_dtype in (S.HIFLOAT8, S.FLOAT4_E2M1FN_X2, S.FLOAT4_E1M2FN_X2), _OP, "x_dtype",
              f"is {a.x_dtype}", "None, hifloat8 (290) or fp4 (296, 297)")
        raise NotImplementedError("fake npu_grouped_matmul: x_dtype (hifloat8 / FP4 x) forms")
    _check_group_list(a, w.shape[0], m)
    scale, pts, aq = _one(a, "scale"), _one(a, "per_token_scale"), _one(a, "antiquant_scale")
    if x.dtype in _FLOATS:
        check_dtype(_OP, "weight", w, (x.dtype,), f"same dtype as x ({x.dtype}) without scales")
        check(w.shape[1] == k, _OP, "weight", f"has shape {tuple(w.shape)}",
              f"[E, K, N] with K = x.size(1) = {k}")
        for name, v in (("scale", scale), ("per_token_scale", pts), ("antiquant_scale", aq),
                        ("weight_dtype", a.weight_dtype), ("scale_dtype", a.scale_dtype),
                        ("per_token_scale_dtype", a.per_token_scale_dtype)):
            check(v is None, _OP, name, "is set", "None in the non-quantized form")
        code = S.SCALAR_TYPE_CODE[x.dtype]
        check(a.output_dtype in (None, code), _OP, "output_dtype", f"is {a.output_dtype}",
              f"None or x's dtype ({code}) in the non-quantized form")
        return
    if x.dtype == torch.int8:
        raise NotImplementedError("fake npu_grouped_matmul: int8 (per-channel / per-token) forms")
    check_dtype(_OP, "x", x, _FLOATS + _FP8, "float16, bfloat16, float32 or fp8 (MX forms)")
    check(soc == 260, _OP, "soc_version", f"is {soc}", "MX forms: Ascend 950 (SoC 260) only")
    e, kg = w.shape[0], math.ceil(k / 64)
    _check_mx_scale("per_token_scale", pts, (m, kg, 2), "per_token_scale_dtype",
                    a.per_token_scale_dtype)
    if w.dtype in _FP8:
        n = w.shape[2]
        check(w.shape[1] == k, _OP, "weight", f"has shape {tuple(w.shape)}",
              f"[E, K, N] with K = x.size(1) = {k}")
        check(a.weight_dtype is None and aq is None, _OP, "antiquant_scale",
              "or weight_dtype is set", "None in the W8A8 MXFP8 form")
        _check_mx_scale("scale", scale, (e, kg, n, 2), "scale_dtype", a.scale_dtype)
        check(a.output_dtype in (15, 5), _OP, "output_dtype", f"is {a.output_dtype}",
              "bfloat16 (15) or float16 (5) in the W8A8 MXFP8 form")
        return
    check_dtype(_OP, "weight", w, _FP4_CARRIERS + _FP8, "fp8 (W8A8 MXFP8) or FP4 packed in "
                "uint8 / int8 / float4_e2m1fn_x2 (W4A8 MXFP)")
    check_dtype(_OP, "x", x, (torch.float8_e4m3fn,), "float8_e4m3fn in the W4A8 MXFP form")
    if a.weight_dtype == S.FLOAT4_E1M2FN_X2:
        raise NotImplementedError("fake npu_grouped_matmul: float4_e1m2fn_x2 weights")
    check(a.weight_dtype == S.FLOAT4_E2M1FN_X2, _OP, "weight_dtype", f"is {a.weight_dtype}",
          "torch_npu.float4_e2m1fn_x2 (296) in the W4A8 MXFP form")
    check(k % 2 == 0 and w.shape[1] * 2 == k, _OP, "weight", f"has shape {tuple(w.shape)}",
          f"[E, K/2, N] (two FP4 per byte along K) with K = x.size(1) = {k} even")
    _check_mx_scale("antiquant_scale", aq, (e, kg, w.shape[2], 2))
    check(scale is None and a.scale_dtype is None, _OP, "scale", "or scale_dtype is set",
          "None in the W4A8 MXFP form (weight scales go in antiquant_scale)")
    check(a.output_dtype == 15, _OP, "output_dtype", f"is {a.output_dtype}",
          "bfloat16 (15) in the W4A8 MXFP form")


def _fp4_to_float(w: torch.Tensor) -> torch.Tensor:
    """[E, K/2, N] bytes (low nibble = even k) -> fp32 [E, K, N] E2M1 values."""
    b = w.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=2)                       # [E, K/2, 2, N]
    vals = _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return vals.flatten(1, 2)


def _reference(a):
    """[out [M, N]]: rows of group e times weight[e], per the group_list (fp32 sums)."""
    x, w, m = a.x[0], a.weight[0], a.x[0].shape[0]
    k = x.shape[1]
    if x.dtype in _FLOATS:
        lhs, rhs, out_dtype = x.float(), w.float(), x.dtype
    else:
        lhs = x.float() * _expand_k(a.per_token_scale[0], k, 1)
        if w.dtype in _FP8:
            rhs, ws = w.float(), a.scale[0]
        else:
            rhs, ws = _fp4_to_float(w), a.antiquant_scale[0]
        rhs = rhs * _expand_k(ws, k, 1).transpose(1, 2)                   # [E, K, N]
        out_dtype = S.CODE_TO_DTYPE[a.output_dtype]
    gl = a.group_list
    ends = gl if a.group_list_type == 0 else gl.cumsum(0)
    group = torch.searchsorted(ends, torch.arange(m, dtype=ends.dtype), right=True)
    out = torch.zeros(m, rhs.shape[2])
    for e in range(rhs.shape[0]):
        out = torch.where((group == e)[:, None], lhs @ rhs[e], out)
    return [out.to(out_dtype)]


register(_OP, _validate, _reference)
