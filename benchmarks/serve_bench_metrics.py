"""The pieces of `benchmarks/serve_bench.py` that need no server: the workload (random token-id
prompts or a JSON-lines dataset), the arrival schedule, one request's figures from its stream
timestamps, the aggregate of a measurement, the Prometheus counter deltas and the printed table.
Pure host arithmetic, testable on synthetic timestamps.

Token counting (why usage, not chunks): every SSE event with a non-empty `choices` list is a *content
chunk*: one engine output delta of the request, which normally carries one token but carries several
when speculative decoding accepts drafts (and its text may be empty while a multi-byte character is
incomplete). The output token count of a request is therefore the `usage.completion_tokens` of the
final event (`stream_options.include_usage`: exact, and no extra work on the server, unlike asking
for logprobs); without a usage event, the sum of the chunks' `logprobs.tokens` lengths when the
chunks carry logprobs, else the number of content chunks. ITL is what a streaming user sees: each gap
between consecutive content chunks (as `vllm bench serve` measures it), so with multi-token chunks the
ITL is larger than TPOT; `tokens_per_chunk` in the results shows when that happens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import throughput_metrics as TM

V4_VOCAB = 129280  # the V4 tokenizer's size (V4-Flash and the tiny model): random ids stay below
FIRST_ID = 2  # ids 0 and 1 are BOS / EOS, never sampled into a random prompt (as throughput.py)


# ---- the workload ------------------------------------------------------------------------------------


@dataclass
class BenchRequest:
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None  # known for token-id prompts; text prompts: from the server's usage


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> list[int]:
    """n lengths uniform in [mean*(1-ratio), mean*(1+ratio)] (at least 1), as vLLM's --random-range-ratio."""
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int | Sequence[int]
) -> list[BenchRequest]:
    """n seeded token-id prompts of random ids in [2, vocab); lengths vary by +-range_ratio."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio {range_ratio}: must be in [0, 1)")
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    return [BenchRequest(rng.integers(FIRST_ID, vocab, size=i).tolist(), o, i) for i, o in zip(ins, outs)]


def dataset_requests(path: str | Path, n: int) -> list[BenchRequest]:
    """The first n lines of a JSON-lines file of {"prompt": str | list[int], "output_len": int},
    cycled when the file has fewer (every measurement sends exactly n requests)."""
    rows = []
    for k, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        p, o = d.get("prompt"), d.get("output_len")
        if not (isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, int) for x in p))):
            raise ValueError(f"{path}:{k}: prompt must be a string or a non-empty list of token ids")
        if not isinstance(o, int) or o < 1:
            raise ValueError(f"{path}:{k}: output_len must be an int >= 1")
        rows.append(BenchRequest(p, o, len(p) if isinstance(p, list) else None))
    if not rows:
        raise ValueError(f"{path}: no requests")
    return [rows[i % len(rows)] for i in range(n)]


def arrival_offsets(n: int, rate: float, seed: int | Sequence[int], burstiness: float = 1.0) -> list[float]:
    """Send times (s after the start) of n requests at `rate` requests/s: the first at 0, the gaps drawn
    from a gamma distribution of mean 1/rate (shape `burstiness`; 1 = exponential, i.e. a Poisson
    process, as vLLM's --burstiness), seeded. rate = inf: every request at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# ---- one request ---------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    index: int
    start: float
    expected_output_len: int
    prompt_len: int | None = None
    chunk_times: list[float] = field(default_factory=list)  # each content chunk's arrival
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk when logprobs say so
    end: float | None = None  # the stream's end ([DONE])
    usage_tokens: int | None = None  # usage.completion_tokens of the last event
    cached_tokens: int | None = None  # its usage.prompt_tokens_details.cached_tokens
    token_ids: list[int] = field(default_factory=list)  # the generated ids (return_token_ids)
    error: str | None = None  # set: the request failed

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        if self.usage_tokens is not None:
            return self.usage_tokens
        return sum(self.chunk_tokens) if len(self.chunk_tokens) == len(self.chunk_times) else len(self.chunk_times)

    @property
    def token_source(self) -> str:
        if self.usage_tokens is not None:
            return "usage"
        return "logprobs" if self.chunk_tokens and len(self.chunk_tokens) == len(self.chunk_times) else "chunks"

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (tokens - 1): the mean time per token after the first; None for one token."""
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once (send to stream end), from the client's timestamps."""
    events = sorted(
        [(r.start, 1) for r in results if r.end is not None] + [(r.end, -1) for r in results if r.end is not None],
        key=lambda e: (e[0], e[1]),
    )
    peak = live = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def summarize(results: Sequence[RequestResult], duration_s: float, max_errors: int = 10) -> dict[str, Any]:
    """The figures of one measurement (`vllm bench serve`'s): completed and failed requests (a failed one
    is counted and its error kept, never dropped), token totals, request / output / total token
    throughput over `duration_s`, and mean / p50 / p90 / p99 (ms) of TTFT, TPOT, ITL and e2e latency
    over the completed requests."""
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    out_toks = sum(r.output_tokens for r in ok)
    in_toks = sum(r.prompt_len or 0 for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    sources = sorted({r.token_source for r in ok})
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(bad),
        "errors": [f"request {r.index}: {r.error or 'stream ended without [DONE]'}" for r in bad[:max_errors]],
        "short_outputs": sum(r.output_tokens != r.expected_output_len for r in ok),
        "total_input_tokens": in_toks,
        "total_output_tokens": out_toks,
        "expected_output_tokens": sum(r.expected_output_len for r in results),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_toks / duration_s if duration_s > 0 else None,
        "total_token_throughput": (in_toks + out_toks) / duration_s if duration_s > 0 else None,
        "ttft_ms": TM.percentiles(r.ttft for r in ok),
        "tpot_ms": TM.percentiles(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": TM.percentiles(g for r in ok for g in r.itl),
        "e2e_ms": TM.percentiles(r.e2e for r in ok),
        "peak_concurrency": peak_concurrency(ok),
        "tokens_per_chunk": out_toks / chunks if chunks else None,
        "token_count_source": sources[0] if len(sources) == 1 else sources,
    }


def workload_notes(
    plan: list[tuple[int | None, int]],
    input_len: int,
    warmup_input_len: int | None,
    warmup_output_len: int,
    dataset: str | None,
) -> list[str]:
    """What the JSON's reader must know of a workload that is not the default one."""
    notes = []
    short = [(c, n) for c, n in plan if c and n < 4 * c]
    if short:
        notes.append(
            "fewer prompts than the default 4 x concurrency: "
            + ", ".join(f"{n} at concurrency {c}" for c, n in short)
            + "; with every prompt sent at once, one round of C prompts is prefilled while the first ones "
            "already decode, and the output throughput over the measurement includes that ramp"
        )
    if warmup_input_len and warmup_output_len > 0 and not dataset and warmup_input_len != input_len:
        notes.append(f"warm-up prompts of {warmup_input_len} tokens (measured ones: {input_len})")
    return notes


DEFINITIONS = {
    "ttft_ms": "first content chunk (an SSE event with choices) - request sent",
    "itl_ms": "every gap between a request's consecutive content chunks (a chunk may hold several tokens)",
    "tpot_ms": "per request (e2e - ttft) / (output tokens - 1), tokens from usage.completion_tokens",
    "e2e_ms": "[DONE] - request sent",
    "duration_s": "first arrival to the last request's end",
    "output_throughput": "output tokens of completed requests / duration (tok/s)",
    "total_token_throughput": "(prompt + output tokens) of completed requests / duration",
    "output_throughput_per_gpu": "output_throughput / server.data_parallel_size (one GPU per rank; on CPU ranks, "
    "per rank)",
    "client_cpu_pct": "this process's CPU time / duration: near 100 the client limits the figures",
    "server_counters": "/metrics counter deltas over the measured window, with the server's own mean latencies",
    "server.memory": "per engine (data-parallel rank): resident weight bytes (its model's parameters and buffers), "
    "state-cache bytes (its pools) and device, from /metrics before the first measurement",
}


# ---- the server's own counters -------------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """{series: value} of the counters and histogram sums / counts of a /metrics page (gauges and
    buckets skipped: only differences over a measurement are reported)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name.endswith(("_total", "_sum", "_count")):
            try:
                out[series] = float(value)
            except ValueError:
                continue
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per series; with the server's mean TTFT / TPOT / e2e (ms) over the measurement,
    derived from the histogram sums and counts (server-side times: the gap to the client's is HTTP)."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    for short, name in (
        ("ttft", "time_to_first_token"),
        ("tpot", "time_per_output_token"),
        ("e2e", "e2e_request_latency"),
    ):
        s, c = d.get(f"deepinfer_{name}_seconds_sum"), d.get(f"deepinfer_{name}_seconds_count")
        if s is not None and c:
            d[f"server_mean_{short}_ms"] = 1e3 * s / c
    return d


def parse_labels(text: str) -> dict[str, str]:
    """{label: value} of `a="x",b="y"`, the text format's escapes undone (a malformed one: ValueError or
    IndexError)."""
    out, i = {}, 0
    while i < len(text):
        eq = text.index("=", i)
        key, j, val = text[i:eq].strip(" ,"), eq + 2, []  # past `="`
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
                val.append("\n" if text[j] == "n" else text[j])
            else:
                val.append(text[j])
            j += 1
        out[key], i = "".join(val), j + 1
    return out


def parse_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample on a /metrics page."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        try:
            out.append((name, parse_labels(labels.rstrip("}")), float(value)))
        except (ValueError, IndexError):  # not a sample this parser knows: skipped, as parse_prometheus does
            continue
    return out


def server_memory(text: str) -> dict[str, Any]:
    """What the server holds, per engine: {"ranks": [{rank, weight_bytes, cache_bytes, device,
    device_name}], "weight_bytes", "cache_bytes"} from its `deepinfer_weight_bytes`,
    `deepinfer_cache_bytes` and `deepinfer_device_info` gauges. A data-parallel server labels each
    rank's series `rank="r"`; a single engine's unlabelled series are its one entry (rank None). No
    such gauges (an older server): no ranks, totals None."""
    ranks: dict[str | None, dict[str, Any]] = {}
    for name, labels, value in parse_series(text):
        if name not in ("deepinfer_weight_bytes", "deepinfer_cache_bytes", "deepinfer_device_info"):
            continue
        if "rank" not in labels and name != "deepinfer_device_info":
            totals = ranks.setdefault(None, {"rank": None})
            totals[name.removeprefix("deepinfer_")] = int(value)
            continue
        entry = ranks.setdefault(labels.get("rank"), {"rank": labels.get("rank")})
        if name == "deepinfer_device_info":
            entry.update(device=labels.get("device"), device_name=labels.get("name"))
        else:
            entry[name.removeprefix("deepinfer_")] = int(value)
    totals = ranks.pop(None, {})
    per_rank = [dict(v, rank=int(k)) for k, v in sorted(ranks.items(), key=lambda kv: int(kv[0]))]
    if not per_rank and totals:  # one engine: its unlabelled series (device info, if any, has no rank)
        per_rank = [dict(totals, rank=None)]
    for entry in per_rank:
        for key in ("weight_bytes", "cache_bytes", "device", "device_name"):
            entry.setdefault(key, None)
    return {
        "ranks": per_rank,
        "weight_bytes": totals.get("weight_bytes"),
        "cache_bytes": totals.get("cache_bytes"),
    }


def memory_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """One line per rank of `server_memory`: its device, weights and state cache in GiB."""
    return [
        f"rank {r['rank']}: {r['device_name']} ({r['device']}): weights {(r['weight_bytes'] or 0) / 2**30:.2f} GiB, "
        f"state cache {(r['cache_bytes'] or 0) / 2**30:.2f} GiB"
        for r in ranks
    ]


# ---- the table -----------------------------------------------------------------------------------------


def _p(d: dict | None, key: str) -> float | None:
    return d.get(key) if d else None


def print_table(rows: list[dict]) -> None:
    """One line per measurement (concurrency): requests, throughput and the latency percentiles (ms)."""
    print(
        f"\n{'conc':>5} {'rate':>6} {'n':>5} {'ok':>5} {'fail':>4} {'dur s':>7} {'req/s':>7} {'out tok/s':>10} "
        f"{'/GPU':>8} {'tot tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} "
        f"{'ITL p99':>8} {'E2E p50':>9} {'E2E p99':>9}  status"
    )
    for r in rows:
        conc = "inf" if r.get("concurrency") is None else str(r["concurrency"])
        counts = " ".join(
            TM._f(r.get(k), f)
            for k, f in (
                ("completed", "5.0f"),
                ("failed", "4.0f"),
                ("duration_s", "7.2f"),
                ("request_throughput", "7.2f"),
                ("output_throughput", "10.1f"),
                ("output_throughput_per_gpu", "8.1f"),
                ("total_token_throughput", "10.1f"),
            )
        )
        lat = " ".join(
            TM._f(_p(r.get(k), p), f)
            for k, f in (("ttft_ms", "9.2f"), ("tpot_ms", "9.3f"), ("itl_ms", "8.3f"), ("e2e_ms", "9.1f"))
            for p in ("p50", "p99")
        )
        print(
            f"{conc:>5} {r.get('request_rate', float('inf')):6.4g} {r.get('num_prompts', 0):5d} {counts} {lat}  "
            f"{r.get('status', '?')}"
        )
