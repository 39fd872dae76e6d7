"""MoE routing: `npu_moe_gating_top_k`, `npu_moe_init_routing_v2`, `npu_moe_token_unpermute`
(the grouped matmul lives in ops_gmm.py, which this module imports so that it registers).

Sources: the docstrings carried in the 2.13.0 wheel (`torch_npu/_op_plugin_docs.py`), its meta
registrations (output shapes and dtypes) and the aclnn pages of the kernels (aclnnMoeGatingTopK,
aclnnMoeInitRoutingV2 / V3, aclnnMoeFinalizeRoutingV2). Value checks on index tensors are skipped
while an NPUGraph is capturing (they would be host syncs); the references never sync.

* gating_top_k: x [T, E] fp16/bf16/fp32, E <= 2048. norm_out = softmax(x) (norm_type 0) or
  sigmoid(x) (1), fp32. Selection scores = norm_out + bias (bias [E], x's dtype). Groups:
  E / group_count experts each (> 2; ceil32(E/group_count) * group_count <= 2048); a group's
  score is its max (group_select_mode 0) or the sum of its top two (1); the best k_group groups
  stay (1 <= k_group <= group_count) and the k best experts among them are chosen
  (1 <= k <= E / group_count * k_group), best first. Hash mode (input_ids [T] and tid2eid [*, k]
  both given, int32/int64): ids = tid2eid[input_ids], no selection. y = norm_out at ids (bias not
  included), y_out = y / (sum(y) + eps) * routed_scaling_factor, in x's dtype; ids int32.
  renorm only 0. [UNCONFIRMED] readings: the aclnn formula writes "normOut = normOut + bias"
  before top-k; the fake (like DeepSeek-V3 and spec sec. 2.3) uses the bias for selection only
  and returns norm_out without it. The y_out normalisation is documented for sigmoid; the fake
  applies it for softmax too. In hash mode bias and groups are ignored. norm_out is NaN unless
  out_flag (the doc: "whether to output" it).
* init_routing_v2 (quant_mode -1 only; every other documented mode raises NotImplementedError):
  x [T, H] fp16/bf16/fp32/int8 (or fp8 with an MX scale [T, ceil(H/64), 2] E8M0, the meta's
  no-quant MX form), expert_idx int32 [T, K] with ids in [0, expert_num). Per the aclnn V2
  formula: sorted_row_idx = stable sort of flatten(expert_idx) (flat index t*K + k) by expert,
  entries outside active_expert_range [start, end) (default [0, expert_num)) last;
  expanded_x[i] = x[sorted_row_idx[i] // K]; rows = T*K, or min(active_num, T*K) when
  active_num > 0. expanded_row_idx (int32 [T*K]): row_idx_type 0 ("gather") puts i at
  sorted_row_idx[i] (-1 for entries outside the range); 1 ("scatter") is sorted_row_idx itself
  (valid first; the rest undefined, here -1). Counts (int64, over the range): type 0 cumsum,
  1 per-expert count ([end - start]), 2 (expert, count) pairs of non-empty experts in order, then
  a (0, 0) pair ([expert_num, 2]; the rest here 0); expert_tokens_num_flag False gives a 0-dim
  tensor (meta). expanded_scale: scale[token] per row (fp32 [rows]); without scale undefined
  (here NaN). Rows past the valid entries: undefined (here 0 / NaN). drop_pad_mode: the torch
  doc says only 0 is supported (1 raises). expert_capacity is unused in dropless mode.
  [UNCONFIRMED]: whether rows past active_num still count in the counts (here they do) and keep
  their position in expanded_row_idx (here they do, pointing past expanded_x).
* token_unpermute (padded_mode False, restore_shape None only): permuted_tokens [T*K, H]
  fp16/bf16/fp32, sorted_indices int32 [T*K] (a permutation of [0, T*K)), probs [T, K]
  (K = 1 without probs); out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]
  (fp32 sum, permuted_tokens' dtype). [UNCONFIRMED] index convention (spec sec. 4.2): the fake
  reads sorted_indices as indexed by source slot t*K + k with the permuted row as value, i.e. the
  row_idx_type 0 `expanded_row_idx` of init_routing_v2 fed in unchanged -- this reproduces the
  950 docstring's example. Other readings in the sources: the A2/A3 docstring's example matches
  the inverse (Megatron) map, permuted row i -> source slot sorted_indices[i]; and the 950 doc
  maps the op onto aclnnMoeFinalizeRoutingV2, whose dropPadMode 0 reads a k-major index
  (slot t + k*T). A2/A3: K <= 512.
"""
from __future__ import annotations

