"""Sparse attention: `npu_lightning_indexer`, `npu_sparse_flash_attention`.

Doc pages: `torch_npu-npu_lightning_indexer.md`, `torch_npu-npu_sparse_flash_attention.md`
(Ascend/op-plugin, read 2026-08-21), output shapes as in the 2.13.0 wheel's meta registrations.

Layouts: query BSND [B,S1,N1,D] or TND [T1,N1,D]; key BSND [B,S2,1,D], TND [T2,1,D] or PA_BSND
[block_num, block_size, 1, D] with `block_table` int32 [B, >= max blocks]. Lengths are int32
tensors of length B: per-batch counts for BSND and PA_BSND, **prefix sums** for TND (required for
TND, and for PA_BSND keys). With rightDownCausal (sparse_mode 3) query i of a batch with lengths
(Lq, Lkv) sees key positions j <= Lkv - Lq + i; sparse_mode 0 applies no causal mask.

Indexer: score[t, j] = sum_h weights[t, h] * ReLU(q[t, h] . k[j]) over visible keys j; returns
int32 indices of the `sparse_count` best keys [.., 1, sparse_count] in descending score order,
padded with -1 when fewer keys are visible [UNCONFIRMED: order of ties / padding value], and the
scores when `return_value`. A5: N1 in {8, 16, 24, 32, 64}, weights not fp32; A2/A3: N1 <= 64.

SFA (attention_mode 2, MLA-absorb): logits = scale_value * (q_nope . k_nope + q_rope . k_rope)
over the keys named by `sparse_indices` (valid entries first, -1 after; sparse_block_size 1),
output = softmax @ v_nope with v = value (or key when value is None; D = 512, rope D = 64).
`sinks` (fp32 [N1], A5 only) is read as one extra logit per head in the softmax denominator:
out = sum_j exp(l_j) v_j / (sum_j exp(l_j) + exp(sink_h)) -- [UNCONFIRMED] reading. A query row
with no visible key outputs zeros. softmax_max / softmax_sum are returned only with
`return_softmax_lse` (else empty fp32 tensors). Value checks on indices and lengths are skipped
while an NPUGraph is capturing (they would be host syncs).
"""
from __future__ import annotations

import torch

from .schema import active, check, check_dim, check_dtype, fail, register

_HALF = (torch.bfloat16, torch.float16)
_I64_MAX = 9223372036854775807


def _lengths(op, name, t, b):
    check(t is not None, op, name, "is None", "required for this layout")
    check_dtype(op, name, t, (torch.int32,), "int32")
    check(t.dim() == 1 and (b is None or t.shape[0] == b), op, name,
          f"has shape {tuple(t.shape)}", f"1-D of length B = {b}")


def _check_layouts(op, a, q, k, lq_name, lk_name, layout_q, layout_k):
    check(layout_q in ("BSND", "TND"), op, "layout_query", f"is {layout_q!r}", "BSND or TND")
    check(layout_k in ("BSND", "TND", "PA_BSND"), op, f"layout_{lk_name}", f"is {layout_k!r}",
          "BSND, TND or PA_BSND")
    if layout_k != "PA_BSND":
        check(layout_k == layout_q, op, f"layout_{lk_name}", f"is {layout_k!r} with query "
              f"{layout_q!r}", "equal to layout_query unless PA_BSND")
    check_dim(op, "query", q, 4 if layout_q == "BSND" else 3)
    check_dim(op, "key", k, 3 if layout_k == "TND" else 4)
    check(k.shape[-2] == 1, op, "key", f"has N = {k.shape[-2]}", "key N (KV_N) = 1")
    b = q.shape[0] if layout_q == "BSND" else None
    aq = getattr(a, f"actual_seq_lengths_{lq_name}")
    ak = getattr(a, f"actual_seq_lengths_{lk_name}")
    if layout_q == "TND" or aq is not None:
        _lengths(op, f"actual_seq_lengths_{lq_name}", aq, b)
        b = aq.shape[0]
    if layout_k in ("TND", "PA_BSND") or ak is not None:
        _lengths(op, f"actual_seq_lengths_{lk_name}", ak, b)
        b = ak.shape[0]
    if layout_k == "PA_BSND":
        bt = a.block_table
        check(bt is not None, op, "block_table", "is None", "required with PA_BSND")
        check_dtype(op, "block_table", bt, (torch.int32,), "int32")
        check(bt.dim() == 2 and bt.shape[0] == b, op, "block_table",
              f"has shape {tuple(bt.shape)}", f"2-D [B = {b}, max blocks]")
        bs = k.shape[1]
        check(bs % 16 == 0 and 0 < bs <= 1024, op, "key", f"has block_size {bs}",
              "block_size a multiple of 16, at most 1024")
    if not active().state.capturing:
        for name, t, layout in ((f"actual_seq_lengths_{lq_name}", aq, layout_q),
                                (f"actual_seq_lengths_{lk_name}", ak, layout_k)):
            if t is not None and layout == "TND" and t.numel() > 1:
                check(bool((t[1:] >= t[:-1]).all()), op, name, "is not non-decreasing",
                      "TND lengths are prefix sums")
            if t is not None:
                check(bool((t >= 0).all()), op, name, "has a negative entry", ">= 0")
    for name, v in (("pre_tokens", a.pre_tokens), ("next_tokens", a.next_tokens)):
        check(v == _I64_MAX, op, name, f"is {v}", "only the default 2**63-1")
    check(a.sparse_mode in (0, 3), op, "sparse_mode", f"is {a.sparse_mode}", "0 or 3")


