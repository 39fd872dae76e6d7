"""The flattened variable-length batch one forward pass runs on.

Sequences sit back to back: sequence i owns rows [cu_seqlens[i], cu_seqlens[i+1]) of every
per-token tensor, starting at absolute position `starts[i]`. Decode (1 token), chunked prefill
(a chunk) and speculative verification (k+1 tokens) are all the same shape of batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.sequence_state import SequenceState
from ..ops.transfer import to_device_parts


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    starts: list[int]                 # first position of each sequence's new tokens
    lens: list[int]                   # number of new tokens of each sequence
    states: list[SequenceState]       # one per sequence, updated in place
    logits_rows: torch.Tensor         # [N] rows of the flat batch whose logits are wanted
    # The engine's batches: each sequence's state slot and the per-slot device tables (block table
    # rows, last tokens; runner/slot_tables.py), so backends gather block tables on the device.
    slot_ids: list[int] | None = None
    slot_tables: Any = None
    # Built once per forward by the attention backend on its first layer (device metadata that
    # every layer shares); opaque to the core.
    backend_meta: dict[str, Any] = field(default_factory=dict)
    # What one layer hands later layers within this forward (V4.1): the YOCO shared hidden, each
    # index source's per-sequence selections, the candidate blocks.
    shared: dict[Any, Any] = field(default_factory=dict)
    # V4.1 bounded replay: (mode "mask" | "compact", each sequence's rectangle start), or None
    truncation: tuple[str, list[int]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    def seq_slices(self) -> list[slice]:
        out, off = [], 0
        for n in self.lens:
            out.append(slice(off, off + n))
            off += n
        return out

    @classmethod
    def build(cls, token_ids: list[list[int]], states: list[SequenceState], device="cpu",
              all_logits: bool = False, logit_modes: list[str] | None = None) -> "ForwardBatch":
        """`logit_modes[i]` picks sequence i's logits rows: "last", "all" or "none"
        (default: every row if all_logits else the last row of every sequence)."""
        ids, pos, rows, starts, lens = [], [], [], [], []
        modes = logit_modes or ["all" if all_logits else "last"] * len(token_ids)
        for toks, st, mode in zip(token_ids, states, modes):
            if not toks:
                raise ValueError("a sequence in the batch has no new tokens")
            s = st.num_tokens
            off = len(ids)
            ids.extend(toks)
            pos.extend(range(s, s + len(toks)))
            if mode == "all":
                rows.extend(range(off, off + len(toks)))
            elif mode == "last":
                rows.append(off + len(toks) - 1)
            starts.append(s)
            lens.append(len(toks))
        ids_t, pos_t, rows_t = to_device_parts([ids, pos, rows], device)     # one host->device copy
        return cls(ids_t, pos_t, starts, lens, list(states), rows_t)

    def commit(self) -> None:
        """Advance every sequence past its new tokens (after the forward succeeded)."""
        for st, n in zip(self.states, self.lens):
            st.num_tokens += n
