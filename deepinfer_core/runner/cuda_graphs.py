"""CUDA graphs of the decode forward: one graph per batch-size bucket, captured on first use.

A decode step (one new token per sequence, the last row's logits) has the same kernels at every step,
so replaying a captured graph removes the per-kernel launch cost from Python (tens of microseconds per
Triton launch, hundreds per layer). The batch is padded up to its bucket with padding sequences that
all live in the cache's spare slot and block (outside the allocator), so padding never touches a real
sequence's state.

Only an attention backend that can describe a batch with fixed-shape device metadata
(`graph_meta(batch, max_blocks)`, see deepinfer_nvidia.attention) can be captured; every op of the
forward must be free of host synchronisation. A capture that fails turns graphs off with one warning
and the runner stays eager. `DEEPINFER_ENFORCE_EAGER=1` or `LLM(enforce_eager=True)` never captures.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..model import ForwardBatch
from ..ops.transfer import copy_into

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None     # None: run the static batch eagerly (capture=False)
    batch: ForwardBatch          # static inputs (input_ids, positions: views of ids_pos) read by the graph
    ids_pos: torch.Tensor        # [2 * size] int64, refilled with one host->device copy per step
    meta: Any                    # the backend's static metadata, refilled before each replay
    logits: torch.Tensor | None  # static output, overwritten by the next replay


def buckets_for(max_seqs: int) -> list[int]:
    return [b for b in BUCKETS if b < max_seqs] + [max_seqs]


class DecodeGraphs:
    def __init__(self, model, cache, backend, max_seqs: int, max_blocks: int, capture: bool = True):
        """`capture=False` runs the same padded, fixed-shape batches eagerly instead of replaying a
        graph: the padding and static-metadata logic, testable without a GPU."""
        self.model, self.backend, self.max_blocks, self.capture = model, backend, max_blocks, capture
        self.buckets = buckets_for(max_seqs)
        self.device = cache.device
        if cache.spare_slot is None:
            raise ValueError("decode CUDA graphs need a StateCache built with spare=True (padding slot)")
        self.pad_slot, self.pad_block = cache.spare_slot, cache.spare_block   # never handed to sequences
        self.pad_state = cache.bind(self.pad_slot, [self.pad_block])
        self.graphs: dict[int, _Captured] = {}
        self.pool = None
        self.failed: str | None = None                 # why capture failed (graphs are off then)

    @staticmethod
    def supported(backend) -> bool:
        return hasattr(backend, "graph_meta")

    def fits(self, token_ids: list[list[int]], seqs, all_logits: bool, logit_modes) -> bool:
        return (self.failed is None and not all_logits and len(token_ids) <= self.buckets[-1]
                and all(len(t) == 1 for t in token_ids)
                and (logit_modes is None or all(m == "last" for m in logit_modes))
                and all(len(st.table) <= self.max_blocks for st in seqs))

    def run(self, token_ids: list[list[int]], seqs) -> torch.Tensor | None:
        """Logits [B, vocab] of one decode step (a view of the graph's output: valid until the next
        forward), or None when capturing failed (the caller runs eagerly)."""
        n = len(seqs)
        size = next(b for b in self.buckets if b >= n)
        cap = self.graphs.get(size) or self._capture(size)
        if cap is None:
            return None
        pad = size - n
        positions = [st.num_tokens for st in seqs] + [0] * pad
        copy_into(cap.ids_pos, [t[0] for t in token_ids] + [0] * pad + positions)
        cap.meta.fill(positions, [st.slot for st in seqs] + [self.pad_slot] * pad,
                      [st.table.ids for st in seqs] + [[self.pad_block]] * pad)
        if cap.graph is None:
            return self.model(cap.batch).logits[:n]
        cap.graph.replay()
        return cap.logits[:n]

    def _capture(self, size: int) -> _Captured | None:
        dev = self.device
        ids_pos = torch.zeros(2 * size, dtype=torch.int64, device=dev)
        batch = ForwardBatch(input_ids=ids_pos[:size], positions=ids_pos[size:],
                             starts=[0] * size, lens=[1] * size, states=[self.pad_state] * size,
                             logits_rows=torch.arange(size, device=dev))
        meta = self.backend.graph_meta(batch, self.max_blocks)
        meta.fill([0] * size, [self.pad_slot] * size, [[self.pad_block]] * size)
        if not self.capture:
            self.graphs[size] = _Captured(None, batch, ids_pos, meta, None)
            return self.graphs[size]
        try:
            side = torch.cuda.Stream(device=dev)      # warm-up (Triton compilation) off the capture
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(batch)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(batch)
        except Exception as exc:                      # a host sync or an uncapturable op somewhere
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, running eagerly from now on: %s", self.failed)
            return None
        self.pool = graph.pool()
        self.graphs[size] = _Captured(graph, batch, ids_pos, meta, out.logits)
        log.info("captured the decode CUDA graph for batch size %d", size)
        return self.graphs[size]