def _query_rows(q, layout, lengths):
    """(rows [T, N, D], batch id [T], position in batch [T], Lq per row [T])."""
    if layout == "BSND":
        b, s = q.shape[:2]
        bq = torch.arange(b).repeat_interleave(s)
        iq = torch.arange(s).repeat(b)
        lq = (lengths.long() if lengths is not None else torch.full((b,), s))[bq]
        return q.flatten(0, 1), bq, iq, lq
    cum = lengths.long()
    t = torch.arange(q.shape[0])
    bq = torch.searchsorted(cum, t, right=True).clamp(max=cum.numel() - 1)
    start = torch.cat((cum.new_zeros(1), cum))[bq]
    return q, bq, t - start, (cum - torch.cat((cum.new_zeros(1), cum[:-1])))[bq]


def _kv_gather(k, layout, lengths, block_table, bq, idx):
    """Key vectors [T, K, D] at logical positions idx [T, K] of batches bq, and Lkv [T]."""
    safe = idx.clamp(min=0).long()
    if layout == "BSND":
        lkv = lengths.long() if lengths is not None else torch.full((k.shape[0],), k.shape[1])
        pos = safe.clamp(max=k.shape[1] - 1)
        return k[bq[:, None], pos, 0], lkv[bq]
    if layout == "TND":
        cum = lengths.long()
        start = torch.cat((cum.new_zeros(1), cum[:-1]))
        pos = (start[bq][:, None] + safe).clamp(max=k.shape[0] - 1)
        return k[pos, 0], (cum - start)[bq]
    bs, nblk = k.shape[1], block_table.shape[1]
    blk = block_table.long()[bq[:, None], (safe // bs).clamp(max=nblk - 1)]
    return k[blk.clamp(min=0), safe % bs, 0], lengths.long()[bq]


def _visible(idx, iq, lq, lkv, sparse_mode):
    ok = (idx >= 0) & (idx < lkv[:, None]) & (iq < lq)[:, None]
    if sparse_mode == 3:
        ok &= idx <= (lkv - lq + iq)[:, None]
    return ok


# ---- npu_lightning_indexer ----------------------------------------------------------------

def _validate_indexer(a, soc):
    op, q, k, w = "npu_lightning_indexer", a.query, a.key, a.weights
    check_dtype(op, "query", q, _HALF, "bfloat16 or float16")
    check(k.dtype == q.dtype, op, "key", f"has dtype {k.dtype}, query {q.dtype}",
          "same dtype as query")
    _check_layouts(op, a, q, k, "query", "key", a.layout_query, a.layout_key)
    check(q.shape[-1] == 128 and k.shape[-1] == 128, op, "query",
          f"has D = {q.shape[-1]} (key {k.shape[-1]})", "query and key D = 128")
    n1 = q.shape[-2]
    if soc == 260:
        check(n1 in (8, 16, 24, 32, 64), op, "query", f"has N1 = {n1}",
              "A5: N1 in {8, 16, 24, 32, 64}")
        check(w.dtype != torch.float32, op, "weights", "is float32", "A5: weights not float32")
    else:
        check(n1 <= 64, op, "query", f"has N1 = {n1}", "A2/A3: N1 <= 64")
    if w.dtype != torch.float32:
        check(w.dtype == q.dtype, op, "weights", f"has dtype {w.dtype}",
              "same dtype as query unless float32")
    check(tuple(w.shape) == tuple(q.shape[:-1]), op, "weights", f"has shape {tuple(w.shape)}",
          f"[B, S1, N1] / [T, N1] = {tuple(q.shape[:-1])}")
    sc = a.sparse_count
    check(1 <= sc <= 2048 or sc in (3072, 4096, 5120, 6144, 7168, 8192), op, "sparse_count",
          f"is {sc}", "[1, 2048] or 3072, 4096, 5120, 6144, 7168, 8192")
    if a.return_value:
        check(a.layout_key != "PA_BSND", op, "return_value", "is True with PA_BSND",
              "only when layout_key is not PA_BSND")


def _ref_indexer(a):
    """Top-`sparse_count` keys per query token of sum_h w_h * ReLU(q_h . k)."""
    q, k = a.query, a.key
    rows, bq, iq, lq = _query_rows(q, a.layout_query, a.actual_seq_lengths_query)
    if a.layout_key == "BSND":
        smax = k.shape[1]
    elif a.layout_key == "TND":
        smax = k.shape[0]
    else:
        smax = a.block_table.shape[1] * k.shape[1]
    pos = torch.arange(smax).expand(rows.shape[0], smax)
    keys, lkv = _kv_gather(k, a.layout_key, a.actual_seq_lengths_key, a.block_table, bq, pos)
    dots = torch.einsum("tnd,tsd->tns", rows.float(), keys.float()).relu()
    score = (a.weights.flatten(0, -2).float()[:, :, None] * dots).sum(1)         # [T, S]
    score = score.masked_fill(~_visible(pos, iq, lq, lkv, a.sparse_mode), float("-inf"))
    kk = min(a.sparse_count, smax)
    val, ind = score.topk(kk, dim=-1)
    ind = torch.where(torch.isinf(val), -1, ind).to(torch.int32)
    pad = a.sparse_count - kk
    ind = torch.nn.functional.pad(ind, (0, pad), value=-1)
    val = torch.nn.functional.pad(val, (0, pad), value=float("-inf"))
    shape = (*q.shape[:-2], 1, a.sparse_count)
    values = val.to(q.dtype).reshape(shape) if a.return_value else q.new_empty(0)
    return ind.reshape(shape), values


# ---- npu_sparse_flash_attention -------------------------------------------------------------

def _validate_sfa(a, soc):
    op, q, k = "npu_sparse_flash_attention", a.query, a.key
    check(a.attention_mode == 2, op, "attention_mode", f"is {a.attention_mode}",
          "only 2 (MLA-absorb)")
    check_dtype(op, "query", q, _HALF, "bfloat16 or float16")
    for name in ("key", "value", "query_rope", "key_rope"):
        t = getattr(a, name)
        if t is None and name != "value":
            fail(op, name, "is None", "attention_mode 2 takes the rope parts (D = 64)")
        if t is not None:
            check(t.dtype == q.dtype, op, name, f"has dtype {t.dtype}, query {q.dtype}",
                  "same dtype as query")
    if a.value is not None:
        check(a.value.shape == k.shape, op, "value", f"has shape {tuple(a.value.shape)}",
              "same shape as key")
    _check_layouts(op, a, q, k, "query", "kv", a.layout_query, a.layout_kv)
    check(q.shape[-1] == 512 and k.shape[-1] == 512, op, "query",
          f"has D = {q.shape[-1]} (key {k.shape[-1]})", "query/key/value D = 512")
    check(a.query_rope.shape[-1] == 64 and a.key_rope.shape[-1] == 64, op, "query_rope",
          f"has D = {a.query_rope.shape[-1]} (key_rope {a.key_rope.shape[-1]})",
          "query_rope / key_rope D = 64")
    check(a.query_rope.shape[:-1] == q.shape[:-1], op, "query_rope",
          f"has shape {tuple(a.query_rope.shape)}", "query's shape with D = 64")
    check(a.key_rope.shape[:-1] == k.shape[:-1], op, "key_rope",
          f"has shape {tuple(a.key_rope.shape)}", "key's shape with D = 64")
    n1 = q.shape[-2]
    if soc == 260:
        check(1 <= n1 <= 128, op, "query", f"has N1 = {n1}", "A5: N1 in 1..128")
        check(a.sparse_block_size == 1, op, "sparse_block_size", f"is {a.sparse_block_size}",
              "A5: only 1")
    else:
        check(n1 in (1, 2, 4, 8, 16, 32, 64, 128), op, "query", f"has N1 = {n1}",
              "A2/A3: N1 in {1, 2, 4, ..., 128}")
        check(a.sinks is None, op, "sinks", "is set", "A2/A3: sinks not supported")
        if a.sparse_block_size != 1:
            raise NotImplementedError("fake npu_sparse_flash_attention: sparse_block_size 1 only")
    si = a.sparse_indices
    check_dtype(op, "sparse_indices", si, (torch.int32,), "int32")
    check(tuple(si.shape[:-1]) == (*q.shape[:-2], 1) and si.shape[-1] > 0, op, "sparse_indices",
          f"has shape {tuple(si.shape)}", "[B, S1, KV_N, sparse_size] / [T, KV_N, sparse_size]")
    if not active().state.capturing:
        valid = si >= 0
        check(bool((si >= -1).all()), op, "sparse_indices", "has entries < -1",
              "valid indices, -1 as padding")
        check(bool((valid[..., 1:] <= valid[..., :-1]).all()), op, "sparse_indices",
              "has a valid entry after an invalid one", "valid entries first, invalid after")
    if a.sinks is not None:
        check_dtype(op, "sinks", a.sinks, (torch.float32,), "float32")
        check(tuple(a.sinks.shape) == (n1,), op, "sinks", f"has shape {tuple(a.sinks.shape)}",
              f"[N1] = [{n1}]")
    if a.return_softmax_lse:
        check(a.layout_kv != "PA_BSND", op, "return_softmax_lse", "is True with PA_BSND",
              "only when layout_kv is not PA_BSND")


def _ref_sfa(a):
    """softmax(scale * [q_nope, q_rope] . [k_nope, k_rope]) @ v over the selected keys."""
    q = a.query
    rows, bq, iq, lq = _query_rows(q, a.layout_query, a.actual_seq_lengths_query)
    rrows = a.query_rope.flatten(0, -3) if a.layout_query == "BSND" else a.query_rope
    idx = a.sparse_indices.reshape(rows.shape[0], -1).long()
    lens, bt = a.actual_seq_lengths_kv, a.block_table
    kn, lkv = _kv_gather(a.key, a.layout_kv, lens, bt, bq, idx)
    kr, _ = _kv_gather(a.key_rope, a.layout_kv, lens, bt, bq, idx)
    v, _ = _kv_gather(a.value if a.value is not None else a.key, a.layout_kv, lens, bt, bq, idx)
    logits = (torch.einsum("tnd,tkd->tnk", rows.float(), kn.float())
              + torch.einsum("tnd,tkd->tnk", rrows.float(), kr.float())) * a.scale_value
    ok = _visible(idx, iq, lq, lkv, a.sparse_mode)[:, None, :]
    logits = logits.masked_fill(~ok, float("-inf"))
    mx = logits.amax(-1, keepdim=True)
    if a.sinks is not None:
        mx = torch.maximum(mx, a.sinks.float()[None, :, None])
    mx = torch.where(torch.isinf(mx), 0.0, mx)
    p = torch.exp(logits - mx)
    denom = p.sum(-1, keepdim=True)
    if a.sinks is not None:
        denom = denom + torch.exp(a.sinks.float()[None, :, None] - mx)
    out = torch.einsum("tnk,tkd->tnd", p / denom.clamp(min=1e-30), v.float())
    out = out.to(q.dtype).reshape(q.shape)
    if a.return_softmax_lse:
        n1 = q.shape[-2]
        m, s = mx.squeeze(-1), denom.squeeze(-1)                          # [T, N1]
        if a.layout_query == "BSND":
            shape = (q.shape[0], q.shape[1], 1, n1)
            m, s = (x.reshape(shape).permute(0, 2, 1, 3) for x in (m, s))
        else:
            m, s = m[None], s[None]
        return out, m.contiguous(), s.contiguous()
    empty = torch.empty(0, dtype=torch.float32)
    return out, empty, empty.clone()


register("npu_lightning_indexer", _validate_indexer, _ref_indexer)
register("npu_sparse_flash_attention", _validate_sfa, _ref_sfa)
