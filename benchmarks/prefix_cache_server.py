"""`benchmarks/prefix_cache.py --server`: the multi-turn workload through the OpenAI server.

Each mode's LLM is served in this process while its workload runs (`serving`: the engine loop's
thread and uvicorn's, on a free port, as `deepinfer serve` runs with the engine in a thread), and
every turn is one streamed `/v1/completions` request per conversation, all sent at once over HTTP
by serve_bench_http's aiohttp client in a process of its own (`client`: as a client on another
host, its JSON work never holds the server's GIL): the prompt as token ids, greedy, `ignore_eos`,
`return_token_ids` (the next turn resends the exact history: this prompt + the returned ids + the
new user message) and `stream_options.include_usage` (`usage.prompt_tokens_details.cached_tokens`:
the hits). Each request comes back as the `RequestOutput` the report reads (`as_output`), with the
client's clock: TTFT is the send to the first streamed chunk (which carries a token).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

import serve_bench_http as SH
import serve_bench_metrics as SM

from deepinfer_core.api.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "prefix-cache-bench"           # the served model's name
BODY = {"return_token_ids": True}      # beside serve_bench_http.send's greedy, streamed body
READ_TIMEOUT_S = 3600.0
START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def serving(llm: Any, max_requests: int) -> Iterator[str]:
    """An OpenAI server over `llm` in this process while the block runs; its URL. The engine steps
    in the engine loop's thread, so nothing else may drive `llm` meanwhile."""
    import uvicorn

    from deepinfer_core.serve.app import build_app
    from deepinfer_core.serve.engine_loop import EngineLoop

    loop = EngineLoop(llm.serving_engine(), max_requests=max_requests)
    loop.start()
    port = SH.free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(llm, loop, MODEL), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="prefix-cache-server", daemon=True)
    thread.start()
    try:
        deadline = time.perf_counter() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.perf_counter() > deadline:
                raise RuntimeError("prefix_cache --server: the server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        loop.stop(30)


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
    """The process the client runs in (started once; `turn` sends it each turn's prompts)."""
    with concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as pool:
        pool.submit(int).result()                 # started before the first timed turn
        yield pool


def _send_all(url: str, reqs: list[SM.BenchRequest]) -> tuple[list[SM.RequestResult], float]:
    """In the client's process: every request sent at once; (results, seconds to the last end)."""
    async def run() -> tuple[list[SM.RequestResult], float]:
        async with SH.client_session(url, {}, READ_TIMEOUT_S) as session:
            return await SH.run_requests(session, MODEL, reqs, [0.0] * len(reqs), None, BODY)

    return asyncio.run(run())


def turn(pool: concurrent.futures.Executor, url: str, prompts: list[list[int]],
         output_len: int) -> tuple[list[RequestOutput], float]:
    """One turn over HTTP, every request sent at once by the client's process: (their outputs,
    seconds from the first send to the last [DONE]). A failed request, or one without usage,
    raises RuntimeError."""
    reqs = [SM.BenchRequest(p, output_len, len(p)) for p in prompts]
    results, elapsed = pool.submit(_send_all, url, reqs).result()
    bad = next((r for r in results if not r.ok or r.cached_tokens is None), None)
    if bad is not None:
        why = bad.error or "no usage.prompt_tokens_details.cached_tokens"
        raise RuntimeError(f"prefix_cache --server: request {bad.index}: {why}")
    return [as_output(r, p) for r, p in zip(results, prompts)], elapsed
