"""The HTTP side of `benchmarks/serve_bench.py`: a launched server's life (a subprocess started on a
free port, waited for on /health, stopped with SIGTERM) and the asyncio client (one streamed
`/v1/completions` request timed chunk by chunk; a workload on its arrival schedule under a concurrency
limit; the server's /metrics counters), plus what this host's accelerators are.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import serve_bench_metrics as SM

try:        # the client's JSON at Rust speed where pydantic is installed (the server's extra): a
    # 6k-id prompt and the event echoing it cost ~0.3 ms instead of ~1 ms, so a burst of long
    # prompts leaves the client's event loop sooner
    from pydantic_core import from_json as json_loads
    from pydantic_core import to_json as json_bytes
except ImportError:
    json_loads = json.loads

    def json_bytes(obj: Any) -> bytes:
        return json.dumps(obj).encode()

# ---- the server ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in a serve command line."""
    for i, x in enumerate(args):
        if x == name and i + 1 < len(args):
            return args[i + 1]
        if x.startswith(name + "="):
            return x.split("=", 1)[1]
    return None


@dataclass
class Server:
    url: str
    launched: list[str] | None = None  # the command, when this process started it
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    startup_s: float | None = None
    exit_code: int | None = None
    dummy: Any = None  # throughput_run.ModelSpec of --dummy-layers


def dummy_model(layers: int, config: str | None, expert_dtype: str | None = None) -> Any:
    """A config-only directory (throughput_run.prepare_model: the config cut as throughput.py cuts it,
    routed experts in `expert_dtype` (None: FP8), plus the V4 tokenizer the server needs) for
    `--load-format dummy`. Imports torch, hence only here."""
    import throughput_run as TR

    return TR.prepare_model(
        SimpleNamespace(
            model=None,
            load_format=None,
            tiny=False,
            config=config,
            layers=layers,
            expert_dtype=expert_dtype,
            mtp=False,
        )
    )


def fp4_note(launch: list[str]) -> str:
    """Whether the launched server keeps FP4 experts FP4 (the engine's fp4_experts option), said aloud."""
    if "--fp4-experts" in launch:
        return "FP4 routed experts, kept FP4 by the server (--fp4-experts in --launch)"
    if "--no-fp4-experts" in launch:
        return ("FP4 routed experts in the checkpoint format, re-encoded to FP8 at load by an NVIDIA server "
                "(--no-fp4-experts in --launch: twice the expert bytes)")
    return (
        "FP4 routed experts in the checkpoint format; --launch leaves fp4_experts to the server's default for "
        "its GPU (re-encoded to FP8 at load unless that GPU keeps them FP4 by default; the portable method "
        "dequantises every weight to the compute dtype at load either way)"
    )


