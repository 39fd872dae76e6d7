"""mHC (A5 only): `npu_mhc_pre`, `npu_mhc_sinkhorn`, `npu_mhc_post`.

Doc pages: `torch_npu-npu_mhc_pre.md`, `torch_npu-npu_mhc_sinkhorn.md`, `torch_npu-npu_mhc_post.md`
(Ascend/op-plugin, read 2026-08-21); A5-only per the spec (§2.7).

* pre: x [T, n, D] or [B, S, n, D] (bf16/fp16), phi fp32 [n^2 + 2n, nD] (W_pre, W_post, W_res) or
  [2n, nD], alpha fp32 [3] / [2], bias fp32 [n^2 + 2n] / [2n], gamma fp32 [n, D] or None.
  x' = RmsNorm over the flattened n*D values (norm_eps, times gamma); mix = x' @ phi^T;
  H_pre = sigmoid(alpha_pre * mix_pre + b_pre) + hc_eps; H_post = 2 sigmoid(alpha_post * mix_post
  + b_post); H_res = alpha_res * mix_res + b_res reshaped row-major to [n, n] (no Sinkhorn);
  h_in = sum_j H_pre[j] x_j (unnormalised x). Returns (h_in, h_post, h_res, inv_rms, h_mix,
  h_pre); h_post is returned as [T, n] ([UNCONFIRMED]: the page says (T, D)); the last three are
  empty unless out_flag = 1, h_res empty for the 2n form [UNCONFIRMED]. n in {4, 6, 8}.
* sinkhorn: x fp32 [T, n, n] / [B, S, n, n]; softmax over the last dim + eps, then column
  normalisation, then (num_iters - 1) x (row, column), each sum + eps; num_iters in [1, 100].
  norm_out / sum_out (out_flag 1) as [2 iters, n, n, *lead] / [2 iters, n, *lead]; sum_out[0]
  has no formula on the page and is zero here [UNCONFIRMED].
* post: y = H_res @ x + h_out (x) H_post, i.e. y[k] = sum_j h_res[k, j] x[j] + h_post[k] h_out
  (the page's literal product; whether the kernel uses H_res or its transpose is [UNCONFIRMED]);
  h_res None -> y = x + h_out (x) h_post.
"""
from __future__ import annotations

import torch

from .schema import check, check_dtype, fail, register

_HALF = (torch.bfloat16, torch.float16)


def _require_a5(op, soc):
    check(soc == 260, op, "soc_version", f"is {soc}", "Ascend 950 (SoC 260) only")


def _check_x(op, x):
    check_dtype(op, "x", x, _HALF, "bfloat16 or float16")
    check(x.dim() in (3, 4), op, "x", f"has {x.dim()} dimensions", "[T, n, D] or [B, S, n, D]")
    n = x.shape[-2]
    check(n in (4, 6, 8), op, "x", f"has n = {n}", "n in {4, 6, 8}")
    return n, x.shape[-1]


def _f32(op, name, t, shape):
    check_dtype(op, name, t, (torch.float32,), "float32")
    check(tuple(t.shape) == tuple(shape), op, name, f"has shape {tuple(t.shape)}",
          f"shape {tuple(shape)}")


def _validate_pre(a, soc):
    op = "npu_mhc_pre"
    _require_a5(op, soc)
    n, d = _check_x(op, a.x)
    check(d <= 16384 and d % 16 == 0, op, "x", f"has D = {d}", "D <= 16384, a multiple of 16")
    rows = a.phi.shape[0] if a.phi.dim() == 2 else -1
    if rows not in (n * n + 2 * n, 2 * n):
        fail(op, "phi", f"has shape {tuple(a.phi.shape)}", f"[n^2 + 2n or 2n, nD] with n = {n}")
    _f32(op, "phi", a.phi, (rows, n * d))
    _f32(op, "alpha", a.alpha, (3 if rows > 2 * n else 2,))
    _f32(op, "bias", a.bias, (rows,))
    if a.gamma is not None:
        _f32(op, "gamma", a.gamma, (n, d))
    check(a.out_flag in (0, 1), op, "out_flag", f"is {a.out_flag}", "0 or 1")
    check(a.inner_precise in (0, 1), op, "inner_precise", f"is {a.inner_precise}", "0 or 1")


