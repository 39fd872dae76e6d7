"""The OpenAI server over two data-parallel ranks with expert parallelism (CPU, gloo), on localhost with
the real `openai` client.

Oracle: `LLM.generate` / `LLM.chat` in this process (one engine). Float32, QAT off and batch-invariant
GEMMs make a request's tokens independent of its batch and rank (as tests/parallel/test_dp_options.py),
so greedy and seeded requests must give exactly the oracle's text, streamed or not, n=2 with logprobs.
A client that leaves mid-stream must free its request on its rank (the ranks' abort counter and cache
gauges on /metrics). A rank killed mid-stream ends the stream with an error event naming the rank, then
/health and new requests answer 503 (never a hang). Last, the CLI path: `deepinfer serve
--data-parallel-size 2 --enable-expert-parallel` answers, drains a running stream on SIGTERM, exits 0 and
leaves no rank behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from deepinfer_core import LLM, SamplingParams

MODEL = "tiny"
PROMPTS = ["ROMEO.\nBut soft, what light", "KING.\nMy lord, the", "HAMLET.\nTo be"]
MESSAGES = [{"role": "user", "content": "Speak the prologue."}]
COMMON = dict(max_model_len=512, dtype="float32", simulate_qat=False, batch_invariant=True, num_speculative_tokens=0)
AUTH = {"Authorization": "Bearer sk-test"}


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, **COMMON)


@pytest.fixture(scope="module")
def server(model_dir, start_server):
    llm = LLM(model=model_dir, data_parallel_size=2, enable_expert_parallel=True, **COMMON)
    url, loop = start_server(llm, 64, MODEL, "sk-test")
    yield url, llm, loop
    llm.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_greedy_and_seeded_completions_equal_llm_generate(server, offline):
    url, _, _ = server
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=7, top_p=0.9, n=2, logprobs=2)):
        got = client(url).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, **kw)
        want = offline.generate(PROMPTS, SamplingParams(max_tokens=12, **kw), use_tqdm=False)
        n = kw.get("n", 1)
        texts = {c.index: c.text for c in got.choices}
        assert [texts[i] for i in range(len(PROMPTS) * n)] == [c.text for o in want for c in o.outputs]
        assert got.usage.completion_tokens == sum(len(c.token_ids) for o in want for c in o.outputs)
        for c in got.choices if "logprobs" in kw else ():
            assert "".join(c.logprobs.tokens) == c.text and all(len(t) >= 2 for t in c.logprobs.top_logprobs)


def test_streamed_completions_join_to_the_same_text(server, offline):
    url, _, _ = server
    chunks = list(
        client(url).completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=16,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    for i, o in enumerate(want):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == o.outputs[0].text and len(mine) > 1
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in want)


def test_chat_equals_llm_chat_streamed_or_not(server, offline):
    url, _, _ = server
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    got = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.0)
    assert got.choices[0].message.content == want
    chunks = list(
        client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_bad_request_refused_by_a_rank_is_a_400(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", json=dict(model=MODEL, prompt=[0, 10**9]), headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert "prompt" in r.json()["error"]["message"]


def test_cache_salt_reaches_the_ranks_and_reset_prefix_cache_answers_for_them(server):
    """Prefix caching is on (the default): a salted request runs (0 cached tokens: a prompt shorter
    than a block), and a reset of the ranks' prefix caches answers true, as one engine's does."""
    url, _, _ = server
    got = client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body={"cache_salt": "s"})
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    r = httpx.post(f"{url}/reset_prefix_cache", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json() == {"reset": True}, r.text


def _wait_idle(url: str, loop) -> None:
    deadline = time.time() + 120  # hang guard
    while loop.num_admitted or metric(url, "deepinfer_requests_running") or metric(url, "deepinfer_cache_used_slots"):
        assert time.time() < deadline, "requests still in the server"
        time.sleep(0.05)


def test_a_client_that_goes_away_mid_stream_frees_its_request_on_its_rank(server):
    url, _, loop = server
    _wait_idle(url, loop)
    aborted = metric(url, "deepinfer_dp_aborted_requests_total")
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60, json=body) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    _wait_idle(url, loop)
    # the rank applied the abort (a finished request would not count) and its slot and blocks are free
    assert metric(url, "deepinfer_dp_aborted_requests_total") == aborted + 1
    assert metric(url, "deepinfer_cache_used_blocks") == 0
    assert client(url).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


def test_a_dead_rank_fails_requests_with_503_and_health(server):
    """Last in this module: the server's engine is dead afterwards."""
    url, llm, _ = server
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60, json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        os.kill(llm._dp._procs[1].pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data:")]
    error = json.loads(rest[-1][len("data: ") :])["error"]
    assert error["code"] == 503 and "rank 1 of 2 died (killed by SIGKILL)" in error["message"], error
    health = httpx.get(f"{url}/health", timeout=60)
    assert health.status_code == 503 and "rank 1 of 2 died" in health.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json=dict(model=MODEL, prompt="x", max_tokens=2), headers=AUTH, timeout=60)
    assert r.status_code == 503 and "rank 1 of 2 died" in r.json()["error"]["message"], r.text


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "engine_flags, processes",
    [(["--data-parallel-size", "2", "--enable-expert-parallel"], 2), (["--engine-process"], 1)],
    ids=["dp2-ep", "engine-process"],
)
def test_cli_serves_over_engine_processes_then_drains_on_sigterm(
    model_dir, free_port, offline, console_server, engine_flags, processes
):
    """Two DP ranks with EP, or the one engine process (`--engine-process`)."""
    port = free_port()
    flags = ["--max-model-len", "512", "--dtype", "float32", "--no-simulate-qat", "--batch-invariant"]
    proc = subprocess.Popen(
        ["deepinfer", "serve", "--model", model_dir, "--port", str(port), *engine_flags,
         "--num-speculative-tokens", "0", "--shutdown-timeout", "60", *flags]
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        console_server.wait_healthy(proc, url, 240)  # start-up loads the model in the engine processes
        ranks = _children(proc.pid)
        assert len(ranks) >= processes
        got = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json=dict(model=model_dir, prompt=PROMPTS, max_tokens=8, temperature=0),
        )
        want = offline.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert [c["text"] for c in got.json()["choices"]] == [o.outputs[0].text for o in want]
        console_server.sigterm_mid_stream(proc, url, model_dir, PROMPTS[0])
        deadline = time.time() + 60
        while any(_alive(pid) for pid in ranks):
            assert time.time() < deadline, "a rank outlived the server"
            time.sleep(0.1)
    finally:
        proc.kill()
