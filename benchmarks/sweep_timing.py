"""Timing for the sweep: warm-up, then the median of several runs measured with CUDA events (host
perf_counter on the CPU); a per-layer split from events recorded by forward hooks on every block;
an optional CUDA-graph replay of a decode step; and the sweep's timed prefill and decode runs of our
engine (`run_prefill`, `run_decode`).

Events bracket the whole step including the host work inside it (batch metadata, Python), which is
what a serving step costs; the split's remainder (total minus the blocks) is the embedding, the
hc_head collapse and the LM head.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from sweep_model import decode_states, prefill_cache, random_ids

from deepinfer_core.model import ForwardBatch


@dataclass
class Timing:
    samples_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "samples_ms": list(self.samples_ms)}


class Clock:
    """CUDA events on a CUDA device, perf_counter otherwise."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def time(self, fn: Callable[[], object], setup: Callable[[], object] | None = None, warmup: int = 2,
             reps: int = 5, max_seconds: float = 30.0) -> Timing:
        """Median of up to `reps` runs after `warmup` ones; stops early (after at least one measured
        run) once `max_seconds` have passed, so a slow path cannot stall the sweep."""
        t0 = time.perf_counter()
        for i in range(warmup):
            if setup is not None:
                setup()
            fn()
            self.sync()
            if time.perf_counter() - t0 > max_seconds / 2:
                break
        out = Timing()
        t0 = time.perf_counter()
        while len(out.samples_ms) < max(1, reps):
            if setup is not None:
                setup()
            a = self.mark()
            fn()
            b = self.mark()
            self.sync()
            out.samples_ms.append(self.elapsed_ms(a, b))
            if time.perf_counter() - t0 > max_seconds:
                break
        return out


def layer_split(model: torch.nn.Module, fn: Callable[[], object], clock: Clock,
                setup: Callable[[], object] | None = None) -> dict:
    """One run of `fn` with an event before and after every block: ms per layer (summed over the
    chunks of a chunked prefill), the whole run, and the remainder outside the blocks. A V4.1 block
    runs through `forward_shifted` (no module call, so no hooks: wrapped for the run instead) and
    its Engram (called by the model before the block) counts as the block's."""
    marks: list[tuple[int, str, object]] = []
    hooks, wrapped = [], []
    for i, layer in enumerate(model.layers):
        parts = [layer] + ([layer.engram] if getattr(layer, "engram", None) is not None else [])
        for m in parts:
            hooks += [m.register_forward_pre_hook(lambda m, a, i=i: _mark(marks, i, "s", clock)),
                      m.register_forward_hook(lambda m, a, o, i=i: _mark(marks, i, "e", clock))]
        if getattr(model, "cfg", None) is not None and model.cfg.hc_shifted:
            layer.forward_shifted = _marked(layer.forward_shifted, i, marks, clock)
            wrapped.append(layer)
    try:
        if setup is not None:
            setup()
        start = clock.mark()
        fn()
        end = clock.mark()
        clock.sync()
    finally:
        for h in hooks:
            h.remove()
        for layer in wrapped:
            del layer.forward_shifted           # the class's method again
    per = [0.0] * len(model.layers)
    open_marks: dict[int, object] = {}
    for i, kind, m in marks:
        if kind == "s":
            open_marks[i] = m
        else:
            per[i] += clock.elapsed_ms(open_marks.pop(i), m)
    total = clock.elapsed_ms(start, end)
    return {"layers_ms": per, "total_ms": total, "embed_head_ms": max(0.0, total - sum(per))}


def _mark(marks: list, i: int, kind: str, clock: Clock) -> None:
    marks.append((i, kind, clock.mark()))


def _marked(method: Callable, i: int, marks: list, clock: Clock) -> Callable:
    """`method` with a start and an end mark of layer `i` around every call."""
    def run(*args, **kwargs):
        _mark(marks, i, "s", clock)
        out = method(*args, **kwargs)
        _mark(marks, i, "e", clock)
        return out
    return run


def cuda_graph_timing(model: torch.nn.Module, batch, clock: Clock, reps: int = 10,
                      max_seconds: float = 30.0) -> Timing:
    """Capture one forward over a fixed batch in a CUDA graph and time its replays. Raises whatever
    the capture raises (a host sync inside the forward, an allocation the capture cannot take)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):                         # warm-up on the side stream; builds the batch's
            model(batch)                           # device metadata once, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        model(batch)
    try:
        return clock.time(graph.replay, warmup=2, reps=reps, max_seconds=max_seconds)
    finally:
        del graph


def free(device) -> None:
    """Collect garbage and return the CUDA allocator's cached blocks (between shapes)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---- the sweep's runs of our engine --------------------------------------------------------

def run_prefill(built, layout, n: int, chunk: int, clock: Clock, a) -> dict:
    """One `n`-token prompt from position 0 in chunks of `chunk`, on a fresh state each run."""
    model, dev = built.model, built.ctx.device
    cache = prefill_cache(layout, n, dev)
    ids = random_ids(n, built.cfg.vocab_size, a.seed + n)
    holder = {}

    def setup():
        holder["st"] = cache.bind(0, list(range(cache.num_blocks)))       # fresh tails, position 0

    def run():
        st = holder["st"]
        for s in range(0, n, chunk):
            batch = ForwardBatch.build([ids[s:s + chunk]], [st], dev)
            model(batch)
            batch.commit()
    with torch.no_grad():
        t = clock.time(run, setup, a.warmup, a.reps, a.max_shape_seconds)
        split = layer_split(model, run, clock, setup)
    return {"ours": {"eager": t.to_dict()}, "split": split, "step_ms": t.median_ms}


def run_decode(built, layout, b: int, c: int, clock: Clock, a, graph_note: dict) -> dict:
    """One decode step of `b` sequences at context `c` (fabricated state), eager and, with
    `--cuda-graph` on CUDA, replayed from a graph (`graph_note` remembers a failed capture)."""
    model, dev = built.model, built.ctx.device
    cache, states = decode_states(layout, b, c, dev, a.seed)
    toks = [[t] for t in random_ids(b, built.cfg.vocab_size, a.seed + b + c)]
    # no commit: every run writes the same position
    run = lambda: model(ForwardBatch.build(toks, states, dev))  # noqa: E731
    with torch.no_grad():
        t = clock.time(run, None, a.warmup, a.reps, a.max_shape_seconds)
        split = layer_split(model, run, clock)
    out = {"ours": {"eager": t.to_dict()}, "split": split, "step_ms": t.median_ms}
    if a.cuda_graph and clock.cuda:
        if graph_note.get("broken"):
            why = f"not tried: capture failed earlier ({graph_note['broken']})"
            out["ours"]["cuda_graph"] = {"status": why}
        else:
            try:
                g = cuda_graph_timing(model, ForwardBatch.build(toks, states, dev), clock,
                                      max(a.reps, 10), a.max_shape_seconds)
                out["ours"]["cuda_graph"] = {"status": "ok", **g.to_dict()}
                out["step_ms"] = min(out["step_ms"], g.median_ms)
            except Exception as e:                # a sync or host read inside the forward
                first = str(e).splitlines()[0][:200] if str(e) else ""
                graph_note["broken"] = f"{type(e).__name__}: {first}"
                out["ours"]["cuda_graph"] = {"status": f"failed: {graph_note['broken']}"}
                free(dev)
    return out
