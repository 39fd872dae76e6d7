"""CPU time a streaming benchmark client spends per SSE event, httpx against aiohttp: why
`serve_bench.py` streams with aiohttp. A local aiohttp server (its own process, so its CPU is not
counted) streams `--events` completion chunks to each of `--streams` concurrent requests; each client
reads them line by line and parses the JSON, as `serve_bench_http.send` does.

    python benchmarks/sse_client_cost.py [--streams 64 --events 200 --rounds 2]

Prints a table and writes benchmarks/results/sse_client_cost.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import resource
import socket
import time
from pathlib import Path

import aiohttp
import httpx

RESULTS = Path(__file__).resolve().parent / "results"
EVENT = ("data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                                "choices": [{"index": 0, "text": " the", "logprobs": None,
                                             "finish_reason": None}]}) + "\n\n").encode()


def _serve(port: int, events: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        for _ in range(events):
            await r.write(EVENT)
            await asyncio.sleep(0.005)          # chunks arrive one by one, as a decode step's do
        await r.write(b"data: [DONE]\n\n")
        return r

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def _httpx(url: str, streams: int) -> int:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        async def one() -> int:
            n = 0
            async with client.stream("POST", "/v1/completions", json={}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        json.loads(line[5:])
                        n += 1
            return n
        return sum(await asyncio.gather(*(one() for _ in range(streams))))


async def _aiohttp(url: str, streams: int) -> int:
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=0)) as client:
        async def one() -> int:
            n = 0
            async with client.post("/v1/completions", json={}) as r:
                async for line in r.content:
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        json.loads(line[5:])
                        n += 1
            return n
        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _wait_for(port: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"the SSE server on port {port} did not start within {timeout} s")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = mp.get_context("spawn").Process(target=_serve, args=(port, a.events), daemon=True)
    server.start()
    rows = []
    try:
        _wait_for(port)
        url = f"http://127.0.0.1:{port}"
        for _ in range(a.rounds):
            for name, client in (("httpx", _httpx), ("aiohttp", _aiohttp)):
                cpu0, t0 = _cpu_s(), time.perf_counter()
                n = asyncio.run(client(url, a.streams))
                cpu, wall = _cpu_s() - cpu0, time.perf_counter() - t0
                rows.append(dict(client=name, events=n, cpu_us_per_event=cpu / n * 1e6, wall_s=wall,
                                 client_cpu_pct=100 * cpu / wall))
    finally:
        server.terminate()
        server.join()
    print(f"{'client':8} {'events':>7} {'CPU us/event':>13} {'wall s':>7} {'client CPU':>11}")
    for r in rows:
        print(f"{r['client']:8} {r['events']:>7} {r['cpu_us_per_event']:>13.1f} {r['wall_s']:>7.2f} "
              f"{r['client_cpu_pct']:>10.0f}%")
    result = dict(settings=vars(a), host=platform.node(), cpu=platform.processor() or platform.machine(),
                  versions=dict(httpx=httpx.__version__, aiohttp=aiohttp.__version__), rows=rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sse_client_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS / 'sse_client_cost.json'}")
    return result


if __name__ == "__main__":
    main()