def launch(srv: Server, serve_args: list[str], log_path: Path, timeout: float) -> None:
    """Start `python -m deepinfer_core.serve SERVE_ARGS` (+ the dummy model, + a free port unless one is
    given) and wait for /health; a server that exits or never answers ends the run with its log's tail."""
    args = list(serve_args)
    if srv.dummy is not None:
        args += ["--model", srv.dummy.path, "--load-format", "dummy"]
    if flag(args, "--port") is None:
        args += ["--port", str(free_port())]
    host = flag(args, "--host") or "127.0.0.1"
    srv.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{flag(args, '--port')}"
    srv.launched = [sys.executable, "-m", "deepinfer_core.serve", *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    srv.log_path = log_path
    print(f"[serve_bench] launching {shlex.join(srv.launched)} (log {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:  # a file, not a pipe: an unread pipe would block the server
        srv.proc = subprocess.Popen(srv.launched, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if srv.proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"serve_bench: the server exited with {srv.proc.returncode} before /health:\n{tail}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"serve_bench: no /health after {timeout:.0f} s (log {log_path})")
        time.sleep(0.5)
    srv.startup_s = time.perf_counter() - t0
    print(f"[serve_bench] server up at {srv.url} after {srv.startup_s:.1f} s", flush=True)


def stop(srv: Server, timeout: float = 120.0) -> None:
    """SIGTERM (the server's graceful shutdown: exit status 0 expected), SIGKILL after `timeout`."""
    if srv.proc is not None and srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
    if srv.proc is not None:
        srv.exit_code = srv.proc.returncode
    if srv.dummy is not None and srv.dummy.tmp_dir is not None:
        shutil.rmtree(srv.dummy.tmp_dir, ignore_errors=True)


# ---- the client ----------------------------------------------------------------------------------------


def client_session(url: str, headers: dict[str, str], read_timeout: float) -> aiohttp.ClientSession:
    """The streaming client: aiohttp, not httpx. Why: per SSE event httpx's async line iterator costs
    about four times the CPU (`benchmarks/sse_client_cost.py`), and a client event loop that busy, at
    thousands of events per second, delays the chunk and end times it records. No connection limit
    (a pool limit would cap the concurrency silently)."""
    return aiohttp.ClientSession(
        base_url=url,
        headers=headers,
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=60.0, sock_read=read_timeout),
        read_bufsize=2**20,  # one SSE event is one line; logprob events can be long
    )


CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


async def send(
    client: aiohttp.ClientSession,
    model: str,
    req: SM.BenchRequest,
    index: int,
    extra: dict[str, Any] | None = None,
) -> SM.RequestResult:
    """One streamed completion; every failure (HTTP status, an error event, a broken stream, a timeout)
    ends up in the result's `error`. `extra`: more body fields (`return_token_ids: true`: the result
    keeps the generated ids)."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    res = SM.RequestResult(index, time.perf_counter(), req.output_len, req.prompt_len)
    try:
        async with client.post("/v1/completions", data=json_bytes(body),
                               headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:300]}"
                return res
            async for raw in r.content:  # line by line
                now = time.perf_counter()  # first, so JSON parsing never delays a timestamp
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    res.end = now
                    break
                ev = json_loads(data)
                if ev.get("error"):
                    res.error = f"error event: {json.dumps(ev['error'])[:300]}"
                    break
                if ev.get("choices"):
                    res.chunk_times.append(now)
                    choice = ev["choices"][0]
                    res.token_ids += choice.get("token_ids") or []
                    lp = choice.get("logprobs")
                    if lp and lp.get("tokens") is not None:
                        res.chunk_tokens.append(len(lp["tokens"]))
                if ev.get("usage"):
                    res.usage_tokens = ev["usage"].get("completion_tokens")
                    res.prompt_len = ev["usage"].get("prompt_tokens", res.prompt_len)
                    details = ev["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
    except Exception as e:  # a failed request is a figure, not a crash
        res.error = f"{type(e).__name__}: {e}"[:300]
    if res.error is None and res.end is None:
        res.error = "stream ended without [DONE]"
    elif res.error is None and not res.chunk_times:
        res.error = "no content chunk"
    return res


async def run_requests(
    client: aiohttp.ClientSession,
    model: str,
    reqs: list[SM.BenchRequest],
    offsets: list[float],
    concurrency: int | None,
    extra: dict[str, Any] | None = None,
) -> tuple[list[SM.RequestResult], float]:
    """All requests on their arrival schedule, at most `concurrency` in flight (a request waiting for a
    slot starts its clock when sent, as vLLM's); (results, seconds from the start to the last end).
    `extra`: more body fields of every request (`send`)."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> SM.RequestResult:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            return await send(client, model, reqs[i], i, extra)
        async with sem:
            return await send(client, model, reqs[i], i, extra)

    results = await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return list(results), time.perf_counter() - t0


def metrics_text(url: str, headers: dict[str, str]) -> str | None:
    """The server's /metrics page (None when it has none or refuses)."""
    try:
        r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


async def scrape(client: aiohttp.ClientSession) -> dict[str, float] | None:
    try:
        async with client.get("/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            return SM.parse_prometheus(await r.text()) if r.status == 200 else None
    except CLIENT_ERRORS:
        return None


# ---- the host ----------------------------------------------------------------------------------------


def device_info() -> dict[str, Any]:
    """This host's accelerators (nvidia-smi: no CUDA context in the client); the server's device when it
    runs here (--launch or a localhost URL). The server's own (per rank) is in the JSON's server.memory."""
    info: dict[str, Any] = {"host": platform.node(), "cpu": platform.machine(), "cpu_count": os.cpu_count()}
    if shutil.which("nvidia-smi"):
        try:
            q = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            info["gpus"] = [g.strip() for g in q.stdout.splitlines() if g.strip()]
        except (OSError, subprocess.SubprocessError) as e:  # a broken driver is no reason to lose the run
            info["gpus"] = f"nvidia-smi failed: {e}"
    return info
