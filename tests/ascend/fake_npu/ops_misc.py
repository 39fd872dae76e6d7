"""Sampling filter and cache write: `npu_top_k_top_p`, `npu_scatter_nd_update_`.

Doc pages: `torch_npu-npu_top_k_top_p.md` (950DT, A2, A3), `torch_npu-npu_scatter_nd_update_.md`
(A2/A3 and older; no A5 row: [UNCONFIRMED] on A5).

* top_k_top_p: logits [B, V] fp32/fp16/bf16; k int32 [B] in [1, 1024]; p [B] of logits' dtype.
  Stable ascending sort; top-k keeps values >= the k-th largest; softmax of what remains; cumsum
  from the smallest; top-p drops positions whose cumulative probability <= 1 - p (the largest is
  always kept); filtered logits become -inf, scattered back to the original order.
* scatter_nd_update_: in place, input[indices[i]] = updates[i]; indices int32/int64, at least
  2-D, last dim a <= input.dim(), no out-of-range index; updates.shape == indices.shape[:-1] +
  input.shape[a:]; input / updates same dtype; input 1-8 dims.
"""
from __future__ import annotations

import torch

from .schema import active, check, check_dtype, register

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _validate_top_k_top_p(a, soc):
    op, x = "npu_top_k_top_p", a.logits
    check_dtype(op, "logits", x, _FLOATS, "float32, float16 or bfloat16")
    check(x.dim() == 2, op, "logits", f"has {x.dim()} dimensions", "2-D [B, V]")
    b = x.shape[0]
    if a.k is not None:
        check_dtype(op, "k", a.k, (torch.int32,), "int32")
        check(tuple(a.k.shape) == (b,), op, "k", f"has shape {tuple(a.k.shape)}", f"[B] = [{b}]")
        if not active().state.capturing:
            check(bool(((a.k >= 1) & (a.k <= 1024)).all()), op, "k", "has a value outside "
                  "[1, 1024]", "k in [1, 1024]")
    if a.p is not None:
        check_dtype(op, "p", a.p, (x.dtype,), f"same dtype as logits ({x.dtype})")
        check(tuple(a.p.shape) == (b,), op, "p", f"has shape {tuple(a.p.shape)}", f"[B] = [{b}]")


def _ref_top_k_top_p(a):
    """Logits with entries outside top-k / top-p set to -inf (the page's sort-based recipe)."""
    x = a.logits
    val, ind = torch.sort(x, dim=-1, stable=True)
    if a.k is not None:
        kth = val.gather(-1, (x.shape[-1] - a.k.long()).clamp(min=0)[:, None])
        val = val.masked_fill(val < kth, float("-inf"))
    if a.p is not None:
        cum = torch.softmax(val.float(), dim=-1).cumsum(-1)
        drop = cum <= (1 - a.p.float())[:, None]
        drop[:, -1] = False
        val = val.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, ind, val)


def _validate_scatter(a, soc):
    op, x, idx, up = "npu_scatter_nd_update_", a.input, a.indices, a.updates
    check(1 <= x.dim() <= 8, op, "input", f"has {x.dim()} dimensions", "1-8 dimensions")
    check_dtype(op, "indices", idx, (torch.int32, torch.int64), "int32 or int64")
    check(idx.dim() >= 2 and idx.shape[-1] <= x.dim(), op, "indices",
          f"has shape {tuple(idx.shape)}", "at least 2-D, last dim <= input.dim()")
    check(up.dtype == x.dtype, op, "updates", f"has dtype {up.dtype}, input {x.dtype}",
          "same dtype as input")
    want = (*idx.shape[:-1], *x.shape[idx.shape[-1]:])
    check(tuple(up.shape) == want, op, "updates", f"has shape {tuple(up.shape)}",
          f"indices.shape[:-1] + input.shape[a:] = {want}")
    if not active().state.capturing:
        bound = torch.tensor(x.shape[:idx.shape[-1]])
        check(bool(((idx >= 0) & (idx < bound)).all()), op, "indices", "has an out-of-range "
              "index", "no out-of-range index")


def _ref_scatter(a):
    """input[tuple(indices[i])] = updates[i], in place; returns input."""
    idx = a.indices.long().reshape(-1, a.indices.shape[-1])
    up = a.updates.reshape(idx.shape[0], *a.input.shape[idx.shape[1]:])
    a.input.index_put_(tuple(idx.t()), up)
    return a.input


register("npu_top_k_top_p", _validate_top_k_top_p, _ref_top_k_top_p)
register("npu_scatter_nd_update_", _validate_scatter, _ref_scatter)
