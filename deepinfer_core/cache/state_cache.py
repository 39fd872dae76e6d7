"""The V4 hybrid state cache: pools sized once from a byte budget, never repartitioned.

Two kinds of memory, both counted exactly (`CacheLayout.slot_bytes` / `block_bytes`):

* a **state slot** per resident sequence: every layer's sliding-window ring (window + rollback room
  positions) and every compressor's tails (the per-token inputs of blocks not yet closed, plus the
  rollback room), fp32 as the pooling runs in fp32;
* **paged blocks** of one logical size (128 positions) for every layer kind: a block holds the
  128/ratio compressed rows of each compressed layer (32 for CSA, 1 for HCA) and the 32 indexer
  keys of each CSA layer. One block table per sequence addresses all of them.

With `kv_fp8` the window rings and the main compressed rows are stored packed (uint8 rows of
`kv_row_bytes(head_dim, rope_dim)` bytes: e4m3 nope dims with a UE8M0 scale per 64, bf16 RoPE dims;
`ops.kv_fp8`), 584 B instead of 1024 B per 512-wide row; indexer keys keep the layout dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.kv_fp8 import kv_row_bytes as packed_row_bytes
from ..ops.transfer import to_device
from .block_allocator import BlockAllocator
from .sequence_state import (
    BlockTable,
    CompressorState,
    LayerPools,
    LayerState,
    SequenceState,
)

BLOCK_SIZE = 128     # a multiple of every compression ratio, so no row straddles two blocks
_FP32 = 4


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def coff(ratio: int) -> int:
    """Ratio-4 compressors overlap two blocks, so their tails hold 2 x d channels per token."""
    return 2 if ratio == 4 else 1


@dataclass(frozen=True)
class CacheLayout:
    ratios: tuple[int, ...]          # main layers, then MTP layers (0 = window only)
    num_main_layers: int
    head_dim: int
    index_head_dim: int
    window: int
    backtrack: int                   # rollback room for speculative tokens
    dtype: torch.dtype
    block_size: int = BLOCK_SIZE
    kv_fp8: bool = False             # rings and main compressed rows packed as FP8 (ops.kv_fp8)
    rope_dim: int = 64               # the bf16 RoPE dims of a packed row

    def __post_init__(self) -> None:
        if self.kv_fp8:
            if self.dtype != torch.bfloat16:
                raise ValueError(f"state cache: kv_fp8 needs the cache dtype torch.bfloat16, got {self.dtype}")
            packed_row_bytes(self.head_dim, self.rope_dim)   # raises unless nope is a multiple of 64

    @classmethod
    def from_config(cls, cfg, dtype: torch.dtype, backtrack: int, with_mtp: bool = True,
                    block_size: int = BLOCK_SIZE, kv_fp8: bool = False) -> "CacheLayout":
        main = [cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)]
        mtp = [cfg.mtp_ratio(i) for i in range(cfg.num_nextn_predict_layers)] if with_mtp else []
        for r in main + mtp:
            if r and block_size % r:
                raise ValueError(f"state cache: block_size={block_size} is not a multiple of compress ratio {r}")
        return cls(tuple(main + mtp), len(main), cfg.head_dim, cfg.index_head_dim, cfg.sliding_window,
                   backtrack, dtype, block_size, kv_fp8=kv_fp8, rope_dim=cfg.qk_rope_head_dim)

    @property
    def ring_len(self) -> int:
        return self.window + self.backtrack

    def tail_len(self, ratio: int) -> int:
        return coff(ratio) * ratio + self.backtrack

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one ring entry / main compressed row (packed with kv_fp8)."""
        if self.kv_fp8:
            return packed_row_bytes(self.head_dim, self.rope_dim)
        return self.head_dim * _elem(self.dtype)

    def kv_pool_spec(self) -> tuple[int, torch.dtype]:
        """(last dim, dtype) of the ring and main-row pools."""
        return (self.kv_row_bytes, torch.uint8) if self.kv_fp8 else (self.head_dim, self.dtype)

    # ---- exact byte counts ---------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        total = 0
        for r in self.ratios:
            total += self.ring_len * self.kv_row_bytes
            if r:
                total += 2 * self.tail_len(r) * coff(r) * self.head_dim * _FP32          # kv + z
            if r == 4:
                total += 2 * self.tail_len(r) * coff(r) * self.index_head_dim * _FP32
        return total

    @property
    def block_bytes(self) -> int:
        e, total = _elem(self.dtype), 0
        for r in self.ratios:
            if r:
                total += self.block_size // r * self.kv_row_bytes
            if r == 4:
                total += self.block_size // r * self.index_head_dim * e
        return total

    def cache_bytes(self, num_slots: int, num_blocks: int) -> int:
        return num_slots * self.slot_bytes + num_blocks * self.block_bytes

    def num_blocks_for_budget(self, budget_bytes: int, num_slots: int, budget_name: str) -> int:
        """Whole blocks that fit in the budget after `num_slots` state slots."""
        left = budget_bytes - num_slots * self.slot_bytes
        n = left // self.block_bytes if self.block_bytes else 0
        if n < 1:
            raise ValueError(f"{budget_name}={budget_bytes} bytes cannot hold max_num_seqs={num_slots} state "
                             f"slots of {self.slot_bytes} bytes plus one {self.block_bytes}-byte block; "
                             f"raise {budget_name} or lower max_num_seqs")
        return int(n)


