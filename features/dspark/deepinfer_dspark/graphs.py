"""CUDA graphs of the greedy DSpark draft: the whole block forward (every stage over
[anchor, noise x (gamma-1)] with its ring context) and the Markov / confidence loop, one graph per
batch bucket, so a draft costs one replay instead of a few hundred kernel launches from Python.

Inputs live in static buffers: the anchors (a device-to-device copy of the tokens the step just
committed), the anchors' positions and the slots (one host-to-device copy). A batch is padded up to
its bucket with copies of its first request (the drafter only reads the cache, so padding needs no
slot of its own); their rows are dropped. The stage ring pools a graph reads are fixed at capture:
a different cache (re-sized) drops the graphs and captures again. A capture that fails turns the
graphs off with one warning; drafting then stays eager. Sampled drafts (their uniforms are keyed by
host seeds and positions) run eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from deepinfer_core.ops.transfer import copy_into
from deepinfer_core.runner.cuda_graphs import buckets_for

log = logging.getLogger(__name__)
Body = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple], tuple[torch.Tensor, torch.Tensor]]


class ProposeGraphs:
    def __init__(self, body: Body, max_seqs: int, device: torch.device, capture: bool = True):
        """`body(anchors [B], anchor_positions [B], slots [B], pools) -> (drafts [B, gamma], confidence
        logits [B, gamma])`; `capture=False` runs the padded static batches eagerly (tests)."""
        self.body, self.capture = body, capture
        self.buckets = buckets_for(max_seqs)
        size = self.buckets[-1]
        self.anchors = torch.zeros(size, dtype=torch.long, device=device)
        self.meta = torch.zeros(2 * size, dtype=torch.long, device=device)   # positions | slots, per bucket
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self.pools: tuple | None = None
        self.mempool = None
        self.failed: str | None = None

    def run(self, anchors: torch.Tensor, positions: list[int], slots: list[int],
            pools: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(drafts [n, gamma], confidence logits [n, gamma]) of n requests, views of the graph's
        outputs valid until the next replay; None when the batch does not fit or capture failed."""
        n = len(slots)
        if self.failed is not None or not 0 < n <= self.buckets[-1]:
            return None
        if pools != self.pools:
            self.graphs, self.pools, self.mempool = {}, pools, None
        size = next(b for b in self.buckets if b >= n)
        pad = size - n
        copy_into(self.meta[:2 * size], positions + positions[:1] * pad + slots + slots[:1] * pad)
        self.anchors[:n].copy_(anchors)
        graph, out = self.graphs.get(size) or self._capture(size)
        if self.failed is not None:
            return None
        if graph is None:
            out = self._body(size)
        else:
            graph.replay()
        return out[0][:n], out[1][:n]

    def _body(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(self.anchors[:size], self.meta[:size], self.meta[size:2 * size], self.pools)

    def _capture(self, size: int):
        if not self.capture:
            self.graphs[size] = (None, None)
            return self.graphs[size]
        dev = self.anchors.device
        try:
            side = torch.cuda.Stream(device=dev)            # warm-up (Triton compilation) off the capture
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._body(size)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                out = self._body(size)
        except Exception as exc:                            # a host sync or an uncapturable op
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("DSpark draft graph capture failed, drafting eagerly from now on: %s", self.failed)
            return None, None
        self.mempool = graph.pool()
        self.graphs[size] = (graph, out)
        log.info("captured the DSpark draft graph for batch size %d", size)
        return self.graphs[size]
