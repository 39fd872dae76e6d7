"""Device metadata of one forward batch, built once on the host and shared by every layer.

The batched kernels never look at Python objects: they read rows, positions, state slots and block
tables from these tensors (layouts in `deepinfer_kernels`' module docs). Everything is computed from
host lists the scheduler already holds and copied to the GPU in one transfer: no device sync.

`StaticMeta` is the CUDA-graph form: fixed shapes (sequences padded to the graph's batch size, every
sequence feeding the same number q of tokens (1: decode, k+1: speculative verification), block tables
padded to the longest possible, closed-block lists to the most that q tokens can close), refilled on
the device before each replay (`derive`, recorded in the graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_kernels.compressor import new_blocks

from deepinfer_core.cache.state_cache import BLOCK_SIZE
from deepinfer_core.ops.transfer import to_device

# Every part of the flat metadata buffer starts on a 16-byte boundary (4 int32s). Triton specialises
# a kernel on whether each pointer argument is 16-byte aligned: parts packed back to back would move
# in and out of alignment with the batch's sizes and compile a new variant of every metadata-reading
# kernel in the middle of serving (seconds each).
ALIGN = 4


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class NewBlocks:
    """The compressed rows one batch closes for one compression ratio (idx < 0 = padding)."""

    seq: torch.Tensor          # [N] int32 sequence of each closed block
    idx: torch.Tensor          # [N] int32 logical block (= row) index within its sequence
    count: int                 # real (unpadded) closed blocks; 0 lets eager batches skip the kernels


@dataclass
class AttentionMeta:
    cu_seqlens: torch.Tensor   # [S+1] int32
    seq_start: torch.Tensor    # [S] int32
    token_seq: torch.Tensor    # [T] int32
    positions: torch.Tensor    # [T] int64
    slots: torch.Tensor        # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32 (0-padded)
    new_blocks: dict[int, NewBlocks]
    max_rows: dict[int, int]   # per ratio: the most compressed rows any query of the batch sees


def _host_parts(starts, lens, slots, tables, ratios, max_blocks: int):
    """The int32 lists of the metadata, in a fixed order. `tables` None: the block table comes from
    the device (no host part)."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    token_seq = [s for s, n in enumerate(lens) for _ in range(n)]
    parts = [cu, list(starts), token_seq, list(slots)]
    if tables is not None:
        parts.append([b for t in tables for b in list(t) + [0] * (max_blocks - len(t))])
    counts = []
    for r in ratios:
        seq, idx = new_blocks(starts, lens, r)
        counts.append(len(seq))
        parts.extend([seq, idx])
    return parts, counts


def _views(flat: torch.Tensor, parts_sizes: list[int], ratios, num_seqs: int, max_blocks: int, positions,
           counts, max_rows, block_table: torch.Tensor | None = None) -> AttentionMeta:
    padded = list(torch.split(flat, [_padded(n) for n in parts_sizes]))
    views = [v[:n] for v, n in zip(padded, parts_sizes)]
    cu_t, start_t, seq_t, slot_t = views[:4]
    if block_table is None:
        block_table = views.pop(4).view(num_seqs, max_blocks)
    new_blocks = {}
    for i, r in enumerate(ratios):
        seq_v, idx_v = views[4 + 2 * i], views[5 + 2 * i]
        new_blocks[r] = NewBlocks(seq_v, idx_v, counts[i])
    return AttentionMeta(cu_t, start_t, seq_t, positions, slot_t, block_table, new_blocks, max_rows)


