"""`GET /metrics` in the Prometheus text format: requests running and waiting, tokens in and out,
TTFT / TPOT / end-to-end histograms, state-cache use, preemptions, speculative acceptance,
prefix-cache hits (with prefix caching on), and the engine's resident memory (weight and
state-cache bytes, the device it runs on).

The engine thread updates everything (`observe_step` after each step, `observe_finished` per finished
request); the HTTP thread only renders a snapshot under the same lock. Under data parallelism every
gauge appears twice: unlabelled, summed over the ranks (the series single-engine clients read), and per
rank with a `rank="r"` label (each rank's own engine: its load, its cache, its weights and device).
"""
from __future__ import annotations

import itertools
import platform
import threading
import weakref
from dataclasses import dataclass, field

from ..api.outputs import RequestOutput
from ..cache.prefix_cache import CUT_SHORT_REASONS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}",
                      f"{name}_count {self.count}"]


def resident_bytes(module) -> int:
    """Bytes of the storages under the module's parameters and buffers, each storage once (runtime
    weights may be views of one packed stack, or share a tensor between modules)."""
    storages = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        s = t.untyped_storage()
        storages[(t.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def device_series(device) -> str:
    """`deepinfer_device_info{device=..., name=...}`: where the engine's weights live (a CUDA device
    with its index, as the process sees it, and the GPU's name; else the host's processor)."""
    import torch
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        dev, name = torch.device("cuda", index), torch.cuda.get_device_name(index)
    else:
        name = platform.processor() or platform.machine()
    return f'deepinfer_device_info{{device="{_label(dev)}",name="{_label(name)}"}}'


# Computed once per runner (weights: a pass over every tensor) and per state cache (its pools): these
# gauges are read after every engine step, on the host path of the step loop.
_STATIC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memory_gauges(runner) -> dict[str, float]:
    """Resident weight bytes, state-cache bytes (0 before the cache exists) and the device of a runner."""
    static = _STATIC.get(runner)
    if static is None:
        static = _STATIC[runner] = (resident_bytes(runner.model), device_series(runner.device))
    cache = runner.cache
    cache_bytes = 0
    if cache is not None:
        cache_bytes = _CACHE_BYTES.get(cache)
        if cache_bytes is None:
            cache_bytes = _CACHE_BYTES[cache] = cache.nbytes()
    return {"deepinfer_weight_bytes": static[0], "deepinfer_cache_bytes": cache_bytes, static[1]: 1}


def prefix_cache_gauges(prefix) -> dict[str, float]:
    """A scheduler's PrefixCache stats: lookups and hits (sequences, prompt tokens), the hit rate
    over tokens, evictions, checkpoints stored, and the hits cut short by reason (each reason, 0
    or not)."""
    st = prefix.stats
    gauges = {
        "deepinfer_prefix_cache_queries_total": st.queries,
        "deepinfer_prefix_cache_hits_total": st.hits,
        "deepinfer_prefix_cache_query_tokens_total": st.query_tokens,
        "deepinfer_prefix_cache_hit_tokens_total": st.hit_tokens,
        "deepinfer_prefix_cache_hit_rate": st.hit_rate,
        "deepinfer_prefix_cache_evicted_blocks_total": st.evicted_blocks,
        "deepinfer_prefix_cache_evicted_checkpoints_total": st.evicted_checkpoints,
        "deepinfer_prefix_cache_checkpoints_stored_total": st.checkpoints_stored,
    }
    for reason in CUT_SHORT_REASONS:
        series = f'deepinfer_prefix_cache_cut_short_total{{reason="{reason}"}}'
        gauges[series] = st.cut_short.get(reason, 0)
    return gauges


def scheduler_gauges(engine) -> dict[str, float]:
    """The gauges of one in-process engine: its scheduler's queues, its state cache, its prefix
    cache (when on), speculation, the memory its runner holds."""
    sched = engine.scheduler
    alloc = sched.blocks.allocator
    spec = engine.spec_metrics
    gauges = {
        "deepinfer_requests_running": len(sched.running),
        "deepinfer_requests_waiting": sum(not s.finished for s in sched.waiting),
        "deepinfer_cache_used_blocks": alloc.num_used_blocks,
        "deepinfer_cache_total_blocks": alloc.num_blocks,
        "deepinfer_cache_used_slots": alloc.num_used_slots,
        "deepinfer_cache_usage_ratio": alloc.num_used_blocks / max(1, alloc.num_blocks),
        "deepinfer_preemptions_total": sched.num_preemptions,
    }
    if spec is not None:
        gauges["deepinfer_spec_decode_drafted_tokens_total"] = spec.num_drafted_tokens
        gauges["deepinfer_spec_decode_accepted_tokens_total"] = spec.num_accepted_tokens
        gauges["deepinfer_spec_decode_acceptance_rate"] = spec.num_accepted_tokens / max(1, spec.num_verified_tokens)
    if sched.prefix is not None:
        gauges.update(prefix_cache_gauges(sched.prefix))
    gauges.update(memory_gauges(engine.executor.runner))
    return gauges


def _split(series: str) -> tuple[str, str]:
    """('name', 'a="x",b="y"') of `name{a="x",b="y"}`; ('name', '') without labels."""
    name, _, labels = series.partition("{")
    return name, labels.rstrip("}")


def gauge_lines(total: dict[str, float], ranks: list[dict[str, float]]) -> list[str]:
    """Gauge families in the text format: the totals unlabelled, then each rank's series with its rank
    label first. An info series (value 1, its labels the facts) is not summed over ranks: only the
    per-rank ones are written when there are ranks."""
    families: dict[str, list[str]] = {}
    for series, value in total.items():
        name = _split(series)[0]
        if not (ranks and name.endswith("_info")):
            families.setdefault(name, []).append(f"{series} {value}")
    for rank, gauges in enumerate(ranks):
        for series, value in gauges.items():
            name, labels = _split(series)
            both = f'rank="{rank}"' + (f",{labels}" if labels else "")
            families.setdefault(name, []).append(f"{name}{{{both}}} {value}")
    out = []
    for name in sorted(families):
        out += [f"# TYPE {name} gauge", *families[name]]
    return out


@dataclass
class ServerMetrics:
    gauges: dict[str, float] = field(default_factory=dict)
    rank_gauges: list[dict[str, float]] = field(default_factory=list)   # per data-parallel rank
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)     # finish reason -> requests
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_step(self, engine) -> None:
        """Gauges from the engine's scheduler and cache (engine thread, between steps); an engine of
        several ranks (parallel/dp_online.py) sums its ranks' own through its `gauges()` and keeps each
        rank's last report (replaced whole, never mutated: a shallow copy is a snapshot)."""
        gauges = engine.gauges() if hasattr(engine, "gauges") else scheduler_gauges(engine)
        ranks = engine.rank_gauges() if hasattr(engine, "rank_gauges") else []   # DP: each rank's last report
        with self.lock:
            self.gauges, self.rank_gauges = gauges, ranks

    def observe_output(self, out: RequestOutput) -> None:
        """Tokens of one output (a delta) and, when the request finished, its latencies."""
        with self.lock:
            self.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
            if not out.finished:
                return
            self.prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                self.finished[c.finish_reason or "abort"] = self.finished.get(c.finish_reason or "abort", 0) + 1
            m = out.metrics
            if m is None or m.first_token_time is None:
                return
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
                if len(m.token_times) > 1:
                    self.tpot.observe((m.token_times[-1] - m.first_token_time) / (len(m.token_times) - 1))

    def observe_abort(self) -> None:
        with self.lock:
            self.finished["abort"] = self.finished.get("abort", 0) + 1

    def render(self, admitted: int) -> str:
        with self.lock:
            lines = gauge_lines(self.gauges, self.rank_gauges)
            lines += ["# TYPE deepinfer_server_admitted_requests gauge",
                      f"deepinfer_server_admitted_requests {admitted}",
                      "# TYPE deepinfer_prompt_tokens_total counter",
                      f"deepinfer_prompt_tokens_total {self.prompt_tokens}",
                      "# TYPE deepinfer_generation_tokens_total counter",
                      f"deepinfer_generation_tokens_total {self.generation_tokens}",
                      "# TYPE deepinfer_requests_finished_total counter"]
            lines += [f'deepinfer_requests_finished_total{{reason="{r}"}} {n}'
                      for r, n in sorted(self.finished.items())]
            lines += self.ttft.lines("deepinfer_time_to_first_token_seconds")
            lines += self.tpot.lines("deepinfer_time_per_output_token_seconds")
            lines += self.e2e.lines("deepinfer_e2e_request_latency_seconds")
        return "\n".join(lines) + "\n"
