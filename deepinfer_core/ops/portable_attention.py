"""Portable attention backend: per sequence, update the compressor tails and rows, pick indexer
top-k blocks, and run one joint softmax over [window tokens | compressed rows] with the sink.

One code path for every chunk shape: a sequence contributes `n` new tokens starting at position
`s` (prefill from zero, chunked prefill, decode and verification are all this). Visibility is by
position: query t sees window positions (t-W, t], CSA blocks picked by the indexer among
b < (t+1)//4, and every HCA block b < (t+1)//128.

`official=True` (the QAT numerics) rounds as DeepSeek's inference code does: the softmax keeps its
max over the keys alone, multiplies the unnormalised exp(s - max) rounded to the key dtype by the
values, and divides by the fp32 sum (the sink's exp(sink - max) included) at the end; the indexer
scores, weights and head sum are rounded to the activation dtype and the top-k is `torch.topk`'s.

A uint8 ring is a kv_fp8 ring of packed rows (`ops.kv_fp8`): read through `unpack_kv_fp8`, written
through `pack_kv_fp8`; its RoPE width follows from the row size.
"""
from __future__ import annotations

import torch

from ..cache.sequence_state import CompressorState, LayerState
from ..config_v41 import BF16_MAX
from .kv_fp8 import pack_kv_fp8, packed_rope_dim, unpack_kv_fp8

QUERY_CHUNK = 256   # bounds the [queries, heads, keys] score tensor on long prefills