import math

import torch

from . import ops_gmm  # noqa: F401  (registers npu_grouped_matmul)
from .schema import active, check, check_dim, check_dtype, register

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_IDX = (torch.int32, torch.int64)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_E8M0 = (torch.uint8, torch.float8_e8m0fnu)
_INIT_QUANT_MODES = (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17)


def _capturing() -> bool:
    return active().state.capturing


def _validate_gating(a, soc):
    op, x = "npu_moe_gating_top_k", a.x
    check_dtype(op, "x", x, _FLOATS, "float16, bfloat16 or float32")
    check_dim(op, "x", x, 2, "2-D [T, E]")
    e, gc = x.shape[1], a.group_count
    check(e <= 2048, op, "x", f"has {e} experts", "last dim (experts) <= 2048")
    check(gc > 0 and e % gc == 0 and e // gc > 2 and math.ceil(e / gc / 32) * 32 * gc <= 2048,
          op, "group_count", f"is {gc} for {e} experts", "> 0, divides E, E/group_count > 2 and "
          "ceil32(E/group_count) * group_count <= 2048")
    check(1 <= a.k_group <= gc, op, "k_group", f"is {a.k_group}", "1 <= k_group <= group_count")
    check(1 <= a.k <= e // gc * a.k_group, op, "k", f"is {a.k}",
          f"1 <= k <= E / group_count * k_group = {e // gc * a.k_group}")
    check(a.group_select_mode in (0, 1), op, "group_select_mode", f"is {a.group_select_mode}",
          "0 (group max) or 1 (sum of the group's top 2)")
    check(a.renorm == 0, op, "renorm", f"is {a.renorm}", "only 0 (norm, then top-k)")
    check(a.norm_type in (0, 1), op, "norm_type", f"is {a.norm_type}", "0 softmax or 1 sigmoid")
    if a.bias is not None:
        check_dtype(op, "bias", a.bias, (x.dtype,), f"same dtype as x ({x.dtype})")
        check(tuple(a.bias.shape) == (e,), op, "bias", f"has shape {tuple(a.bias.shape)}",
              f"1-D [E] = [{e}]")
    check((a.input_ids is None) == (a.tid2eid is None), op, "input_ids",
          "and tid2eid are not both given or both None", "hash mode needs both")
    if a.input_ids is not None:
        ids, table = a.input_ids, a.tid2eid
        check_dtype(op, "input_ids", ids, _IDX, "int32 or int64")
        check_dtype(op, "tid2eid", table, _IDX, "int32 or int64")
        check(tuple(ids.shape) == (x.shape[0],), op, "input_ids", f"has shape {tuple(ids.shape)}",
              f"1-D [T] = [{x.shape[0]}]")
        check(table.dim() == 2 and table.shape[1] == a.k, op, "tid2eid",
              f"has shape {tuple(table.shape)}", f"2-D [*, k] with k = {a.k}")
        if not _capturing():
            check(bool(((ids >= 0) & (ids < table.shape[0])).all()), op, "input_ids",
                  "has an id outside tid2eid's rows", f"in [0, {table.shape[0]})")
            check(bool(((table >= 0) & (table < e)).all()), op, "tid2eid",
                  "has an expert id out of range", f"in [0, E) = [0, {e})")


def _ref_gating(a):
    """(y_out [T, k] x.dtype, expert ids int32 [T, k], norm_out fp32 [T, E] or NaN)."""
    x = a.x.float()
    norm = torch.softmax(x, dim=-1) if a.norm_type == 0 else torch.sigmoid(x)
    if a.input_ids is not None:
        ids = a.tid2eid.long()[a.input_ids.long()]
    else:
        sel = norm if a.bias is None else norm + a.bias.float()
        t, e = sel.shape
        grouped = sel.view(t, a.group_count, e // a.group_count)
        gscore = (grouped.amax(-1) if a.group_select_mode == 0
                  else grouped.topk(2, dim=-1).values.sum(-1))
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, gscore.topk(a.k_group, dim=-1).indices, True)
        masked = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
        ids = masked.topk(a.k, dim=-1).indices
    y = norm.gather(1, ids)
    y = y / (y.sum(-1, keepdim=True) + a.eps) * a.routed_scaling_factor
    out = norm if a.out_flag else torch.full_like(norm, float("nan"))
    return y.to(a.x.dtype), ids.to(torch.int32), out