def build_meta(batch, ratios: tuple[int, ...]) -> AttentionMeta:
    """From host lists; the block table from the engine's per-slot device table when the batch
    carries one (a gather by slot), else from each state's host list."""
    starts, lens, states = batch.starts, batch.lens, batch.states
    tables = device_table = None
    if batch.slot_tables is not None:
        slots = batch.slot_ids
        max_blocks = max(1, max(-(-(s + n) // BLOCK_SIZE) for s, n in zip(starts, lens)))
    else:
        slots = [st.slot for st in states]
        tables = [st.table.ids for st in states]
        max_blocks = max(1, max(len(t) for t in tables))
    parts, counts = _host_parts(starts, lens, slots, tables, ratios, max_blocks)
    flat = to_device([v for p in parts for v in p + [0] * (_padded(len(p)) - len(p))], torch.int32,
                     batch.positions.device)
    if batch.slot_tables is not None:
        slot_t = flat[sum(_padded(len(p)) for p in parts[:3]):][:len(slots)]
        device_table = batch.slot_tables.block_table.index_select(0, slot_t)[:, :max_blocks]
    max_rows = {r: max((st + n) // r for st, n in zip(starts, lens)) for r in ratios}
    return _views(flat, [len(p) for p in parts], ratios, len(lens), max_blocks, batch.positions, counts,
                  max_rows, device_table)


def closed_blocks_bound(ratios: tuple[int, ...], num_seqs: int, query_len: int) -> dict[int, int]:
    """Per ratio, the most blocks a fixed-q batch can close: q consecutive positions s..s+q-1 close
    blocks s//r .. (s+q)//r - 1, at most ceil(q/r) of them per sequence."""
    return {r: num_seqs * -(-query_len // r) for r in ratios}


class StaticMeta:
    """Fixed-shape metadata for a CUDA graph of `num_seqs` sequences of `query_len` new tokens each
    (1: decode; k+1: verification of k draft tokens). `positions` is the graph's static [num_seqs *
    query_len] positions tensor (the caller refills it); `query_len=None` reads q off its length."""

    def __init__(self, ratios: tuple[int, ...], num_seqs: int, max_blocks: int, positions: torch.Tensor,
                 query_len: int | None = None):
        n = num_seqs
        q = positions.numel() // max(n, 1) if query_len is None else query_len
        if n < 1 or q < 1 or positions.numel() != n * q:
            raise ValueError(f"StaticMeta: positions holds {positions.numel()} entries, expected num_seqs={n} "
                             f"x query_len={q} (both >= 1)")
        self.ratios, self.num_seqs, self.max_blocks, self.query_len = ratios, n, max_blocks, q
        self.blocks_len = closed_blocks_bound(ratios, n, q)
        sizes = [n + 1, n, n * q, n, n * max_blocks] + [self.blocks_len[r] for r in ratios for _ in (0, 1)]
        dev = positions.device
        flat = torch.zeros(sum(_padded(n) for n in sizes), dtype=torch.int32, device=dev)
        rows = {r: max_blocks * 128 // r for r in ratios}      # the most rows a block table can hold
        self.meta = m = _views(flat, sizes, ratios, n, max_blocks, positions,
                               [self.blocks_len[r] for r in ratios], rows)
        # the parts that never change for this shape: sequence s owns rows s*q .. s*q+q-1 and the
        # closed-block entries s*ceil(q/r) .. (s+1)*ceil(q/r)-1
        m.cu_seqlens.copy_(torch.arange(n + 1, device=dev) * q)
        m.token_seq.copy_(torch.arange(n, device=dev).repeat_interleave(q))
        for r in ratios:
            m.new_blocks[r].seq.copy_(torch.arange(n, device=dev).repeat_interleave(-(-q // r)))

    def extra_inputs(self, starts: list[int]) -> list[int]:
        """The closed-block index of every (sequence, j < ceil(q/r)), ratio by ratio (-1: none):
        cheap on the host, and a dozen fewer tiny kernels in every replay than deriving them."""
        q, out = self.query_len, []
        for r in self.ratios:
            per = -(-q // r)
            for s in starts:
                first, end = s // r, (s + q) // r
                out.extend(first + j if first + j < end else -1 for j in range(per))
        return out

    def extra_inputs_device(self, starts: torch.Tensor) -> torch.Tensor:
        """`extra_inputs` from device starts [num_seqs] (a step launched before the host knows its
        positions: speculative verification after a verdict still on the device)."""
        q, parts = self.query_len, []
        for r in self.ratios:
            first = (starts // r)[:, None]
            idx = first + torch.arange(-(-q // r), device=starts.device)
            parts.append(torch.where(idx < ((starts + q) // r)[:, None], idx, -1).flatten())
        return torch.cat(parts)

    def derive(self, slots: torch.Tensor, block_table: torch.Tensor, extra: torch.Tensor) -> None:
        """Refill the metadata on the device from the static positions (already in place), the
        batch's slots [num_seqs], the engine's per-slot block table [slots, max_blocks] and the
        `extra_inputs`: no host work, so a CUDA graph records it. Closed-block lists are laid out
        ceil(q/r) entries per sequence (idx -1 where fewer close), which the kernels treat as
        padding wherever it sits."""
        m, n, q = self.meta, self.num_seqs, self.query_len
        if block_table.shape[1] != self.max_blocks:
            raise ValueError(f"block table is {block_table.shape[1]} blocks wide, the static metadata "
                             f"{self.max_blocks}")
        m.seq_start.copy_(m.positions.view(n, q)[:, 0])
        m.slots.copy_(slots)
        torch.index_select(block_table, 0, slots, out=m.block_table)
        off = 0
        for r in self.ratios:
            m.new_blocks[r].idx.copy_(extra[off:off + self.blocks_len[r]])
            off += self.blocks_len[r]