class PortableAttentionBackend:
    batch_invariant = False     # one sequence at a time, but the GEMM shapes follow the batch

    def __init__(self, official: bool = False):
        self.official = official

    def forward(self, attn, inp, batch, states: list[LayerState]) -> torch.Tensor:
        out = torch.empty_like(inp.q)
        rect = rectangles(attn, batch)
        full = batch.shared.get("yoco_full") if attn.yoco_consumer else None
        comp_rows_of = zip(full.seq_slices(), full.starts) if full is not None else None
        for i, (sl, start, st) in enumerate(zip(batch.seq_slices(), batch.starts, states)):
            pos = batch.positions[sl]
            csl, cstart = next(comp_rows_of) if comp_rows_of is not None else (sl, start)
            comp_rows = comp_mask = None
            if attn.compressor is not None:
                comp = attn.compressor
                z = None if inp.comp_z is None else inp.comp_z[csl]
                if attn.indexer is not None and attn.indexer.wk is not None:    # V4.1 key source
                    self.compress(st.compressor, inp.comp_kv[csl], z, cstart, comp.finalize_with_prerope,
                                  (st.indexer, attn.indexer.keys))
                else:
                    self.compress(st.compressor, inp.comp_kv[csl], z, cstart, comp.finalize)
            if st.compressor is not None:        # a sharing layer reads its source's rows
                comp_rows = st.compressor.read_rows()
                comp_mask = self.select(attn, inp, batch, i, st, sl, start, pos)
            out[sl] = self.attend(attn, inp.q[sl], inp.kv[sl], st, start, pos, comp_rows, comp_mask,
                                  self.official, rect[i])
            self.write_ring(st, inp.kv[sl], start, rect[i])
        return out

    # ---- compressor ------------------------------------------------------------------------------
    @staticmethod
    def compress(cs: CompressorState, kv: torch.Tensor, z: torch.Tensor | None, start: int, finalize,
                 index_keys=None) -> None:
        """Append the per-token (kv, z) of positions start.. and emit every block they complete.
        `z` None: an ungated ratio-1 compressor (each token is a row, no tails). `index_keys`
        (V4.1): (the index-key state, keys(rows before RoPE, block starts)); `finalize` then
        returns (rows, rows before RoPE)."""
        m, n = cs.ratio, kv.shape[0]
        end = start + n
        first, last = start // m, end // m          # blocks [first, last) close inside this chunk
        if last > first:
            blocks = torch.arange(first, last, device=kv.device)
            if z is None:
                pooled = kv
            else:
                c = 2 if cs.overlap else 1
                base = max(0, (first - (c - 1)) * m)     # oldest position the new blocks read
                old = torch.arange(base, start, device=kv.device)
                ext_kv = torch.cat([cs.tail_kv[old % cs.tail_len], kv])   # positions base..end-1
                ext_z = torch.cat([cs.tail_z[old % cs.tail_len], z])
                cur = (blocks * m - base)[:, None] + torch.arange(m, device=kv.device)[None, :]
                if cs.overlap:
                    d = kv.shape[1] // 2
                    prev = (cur - m).clamp(min=0)
                    prev_z = ext_z[prev, :d].masked_fill((blocks == 0)[:, None, None], float("-inf"))
                    slot_kv = torch.cat([ext_kv[prev, :d], ext_kv[cur, d:]], dim=1)   # [nb, 2m, d]
                    slot_z = torch.cat([prev_z, ext_z[cur, d:]], dim=1)
                else:
                    slot_kv, slot_z = ext_kv[cur], ext_z[cur]
                pooled = (slot_kv * torch.softmax(slot_z, dim=1)).sum(dim=1)          # fp32, per channel
            if index_keys is None:
                cs.write_rows(first, finalize(pooled, blocks * m))
            else:
                rows, pre_rope = finalize(pooled, blocks * m)
                cs.write_rows(first, rows)
                index_keys[0].write_rows(first, index_keys[1](pre_rope, blocks * m))
        cs.n_rows = last
        if index_keys is not None:
            index_keys[0].n_rows = last
        if z is None:
            return
        keep = torch.arange(max(start, end - cs.tail_len), end, device=kv.device)
        cs.tail_kv[keep % cs.tail_len] = kv[keep - start]
        cs.tail_z[keep % cs.tail_len] = z[keep - start]

    # ---- selection -------------------------------------------------------------------------------
    def select(self, attn, inp, batch, i: int, st: LayerState, sl: slice, start: int, pos) -> torch.Tensor:
        """The compressed rows query rows `pos` of sequence i attend: [n, n_rows] bool."""
        if attn.index_source < 0:                   # V4 HCA: every visible row
            return self.causal_block_mask(pos, attn.ratio, st.compressor.n_rows)
        ix = attn.indexer
        if ix is None:                              # V4.1: the index source's selection
            return batch.shared[("topk", attn.index_source)][i]
        if ix.compressor is not None:               # V4 CSA: the indexer's own compressor
            self.compress(st.indexer, inp.idx_kv[sl], inp.idx_z[sl], start, ix.compressor.finalize)
            return self.index_select(inp.idx_q[sl], inp.idx_w[sl], st.indexer.read_rows(), pos,
                                     attn.ratio, ix.topk)
        keys = st.indexer.read_rows()
        valid = self.causal_block_mask(pos, attn.ratio, keys.shape[0])
        if keys.shape[0]:
            q, w, topo = inp.idx_q[sl], inp.idx_w[sl], attn.cfg.topology
            picked, cands = torch.empty_like(valid), []
            for a in range(0, q.shape[0], QUERY_CHUNK):       # bounds [queries, heads, rows]
                rows, ok = slice(a, a + QUERY_CHUNK), valid[a:a + QUERY_CHUNK]
                scores = self.index_scores(q[rows], w[rows], keys).masked_fill(~ok, float("-inf"))
                if attn.candidate == "source":
                    cands.append(candidate_rows(scores, ok, topo.candidate_block_size,
                                                topo.candidate_topk_blocks))
                elif attn.candidate == "consumer":
                    ok = ok & batch.shared[("candidates",)][i][rows]
                    scores = scores.masked_fill(~ok, float("-inf"))
                picked[rows] = self.top_mask(scores, ok, ix.topk)
            if cands:
                _share(batch, ("candidates",), i, torch.cat(cands))
            valid = picked
        _share(batch, ("topk", attn.layer_id), i, valid)
        return valid

    @staticmethod
    def causal_block_mask(pos: torch.Tensor, ratio: int, n_rows: int) -> torch.Tensor:
        """[n, n_rows]: block b is visible to the query at p once complete, b < (p+1)//ratio."""
        return torch.arange(n_rows, device=pos.device)[None, :] < ((pos + 1) // ratio)[:, None]

    def index_select(self, q, w, keys, pos, ratio: int, topk: int) -> torch.Tensor:
        """Lightning indexer: visible-block mask [n, n_rows] holding each query's top-k blocks.
        w [n, heads]: the per-head weights with the 1/sqrt(head_dim) score scale folded in."""
        n_rows = keys.shape[0]
        valid = self.causal_block_mask(pos, ratio, n_rows)
        if n_rows == 0:
            return valid
        return self.top_mask(self.index_scores(q, w, keys).masked_fill(~valid, float("-inf")), valid, topk)

    def index_scores(self, q, w, keys) -> torch.Tensor:
        """[n, n_rows] sum_h w_h relu(q_h . k): fp32, or in the activation dtype (official)."""
        if self.official:
            scores = torch.einsum("thd,bd->thb", q, keys.to(q.dtype))
            return (scores.relu() * w.to(q.dtype)[..., None]).sum(dim=1)
        scores = torch.relu(torch.einsum("thd,bd->thb", q.float(), keys.float()))
        return (scores * w.float()[..., None]).sum(dim=1)

    def top_mask(self, scores: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor:
        """The `topk` best of `scores` (masked -inf where not `valid`) as a mask inside `valid`."""
        k = min(topk, scores.shape[1])
        if self.official:
            top = torch.topk(scores, k, dim=-1).indices
        else:
            # stable sort: among equal scores the lowest block index wins, deterministically
            top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return torch.zeros_like(valid).scatter_(1, top, True) & valid

    # ---- attention -------------------------------------------------------------------------------
    @staticmethod
    def attend(attn, q, kv, st: LayerState, start: int, pos, comp_rows, comp_mask,
               official: bool = False, rect_lo: int = 0) -> torch.Tensor:
        """`rect_lo`: bounded replay, no window key before this position (0: none)."""
        W, ring_size = attn.window, st.ring.shape[0]
        ring_pos = torch.arange(min(max(0, start - W + 1, rect_lo), start), start, device=q.device)
        ring_keys = st.ring[ring_pos % ring_size]
        if st.ring.dtype == torch.uint8:
            ring_keys = unpack_kv_fp8(ring_keys, kv.shape[1], ring_rope_dim(st.ring, kv), kv.dtype)
        keys = torch.cat([ring_keys, kv])
        key_pos = torch.cat([ring_pos, pos])
        if comp_rows is not None and comp_rows.shape[0]:
            keys = torch.cat([keys, comp_rows])
        keys_f = keys.float()
        sink = attn.attn_sink.float()
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], QUERY_CHUNK):
            p = pos[a:a + QUERY_CHUNK, None]
            mask = (key_pos[None, :] <= p) & (key_pos[None, :] > p - W) & (key_pos[None, :] >= rect_lo)
            if comp_rows is not None and comp_rows.shape[0]:
                mask = torch.cat([mask, comp_mask[a:a + QUERY_CHUNK]], dim=1)
            logits = torch.einsum("thd,kd->thk", q[a:a + QUERY_CHUNK].float(), keys_f) * attn.scale
            logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
            if official:
                o = sink_softmax_values(logits, sink, keys_f, keys.dtype)
            else:
                # the sink joins the softmax denominator only (a logit with a zero value vector)
                both = torch.cat([logits, sink[None, :, None].expand(logits.shape[0], -1, 1)], dim=-1)
                probs = torch.softmax(both, dim=-1)[..., :-1]
                o = torch.einsum("thk,kd->thd", probs.to(keys.dtype), keys)
            out[a:a + QUERY_CHUNK] = o.to(q.dtype)
        return out

    @staticmethod
    def write_ring(st: LayerState, kv: torch.Tensor, start: int, rect_lo: int = 0) -> None:
        """Record the last positions of `kv` (rows start..) in the window ring; none before
        `rect_lo` (bounded replay: rows no window may see)."""
        ring_size, n = st.ring.shape[0], kv.shape[0]
        keep = torch.arange(min(max(start, start + n - ring_size, rect_lo), start + n), start + n, device=kv.device)
        if st.ring.dtype == torch.uint8:
            st.ring[keep % ring_size] = pack_kv_fp8(kv[keep - start], ring_rope_dim(st.ring, kv))
        else:
            st.ring[keep % ring_size] = kv[keep - start].to(st.ring.dtype)


