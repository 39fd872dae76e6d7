"""V4 attention on torch_npu: the sparse-attention core on `npu_sparse_flash_attention` (SFA) and
the CSA top-k on `npu_lightning_indexer`; everything else (compressors, cache writes, V4.1's
shared selections) is the core's portable backend, running on the same device.

NOTHING HERE HAS RUN ON ASCEND HARDWARE. It is written from the torch_npu 2.13.0 doc pages and
schemas and tested only on the simulated device of `tests/ascend/fake_npu` (CPU tensors).

Interface level: a full attention backend (`deepinfer_core.contracts.AttentionBackend`), and a
graph-capable one (`GraphAttentionBackend`): a decode / verify batch of the decode graphs runs on
fixed-shape device metadata built once per step and is captured in an NPUGraph (aclgraph); that
path is attention_graph.py. Everything below describes the eager path (any batch).
`AscendAttentionBackend` subclasses the core's `PortableAttentionBackend`, keeps its `compress`,
`select` (HCA masks, V4.1 index sources and consumers), `write_ring` and state layout, and replaces
(a) `PortableAttentionBackend.index_select` for V4 CSA layers (indexer with its own compressor) by
one `npu_lightning_indexer` call per key pool, and (b) the per-sequence `attend` by one
`npu_sparse_flash_attention` call over the whole batch of the layer.

Mapping (per layer forward; host ints only from the batch: starts, lengths, row counts, tables):
1. Compressors, per sequence, exactly as the portable backend (pool, finalize, write rows, tails).
2. Indexer (V4 CSA): every query token is its own TND row (query length 1), because the op's causal
   rule knows no compression ratio. query <- the indexer queries [T, Hi, 128]; weights <- the head
   weights [T, Hi] (1/sqrt(Di) and Hi^-1/2 already folded in by the model) cast to the query dtype
   (A5 refuses fp32 weights); key <- the paged indexer-key pool viewed PA_BSND
   [blocks, block_size / ratio, 1, 128] (block size a multiple of 16: the cache's block_size must
   be a multiple of 16 * ratio); block_table <- the token's sequence's table (int32, one row per
   token); actual_seq_lengths_key <- (position + 1) // ratio, the blocks complete at that token
   (computed on the device); sparse_count <- index_topk; sparse_mode 0 (the key length is the
   whole visibility rule). The result: int32 row indices [T, topk], -1 where fewer rows are
   visible. [UNCONFIRMED: the padding value and the tie order; the portable backend breaks ties
   to the lower row (fp32 numerics) or as `torch.topk` (official numerics, bf16 scores).]
3. Sparse attention: one TND batch. Per sequence the logical KV is
   [window ring rows (positions lo..start-1) | the chunk's new KV rows | every compressed row],
   gathered and concatenated (bf16/fp16, the query's dtype) -- the same gather the portable
   backend does; actual_seq_lengths_kv are their prefix sums. query (q_nope) <- V4's whole
   512-dim query (RoPE tail included), key and value <- the same tensor of V4's 512-dim shared
   KV rows (K = V), query_rope / key_rope <- zeros of width 64 [UNCONFIRMED: that zero rope
   slots add exactly 0 and cost nothing but bandwidth]; scale_value <- attn.scale (512^-1/2);
   sinks <- attn_sink (fp32 [H]) [UNCONFIRMED: read as one extra logit per head in the softmax
   denominator, which is V4's sink]; attention_mode 2, sparse_mode 0, sparse_block_size 1.
   sparse_indices per query token (int32 [T, 1, K]) = its window positions (p-W, p] (and >= the
   bounded-replay rectangle) mapped to logical indices, union the compressed rows it sees (CSA:
   the indexer's picks; HCA: every complete block b < (p+1)//ratio; V4.1: the shared mask), each
   shifted past the window and new rows; sorted descending so valid entries come first and -1
   pads the rest; K = window + the widest compressed part of the batch. [UNCONFIRMED: the largest
   sparse size the op accepts -- HCA at 1M tokens is about window + 8192.]
4. The new KV rows go into the window ring (portable `write_ring`).

Host syncs: none added (index tensors are built on the device; lengths and block tables are host
lists copied once per call). The inherited portable code keeps its own (`write_rows` reads the
last block index); the graph path has none and copies nothing from the host. Not mapped yet:
one paged bf16 pool holding the SWA blocks and compressed blocks side by side, which would let
SFA read them in place (PA_BSND) instead of a gather (here and in the graph path); the kv_fp8
cache (SFA's quantized variant needs Q_D 576); A2/A3 (SFA takes no sinks there); the official
(QAT) rounding order of the sink softmax and of the indexer scores, which the fused ops do not
follow (differences at bf16-noise level, and top-k picks may differ at near-ties).
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.ops.kv_fp8 import unpack_kv_fp8
from deepinfer_core.ops.portable_attention import (
    PortableAttentionBackend,
    rectangles,
    ring_rope_dim,
)

from .attention_graph import META_KEY, GraphMeta, graph_forward

ROPE_DIM = 64          # SFA's MLA-absorb rope width: V4 puts zeros there
HALF = (torch.bfloat16, torch.float16)
SFA_HEAD_DIM, INDEX_HEAD_DIM, A5_INDEX_HEADS = 512, 128, (8, 16, 24, 32, 64)
SPARSE_COUNTS = (*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192)


def unsupported(soc_family: str, dtype: torch.dtype, cfg: Any, block_size: int) -> str | None:
    """Why this backend cannot serve the build (SoC family, compute dtype, model config, the
    state cache's block size), or None: the op table's test, once at start-up."""
    if soc_family != "A5":
        return ("portable: npu_sparse_flash_attention takes no sinks before the Ascend 950, and "
                "V4's attention has one")
    if dtype not in HALF:
        return f"portable: the SFA / indexer ops take bfloat16 or float16, not {dtype}"
    if cfg.head_dim != SFA_HEAD_DIM or not 1 <= cfg.num_attention_heads <= 128:
        return (f"portable: SFA's MLA-absorb mode needs head_dim {SFA_HEAD_DIM} and 1-128 heads "
                f"(the model has {cfg.head_dim}, {cfg.num_attention_heads})")
    if 4 in cfg.compress_ratios and not cfg.index_keys_projected:        # V4 CSA indexer
        if cfg.index_head_dim != INDEX_HEAD_DIM or cfg.index_n_heads not in A5_INDEX_HEADS:
            return (f"portable: npu_lightning_indexer needs D {INDEX_HEAD_DIM} and (A5) "
                    f"{list(A5_INDEX_HEADS)} heads (the model has {cfg.index_head_dim}, "
                    f"{cfg.index_n_heads})")
        if cfg.index_topk not in SPARSE_COUNTS or (block_size // 4) % 16:
            return (f"portable: index_topk {cfg.index_topk} or {block_size // 4} key rows per "
                    "block outside npu_lightning_indexer's documented values")
    return None


class AscendAttentionBackend(PortableAttentionBackend):
    batch_invariant = False     # not claimed: the fused ops' reduction order is undocumented
    # its ops are torch_npu's: graphs are torch.npu's NPUGraph also where the tensors sit on the
    # CPU (the tests' simulated torch_npu); runner/cuda_graphs.GraphApi.of reads it
    graph_device_type = "npu"

    def __init__(self, torch_npu: Any, official: bool = False, index_topk: int | None = None):
        super().__init__(official=official)
        self._sfa = torch_npu.npu_sparse_flash_attention       # bound once
        self._indexer = torch_npu.npu_lightning_indexer
        self.index_topk = index_topk     # V4.1 consumers' selection width (None: every row)

    # ---- decode graphs (contracts.GraphAttentionBackend) -----------------------------------------
    def graph_num_extra(self, num_seqs: int, query_len: int) -> int:
        return 0                          # the metadata derives from positions, slots and tables

    def graph_meta(self, batch, max_blocks: int) -> GraphMeta:
        """Install fixed-shape metadata into the graph's static batch (its states are the padding
        state, whose block is scratch); `derive` refills it on the device before each replay."""
        meta = batch.backend_meta[META_KEY] = GraphMeta(batch, max_blocks)
        return meta

    # ---- the layer -------------------------------------------------------------------------------
    def forward(self, attn, inp, batch, states: list) -> torch.Tensor:
        if inp.q.dtype not in HALF:
            raise ValueError(f"AscendAttentionBackend: query dtype {inp.q.dtype}; "
                             "npu_sparse_flash_attention takes bfloat16 or float16")
        meta = batch.backend_meta.get(META_KEY)
        if meta is not None:
            return graph_forward(self, attn, inp, meta, states)
        rect = rectangles(attn, batch)
        full = batch.shared.get("yoco_full") if attn.yoco_consumer else None
        comp_rows_of = zip(full.seq_slices(), full.starts) if full is not None else None
        ix = attn.indexer
        lightning = ix is not None and ix.compressor is not None       # V4 CSA
        slices = batch.seq_slices()
        rows: list = [None] * len(states)      # each sequence's compressed rows [n_rows, D]
        picks: list = [None] * len(states)     # row indices [n, k] int32, -1 padded
        for i, (sl, start, st) in enumerate(zip(slices, batch.starts, states)):
            csl, cstart = next(comp_rows_of) if comp_rows_of is not None else (sl, start)
            if attn.compressor is not None:
                comp = attn.compressor
                z = None if inp.comp_z is None else inp.comp_z[csl]
                if ix is not None and ix.wk is not None:                # V4.1 key source
                    self.compress(st.compressor, inp.comp_kv[csl], z, cstart,
                                  comp.finalize_with_prerope, (st.indexer, ix.keys))
                else:
                    self.compress(st.compressor, inp.comp_kv[csl], z, cstart, comp.finalize)
            if st.compressor is None:
                continue
            rows[i] = st.compressor.read_rows()
            if lightning:
                self.compress(st.indexer, inp.idx_kv[sl], inp.idx_z[sl], start,
                              ix.compressor.finalize)
            else:
                mask = self.select(attn, inp, batch, i, st, sl, start, batch.positions[sl])
                k = mask.shape[1] if attn.index_source < 0 or self.index_topk is None \
                    else min(mask.shape[1], self.index_topk)
                picks[i] = mask_to_indices(mask, k)
        if lightning:
            picks = self.lightning_topk(inp.idx_q, inp.idx_w, batch, states, attn.ratio, ix.topk)
        out = self.sparse_attention(attn, inp.q, inp.kv, batch, states, rect, rows, picks)
        for sl, start, st, lo in zip(slices, batch.starts, states, rect):
            self.write_ring(st, inp.kv[sl], start, lo)
        return out

    # ---- the indexer -----------------------------------------------------------------------------
    def lightning_topk(self, q: torch.Tensor, w: torch.Tensor, batch, states: list, ratio: int,
                       topk: int) -> list:
        """Each sequence's top-`topk` indexer rows per query token, [n, topk] int32 (-1 padded):
        one `npu_lightning_indexer` call per distinct key pool (the engine's cache has one)."""
        slices = batch.seq_slices()
        groups: dict[int, list[int]] = {}
        for i, st in enumerate(states):
            groups.setdefault(id(st.indexer.pool), []).append(i)
        picks: list = [None] * len(states)
        for members in groups.values():
            pool = states[members[0]].indexer.pool                   # [blocks, rpb, Di]
            toks = torch.cat([torch.arange(slices[i].start, slices[i].stop) for i in members])
            toks = toks.to(q.device)
            seq_of = [j for j, i in enumerate(members) for _ in range(batch.lens[i])]
            width = max(1, max(len(states[i].indexer.table) for i in members))
            tables = [states[i].indexer.table.ids + [0] * (width - len(states[i].indexer.table))
                      for i in members]
            tables_t = torch.tensor(tables, dtype=torch.int32, device=q.device)
            seq_t = torch.tensor(seq_of, dtype=torch.long, device=q.device)
            qg = q if len(members) == len(states) else q[toks]
            wg = w if len(members) == len(states) else w[toks]
            pos = batch.positions if len(members) == len(states) else batch.positions[toks]
            n = qg.shape[0]
            idx, _ = self._indexer(
                qg.contiguous(), pool.view(pool.shape[0], pool.shape[1], 1, pool.shape[2]),
                wg.to(qg.dtype).contiguous(),
                actual_seq_lengths_query=torch.arange(1, n + 1, dtype=torch.int32,
                                                      device=q.device),
                actual_seq_lengths_key=((pos + 1) // ratio).to(torch.int32),
                block_table=tables_t[seq_t], layout_query="TND", layout_key="PA_BSND",
                sparse_count=topk, sparse_mode=0)
            idx = idx.view(n, topk)
            off = 0
            for i in members:
                picks[i] = idx[off:off + batch.lens[i]]
                off += batch.lens[i]
        return picks

    # ---- sparse attention ------------------------------------------------------------------------
    def sparse_attention(self, attn, q: torch.Tensor, kv: torch.Tensor, batch, states: list,
                         rect: list[int], rows: list, picks: list) -> torch.Tensor:
        """One `npu_sparse_flash_attention` over the batch: [T, H, D] in q's dtype."""
        keys, lens, parts = [], [], []
        W = attn.window
        for i, (sl, start, st) in enumerate(zip(batch.seq_slices(), batch.starts, states)):
            ring_keys, first = window_rows(st.ring, start, W, rect[i], kv)
            n, r = sl.stop - sl.start, ring_keys.shape[0]
            seq_keys = [ring_keys.to(q.dtype), kv[sl].to(q.dtype)]
            if rows[i] is not None and rows[i].shape[0]:
                seq_keys.append(rows[i].to(q.dtype))
            keys += seq_keys
            lens.append(sum(k.shape[0] for k in seq_keys))
            parts.append(sparse_row(batch.positions[sl], first, W, rect[i],
                                    picks[i] if rows[i] is not None else None, r + n))
        K = max(p.shape[1] for p in parts)
        sparse = torch.cat([torch.nn.functional.pad(p, (0, K - p.shape[1]), value=-1)
                            for p in parts])
        key = torch.cat(keys)[:, None, :]                                  # TND [sum Lkv, 1, D]
        T, H, _ = q.shape
        out, _, _ = self._sfa(
            q.contiguous(), key, key, sparse[:, None, :], attn.scale,
            actual_seq_lengths_query=prefix_sums(batch.lens, q.device),
            actual_seq_lengths_kv=prefix_sums(lens, q.device),
            query_rope=q.new_zeros(T, H, ROPE_DIM), key_rope=key.new_zeros(key.shape[0], 1,
                                                                           ROPE_DIM),
            sparse_block_size=1, layout_query="TND", layout_kv="TND", sparse_mode=0,
            attention_mode=2, sinks=attn.attn_sink.float())
        return out


def window_rows(ring: torch.Tensor, start: int, window: int, rect_lo: int,
                kv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the ring rows of positions first..start-1 a query of this chunk may see, first): the
    portable `attend`'s ring gather (kv_fp8 rings unpacked)."""
    first = min(max(0, start - window + 1, rect_lo), start)
    pos = torch.arange(first, start, device=kv.device)
    got = ring[pos % ring.shape[0]]
    if ring.dtype == torch.uint8:
        got = unpack_kv_fp8(got, kv.shape[1], ring_rope_dim(ring, kv), kv.dtype)
    return got, first


def sparse_row(pos: torch.Tensor, first: int, window: int, rect_lo: int,
               comp: torch.Tensor | None, comp_offset: int) -> torch.Tensor:
    """One sequence's `sparse_indices` [n, window + k] int32 (logical KV = [ring rows from
    position `first` | new rows | compressed rows at `comp_offset`]): the window positions
    (p - window, p] at or after `rect_lo`, and the compressed rows `comp` [n, k] (-1 = none),
    sorted descending: valid entries first, -1 after."""
    lag = torch.arange(window, device=pos.device)
    x = pos[:, None] - lag[None, :]                                    # window positions
    win = torch.where((x >= first) & (x >= rect_lo), x - first, -1)
    if comp is not None and comp.shape[1]:
        comp = torch.where(comp >= 0, comp.long() + comp_offset, -1)
        win = torch.cat([win, comp], dim=1)
    return torch.sort(win, dim=1, descending=True).values.to(torch.int32)


def mask_to_indices(mask: torch.Tensor, k: int) -> torch.Tensor:
    """A row mask [n, R] (at most k set per row) as indices [n, k] int32, valid first, -1 after."""
    idx = torch.arange(mask.shape[1], device=mask.device)
    got = torch.where(mask, idx[None, :], -1)
    return torch.sort(got, dim=1, descending=True).values[:, :k].to(torch.int32)


def prefix_sums(lengths: list[int], device) -> torch.Tensor:
    """TND lengths: int32 prefix sums (host ints, one host-to-device copy)."""
    out, acc = [], 0
    for n in lengths:
        acc += n
        out.append(acc)
    return torch.tensor(out, dtype=torch.int32, device=device)
