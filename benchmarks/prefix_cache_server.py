"""`benchmarks/prefix_cache.py --server`: the multi-turn workload through the OpenAI server, as a
user runs it.

Each mode is its own `python -m deepinfer_core.serve` (serve_bench_http.launch: a subprocess on a
free port, waited for on /health, stopped with SIGTERM), started with the engine options the
in-process benchmark gives its LLM (`engine_flags`: prefix caching on or off, the same cache
blocks: the first server sizes its cache, the next ones are given as many) and `--launch`'s
extra flags. So the server's own defaults apply: on a CUDA device its engine steps in a child
process (`--launch=--no-engine-process`: a thread of the server's). A mode's server is warmed up
over HTTP (as the in-process benchmark warms its LLM) and kept while the mode does not change.

Every turn is one streamed `/v1/completions` request per conversation, all sent at once over
HTTP (`send_turn`) by serve_bench_http's aiohttp client in a process of its own (`client`: as a
client on another host): the prompt as token ids, greedy, `ignore_eos`, `return_token_ids` (the
next turn resends the exact history: this prompt + the returned ids + the new user message) and
`stream_options.include_usage` (`usage.prompt_tokens_details.cached_tokens`: the hits). Each
request comes back as the `RequestOutput` the report reads (`as_output`), with the client's
clock: TTFT is the send to the first streamed chunk (which carries a token). The prefix cache's
counters come from the server's /metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import serve_bench_http as SH
import serve_bench_metrics as SM

from deepinfer_core.api.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "prefix-cache-bench"           # the served model's name
BODY = {"return_token_ids": True}      # beside serve_bench_http.send's greedy, streamed body
READ_TIMEOUT_S = 3600.0
START_TIMEOUT_S = 900.0                # a fresh GPU compiles its kernels while starting
PREFIX = "deepinfer_prefix_cache_"
COUNTERS = ("queries", "hits", "query_tokens", "hit_tokens", "evicted_blocks",
            "evicted_checkpoints", "checkpoints_stored")


def engine_flags(a: argparse.Namespace, spec: Any, caching: bool,
                 num_blocks: int | None) -> list[str]:
    """The server's command-line flags for one mode: the options `throughput_run.build_llm` gives
    the in-process LLM (but its seed: the requests are greedy), the mode's prefix caching, the
    cache blocks, then `--launch`'s."""
    opts: dict[str, Any] = {
        "load_format": spec.load_format, "dtype": a.dtype, "simulate_qat": not a.no_qat,
        "device": a.device, "max_num_seqs": a.max_num_seqs,
        "max_model_len": a.max_model_len, "max_num_batched_tokens": a.max_num_batched_tokens,
        "gpu_memory_utilization": a.gpu_memory_utilization, "kv_cache_dtype": a.kv_cache_dtype,
        "enforce_eager": a.enforce_eager or None, "batch_invariant": a.batch_invariant or None,
        "num_cache_blocks": num_blocks, "enable_prefix_caching": caching}
    if caching:
        opts.update(prefix_checkpoint_slots=a.checkpoint_slots,
                    prefix_checkpoint_interval=a.checkpoint_interval)
    flags = ["--model", spec.path, "--served-model-name", MODEL,
             "--max-requests", str(a.conversations)]
    for name, value in opts.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            flags += [f"--{flag}", str(value)]
    return flags + shlex.split(a.launch or "")


def as_output(res: SM.RequestResult, prompt: list[int]) -> RequestOutput:
    """One request as the client saw it, in the shape `prefix_cache_report.call_row` reads: the
    generated ids, the cached tokens, and client times (send, each chunk's arrival, [DONE])."""
    times = RequestMetrics(arrival_time=res.start, first_token_time=res.chunk_times[0],
                           finished_time=res.end, token_times=list(res.chunk_times))
    out = CompletionOutput(0, "", list(res.token_ids), None, None, "length")
    return RequestOutput(f"turn-request-{res.index}", None, prompt, None, [out], True, times,
                         res.cached_tokens or 0)


@contextlib.contextmanager
def client() -> Iterator[concurrent.futures.Executor]:
    """The process the client runs in (started once; `Served.turn` sends it each turn's prompts)."""
    with concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as pool:
        pool.submit(int).result()                 # started before the first timed turn
        yield pool


def _send_all(url: str, reqs: list[SM.BenchRequest]) -> tuple[list[SM.RequestResult], float]:
    """In the client's process: every request sent at once; (results, seconds to the last end)."""
    async def run() -> tuple[list[SM.RequestResult], float]:
        async with SH.client_session(url, {}, READ_TIMEOUT_S) as session:
            return await SH.run_requests(session, MODEL, reqs, [0.0] * len(reqs), None, BODY)

    return asyncio.run(run())


