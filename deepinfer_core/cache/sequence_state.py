"""One sequence's view of the V4 decode state: window ring, compressor
tails (per-sequence, in the sequence's state *slot*) and compressed rows / indexer keys (paged,
addressed through the sequence's block table). The tensors are views into `StateCache` pools.

Visibility is decided by position, never by slot, so rolling back speculative tokens only moves
`num_tokens` back (rows with index >= floor((n+1)/m) are simply ignored and later overwritten).

With a kv_fp8 cache the main compressed rows are packed uint8 rows (`ops.kv_fp8`); `read_rows` /
`write_rows` unpack / pack them, so callers always see [n, d] bf16 rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..ops.kv_fp8 import pack_kv_fp8, unpack_kv_fp8


class BlockTable:
    """The block ids of one sequence, shared by every paged pool of every layer (one logical
    block = `block_size` positions in all of them). `ids` is a host list; `tensor` mirrors it,
    copied on first use only (batched backends read the host list, never this tensor)."""

    def __init__(self, ids: list[int], device) -> None:
        self.device = device
        self.set(ids)

    def set(self, ids: list[int]) -> None:
        self.ids = list(ids)
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self.ids, dtype=torch.int64, device=self.device)
        return self._tensor

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class CompressorState:
    """One KV compressor (main or indexer) of one layer of one sequence."""

    ratio: int
    overlap: bool                     # ratio-4 compressors pool 2*ratio tokens (previous block too)
    tail_kv: torch.Tensor             # [tail_len, c*d] fp32: wkv(x) per token, slot = pos % tail_len
    tail_z: torch.Tensor              # [tail_len, c*d] fp32: wgate(x) + ape per token
    pool: torch.Tensor                # [num_blocks, rows_per_block, d]: every sequence's rows
    table: BlockTable                 # this sequence's blocks in `pool`
    n_rows: int = 0
    fp8_dims: tuple[int, int] | None = None   # kv_fp8: (d, rope_dim) of the packed uint8 pool rows

    @property
    def tail_len(self) -> int:
        return self.tail_kv.shape[0]

    @property
    def rows_per_block(self) -> int:
        return self.pool.shape[1]

    def read_rows(self) -> torch.Tensor:
        """[n_rows, d]: the emitted rows in order (a gather over the block table)."""
        nb = -(-self.n_rows // self.rows_per_block)
        if nb > len(self.table):
            raise RuntimeError(f"state cache: {self.n_rows} rows need {nb} blocks, "
                               f"the block table holds {len(self.table)}")
        rows = self.pool[self.table.tensor[:nb]].flatten(0, 1)[: self.n_rows]
        if self.fp8_dims is not None:
            return unpack_kv_fp8(rows, *self.fp8_dims, dtype=torch.bfloat16)
        return rows

    def write_rows(self, first: int, rows: torch.Tensor) -> None:
        """Store rows first .. first+len(rows)-1 into their blocks."""
        idx = torch.arange(first, first + rows.shape[0], device=rows.device)
        blk = idx // self.rows_per_block
        if int(blk[-1]) >= len(self.table):
            raise RuntimeError(f"state cache: row {first + rows.shape[0] - 1} needs block {int(blk[-1])}, "
                               f"the block table holds {len(self.table)}")
        if self.fp8_dims is not None:
            rows = pack_kv_fp8(rows, self.fp8_dims[1])
        self.pool[self.table.tensor[blk], idx % self.rows_per_block] = rows.to(self.pool.dtype)


@dataclass
class LayerPools:
    """One layer's whole pools, every slot and block (batched kernels index them with device
    metadata; the per-sequence views below serve the portable ops)."""

    ring: torch.Tensor                                   # [num_slots, ring_len, head_dim] (kv_fp8: uint8 rows)
    compressor: dict[str, torch.Tensor] | None = None    # tail_kv, tail_z [num_slots, ...], rows [num_blocks, ...]
    indexer: dict[str, torch.Tensor] | None = None


@dataclass
class LayerState:
    ring: torch.Tensor                         # [ring_size, head_dim] (kv_fp8: packed uint8), slot = pos % ring_size
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None     # CSA layers: the indexer's own compressor + keys
    pools: LayerPools | None = None            # the layer's pools of the cache this state lives in


@dataclass(eq=False)
class SequenceState:
    layers: list[LayerState]
    mtp_layers: list[LayerState] = field(default_factory=list)
    num_tokens: int = 0                        # tokens whose state is committed (= next position)
    slot: int = -1                             # state slot in the cache (rings, tails)
    table: BlockTable | None = None            # shared by every paged pool
    block_size: int = 128
    grow: Callable[["SequenceState", int], None] | None = None   # self-managed states only
    backtrack: int = 0                         # the rollback room its rings and tails were sized with
    engram_ids: torch.Tensor | None = None     # Engram: compressed ids, slot = pos % len (model/engram.py)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def rollback(self, num_tokens: int) -> None:
        """Forget the tokens at positions >= `num_tokens` (speculative drafts a verification rejected):
        the state is then exactly the state after position num_tokens - 1.
        Rings and compressor tails are sized window + backtrack and c*ratio + backtrack slots, so the
        rejected tokens' writes never overwrote an entry a later query reads (visibility is by
        position); the compressed rows and indexer keys they completed are uncounted here and
        rewritten when real tokens complete those blocks."""
        if not self.num_tokens - self.backtrack <= num_tokens <= self.num_tokens:
            raise ValueError(f"rollback to {num_tokens} tokens from {self.num_tokens}: at most backtrack="
                             f"{self.backtrack} tokens can be rolled back (DEEPINFER_MAX_BACKTRACKING_TOKENS)")
        self.num_tokens = num_tokens
        for layer in self.layers + self.mtp_layers:
            for cs in (layer.compressor, layer.indexer):
                if cs is not None:
                    cs.n_rows = min(cs.n_rows, num_tokens // cs.ratio)

    def resume(self, num_tokens: int) -> None:
        """Take over a state whose slot and blocks hold the first `num_tokens` positions of another
        sequence (a prefix checkpoint copied into this slot, `StateCache.copy_slots`): every
        compressor has emitted num_tokens // ratio rows, as a cold run would have."""
        self.num_tokens = num_tokens
        for layer in self.layers + self.mtp_layers:
            for cs in (layer.compressor, layer.indexer):
                if cs is not None:
                    cs.n_rows = num_tokens // cs.ratio

    def reserve(self, num_new_tokens: int) -> None:
        """Make sure blocks exist for the next `num_new_tokens` positions (engine-managed states
        get them from the scheduler; a self-managed state allocates them itself)."""
        need = self.blocks_needed(self.num_tokens + num_new_tokens)
        if need > len(self.table):
            if self.grow is None:
                raise RuntimeError(f"state cache: positions up to {self.num_tokens + num_new_tokens} need "
                                   f"{need} blocks, the scheduler allocated {len(self.table)}")
            self.grow(self, need)
