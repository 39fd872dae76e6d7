"""`GET /metrics` in the Prometheus text format: requests running and waiting, tokens in and out,
TTFT / TPOT / end-to-end histograms, state-cache use, preemptions, speculative acceptance.

The engine thread updates everything (`observe_step` after each step, `observe_finished` per finished
request); the HTTP thread only renders a snapshot under the same lock.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..api.outputs import RequestOutput

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


def scheduler_gauges(engine) -> dict[str, float]:
    """The gauges of one in-process engine: its scheduler's queues, its state cache, speculation."""
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
    return gauges


@dataclass
class ServerMetrics:
    gauges: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)     # finish reason -> requests
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_step(self, engine) -> None:
        """Gauges from the engine's scheduler and cache (engine thread, between steps); an engine of
        several ranks (parallel/dp_online.py) sums its ranks' own through its `gauges()`."""
        gauges = engine.gauges() if hasattr(engine, "gauges") else scheduler_gauges(engine)
        with self.lock:
            self.gauges = gauges

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
            lines = [f"# TYPE {name} gauge\n{name} {value}" for name, value in sorted(self.gauges.items())]
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
