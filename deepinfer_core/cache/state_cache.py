"""The V4 hybrid state cache: pools sized once from a byte budget, never repartitioned.

Two kinds of memory, both counted exactly (`CacheLayout.slot_bytes` / `block_bytes`):

* a **state slot** per resident sequence: every layer's sliding-window ring (window + rollback room
  positions) and every compressor's tails (the per-token inputs of blocks not yet closed, plus the
  rollback room), fp32 as the pooling runs in fp32;
* **paged blocks** of one logical size (128 positions) for every layer kind: a block holds the
  128/ratio compressed rows of each compressed layer (32 for CSA, 1 for HCA) and the 32 indexer
  keys of each CSA layer. One block table per sequence addresses all of them.

Cross-layer sharing (V4.1): only a KV-source layer owns compressor pools (tails only when gated,
ratio > 1) and its index-key rows (no tails: projected from its compressed rows); a sharing layer
aliases its source's pools and adds no byte (`kv_owner`).

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
    # per layer: the layer whose compressor pools it reads (-1: window only); None: every
    # compressed layer its own (V4). Set: V4.1 sharing, index keys projected (no indexer tails).
    kv_owner: tuple[int, ...] | None = None
    engram_history: int = 0          # Engram: the N-1 earlier token ids each n-gram reads (0: none)

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
        owner = None
        if cfg.topology is not None:
            owner = tuple(cfg.kv_source(i) for i in range(len(main))) + tuple(
                len(main) + i if r else -1 for i, r in enumerate(mtp))
        return cls(tuple(main + mtp), len(main), cfg.head_dim, cfg.index_head_dim, cfg.sliding_window,
                   backtrack, dtype, block_size, kv_fp8=kv_fp8, rope_dim=cfg.qk_rope_head_dim,
                   kv_owner=owner, engram_history=cfg.engram.max_ngram - 1 if cfg.engram else 0)

    @property
    def ring_len(self) -> int:
        return self.window + self.backtrack

    def tail_len(self, ratio: int) -> int:
        if self.kv_owner is not None and ratio == 1:
            return 0                  # an ungated ratio-1 compressor emits a row per token
        return coff(ratio) * ratio + self.backtrack

    def owner(self, layer: int) -> int:
        """The layer whose compressor pools `layer` uses (-1: none)."""
        if self.kv_owner is not None:
            return self.kv_owner[layer]
        return layer if self.ratios[layer] else -1

    def index_kind(self, layer: int) -> str | None:
        """The index-key pools `layer` owns: "compressor" (V4 CSA: tails + keys), "projected"
        (V4.1 KV source: keys only) or None."""
        if self.kv_owner is not None:
            return "projected" if self.owner(layer) == layer else None
        return "compressor" if self.ratios[layer] == 4 else None

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
    def engram_ring_len(self) -> int:
        """Compressed token ids kept per sequence for Engram's n-grams (0: no Engram)."""
        return self.engram_history + self.backtrack if self.engram_history else 0

    @property
    def slot_bytes(self) -> int:
        total = self.engram_ring_len * 8                       # int64 ids
        for i, r in enumerate(self.ratios):
            total += self.ring_len * self.kv_row_bytes
            if self.owner(i) == i:
                total += 2 * self.tail_len(r) * coff(r) * self.head_dim * _FP32          # kv + z
            if self.index_kind(i) == "compressor":
                total += 2 * self.tail_len(r) * coff(r) * self.index_head_dim * _FP32
        return total

    @property
    def block_bytes(self) -> int:
        e, total = _elem(self.dtype), 0
        for i, r in enumerate(self.ratios):
            if self.owner(i) == i:
                total += self.block_size // r * self.kv_row_bytes
            if self.index_kind(i):
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
        for i, r in enumerate(L.ratios):
            self.rings.append(torch.empty(self.num_slots, L.ring_len, kv_width, dtype=kv_dtype, device=device))
            owns = L.owner(i) == i
            self.comp.append(self._compressor_pools(r, L.head_dim, kv_width, kv_dtype) if owns else None)
            di, kind = L.index_head_dim, L.index_kind(i)
            self.index.append(self._compressor_pools(r, di, di, L.dtype, kind == "projected") if kind else None)
        self.engram_ids = torch.zeros(self.num_slots, L.engram_ring_len, dtype=torch.int64, device=device)
        own = [L.owner(i) for i in range(len(L.ratios))]     # sharing layers alias their owner's pools
        self.layer_pools = [LayerPools(ring, self.comp[o] if o >= 0 else None,
                                       self.index[o] if L.kv_owner is not None and o >= 0 else index)
                            for ring, index, o in zip(self.rings, self.index, own)]

    def _compressor_pools(self, ratio: int, d: int, width: int, dtype: torch.dtype,
                          no_tails: bool = False) -> dict[str, torch.Tensor]:
        """fp32 tails of C*d channels; rows of `width` elements of `dtype` (packed: uint8 bytes)."""
        L, c = self.layout, coff(ratio)
        n = 0 if no_tails else L.tail_len(ratio)
        return {"tail_kv": torch.empty(self.num_slots, n, c * d, dtype=torch.float32, device=self.device),
                "tail_z": torch.empty(self.num_slots, n, c * d, dtype=torch.float32, device=self.device),
                "rows": torch.empty(self.num_blocks, L.block_size // ratio, width, dtype=dtype, device=self.device)}

    def tensors(self) -> list[torch.Tensor]:
        return self.slot_tensors() + [p["rows"] for p in self.comp + self.index if p is not None]

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

    def slot_tensors(self) -> list[torch.Tensor]:
        """The pools indexed by state slot (window rings, compressor tails, Engram ids)."""
        out = list(self.rings) + [self.engram_ids]
        for pools in self.comp + self.index:
            if pools is not None:
                out += [pools["tail_kv"], pools["tail_z"]]
        return out

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy what slots `src` hold into slots `dst`, one op per pool: with the blocks before an
        aligned position, a slot is a sequence's whole state there (a prefix checkpoint taken, or
        restored into a new sequence's slot, `SequenceState.resume`)."""
        if len(set(dst)) != len(dst):         # index_copy_ picks any of them on a GPU
            raise RuntimeError(f"state cache: slots copied into twice in one op: {list(dst)}")
        s, d = (to_device(list(x), torch.long, self.device) for x in (src, dst))
        for t in self.slot_tensors():
            t.index_copy_(0, d, t.index_select(0, s))

    def bind(self, slot: int, block_ids: list[int], fresh: bool = True) -> SequenceState:
        """A sequence's state over slot `slot` and the given blocks; `fresh` resets the tails (z = -inf)
        so nothing leaks from the slot's previous owner."""
        table = BlockTable(block_ids, self.device)
        layers = []
        for i, r in enumerate(self.layout.ratios):
            st = LayerState(ring=self.rings[i][slot], pools=self.layer_pools[i])
            owner = self.layout.owner(i)
            if 0 <= owner < i:                       # a sharing layer: its source's states
                st.compressor, st.indexer = layers[owner].compressor, layers[owner].indexer
            elif owner == i:
                st.compressor = self._compressor_state(self.comp[i], r, slot, table, fresh)
                if self.layout.kv_fp8:
                    st.compressor.fp8_dims = (self.layout.head_dim, self.layout.rope_dim)
            if self.layout.index_kind(i):
                st.indexer = self._compressor_state(self.index[i], r, slot, table, fresh)
            layers.append(st)
        n = self.layout.num_main_layers
        return SequenceState(layers=layers[:n], mtp_layers=layers[n:], slot=slot, table=table,
                             block_size=self.layout.block_size, backtrack=self.layout.backtrack,
                             engram_ids=self.engram_ids[slot])

    @staticmethod
    def _compressor_state(pools, ratio: int, slot: int, table: BlockTable, fresh: bool) -> CompressorState:
        kv, z = pools["tail_kv"][slot], pools["tail_z"][slot]
        if fresh:
            kv.zero_()
            z.fill_(float("-inf"))
        return CompressorState(ratio=ratio, overlap=coff(ratio) == 2, tail_kv=kv, tail_z=z,
                               pool=pools["rows"], table=table)


def new_sequence_state(cfg, dtype: torch.dtype, device="cpu", backtrack: int = 0,
                       with_mtp: bool = True, max_tokens: int = 8192) -> SequenceState:
    """A standalone state with a private one-slot cache for up to `max_tokens` positions (tests and
    tools; the engine binds states from its shared `StateCache`)."""
    layout = CacheLayout.from_config(cfg, dtype, backtrack, with_mtp=with_mtp)
    cache = StateCache(layout, num_slots=1, num_blocks=-(-max_tokens // layout.block_size), device=device)
    return cache.bind(0, list(range(cache.num_blocks)))