def _validate_init_routing(a, soc):
    op, x, idx = "npu_moe_init_routing_v2", a.x, a.expert_idx
    check(a.quant_mode in _INIT_QUANT_MODES, op, "quant_mode", f"is {a.quant_mode}",
          f"one of {list(_INIT_QUANT_MODES)}")
    if a.quant_mode != -1 or a.x_dtype is not None:
        raise NotImplementedError(f"fake npu_moe_init_routing_v2: quant_mode {a.quant_mode} / "
                                  f"x_dtype {a.x_dtype} not modelled (only quant_mode -1, "
                                  "x_dtype None)")
    check_dim(op, "x", x, 2, "2-D [T, H]")
    check_dtype(op, "x", x, _FLOATS + (torch.int8,) + _FP8,
                "float16, bfloat16, float32, int8 (fp8 with an MX scale)")
    check_dim(op, "expert_idx", idx, 2, "2-D [T, K]")
    check_dtype(op, "expert_idx", idx, (torch.int32,), "int32")
    check(idx.shape[0] == x.shape[0], op, "expert_idx", f"has {idx.shape[0]} rows",
          f"same first dim as x ({x.shape[0]})")
    check(a.drop_pad_mode in (0, 1), op, "drop_pad_mode", f"is {a.drop_pad_mode}", "0 or 1")
    check(a.drop_pad_mode == 0, op, "drop_pad_mode", "is 1", "only 0 (dropless) is supported")
    check(a.active_num >= -1, op, "active_num", f"is {a.active_num}", ">= -1")
    check(a.expert_tokens_num_type in (0, 1, 2), op, "expert_tokens_num_type",
          f"is {a.expert_tokens_num_type}", "0 cumsum, 1 count or 2 key_value")
    cap = 5120 if a.expert_tokens_num_type == 2 else 10240
    check(0 < a.expert_num <= cap, op, "expert_num", f"is {a.expert_num}", f"in (0, {cap}]")
    check(a.row_idx_type in (0, 1), op, "row_idx_type", f"is {a.row_idx_type}", "0 or 1")
    r = a.active_expert_range
    check(r == [] or (len(r) == 2 and 0 <= r[0] < r[1] <= a.expert_num), op,
          "active_expert_range", f"is {r}", "[] or [start, end) with 0 <= start < end <= "
          "expert_num")
    check(a.offset is None, op, "offset", "is set", "None unless quant_mode is 0")
    if a.scale is not None:
        if x.dtype in _FP8:
            check_dtype(op, "scale", a.scale, _E8M0, "E8M0 (uint8 or float8_e8m0fnu) for fp8 x")
            want = (x.shape[0], math.ceil(x.shape[1] / 64), 2)
        else:
            check_dtype(op, "scale", a.scale, (torch.float32,), "float32")
            want = (x.shape[0],)
        check(tuple(a.scale.shape) == want, op, "scale", f"has shape {tuple(a.scale.shape)}",
              f"{want} in the no-quant mode")
    if not _capturing():
        check(bool(((idx >= 0) & (idx < a.expert_num)).all()), op, "expert_idx",
              "has an id out of range", f"in [0, expert_num) = [0, {a.expert_num})")


def _gather_rows(t, src, ok, fill):
    """t[src] with the rows where ~ok set to `fill` (1-byte dtypes gathered as raw bytes)."""
    mask = ok.view(-1, *[1] * (t.dim() - 1))
    if t.element_size() == 1 and t.dtype != torch.int8:
        return torch.where(mask, t.view(torch.uint8)[src], 0).view(t.dtype)
    return torch.where(mask, t[src], torch.tensor(fill, dtype=t.dtype))


