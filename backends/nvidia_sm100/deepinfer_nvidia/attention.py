"""The NVIDIA attention backend: the whole batch of one layer in a few kernel launches.

Per layer, in this order (each step may overwrite what an earlier one reads, so the order matters):
1. compressors: pool the blocks this batch closes (reading older tokens from the slot's tails), finalize
   the rows (norm, RoPE, QAT quant: the model's own code, batched), write them into their paged
   blocks, then store the newest tokens into the tails;
2. CSA layers: the indexer's compressor the same way, then indexer scores and the top-k rows per query;
3. sparse attention over [window ring | new keys | selected compressed rows] with the sink;
4. the new keys go into the window ring.
Semantics are the portable backend's (`deepinfer_core.ops.portable_attention`), batched over
sequences with device metadata (`batch_meta`) instead of a Python loop; `official` (the QAT
numerics) selects the portable backend's `official=True` rounding in the indexer scores and the sink
softmax.
"""
from __future__ import annotations

import torch

from .batch_meta import AttentionMeta, build_meta

META_KEY = "nvidia_attention"


class NvidiaAttentionBackend:
    def __init__(self, ratios: tuple[int, ...], batch_invariant: bool = False,
                 official: bool = False):
        self.ratios = tuple(sorted({r for r in ratios if r}))
        self.batch_invariant, self.official = batch_invariant, official

    @staticmethod
    def compiles_expected():
        """The runner's warm-up runs inside this: Triton compiles are expected there, and a compile
        after it is logged as a warning naming the kernel argument that made it (compile_watch.py)."""
        from deepinfer_kernels.compile_watch import compile_watch
        return compile_watch().expecting()

    def batch_invariant_variant(self) -> "NvidiaAttentionBackend":
        """Fixed attention tiles and a fixed split size (the batch_invariant feature's protocol); the
        compressors (per block) and the indexer (fixed score tiles, exact top-k) already are."""
        return type(self)(self.ratios, batch_invariant=True, official=self.official)

    def meta(self, batch) -> AttentionMeta:
        m = batch.backend_meta.get(META_KEY)
        if m is None:
            m = batch.backend_meta[META_KEY] = build_meta(batch, self.ratios)
        return m

    def forward(self, attn, inp, batch, states) -> torch.Tensor:
        from deepinfer_kernels.indexer import indexer_topk
        from deepinfer_kernels.sparse_attention import sparse_attention

        m = self.meta(batch)
        pools = states[0].pools
        comp_rows = comp_idx = None
        if attn.compressor is not None:
            self._compress(attn.compressor, pools.compressor, inp.comp_kv, inp.comp_z, m)
            comp_rows = pools.compressor["rows"]
        if attn.indexer is not None:
            ix = attn.indexer
            self._compress(ix.compressor, pools.indexer, inp.idx_kv, inp.idx_z, m)
            comp_idx = indexer_topk(inp.idx_q, inp.idx_w, pools.indexer["rows"], m.block_table, m.token_seq,
                                    m.positions, topk=ix.topk, ratio=attn.ratio,
                                    max_rows=m.max_rows[attn.ratio], official=self.official)
        out = sparse_attention(inp.q, inp.kv, pools.ring, attn.attn_sink, scale=attn.scale, window=attn.window,
                               cu_seqlens=m.cu_seqlens, seq_start=m.seq_start, token_seq=m.token_seq,
                               positions=m.positions, slots=m.slots, comp_rows=comp_rows,
                               block_table=m.block_table, comp_idx=comp_idx, comp_ratio=attn.ratio,
                               batch_invariant=self.batch_invariant, official=self.official)
        self._write_ring(inp.kv, pools.ring, m)
        return out

    @staticmethod
    def _compress(compressor, pools: dict, kv: torch.Tensor, z: torch.Tensor, m: AttentionMeta) -> None:
        from deepinfer_kernels.compressor import compress_blocks, update_tails, write_rows

        nb = m.new_blocks[compressor.ratio]
        if nb.count:
            pooled = compress_blocks(kv, z, pools["tail_kv"], pools["tail_z"], ratio=compressor.ratio,
                                     blk_seq=nb.seq, blk_idx=nb.idx, cu_seqlens=m.cu_seqlens,
                                     seq_start=m.seq_start, slots=m.slots)
            # RoPE at each block's first position (padding rows: position 0, never written)
            rows = compressor.finalize(pooled, nb.idx.clamp(min=0).long() * compressor.ratio)
            write_rows(rows, pools["rows"], m.block_table, blk_seq=nb.seq, blk_idx=nb.idx)
        update_tails(kv, z, pools["tail_kv"], pools["tail_z"], cu_seqlens=m.cu_seqlens, seq_start=m.seq_start,
                     slots=m.slots, token_seq=m.token_seq, positions=m.positions)

    @staticmethod
    def _write_ring(kv: torch.Tensor, ring: torch.Tensor, m: AttentionMeta) -> None:
        from deepinfer_kernels.compressor import write_ring
        write_ring(kv, ring, cu_seqlens=m.cu_seqlens, seq_start=m.seq_start, slots=m.slots,
                   token_seq=m.token_seq, positions=m.positions)

    # ---- CUDA graphs (protocol used by deepinfer_core.runner.cuda_graphs) -----------------------
    def graph_num_extra(self, num_seqs: int, query_len: int) -> int:
        """The closed-block indices a graph's step computes on the host (StaticMeta.extra_inputs)."""
        from .batch_meta import closed_blocks_bound
        return sum(closed_blocks_bound(self.ratios, num_seqs, query_len).values())

    def graph_meta(self, batch, max_blocks: int):
        """Install fixed-shape metadata into `batch` (the graph's static decode batch) and return
        it; the graph refills it on the device before each replay (`StaticMeta.derive`)."""
        from .batch_meta import StaticMeta
        static = StaticMeta(self.ratios, batch.num_seqs, max_blocks, batch.positions, query_len=batch.lens[0])
        batch.backend_meta[META_KEY] = static.meta
        return static
