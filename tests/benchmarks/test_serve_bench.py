"""benchmarks/serve_bench.py on the CPU, CI-sized: the per-request and aggregate figures on synthetic
timestamps (known TTFT / ITL / TPOT), the seeded arrival schedule, the workload generators, the SSE
client against an in-process fake server (failures are counted, never dropped), one end-to-end run
that launches the real server on a 3-layer tiny checkpoint, and sse_client_cost.py's two clients
reading every event. Nothing here asserts a speed.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import serve_bench as SB  # noqa: E402
import serve_bench_http as SH  # noqa: E402
import serve_bench_metrics as SM  # noqa: E402


def _result(
    index: int, start: float, chunks: list[float], end: float, tokens: int | None, expected: int = 4
) -> SM.RequestResult:
    return SM.RequestResult(index, start, expected, prompt_len=8, chunk_times=chunks, end=end, usage_tokens=tokens)


# ---- figures on synthetic timestamps ------------------------------------------------------------------


def test_one_requests_ttft_itl_tpot_e2e():
    """Sent at 1.0; chunks at 1.1, 1.15, 1.25, 1.3; [DONE] at 1.3; 4 tokens: TTFT 100 ms, ITL 50 / 100
    / 50 ms, e2e 300 ms, TPOT (300 - 100) / 3 ms."""
    r = _result(0, 1.0, [1.1, 1.15, 1.25, 1.3], 1.3, 4)
    assert r.ok and r.token_source == "usage" and r.output_tokens == 4
    assert r.ttft == pytest.approx(0.1) and r.e2e == pytest.approx(0.3)
    assert r.itl == pytest.approx([0.05, 0.1, 0.05])
    assert r.tpot == pytest.approx(0.2 / 3)
    assert _result(1, 0.0, [0.2], 0.2, 1).tpot is None  # one token: no TPOT


def test_tokens_counted_by_usage_then_logprobs_then_chunks():
    """Two chunks of 3 and 1 tokens (speculative decoding): usage says 4; without usage the chunks'
    logprobs say 4; without either, the chunk count (2) is all the client knows."""
    r = _result(0, 0.0, [0.1, 0.2], 0.2, 4)
    assert r.output_tokens == 4 and r.tpot == pytest.approx(0.1 / 3)
    r.usage_tokens, r.chunk_tokens = None, [3, 1]
    assert r.output_tokens == 4 and r.token_source == "logprobs"
    r.chunk_tokens = []
    assert r.output_tokens == 2 and r.token_source == "chunks"


def test_summary_keeps_failures_and_orders_percentiles():
    good = [
        _result(i, 0.1 * i, [0.1 * i + 0.05 + 0.01 * i, 0.1 * i + 0.2, 0.1 * i + 0.3, 0.1 * i + 0.4], 0.1 * i + 0.4, 4)
        for i in range(10)
    ]
    failed = SM.RequestResult(10, 0.0, 4, error="HTTP 503: busy")
    cut = SM.RequestResult(11, 0.0, 4, chunk_times=[0.1])  # no [DONE]: failed, not dropped
    s = SM.summarize([*good, failed, cut], duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (12, 10, 2)
    assert s["errors"] == ["request 10: HTTP 503: busy", "request 11: stream ended without [DONE]"]
    assert s["total_output_tokens"] == 40 and s["expected_output_tokens"] == 48 and s["short_outputs"] == 0
    assert s["total_input_tokens"] == 80
    assert s["request_throughput"] == pytest.approx(5.0) and s["output_throughput"] == pytest.approx(20.0)
    assert s["total_token_throughput"] == pytest.approx(60.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(50 + 4.5 * 10) and s["e2e_ms"]["mean"] == pytest.approx(400.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(np.mean([(400 - (50 + 10 * i)) / 3 for i in range(10)]))
    itl = [150 - 10 * i for i in range(10)] + [100.0] * 20  # first gap shrinks with i, then 100 ms
    assert s["itl_ms"]["mean"] == pytest.approx(np.mean(itl)) and s["itl_ms"]["p99"] == pytest.approx(147.1)
    assert s["tokens_per_chunk"] == 1.0
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert s[k]["p50"] <= s[k]["p90"] <= s[k]["p99"]
    assert s["peak_concurrency"] == 4  # requests 0.1 apart, each 0.4 long


def test_prometheus_counter_deltas_and_server_means():
    before = SM.parse_prometheus(
        "# TYPE x counter\ndeepinfer_generation_tokens_total 10\n"
        "deepinfer_requests_running 3\ndeepinfer_time_to_first_token_seconds_sum 1.0\n"
        "deepinfer_time_to_first_token_seconds_count 4\n"
    )
    after = SM.parse_prometheus(
        'deepinfer_generation_tokens_total 50\ndeepinfer_requests_finished_total{reason="length"}'
        " 2\ndeepinfer_time_to_first_token_seconds_sum 1.5\n"
        "deepinfer_time_to_first_token_seconds_count 6\n"
    )
    d = SM.counter_delta(before, after)
    assert d["deepinfer_generation_tokens_total"] == 40 and d['deepinfer_requests_finished_total{reason="length"}'] == 2
    assert "deepinfer_requests_running" not in d and d["server_mean_ttft_ms"] == pytest.approx(250.0)


# ---- arrivals and workload ---------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    a = SM.arrival_offsets(20000, 8.0, seed=3)
    assert a == SM.arrival_offsets(20000, 8.0, seed=3) and a != SM.arrival_offsets(20000, 8.0, seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all() and len(a) == 20000
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05)  # exponential: std = mean
    bursty = np.diff(SM.arrival_offsets(20000, 8.0, seed=3, burstiness=0.25))
    assert bursty.mean() == pytest.approx(1 / 8.0, rel=0.06) and bursty.std() > 1.5 * gaps.std()
    assert SM.arrival_offsets(5, math.inf, seed=0) == [0.0] * 5 and SM.arrival_offsets(0, 1.0, 0) == []


def test_random_prompts_are_seeded_and_vary_within_the_range(tmp_path):
    r = SM.random_requests(200, 100, 20, 0.5, vocab=1000, seed=[0, 1, 0])
    assert [x.prompt for x in r] == [x.prompt for x in SM.random_requests(200, 100, 20, 0.5, 1000, [0, 1, 0])]
    assert all(50 <= x.prompt_len == len(x.prompt) <= 150 and 10 <= x.output_len <= 30 for x in r)
    assert len({x.prompt_len for x in r}) > 20 and all(2 <= t < 1000 for x in r for t in x.prompt)
    fixed = SM.random_requests(4, 16, 8, 0.0, vocab=1000, seed=0)
    assert {x.prompt_len for x in fixed} == {16} and {x.output_len for x in fixed} == {8}
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello", "output_len": 3}\n\n{"prompt": [5, 6, 7], "output_len": 2}\n')
    d = SM.dataset_requests(path, 3)
    assert [(x.prompt, x.output_len, x.prompt_len) for x in d] == [
        ("hello", 3, None),
        ([5, 6, 7], 2, 3),
        ("hello", 3, None),
    ]
    path.write_text('{"prompt": [], "output_len": 2}\n')
    with pytest.raises(ValueError, match="d.jsonl:1: prompt"):
        SM.dataset_requests(path, 1)


# ---- the client against a fake server ------------------------------------------------------------------


def test_prompts_per_concurrency_plans_whole_rounds_of_the_batch():
    a = SB.resolve(["--concurrency", "1,16", "--prompts-per-concurrency", "4"])
    assert SB.Bench(a, None, None).plan() == [(1, 4), (16, 64)]
    assert SB.Bench(SB.resolve(["--concurrency", "1,16"]), None, None).plan() == [(1, 16), (16, 64)]
    for bad in (["--prompts-per-concurrency", "2"], ["--concurrency", "4", "--prompts-per-concurrency", "0"]):
        with pytest.raises(SystemExit, match="prompts-per-concurrency"):
            SB.resolve(bad)
    with pytest.raises(SystemExit, match="--expert-dtype shapes the --dummy-layers model"):
        SB.resolve(["--expert-dtype", "fp4"])


def test_client_reports_every_failure():
    """Request 0 streams 3 chunks + usage + [DONE]; 1 is refused (503); 2's stream ends before [DONE]:
    one completed request, two failed ones with their errors (a local aiohttp server)."""
    from aiohttp import web

    def event(d: dict) -> bytes:
        return f"data: {json.dumps(d)}\n\n".encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
        which = body["prompt"][0]
        if which == 1:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        for t in ("a", "b", "c"):
            await asyncio.sleep(0.01)
            await r.write(event({"choices": [{"index": 0, "text": t}]}))
        if which == 0:
            await r.write(event({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}))
            await r.write(b"data: [DONE]\n\n")
        await r.write_eof()
        return r

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            reqs = [SM.BenchRequest([i, 9], 3, 2) for i in range(3)]
            async with SH.client_session(f"http://127.0.0.1:{port}", {}, 30.0) as cl:
                return await SH.run_requests(cl, "m", reqs, [0.0, 0.0, 0.0], concurrency=2)
        finally:
            await runner.cleanup()

    results, duration = asyncio.run(go())
    s = SM.summarize(results, duration)
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (1, 2, 3)
    assert results[0].ttft > 0 and len(results[0].itl) == 2 and results[0].token_source == "usage"
    assert s["errors"][0].startswith("request 1: HTTP 503") and "without [DONE]" in s["errors"][1]


def test_sse_client_cost_reads_every_event_with_both_clients(tmp_path, monkeypatch):
    import sse_client_cost as SC

    monkeypatch.setattr(SC, "RESULTS", tmp_path)
    res = SC.main(["--streams", "3", "--events", "4", "--rounds", "1"])
    assert [(r["client"], r["events"]) for r in res["rows"]] == [("httpx", 12), ("aiohttp", 12)]
    assert all(r["cpu_us_per_event"] > 0 for r in res["rows"])
    assert json.loads((tmp_path / "sse_client_cost.json").read_text())["rows"] == res["rows"]


# ---- end to end -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny3_dir(tmp_path_factory) -> Path:
    """A 3-layer tiny checkpoint: every step ~3x cheaper than the 8-layer one."""
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve_bench_tiny3"), {"num_hidden_layers": 3}, seed=0)


def test_launch_end_to_end_on_the_tiny_model(tiny3_dir, tmp_path):
    out = tmp_path / "serve_bench_tiny.json"
    res = SB.main(
        [
            "--launch",
            f"--model {tiny3_dir} --max-model-len 128 --max-num-seqs 4 --num-speculative-tokens 0",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--concurrency",
            "1,4",
            "--num-prompts",
            "6",
            "--warmup-output-len",
            "2",
            "--out",
            str(out),
            "--server-log",
            str(tmp_path / "server.log"),
        ]
    )
    d = json.loads(out.read_text())
    assert d["complete"] and res["json_path"] == str(out) and d["server"]["exit_code"] == 0
    assert d["server"]["model"] == str(tiny3_dir) and d["server"]["models"]["data"][0]["max_model_len"] == 128
    assert [r["concurrency"] for r in d["rows"]] == [1, 4]
    for r in d["rows"]:
        assert r["status"] == "ok" and r["completed"] == r["num_prompts"] == 6 and r["failed"] == 0, r
        assert r["total_output_tokens"] == 6 * 5 and r["total_input_tokens"] == 6 * 8
        assert r["token_count_source"] == "usage" and r["warmup"]["failed"] == 0
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 < r[k]["p50"] <= r[k]["p90"] <= r[k]["p99"], (k, r[k])
        assert r["output_throughput"] > 0 and r["peak_concurrency"] <= r["concurrency"]
        assert r["server_counters"]["deepinfer_generation_tokens_total"] == 30
    # one in-process engine: its memory unlabelled on /metrics, one "rank"; per GPU = the total
    mem = d["server"]["memory"]
    assert d["server"]["data_parallel_size"] == 1 and [r["rank"] for r in mem["ranks"]] == [None]
    assert mem["ranks"][0]["weight_bytes"] == mem["weight_bytes"] > 0 and mem["cache_bytes"] > 0
    assert mem["ranks"][0]["device"] == "cpu"
    assert all(r["output_throughput_per_gpu"] == r["output_throughput"] for r in d["rows"])
    assert [c["concurrency"] for c in d["throughput_comparison"]] == [1, 4]
    assert all(c["input_len"] == 8 and c["output_len"] == 5 for c in d["throughput_comparison"])
    # 6 requests are 6 rounds of throughput.py's batch at concurrency 1, not whole rounds at 4
    assert [c["same_workload"] for c in d["throughput_comparison"]] == [True, False]
    # the launched server computes in the engine's default dtype; the offline command must say the same
    assert all(c["throughput_command"].endswith("--dtype float32") for c in d["throughput_comparison"])