def send_turn(pool: concurrent.futures.Executor, url: str, prompts: list[list[int]],
              output_len: int) -> tuple[list[RequestOutput], float]:
    """Every prompt sent at once to the server at `url` by the client's process: (their outputs,
    seconds from the first send to the last [DONE]). A failed request, or one without usage,
    raises RuntimeError."""
    reqs = [SM.BenchRequest(p, output_len, len(p)) for p in prompts]
    results, elapsed = pool.submit(_send_all, url, reqs).result()
    bad = next((r for r in results if not r.ok or r.cached_tokens is None), None)
    if bad is not None:
        why = bad.error or "no usage.prompt_tokens_details.cached_tokens"
        raise RuntimeError(f"prefix_cache --server: request {bad.index}: {why}")
    return [as_output(r, p) for r, p in zip(results, prompts)], elapsed


def prefix_stats(metrics: str) -> dict[str, Any] | None:
    """The prefix cache's counters on a /metrics page, as `PrefixCacheStats` fields (None: the
    server has no prefix cache)."""
    series = SM.parse_prometheus(metrics)
    if f"{PREFIX}queries_total" not in series:
        return None
    out: dict[str, Any] = {k: int(series[f"{PREFIX}{k}_total"]) for k in COUNTERS}
    out["cut_short"] = {labels["reason"]: int(v) for name, labels, v in SM.parse_series(metrics)
                        if name == f"{PREFIX}cut_short_total" and "rank" not in labels}
    return out


def timeline(outs: list[RequestOutput], server: dict[str, float]) -> dict[str, float | None]:
    """Where a turn's time to first token went: the spread of the client's sends and of the first
    chunks' arrivals (ms after the first send), and the server's own mean TTFT over the turn (its
    /metrics histogram: from the engine's arrival to its first token, without HTTP)."""
    sends = [o.metrics.arrival_time for o in outs]
    firsts = [o.metrics.first_token_time for o in outs]
    t0 = min(sends)
    return {"send_spread_ms": 1e3 * (max(sends) - t0),
            "first_chunk_ms_min": 1e3 * (min(firsts) - t0),
            "first_chunk_ms_max": 1e3 * (max(firsts) - t0),
            "server_mean_ttft_ms": server.get("server_mean_ttft_ms")}


class Served:
    """One mode's server while its block runs: `turn` (one round of requests), `stats`, `reset`."""

    def __init__(self, pool: concurrent.futures.Executor, flags: list[str], log_path: Path):
        self.pool, self.srv = pool, SH.Server(url="")
        self.last: dict[str, float | None] = {}      # the last turn's timeline
        self.warmup_seconds = None                   # the runner's: in the server's process
        self.log_path = log_path
        SH.launch(self.srv, flags, log_path, START_TIMEOUT_S)
        self.startup_s = self.srv.startup_s

    def close(self) -> None:
        SH.stop(self.srv)

    def metrics(self) -> str:
        text = SH.metrics_text(self.srv.url, {})
        if text is None:
            raise RuntimeError(f"prefix_cache --server: no /metrics from {self.srv.url}")
        return text

    def num_blocks(self) -> int | None:
        """The cache blocks the server sized (its `deepinfer_cache_total_blocks` gauge)."""
        for name, labels, value in SM.parse_series(self.metrics()):
            if name == "deepinfer_cache_total_blocks" and "rank" not in labels:
                return int(value)
        return None

    def stats(self) -> dict[str, Any] | None:
        return prefix_stats(self.metrics())

    def reset(self) -> bool:
        """POST /reset_prefix_cache: True when no cached prefix is left."""
        r = httpx.post(f"{self.srv.url}/reset_prefix_cache", timeout=60)
        r.raise_for_status()
        return bool(r.json().get("reset"))

    def turn(self, prompts: list[list[int]], output_len: int) -> tuple[list[RequestOutput], float]:
        """One turn: `send_turn` to this server (a failure says whether the server exited). Its
        timeline (`timeline`) is kept in `last`."""
        before = SM.parse_prometheus(self.metrics())
        try:
            outs, elapsed = send_turn(self.pool, self.srv.url, prompts, output_len)
        except RuntimeError as exc:
            if self.srv.proc is not None and self.srv.proc.poll() is not None:
                raise RuntimeError(f"{exc}; the server exited with {self.srv.proc.returncode} "
                                   f"(log {self.log_path})") from None
            raise
        self.last = timeline(outs, SM.counter_delta(before, SM.parse_prometheus(self.metrics())))
        return outs, elapsed