def _ref_init_routing(a):
    """(expanded_x, expanded_row_idx int32, counts int64, expanded_scale)."""
    t, k = a.expert_idx.shape
    n, num = t * k, a.expert_num
    start, end = a.active_expert_range or [0, num]
    flat = a.expert_idx.reshape(-1).long()
    valid = (flat >= start) & (flat < end)
    order = torch.argsort(torch.where(valid, flat, num), stable=True)
    pos = torch.arange(n)
    ok = pos < valid.sum()
    rows = n if a.active_num <= 0 else min(a.active_num, n)
    src, ok_r = order[:rows] // k, ok[:rows]
    if a.row_idx_type == 0:
        row_idx = torch.full((n,), -1).scatter_(0, order, torch.where(ok, pos, -1))
    else:
        row_idx = torch.where(ok, order, -1)
    expanded_x = _gather_rows(a.x, src, ok_r, 0)
    cnt = torch.zeros(num, dtype=torch.long).scatter_add_(0, torch.where(valid, flat, 0),
                                                          valid.long())[start:end]
    if not a.expert_tokens_num_flag:
        counts = torch.zeros((), dtype=torch.long)
    elif a.expert_tokens_num_type == 0:
        counts = cnt.cumsum(0)
    elif a.expert_tokens_num_type == 1:
        counts = cnt
    else:
        nz = cnt != 0
        o = torch.argsort((~nz).int(), stable=True)
        pairs = torch.stack([torch.arange(start, end)[o], cnt[o]], 1) * nz[o, None]
        counts = torch.zeros(num, 2, dtype=torch.long)
        counts[:end - start] = pairs
    if a.scale is None:
        scale = torch.full((rows,), float("nan"))
    elif a.x.dtype in _FP8:
        scale = _gather_rows(a.scale.view(torch.float8_e8m0fnu), src, ok_r, 0)
    else:
        scale = _gather_rows(a.scale, src, ok_r, float("nan"))
    return expanded_x, row_idx.to(torch.int32), counts, scale


def _validate_unpermute(a, soc):
    op, p, idx = "npu_moe_token_unpermute", a.permuted_tokens, a.sorted_indices
    check(a.padded_mode is False, op, "padded_mode", f"is {a.padded_mode}", "only False")
    check(a.restore_shape is None, op, "restore_shape", f"is {a.restore_shape}", "only None")
    check_dim(op, "permuted_tokens", p, 2, "2-D [T*K, H]")
    check_dtype(op, "permuted_tokens", p, _FLOATS, "float16, bfloat16 or float32")
    check_dim(op, "sorted_indices", idx, 1, "1-D [T*K]")
    check_dtype(op, "sorted_indices", idx, (torch.int32,), "int32")
    if a.probs is not None:
        check_dim(op, "probs", a.probs, 2, "2-D [T, K]")
        check_dtype(op, "probs", a.probs, _FLOATS, "float16, bfloat16 or float32")
        k = a.probs.shape[1]
        check(a.probs.numel() == idx.shape[0], op, "probs", f"has shape {tuple(a.probs.shape)}",
              f"[T, K] with T*K = sorted_indices length {idx.shape[0]}")
        if soc != 260:
            check(k <= 512, op, "probs", f"has K = {k}", "A2/A3: K <= 512")
    check(p.shape[0] == idx.shape[0], op, "permuted_tokens", f"has {p.shape[0]} rows",
          f"T*K = {idx.shape[0]} rows (the length of sorted_indices)")
    if not _capturing():
        n = idx.shape[0]
        ok = bool(((idx >= 0) & (idx < n)).all()) and torch.unique(idx).numel() == n
        check(ok, op, "sorted_indices", "is not a permutation of [0, T*K)",
              f"values in [0, {n - 1}], no repeated index")


def _ref_unpermute(a):
    """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]] (fp32 sum)."""
    p, k = a.permuted_tokens, 1 if a.probs is None else a.probs.shape[1]
    rows = p.float()[a.sorted_indices.long()].view(-1, k, p.shape[1])
    if a.probs is not None:
        rows = rows * a.probs.float()[..., None]
    return rows.sum(1).to(p.dtype)


register("npu_moe_gating_top_k", _validate_gating, _ref_gating)
register("npu_moe_init_routing_v2", _validate_init_routing, _ref_init_routing)
register("npu_moe_token_unpermute", _validate_unpermute, _ref_unpermute)
