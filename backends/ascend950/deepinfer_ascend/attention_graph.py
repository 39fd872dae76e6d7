"""The Ascend attention backend's graph path: a decode or verify batch of fixed shape (the decode
graphs' padded bucket: S sequences of q tokens each, runner/cuda_graphs.py) on device metadata
only, so an NPUGraph (aclgraph) captures it once and replays it at every step.

Metadata (`GraphMeta`), fixed-shape device tensors:
* refilled once per step by `derive` (recorded in the graph, before the model): each sequence's
  slot, first position and block-table row (a gather from the engine's per-slot table), and per
  query token its slot and block-table row (the indexer's block table);
* constant for the graph's shape, built at `graph_meta`: the TND prefix sums of the queries (q per
  sequence for SFA, 1 per token for the indexer);
* built once per step by the first layer that needs them (`GraphMeta.part`; `derive` forgets them,
  so the capture records their building once, in the first such layer): the window rows each
  sequence reads and the window part of every token's sparse indices; per compression ratio the
  blocks the step may close, the tail entries they pool and the rows they write; HCA's sparse
  indices; the indexer's key lengths (p + 1) // 4; the KV prefix sums per key length.

Per layer (device ops of fixed shape only: no host value, no host sync; V4's layers):
1. Compressors (main, then a CSA layer's indexer): the step's per-token inputs go into the slot's
   tails first (index_put at [slot, position % tail_len]); then each of the ceil(q / ratio) blocks
   per sequence the step may close is pooled from the tails, which still hold every position it
   reads (tails keep c * ratio + backtrack positions and q <= backtrack + 1), finalized by the
   model's code and written into its paged row. A candidate that closes nothing writes into the
   padding block (scratch: DecodeGraphs' spare block). The math is the portable `compress`'s.
2. CSA: `npu_lightning_indexer` reads the indexer keys in place: PA_BSND over the paged pool, per
   query token its sequence's block-table row and key length (p + 1) // 4, as the eager path.
3. `npu_sparse_flash_attention`, TND with one KV batch per sequence of fixed length
   L = (W + q - 1 window rows | the compressed rows): the ring rows of positions s - W + 1 .. s - 1
   (and the step's own new rows) are gathered by slot, the compressed rows by block table -- the
   CSA picks of each token, or every HCA row a sequence can have (max_blocks rows). The gather is
   unavoidable: SFA takes one key tensor and the cache keeps window rings per slot apart from the
   compressed rows per block (HCA's one-row blocks are below PA_BSND's block size of 16 anyway).
   Sparse indices as the eager path orders them (compressed rows, then window positions, each
   descending; -1 after).
4. The new KV rows go into the ring (index_put at [slot, position % ring_len]).

Not served here (the layer raises, so capture fails and the runner stays eager with a warning):
V4.1's shared compressors and selections, YOCO and bounded replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer_core.ops.kv_fp8 import pack_kv_fp8, unpack_kv_fp8
from deepinfer_core.ops.portable_attention import ring_rope_dim

META_KEY = "ascend_graph"
ROPE_DIM = 64


@dataclass
class WindowPart:
    """The window rows of a step: per sequence positions s - W + 1 .. s + q - 1."""

    ring_row: torch.Tensor     # [S, Wq] ring entry of each position (clamped at 0)
    is_new: torch.Tensor       # [S, Wq] the position is one of the step's own tokens
    new_row: torch.Tensor      # [S, Wq] its row of the flat batch (clamped into the sequence)
    sparse: torch.Tensor       # [T, W] int32 window key indices per token, descending, -1 after


@dataclass
class ClosingPart:
    """The blocks of one compression ratio the step may close, ceil(q / ratio) per sequence."""

    token_tail: torch.Tensor   # [T] tail entry of each token's position
    slot: torch.Tensor         # [N] slot of each candidate
    tail: torch.Tensor         # [N, c * ratio] tail entries of the positions it pools
    first_block: torch.Tensor  # [N] 1 where the candidate is block 0 (no previous block)
    block_start: torch.Tensor  # [N] its first position (RoPE of the row)
    blk: torch.Tensor          # [N] the paged block its row goes to (scratch where none closes)
    row: torch.Tensor          # [N] the row inside that block


class GraphMeta:
    """Fixed-shape device metadata of one graph batch (contracts.GraphMetadata)."""

    def __init__(self, batch, max_blocks: int):
        S, q = batch.num_seqs, batch.lens[0]
        if any(n != q for n in batch.lens):
            raise ValueError(f"graph batch: every sequence feeds the same tokens, got {batch.lens}")
        dev, i32, i64 = batch.positions.device, torch.int32, torch.int64
        self.num_seqs, self.query_len, self.max_blocks = S, q, max_blocks
        self.positions = batch.positions                     # static [T], refilled by the runner
        self.scratch_block = batch.states[0].table.ids[0]    # the padding state's block
        T = S * q
        self.token_seq = torch.arange(S, device=dev).repeat_interleave(q)
        self.token_offset = torch.arange(q, device=dev).repeat(S)
        self.query_lens = (torch.arange(1, S + 1, device=dev) * q).to(i32)
        self.token_query_lens = torch.arange(1, T + 1, dtype=i32, device=dev)
        self.slots = torch.zeros(S, dtype=i64, device=dev)
        self.starts = torch.zeros(S, dtype=i64, device=dev)
        self.block_table = torch.zeros(S, max_blocks, dtype=i32, device=dev)
        self.token_slots = torch.zeros(T, dtype=i64, device=dev)
        self.token_table = torch.zeros(T, max_blocks, dtype=i32, device=dev)
        self._parts: dict[Any, Any] = {}

    # ---- contracts.GraphMetadata --------------------------------------------------------------
    def extra_inputs(self, starts: list[int]) -> list[int]:
        return []                         # everything derives from the positions and slots

    def extra_inputs_device(self, starts: torch.Tensor) -> torch.Tensor:
        return starts.new_zeros(0)

    def derive(self, slots: torch.Tensor, block_table: torch.Tensor, extra: torch.Tensor) -> None:
        """Refill from the static positions, the batch's slots [S] and the engine's per-slot block
        table [slots, max_blocks]: device ops only (the graph records them)."""
        if block_table.shape[1] != self.max_blocks:
            raise ValueError(f"block table is {block_table.shape[1]} blocks wide, the graph "
                             f"metadata {self.max_blocks}")
        self.starts.copy_(self.positions.view(self.num_seqs, self.query_len)[:, 0])
        self.slots.copy_(slots)
        torch.index_select(block_table, 0, self.slots, out=self.block_table)
        torch.index_select(self.slots, 0, self.token_seq, out=self.token_slots)
        torch.index_select(self.block_table, 0, self.token_seq, out=self.token_table)
        self._parts.clear()

    # ---- per-step parts, built by the first layer that asks ------------------------------------
    def part(self, key, build: Callable[[], Any]):
        got = self._parts.get(key)
        if got is None:
            got = self._parts[key] = build()
        return got

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.positions.device)

    def window(self, window: int, ring_len: int) -> WindowPart:
        def build():
            S, q = self.num_seqs, self.query_len
            s = self.starts[:, None]
            x = s - (window - 1) + self.arange(window + q - 1)            # positions [S, Wq]
            new_row = self.arange(S)[:, None] * q + (x - s).clamp(0, q - 1)
            lag = self.arange(window)
            p = self.positions[:, None]
            sparse = torch.where(p - lag >= 0, self.token_offset[:, None] + window - 1 - lag, -1)
            return WindowPart(x.clamp(min=0) % ring_len, x >= s, new_row, sparse.to(torch.int32))
        return self.part(("window", window, ring_len), build)

    def closing(self, ratio: int, overlap: bool, tail_len: int, rows_per_block: int) -> ClosingPart:
        def build():
            q = self.query_len
            b = (self.starts // ratio)[:, None] + self.arange(-(-q // ratio))        # [S, nb]
            closes = b < ((self.starts + q) // ratio)[:, None]
            c = 2 if overlap else 1
            pos = (b[..., None] - (c - 1)) * ratio + self.arange(c * ratio)
            col = (b // rows_per_block).clamp(max=self.max_blocks - 1)
            blk = torch.where(closes, self.block_table.gather(1, col).long(), self.scratch_block)
            row = torch.where(closes, b % rows_per_block, 0)
            return ClosingPart(self.positions % tail_len,
                               self.slots[:, None].expand_as(b).flatten(),
                               (pos.clamp(min=0) % tail_len).flatten(0, 1), (b == 0).flatten(),
                               (b * ratio).flatten(), blk.flatten(), row.flatten())
        return self.part(("closing", ratio, overlap, tail_len, rows_per_block), build)

    def every_row(self, ratio: int, rows_per_block: int, win: WindowPart) -> tuple:
        """HCA: (block [S, R], row [S, R]) of every row a sequence can hold (R = max_blocks *
        rows_per_block) and the sparse indices [T, R + W] of the rows each token sees and of its
        window positions."""
        def build():
            r = self.arange(self.max_blocks * rows_per_block)
            blk = self.block_table[:, r // rows_per_block].long()
            n = ((self.positions + 1) // ratio)[:, None]                 # rows each token sees
            comp = torch.where(r < n, win.ring_row.shape[1] + r, -1)
            return blk, (r % rows_per_block).expand_as(blk), descending(comp, win.sparse)
        return self.part(("every_row", ratio, rows_per_block, win.sparse.shape[1]), build)

    def key_lens(self, ratio: int) -> torch.Tensor:
        """The indexer's key length per query token: the rows complete at its position."""
        return self.part(("key_lens", ratio),
                         lambda: ((self.positions + 1) // ratio).to(torch.int32))

    def kv_lens(self, length: int) -> torch.Tensor:
        """TND prefix sums of S KV batches of `length` keys each."""
        return self.part(("kv_lens", length), lambda: (self.arange(self.num_seqs) + 1).mul(
            length).to(torch.int32))


def descending(comp: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """One token's sparse indices [T, K] int32: compressed key indices (all above the window's)
    then window ones, each descending, -1 after (the eager path's `sparse_row` order)."""
    both = torch.cat([comp.to(window.dtype), window], dim=1)
    return torch.sort(both, dim=1, descending=True).values


# ---- the layer --------------------------------------------------------------------------------

def check_v4_layer(attn, st) -> None:
    """The graph path serves V4's layer kinds: window only, CSA with its lightning indexer, HCA."""
    v4 = not attn.yoco_consumer and (
        (attn.compressor is None and st.compressor is None)
        or (attn.compressor is not None and attn.indexer is None and attn.index_source < 0)
        or (attn.compressor is not None and attn.indexer is not None
            and attn.indexer.compressor is not None))
    if not v4:
        raise NotImplementedError(
            f"Ascend graph attention: layer {attn.layer_id} is a V4.1 layer (shared compressors or "
            "selections, YOCO); its decode runs eagerly (enforce_eager=True says so up front)")


def graph_forward(backend, attn, inp, meta: GraphMeta, states: list) -> torch.Tensor:
    """One layer over the graph batch: [T, H, D] in q's dtype (see the module docstring)."""
    st = states[0]                     # the padding state: only its pools and formats are read
    check_v4_layer(attn, st)
    pools, W, q = st.pools, attn.window, inp.q
    win = meta.window(W, pools.ring.shape[1])
    comp_keys, sparse = None, None
    if attn.compressor is not None:
        compress(meta, pools.compressor, st.compressor, inp.comp_kv, inp.comp_z,
                 attn.compressor.finalize)
        rows = pools.compressor["rows"]
        fp8 = st.compressor.fp8_dims
        ix = attn.indexer
        if ix is not None:                                             # V4 CSA
            compress(meta, pools.indexer, st.indexer, inp.idx_kv, inp.idx_z,
                     ix.compressor.finalize)
            picks = lightning_picks(backend, meta, inp.idx_q, inp.idx_w, pools.indexer["rows"],
                                    attn.ratio, ix.topk)
            comp_keys, comp = picked_rows(meta, rows, picks, W)
            sparse = descending(comp, win.sparse)
        else:                                                          # V4 HCA
            blk, row, sparse = meta.every_row(attn.ratio, rows.shape[1], win)
            comp_keys = rows[blk, row]
        if fp8 is not None:
            comp_keys = unpack_kv_fp8(comp_keys, *fp8, dtype=torch.bfloat16)
    keys = window_keys(meta, win, pools.ring, inp.kv).to(q.dtype)
    if comp_keys is not None:
        keys = torch.cat([keys, comp_keys.to(q.dtype)], dim=1)
    else:
        sparse = win.sparse
    S, L = keys.shape[:2]
    key = keys.reshape(S * L, 1, -1)
    T, H, _ = q.shape
    out, _, _ = backend._sfa(
        q.contiguous(), key, key, sparse[:, None, :], attn.scale,
        actual_seq_lengths_query=meta.query_lens, actual_seq_lengths_kv=meta.kv_lens(L),
        query_rope=q.new_zeros(T, H, ROPE_DIM), key_rope=key.new_zeros(S * L, 1, ROPE_DIM),
        sparse_block_size=1, layout_query="TND", layout_kv="TND", sparse_mode=0,
        attention_mode=2, sinks=attn.attn_sink.float())
    write_ring(meta, pools.ring, inp.kv)
    return out


def compress(meta: GraphMeta, pools: dict, cs, kv: torch.Tensor, z: torch.Tensor,
             finalize) -> None:
    """The portable `compress` over the graph batch: tails first, then every candidate block
    pooled from the tails and its row written (scratch where the candidate closes nothing)."""
    m, tail_kv, tail_z = cs.ratio, pools["tail_kv"], pools["tail_z"]
    room = tail_kv.shape[1] - (2 if cs.overlap else 1) * m        # the tails' backtrack room
    if meta.query_len > room + 1:
        raise ValueError(f"Ascend graph attention: {meta.query_len} tokens per sequence would "
                         f"overwrite tail entries a closing block still pools (room {room})")
    part = meta.closing(m, cs.overlap, tail_kv.shape[1], pools["rows"].shape[1])
    tail_kv.index_put_((meta.token_slots, part.token_tail), kv)
    tail_z.index_put_((meta.token_slots, part.token_tail), z)
    ext_kv = tail_kv[part.slot[:, None], part.tail]                    # [N, c*m, c*d]
    ext_z = tail_z[part.slot[:, None], part.tail]
    if cs.overlap:
        d = kv.shape[1] // 2
        prev_z = ext_z[:, :m, :d].masked_fill(part.first_block[:, None, None], float("-inf"))
        slot_kv = torch.cat([ext_kv[:, :m, :d], ext_kv[:, m:, d:]], dim=1)   # [N, 2m, d]
        slot_z = torch.cat([prev_z, ext_z[:, m:, d:]], dim=1)
    else:
        slot_kv, slot_z = ext_kv, ext_z
    pooled = (slot_kv * torch.softmax(slot_z, dim=1)).sum(dim=1)
    rows = finalize(pooled, part.block_start)
    if cs.fp8_dims is not None:
        rows = pack_kv_fp8(rows, cs.fp8_dims[1])
    pools["rows"].index_put_((part.blk, part.row), rows.to(pools["rows"].dtype))


def lightning_picks(backend, meta: GraphMeta, q: torch.Tensor, w: torch.Tensor,
                    pool: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """Each token's top-`topk` indexer rows [T, topk] int32 (-1 padded): one indexer call over
    the batch reading the key pool in place (each token its own TND query batch)."""
    n = q.shape[0]
    idx, _ = backend._indexer(
        q.contiguous(), pool.view(pool.shape[0], pool.shape[1], 1, pool.shape[2]),
        w.to(q.dtype).contiguous(), actual_seq_lengths_query=meta.token_query_lens,
        actual_seq_lengths_key=meta.key_lens(ratio), block_table=meta.token_table,
        layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=0)
    return idx.view(n, topk)


def picked_rows(meta: GraphMeta, rows: torch.Tensor, picks: torch.Tensor, window: int):
    """CSA: (each sequence's picked rows [S, q*topk, ...] gathered by block table, each token's
    compressed key indices [T, topk]: its picks in ascending row order, past the window rows)."""
    S, q, k = meta.num_seqs, meta.query_len, picks.shape[1]
    asc = torch.sort(torch.where(picks >= 0, picks, torch.iinfo(picks.dtype).max), dim=1).values
    valid = asc != torch.iinfo(picks.dtype).max
    r = torch.where(valid, asc, 0).long().view(S, q * k)
    rpb = rows.shape[1]
    blk = meta.block_table.gather(1, (r // rpb).clamp(max=meta.max_blocks - 1)).long()
    slot_of = meta.token_offset[:, None] * k + meta.arange(k)
    comp = torch.where(valid, window + q - 1 + slot_of, -1)
    return rows[blk, r % rpb], comp


def window_keys(meta: GraphMeta, win: WindowPart, ring: torch.Tensor,
                kv: torch.Tensor) -> torch.Tensor:
    """[S, W + q - 1, D]: ring rows of the positions before the step, the step's own rows after."""
    got = ring[meta.slots[:, None], win.ring_row]
    if ring.dtype == torch.uint8:
        got = unpack_kv_fp8(got, kv.shape[1], ring_rope_dim(ring, kv), kv.dtype)
    return torch.where(win.is_new[..., None], kv[win.new_row], got.to(kv.dtype))


def write_ring(meta: GraphMeta, ring: torch.Tensor, kv: torch.Tensor) -> None:
    """The step's KV rows into their slots' rings at position % ring_len (after the attention
    read them, as the eager path; packed for a kv_fp8 ring)."""
    pos = meta.part(("ring", ring.shape[1]), lambda: meta.positions % ring.shape[1])
    rows = pack_kv_fp8(kv, ring_rope_dim(ring, kv)) if ring.dtype == torch.uint8 else \
        kv.to(ring.dtype)
    ring.index_put_((meta.token_slots, pos), rows)