def _ref_pre(a):
    """(h_in, h_post, h_res, inv_rms, h_mix, h_pre) per the page's formulas."""
    x = a.x.float()
    n, d = x.shape[-2:]
    flat = x.flatten(-2)
    inv_rms = torch.rsqrt(flat.pow(2).mean(-1) + a.norm_eps)
    xn = flat * inv_rms[..., None]
    if a.gamma is not None:
        xn = xn * a.gamma.flatten()
    mix = xn @ a.phi.t()
    lin = lambda i, lo, hi: a.alpha[i] * mix[..., lo:hi] + a.bias[lo:hi]  # noqa: E731
    h_pre = torch.sigmoid(lin(0, 0, n)) + a.hc_eps
    h_post = 2 * torch.sigmoid(lin(1, n, 2 * n))
    if mix.shape[-1] > 2 * n:
        h_res = lin(2, 2 * n, 2 * n + n * n).unflatten(-1, (n, n))
    else:
        h_res = x.new_empty(0)
    h_in = (h_pre[..., None] * x).sum(-2).to(a.x.dtype)
    if a.out_flag:
        return h_in, h_post, h_res, inv_rms, mix, h_pre
    e = x.new_empty(0)
    return h_in, h_post, h_res, e, e.clone(), e.clone()


def _validate_sinkhorn(a, soc):
    op, x = "npu_mhc_sinkhorn", a.x
    _require_a5(op, soc)
    check_dtype(op, "x", x, (torch.float32,), "float32")
    check(x.dim() in (3, 4) and x.shape[-1] == x.shape[-2] and x.shape[-1] in (4, 6, 8), op,
          "x", f"has shape {tuple(x.shape)}", "[T, n, n] or [B, S, n, n], n in {4, 6, 8}")
    check(1 <= a.num_iters <= 100, op, "num_iters", f"is {a.num_iters}", "in [1, 100]")
    check(a.out_flag in (0, 1), op, "out_flag", f"is {a.out_flag}", "0 or 1")


def _ref_sinkhorn(a):
    """(y, norm_out, sum_out): softmax rows + eps, then alternate column / row normalisation."""
    eps = a.eps
    norms, sums = [torch.softmax(a.x, dim=-1) + eps], [torch.zeros_like(a.x[..., 0, :])]
    for step in range(1, 2 * a.num_iters):
        dim = -2 if step % 2 else -1
        s = norms[-1].sum(dim, keepdim=True) + eps
        sums.append(s.squeeze(dim))
        norms.append(norms[-1] / s)
    y = norms[-1]
    if not a.out_flag:
        return y, y.new_empty(0), y.new_empty(0)
    lead = a.x.dim() - 2
    perm_n = (0, lead + 1, lead + 2, *range(1, lead + 1))
    perm_s = (0, lead + 1, *range(1, lead + 1))
    return y, torch.stack(norms).permute(perm_n), torch.stack(sums).permute(perm_s)


def _validate_post(a, soc):
    op = "npu_mhc_post"
    _require_a5(op, soc)
    n, d = _check_x(op, a.x)
    lead = tuple(a.x.shape[:-2])
    check(a.h_out.dtype == a.x.dtype, op, "h_out", f"has dtype {a.h_out.dtype}",
          "same dtype as x")
    check(tuple(a.h_out.shape) == (*lead, d), op, "h_out", f"has shape {tuple(a.h_out.shape)}",
          f"{(*lead, d)} = x's shape without n")
    _f32(op, "h_post", a.h_post, (*lead, n))
    if a.h_res is not None:
        _f32(op, "h_res", a.h_res, (*lead, n, n))


def _ref_post(a):
    """y = h_res @ x + h_post (x) h_out (h_res None: x + h_post (x) h_out)."""
    x = a.x.float()
    res = x if a.h_res is None else a.h_res @ x
    return (res + a.h_post[..., None] * a.h_out.float()[..., None, :]).to(a.x.dtype)


register("npu_mhc_pre", _validate_pre, _ref_pre)
register("npu_mhc_sinkhorn", _validate_sinkhorn, _ref_sinkhorn)
register("npu_mhc_post", _validate_post, _ref_post)