def candidate_rows(scores: torch.Tensor, valid: torch.Tensor, block_size: int, n_blocks: int) -> torch.Tensor:
    """V4.1's first top-k level: rows [n, R] inside each query's `n_blocks` best blocks of
    `block_size` consecutive rows, a block scoring its best visible row (capped at the bf16
    maximum); the last block holding a visible row is always kept; ties go to the lower block."""
    n, R = scores.shape
    nb = -(-R // block_size)
    padded = torch.nn.functional.pad(scores, (0, nb * block_size - R), value=float("-inf"))
    block = padded.view(n, nb, block_size).amax(-1).clamp(max=BF16_MAX)
    seen = valid.sum(dim=1)
    last = ((seen - 1).clamp(min=0) // block_size)[:, None]
    pin = torch.where(seen[:, None] > 0, float("inf"), float("-inf")).to(block.dtype)
    block = block.scatter(1, last, pin)
    top = torch.sort(block, dim=-1, descending=True, stable=True).indices[:, :n_blocks]
    keep = torch.zeros(n, nb, dtype=torch.bool, device=scores.device).scatter_(1, top, True)
    keep &= block > float("-inf")
    return keep.repeat_interleave(block_size, dim=1)[:, :R] & valid


def rectangles(attn, batch) -> list[int]:
    """Each sequence's first window-visible position in this layer: the bounded-replay rectangle
    in a YOCO consumer layer, 0 elsewhere."""
    if batch.truncation is None or not attn.yoco_consumer:
        return [0] * batch.num_seqs
    return batch.truncation[1]


def _share(batch, key, i: int, value) -> None:
    """Hand sequence i's `value` to later layers of this forward (`ForwardBatch.shared`)."""
    batch.shared.setdefault(key, [None] * batch.num_seqs)[i] = value


def sink_softmax_values(logits: torch.Tensor, sink: torch.Tensor, values: torch.Tensor,
                        p_dtype: torch.dtype) -> torch.Tensor:
    """The official order of the sink softmax times the values, fp32 [..., H, D]: logits [.., H, K]
    (masked keys -inf; every query sees at least itself), sink [H], values [.., K, D] fp32. The max
    is over the keys alone; the unnormalised probabilities are rounded to `p_dtype` for the
    product; the fp32 denominator adds the sink's exp(sink - max)."""
    m = logits.amax(dim=-1, keepdim=True)
    e = torch.exp(logits - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink[:, None] - m)
    return torch.matmul(e.to(p_dtype).float(), values) / denom


def ring_rope_dim(ring: torch.Tensor, kv: torch.Tensor) -> int:
    rope = packed_rope_dim(kv.shape[1], ring.shape[-1])
    if rope is None:
        raise ValueError(f"kv_fp8 ring rows of {ring.shape[-1]} bytes do not hold {kv.shape[1]}-wide keys")
    return rope
