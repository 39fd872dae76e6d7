"""Norms and RoPE: `npu_rms_norm`, `npu_add_rms_norm`, `npu_rotary_mul`.

Doc pages (Ascend/op-plugin `docs/zh/custom_APIs/torch_npu/`, also carried as docstrings in the
wheel's `torch_npu/_op_plugin_docs.py`): `(beta)torch_npu-npu_rms_norm.md`,
`torch_npu-npu_add_rms_norm.md` ((y, rstd, x1 + x2); lists 950DT),
`torch_npu-npu_rotary_mul.md`. Output shapes follow the wheel's meta registrations (rstd keeps
the leading dims of x, 1 over gamma's dims).
[UNCONFIRMED] on A5: the rms_norm and rotary_mul pages list no A5 row (vllm-ascend calls
both on A5).
"""
from __future__ import annotations

import torch

from .schema import check, check_dim, check_dtype, register

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _check_norm_args(op, x_name, x, gamma, dims, gamma_dtypes):
    check_dtype(op, x_name, x, _FLOATS, "float16, bfloat16 or float32")
    check(dims[0] <= x.dim() <= dims[1], op, x_name, f"has {x.dim()} dimensions",
          f"{dims[0]}-{dims[1]} dimensions")
    check(gamma.dtype in gamma_dtypes, op, "gamma", f"has dtype {gamma.dtype} for {x_name} "
          f"{x.dtype}", "gamma dtype: " + ", ".join(map(str, gamma_dtypes)))
    check(1 <= gamma.dim() < x.dim() + (dims[0] == 1)
          and tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim():]),
          op, "gamma", f"has shape {tuple(gamma.shape)} for {x_name} {tuple(x.shape)}",
          f"the trailing dimensions of {x_name} (usually its last one)")


def _rms_norm(x, gamma, eps):
    nd = gamma.dim()
    dims = tuple(range(x.dim() - nd, x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def _validate_rms_norm(a, soc):
    # rms_norm page, A2/A3 table: fp16/bf16 x with gamma of the same dtype or float32
    x = a.input
    _check_norm_args("npu_rms_norm", "input", x, a.gamma, (2, 8), (x.dtype, torch.float32))


def _ref_rms_norm(a):
    """y = x / sqrt(mean(x^2 over gamma's dims) + epsilon) * gamma (fp32 math, x's dtype out);
    rstd fp32 with shape x.shape[:-gamma.dim()] + (1,) * gamma.dim()."""
    return _rms_norm(a.input, a.gamma, a.epsilon)


def _validate_add_rms_norm(a, soc):
    op = "npu_add_rms_norm"
    check(a.x2.dtype == a.x1.dtype, op, "x2", f"has dtype {a.x2.dtype}, x1 has {a.x1.dtype}",
          "same dtype as x1")
    check(a.x2.shape == a.x1.shape, op, "x2", f"has shape {tuple(a.x2.shape)}, "
          f"x1 has {tuple(a.x1.shape)}", "same shape as x1")
    _check_norm_args(op, "x1", a.x1, a.gamma, (1, 8), (a.x1.dtype,))


def _ref_add_rms_norm(a):
    """x = x1 + x2 (in x1's dtype); (rms_norm(x) as npu_rms_norm, rstd, x)."""
    x = a.x1 + a.x2
    y, rstd = _rms_norm(x, a.gamma, a.epsilon)
    return y, rstd, x


def _validate_rotary_mul(a, soc):
    op, x = "npu_rotary_mul", a.input
    check(a.rotary_mode in ("half", "interleave"), op, "rotary_mode",
          f"is {a.rotary_mode!r}", "'half' or 'interleave'")
    check_dtype(op, "input", x, _FLOATS, "float16, bfloat16 or float32")
    check_dim(op, "input", x, 4, "4-D (BNSD, BSND or SBND)")
    d = x.shape[-1]
    check(d % 2 == 0 and d < 896, op, "input", f"has D = {d}", "D < 896 and a multiple of 2")
    for name in ("r1", "r2"):
        r = getattr(a, name)
        check_dtype(op, name, r, (x.dtype,), f"same dtype as input ({x.dtype})")
        check_dim(op, name, r, 4, "4-D")
        check(r.shape[-1] == d and all(rs in (1, xs) for rs, xs in zip(r.shape, x.shape)),
              op, name, f"has shape {tuple(r.shape)} for input {tuple(x.shape)}",
              "broadcastable to input with the same D (11SD/B1SD/BNSD, 1S1D/BS1D/BSND, ...)")
        if a.rotary_mode == "interleave" and a.rotate is None:
            check(sum(s > 1 for s in r.shape[:3]) <= 1, op, name,
                  f"has shape {tuple(r.shape)} in interleave mode",
                  "interleave mode: 11SD, 1S1D or S11D (broadcast over B and N)")
    if a.rotate is not None:
        check_dtype(op, "rotate", a.rotate, _FLOATS)
        check(tuple(a.rotate.shape) == (d, d), op, "rotate",
              f"has shape {tuple(a.rotate.shape)}", f"2-D [D, D] = [{d}, {d}]")


def _ref_rotary_mul(a):
    """output = r1 * x + r2 * x_new; x_new = x @ rotate if rotate is given, else
    'half': cat(-x2, x1) of the two halves; 'interleave': (-x[1::2], x[::2]) interleaved."""
    x = a.input.float()
    if a.rotate is not None:
        x_new = x @ a.rotate.float()
    elif a.rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        x_new = torch.cat((-x2, x1), dim=-1)
    else:
        x_new = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (a.r1.float() * x + a.r2.float() * x_new).to(a.input.dtype)


register("npu_rms_norm", _validate_rms_norm, _ref_rms_norm)
register("npu_add_rms_norm", _validate_add_rms_norm, _ref_add_rms_norm)
register("npu_rotary_mul", _validate_rotary_mul, _ref_rotary_mul)