class StateCache:
    """The pools of one model's state, plus the allocator of their slots and blocks."""

    def __init__(self, layout: CacheLayout, num_slots: int, num_blocks: int, device="cpu", spare: bool = False):
        """`spare`: one more slot and block than the allocator hands out (`spare_slot`, `spare_block`),
        for CUDA-graph padding; `num_slots`/`num_blocks` count the pools, spare included."""
        self.layout, self.device = layout, device
        self.num_slots, self.num_blocks = num_slots + spare, num_blocks + spare
        self.allocator = BlockAllocator(num_blocks, num_slots)
        self.spare_slot, self.spare_block = (num_slots, num_blocks) if spare else (None, None)
        L = layout
        # torch.empty: pages are touched only when used; nothing is read before it is written
        # (visibility is by position and tails are reset when a slot is bound).
        self.rings, self.comp, self.index = [], [], []
        kv_width, kv_dtype = L.kv_pool_spec()
        for r in L.ratios:
            self.rings.append(torch.empty(self.num_slots, L.ring_len, kv_width, dtype=kv_dtype, device=device))
            self.comp.append(self._compressor_pools(r, L.head_dim, kv_width, kv_dtype) if r else None)
            di = L.index_head_dim
            self.index.append(self._compressor_pools(r, di, di, L.dtype) if r == 4 else None)
        self.layer_pools = [LayerPools(ring, comp, index) for ring, comp, index in zip(self.rings, self.comp, self.index)]

    def _compressor_pools(self, ratio: int, d: int, width: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """fp32 tails of C*d channels; rows of `width` elements of `dtype` (packed: uint8 bytes)."""
        L, c = self.layout, coff(ratio)
        return {"tail_kv": torch.empty(self.num_slots, L.tail_len(ratio), c * d, dtype=torch.float32, device=self.device),
                "tail_z": torch.empty(self.num_slots, L.tail_len(ratio), c * d, dtype=torch.float32, device=self.device),
                "rows": torch.empty(self.num_blocks, L.block_size // ratio, width, dtype=dtype, device=self.device)}

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.rings)
        for pools in self.comp + self.index:
            if pools is not None:
                out.extend(pools.values())
        return out

    def nbytes(self) -> int:
        """Bytes actually allocated by the pools (equals layout.cache_bytes; tested)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reset_slots(self, slots: list[int]) -> None:
        """Fresh tails (kv 0, z -inf) for new owners of these slots: one op per pool."""
        idx = to_device(slots, torch.long, self.device)
        for pools in self.comp + self.index:
            if pools is not None:
                pools["tail_kv"].index_fill_(0, idx, 0.0)
                pools["tail_z"].index_fill_(0, idx, float("-inf"))

    def bind(self, slot: int, block_ids: list[int], fresh: bool = True) -> SequenceState:
        """A sequence's state over slot `slot` and the given blocks; `fresh` resets the tails (z = -inf)
        so nothing leaks from the slot's previous owner."""
        table = BlockTable(block_ids, self.device)
        layers = []
        for i, r in enumerate(self.layout.ratios):
            st = LayerState(ring=self.rings[i][slot], pools=self.layer_pools[i])
            if r:
                st.compressor = self._compressor_state(self.comp[i], r, slot, table, fresh)
                if self.layout.kv_fp8:
                    st.compressor.fp8_dims = (self.layout.head_dim, self.layout.rope_dim)
            if r == 4:
                st.indexer = self._compressor_state(self.index[i], r, slot, table, fresh)
            layers.append(st)
        n = self.layout.num_main_layers
        return SequenceState(layers=layers[:n], mtp_layers=layers[n:], slot=slot, table=table,
                             block_size=self.layout.block_size, backtrack=self.layout.backtrack)

    @staticmethod
    def _compressor_state(pools, ratio: int, slot: int, table: BlockTable, fresh: bool) -> CompressorState:
        kv, z = pools["tail_kv"][slot], pools["tail_z"][slot]
        if fresh:
            kv.zero_()
            z.fill_(float("-inf"))
        return CompressorState(ratio=ratio, overlap=coff(ratio) == 2, tail_kv=kv, tail_z=z,
                               pool=pools["rows"], table=table)
