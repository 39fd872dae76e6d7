"""CUDA graphs of the DSpark drafter's two steps, so a speculative step launches no per-kernel Python
for them:

* observe (`ObserveGraphs`, per (batch bucket, q)): a step of q rows per sequence (a verify step, or
  decode): the target features (copied from the target graph's output) through main_proj/main_norm,
  each stage's key of every row, scattered into the stage rings. Padding sequences write into the
  cache's spare slot, which no sequence owns.
* propose (`ProposeGraphs`, per (batch bucket, kind)): "draft", a greedy draft, the whole block
  forward (every stage over [anchor, noise x (gamma-1)] with its ring context) and the Markov /
  confidence loop; "block", the block forward alone, for sampled drafts, which the drafter then draws
  left to right eagerly (their uniforms are keyed by host seeds and positions). Padding sequences
  copy the batch's first request (a draft only reads the cache); their rows are dropped.

Inputs live in static buffers, filled by one host-to-device copy (positions, slots) and
device-to-device copies (features, anchors). The stage ring pools a graph reads or writes are fixed
at capture: a different cache (re-sized) drops the graphs and captures again. A capture that fails
turns that kind of graph off with one warning; the drafter then runs that step eagerly, as it does
for steps that do not fit (prefill chunks, mixed lengths). `capture=False` runs the same padded
static batches eagerly (tests without a GPU).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.ops.transfer import copy_into
from deepinfer_core.runner.cuda_graphs import buckets_for

log = logging.getLogger(__name__)


class _StaticGraphs:
    """Graphs keyed by static shape, captured on first use, over pools fixed at capture."""

    def __init__(self, max_seqs: int, capture: bool, what: str, device):
        self.buckets = buckets_for(max_seqs)
        self.capture, self.what, self.device = capture, what, torch.device(device)
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph | None, Any]] = {}
        self.pools: tuple | None = None
        self.mempool = None
        self.failed: str | None = None

    def bucket(self, n: int) -> int | None:
        """The batch bucket of n sequences; None when graphs are off or n is too many."""
        if self.failed is not None or not 0 < n <= self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= n)

    def use_pools(self, pools: tuple) -> None:
        if pools != self.pools:
            self.graphs, self.pools, self.mempool = {}, pools, None

    def replay(self, key, body: Callable[[], Any]) -> Any | None:
        """`body()`'s outputs (the graph's static ones when captured); None when capture failed."""
        graph, out = self.graphs.get(key) or self._capture(key, body)
        if self.failed is not None:
            return None
        if graph is None:
            return body()
        graph.replay()
        return out

    def _capture(self, key, body: Callable[[], Any]):
        if not self.capture:
            self.graphs[key] = (None, None)
            return self.graphs[key]
        dev = self.device
        try:
            side = torch.cuda.Stream(device=dev)            # warm-up (Triton compilation) off the capture;
            side.wait_stream(torch.cuda.current_stream(dev))   # the step's own inputs: an observe warm-up
            with torch.cuda.stream(side):                   # writes the values the replay then writes
                for _ in range(2):
                    body()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                out = body()
        except Exception as exc:                            # a host sync or an uncapturable op
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("DSpark %s graph capture failed, running it eagerly from now on: %s", self.what, self.failed)
            return None, None
        self.mempool = graph.pool()
        self.graphs[key] = (graph, out)
        log.info("captured the DSpark %s graph for %s", self.what, key)
        return self.graphs[key]


class ProposeGraphs(_StaticGraphs):
    def __init__(self, bodies: dict[str, Callable[..., Any]], max_seqs: int, device, capture: bool = True):
        """`bodies[kind](anchors [B], anchor_positions [B], slots [B], pools)`: "draft" -> (drafts
        [B, gamma], confidence logits [B, gamma]); "block" -> hidden [B*gamma, D]."""
        super().__init__(max_seqs, capture, "draft", device)
        self.bodies = bodies
        size = self.buckets[-1]
        self.anchors = torch.zeros(size, dtype=torch.long, device=device)
        self.meta = torch.zeros(2 * size, dtype=torch.long, device=device)   # positions | slots, per bucket

    def run(self, kind: str, anchors: torch.Tensor, positions: list[int], slots: list[int], pools: tuple) -> Any:
        """The `kind` body's outputs for n requests padded to their bucket (sequence-major rows: the
        first n, or n*gamma, are theirs), views of the graph's outputs valid until the next replay;
        None when the batch does not fit or capture failed."""
        n = len(slots)
        size = self.bucket(n)
        if size is None:
            return None
        self.use_pools(pools)
        pad = size - n
        copy_into(self.meta[:2 * size], positions + positions[:1] * pad + slots + slots[:1] * pad)
        self.anchors[:n].copy_(anchors)
        body = self.bodies[kind]
        return self.replay((size, kind), lambda: body(self.anchors[:size], self.meta[:size], self.meta[size:2 * size],
                                                      self.pools))


class ObserveGraphs(_StaticGraphs):
    def __init__(self, body: Callable[..., None], max_seqs: int, max_query_len: int, features_like: torch.Tensor,
                 pad_slot: int, capture: bool = True):
        """`body(features [B*q, F], positions [B*q], row_slots [B*q], pools)` writes the rings;
        `pad_slot`: a slot no sequence owns (the cache's spare), where padding rows write."""
        super().__init__(max_seqs, capture, "observe", features_like.device)
        self.body, self.max_query_len, self.pad_slot = body, max_query_len, pad_slot
        rows, dev = self.buckets[-1] * max_query_len, self.device
        self.features = torch.zeros(rows, features_like.shape[-1], dtype=features_like.dtype, device=dev)
        self.meta = torch.zeros(2 * rows, dtype=torch.long, device=dev)      # positions | row slots

    def run(self, features: torch.Tensor, starts: list[int], slots: list[int], q: int, pools: tuple) -> bool:
        """Write the keys of n sequences' q rows each (row j of sequence i at starts[i] + j); False
        when the step does not fit or capture failed (the caller writes them eagerly)."""
        n = len(slots)
        size = self.bucket(n)
        if size is None or not 1 <= q <= self.max_query_len:
            return False
        self.use_pools(pools)
        pad, t = size - n, size * q
        positions = [s + j for s in starts for j in range(q)] + list(range(q)) * pad
        row_slots = [s for s in slots for _ in range(q)] + [self.pad_slot] * (pad * q)
        copy_into(self.meta[:2 * t], positions + row_slots)
        self.features[:n * q].copy_(features)
        done = self.replay((size, q), lambda: self.body(self.features[:t], self.meta[:t], self.meta[t:2 * t],
                                                        self.pools) or True)
        return done is not None
