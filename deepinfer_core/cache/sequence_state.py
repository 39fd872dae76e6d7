"""Per-sequence V4 decode state (spec deepseek_v4.md §5): window ring, compressed rows,
indexer keys and compressor tails, for every main layer and every MTP block.

Visibility is decided by position, never by slot, so rolling back speculative tokens only moves
`num_tokens` back (rows with index >= floor((n+1)/m) are simply ignored and later overwritten).
This contiguous per-sequence layout is the portable one; a paged layout can replace it behind
the same fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelConfig


@dataclass
class CompressorState:
    """One KV compressor (main or indexer) of one layer of one sequence."""

    ratio: int
    overlap: bool                     # ratio-4 compressors pool 2*ratio tokens (previous block too)
    tail_kv: torch.Tensor             # [tail_len, c*d] fp32: wkv(x) per token, slot = pos % tail_len
    tail_z: torch.Tensor              # [tail_len, c*d] fp32: wgate(x) + ape per token
    rows: torch.Tensor                # [capacity, d] emitted compressed rows
    n_rows: int = 0

    @property
    def tail_len(self) -> int:
        return self.tail_kv.shape[0]

    def ensure_capacity(self, n: int) -> None:
        if n > self.rows.shape[0]:
            new = self.rows.new_zeros((max(n, 2 * self.rows.shape[0]), self.rows.shape[1]))
            new[: self.n_rows] = self.rows[: self.n_rows]
            self.rows = new


@dataclass
class LayerState:
    ring: torch.Tensor                         # [ring_size, head_dim], slot = pos % ring_size
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None     # CSA layers: the indexer's own compressor + keys


@dataclass
class SequenceState:
    layers: list[LayerState]
    mtp_layers: list[LayerState] = field(default_factory=list)
    num_tokens: int = 0                        # tokens whose state is committed (= next position)


def _compressor(ratio: int, d: int, dtype, device, backtrack: int) -> CompressorState:
    c = 2 if ratio == 4 else 1
    tail_len = c * ratio + backtrack
    return CompressorState(
        ratio=ratio, overlap=c == 2,
        tail_kv=torch.zeros(tail_len, c * d, dtype=torch.float32, device=device),
        tail_z=torch.full((tail_len, c * d), float("-inf"), dtype=torch.float32, device=device),
        rows=torch.zeros(16, d, dtype=dtype, device=device),
    )


def _layer(cfg: ModelConfig, ratio: int, dtype, device, backtrack: int) -> LayerState:
    ring = torch.zeros(cfg.sliding_window + backtrack, cfg.head_dim, dtype=dtype, device=device)
    st = LayerState(ring=ring)
    if ratio:
        st.compressor = _compressor(ratio, cfg.head_dim, dtype, device, backtrack)
    if ratio == 4:
        st.indexer = _compressor(ratio, cfg.index_head_dim, dtype, device, backtrack)
    return st


def new_sequence_state(cfg: ModelConfig, dtype: torch.dtype, device="cpu", backtrack: int = 0,
                       with_mtp: bool = True) -> SequenceState:
    """A fresh state: tails reset (z = -inf) so nothing leaks between sequences (spec §5.1)."""
    layers = [_layer(cfg, cfg.layer_ratio(i), dtype, device, backtrack) for i in range(cfg.num_hidden_layers)]
    mtp = [_layer(cfg, cfg.mtp_ratio(i), dtype, device, backtrack)
           for i in range(cfg.num_nextn_predict_layers)] if with_mtp else []
    return SequenceState(layers=layers, mtp_layers=mtp)
