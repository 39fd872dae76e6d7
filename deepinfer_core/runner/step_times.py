"""The verify step-time table VARLEN schedules with, measured at start-up.

Per (batch bucket, rows per sequence q = 1..gamma+1): one warm-up and `reps` timed forwards, the
trimmed mean (min and max dropped). With decode CUDA graphs each shape is its graph's replay (captured
here if the warm-up did not); without, an eager forward of that many padding sequences in a scratch
cache. The ids are random: MoE routing must spread over the experts as a real batch's does (one
repeated id routes every row alike and would time a fraction of the expert weights).
"""
from __future__ import annotations

import logging
import time

import torch

from ..cache.state_cache import StateCache
from ..model import ForwardBatch
from ..speculative.varlen import StepTimes
from .cuda_graphs import buckets_for

log = logging.getLogger(__name__)


def _trimmed_mean(samples: list[float]) -> float:
    samples = sorted(samples)
    inner = samples[1:-1] if len(samples) > 2 else samples
    return sum(inner) / len(inner)


def _graph_ms(graphs, size: int, q: int, ids: torch.Tensor, reps: int) -> float | None:
    graphs.capture_bucket(size, q)
    cap = graphs.graphs.get((size, q))
    if cap is None or cap.graph is None:
        return None
    cap.inputs[:size * q].copy_(ids)
    samples = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        cap.graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return _trimmed_mean(samples[1:])


def _eager_ms(runner, size: int, q: int, ids: torch.Tensor, reps: int) -> float:
    layout = runner.cache_layout()
    blocks = -(-q // layout.block_size)
    scratch = StateCache(layout, size, size * blocks, runner.device)
    states = [scratch.bind(s, list(range(s * blocks, (s + 1) * blocks))) for s in range(size)]
    rows = ids.view(size, q).tolist()
    cuda = torch.device(runner.device).type == "cuda"
    samples = []
    for _ in range(reps + 1):
        batch = ForwardBatch.build(rows, states, runner.device, all_logits=True)   # positions 0..q-1 each time
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.model(batch)
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _trimmed_mean(samples[1:])


@torch.no_grad()
def profile_step_times(runner, max_seqs: int, max_rows: int, reps: int = 5) -> StepTimes:
    """The table for batches up to `max_seqs` sequences of 1..`max_rows` rows each."""
    t0 = time.perf_counter()
    buckets = buckets_for(max_seqs)
    vocab = int(runner.model_config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    graphs = runner.graphs
    table = []
    for size in buckets:
        row = []
        for q in range(1, max_rows + 1):
            ids = torch.randint(0, vocab, (size * q,), generator=gen)
            ms = None
            if graphs is not None:
                ms = _graph_ms(graphs, size, q, ids.to(runner.device), reps)
            if ms is None:
                ms = _eager_ms(runner, size, q, ids, reps)
            row.append(max(ms, 1e-3))
        table.append(tuple(row))
    times = StepTimes(tuple(buckets), max_rows, tuple(table))
    log.info("VARLEN step times: %d batch buckets x %d rows per sequence in %.1f s (%s)", len(buckets), max_rows,
             time.perf_counter() - t0, "graph replays" if graphs is not None else "eager forwards")
    return times
