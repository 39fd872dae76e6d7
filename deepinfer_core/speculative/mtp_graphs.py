"""CUDA graphs of the MTP drafter's forwards, so a speculative step launches no per-kernel Python.

* observe: the MTP block over every row of a step of q rows per sequence (a verify step, or decode),
  reading the target's final streams (copied into a static buffer) and each row's next token, with
  the logits and output streams of one row per sequence: its last committed row (a static index).
* step: one further draft (EAGLE-style recursion, one row per sequence): the block's own streams of
  the previous draft as h, that draft as the next token, one position on.

Both are `DecodeGraphs` over a body in place of the model, so bucketing, padding sequences (the
cache's spare slot) and the attention backend's fixed-shape metadata are the decode graphs' own.
Drafts are drawn between replays (argmax, or a sample with the request's parameters and "draft"
uniform: speculative/mtp.draw), exactly as the eager drafter draws them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from ..ops.transfer import copy_into
from ..runner.cuda_graphs import DecodeGraphs


class _Out(NamedTuple):
    logits: torch.Tensor
    streams: torch.Tensor


class _ObserveBody:
    def __init__(self, model, streams_in: torch.Tensor, rows_in: torch.Tensor):
        self.model, self.streams_in, self.rows_in = model, streams_in, rows_in

    def __call__(self, batch) -> _Out:
        t, n = batch.input_ids.numel(), batch.num_seqs
        rows = self.rows_in[:n]
        logits, u = self.model.mtp_step(self.streams_in[:t], batch.input_ids, replace(batch, logits_rows=rows))
        return _Out(logits, u.index_select(0, rows))


class _StepBody:
    def __init__(self, model, streams_in: torch.Tensor):
        self.model, self.streams_in = model, streams_in

    def __call__(self, batch) -> _Out:
        n = batch.num_seqs
        return _Out(*self.model.mtp_step(self.streams_in[:n], batch.input_ids, batch))


class MTPGraphs:
    def __init__(self, model, graphs: DecodeGraphs, cache, backend, streams_like: torch.Tensor):
        """`graphs`: the runner's decode graphs (their buckets, query lengths and slot tables)."""
        max_seqs, q = graphs.buckets[-1], graphs.max_query_len
        dev = streams_like.device
        self.streams_in = torch.zeros(max_seqs * q, *streams_like.shape[1:], dtype=streams_like.dtype, device=dev)
        self.rows_in = torch.zeros(max_seqs, dtype=torch.long, device=dev)
        common = dict(cache=cache, backend=backend, max_seqs=max_seqs, max_blocks=graphs.max_blocks,
                      tables=graphs.tables, per_sequence_output=True)
        self.observe_graphs = DecodeGraphs(_ObserveBody(model, self.streams_in, self.rows_in), max_query_len=q,
                                           **common)
        self.step_graphs = DecodeGraphs(_StepBody(model, self.streams_in), max_query_len=1, **common)

    def fits(self, lens: list[int]) -> bool:
        return self.observe_graphs.fits_uniform(lens, len(lens) * lens[0])

    def observe(self, streams: torch.Tensor, next_ids: torch.Tensor, positions: list[int], slots: list[int],
                q: int, last_rows: list[int] | torch.Tensor,
                starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """MTP logits and output streams of `last_rows` (one per sequence) after the block ran over
        every row; None when capture failed (run eagerly). `starts`: each sequence's first position on
        the device, in place of `positions` (a step whose verdict the host has not read)."""
        self.streams_in[:streams.shape[0]].copy_(streams)
        if isinstance(last_rows, torch.Tensor):
            self.rows_in.zero_()                  # padding sequences read row 0
            self.rows_in[:last_rows.numel()].copy_(last_rows)
        else:
            copy_into(self.rows_in, last_rows + [0] * (self.rows_in.numel() - len(last_rows)))
        return self.observe_graphs.replay([0] * next_ids.numel(), positions, slots, q, device_ids=next_ids,
                                          device_starts=starts)

    def draft_step(self, streams: torch.Tensor, tokens: torch.Tensor, positions: list[int],
                   slots: list[int], starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.streams_in[:streams.shape[0]].copy_(streams)
        return self.step_graphs.replay([0] * tokens.numel(), positions, slots, 1, device_ids=tokens,
                                       device_starts=starts)
