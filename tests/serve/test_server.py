"""The OpenAI-compatible server on localhost (bundled model, CPU) with the real `openai` client:
completions streamed and not, n=2, logprobs, batched prompts, seeded and greedy requests equal to
`LLM.generate` with the same parameters; bad requests are 400s naming the field; the API key; a
client that goes away mid-stream leaves no request in the engine. Chat: equal to `LLM.chat`, streamed
or not; thinking mode's `reasoning_content`; a `json_schema` response that validates."""
from __future__ import annotations

import asyncio
import json
import random
import re
import resource
import subprocess
import time

import httpx
import jsonschema
import openai
import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.serve.chat import ReasoningSplit
from deepinfer_core.serve.engine_loop import EngineLoop

MODEL = "tiny"
PROMPTS = ["ROMEO.\nBut soft, what light", "KING.\nMy lord, the"]


@pytest.fixture(scope="module")
def server(model_dir, start_server):
    llm = LLM(model=model_dir, max_model_len=512, num_speculative_tokens=0)
    url, loop = start_server(llm, 512, MODEL, "sk-test")
    yield url, llm, loop


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, max_model_len=512, num_speculative_tokens=0)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)


def test_greedy_and_seeded_completions_equal_llm_generate(server, offline):
    url, _, _ = server
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=7, top_p=0.9)):
        got = client(url).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, **kw)
        want = offline.generate(PROMPTS, SamplingParams(max_tokens=12, **kw), use_tqdm=False)
        assert [c.text for c in got.choices] == [o.outputs[0].text for o in want]
        assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in want)
        assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)


def test_streamed_completion_joins_to_the_same_text(server, offline):
    url, _, _ = server
    chunks = list(client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = offline.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    assert text == want.outputs[0].text and len([c for c in chunks if c.choices]) > 1
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n_and_logprobs(server):
    url, _, _ = server
    got = client(url).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, n=2, seed=3, logprobs=2)
    assert sorted(c.index for c in got.choices) == [0, 1, 2, 3]
    for c in got.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 5
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)
        assert "".join(c.logprobs.tokens) == c.text


@pytest.mark.parametrize("body,field", [
    (dict(model=MODEL, prompt="x", temperature=-1), "temperature"),
    (dict(model=MODEL, prompt="x", top_p=0), "top_p"),
    (dict(model=MODEL, prompt="x", logprobs=50), "logprobs"),
    (dict(model=MODEL, prompt="x", max_tokens="many"), "max_tokens"),
    (dict(model=MODEL, prompt="x", no_such_field=1), "no_such_field"),
    (dict(model="gpt-4", prompt="x"), "model"),
    (dict(model=MODEL), "prompt"),
    (dict(model=MODEL, prompt="x" * 5000), "prompt"),
    (dict(model=MODEL, prompt=[0, 10**9]), "prompt"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, field):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-test"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or field in err["message"], err


def test_bad_json_wrong_key_and_health(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"Authorization": "Bearer sk-test",
                                                                             "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_client_that_goes_away_mid_stream_leaves_nothing_behind(server):
    url, llm, loop = server
    with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": "Bearer sk-test"}, timeout=60,
                      json=dict(model=MODEL, prompt=PROMPTS[0], max_tokens=400, ignore_eos=True, stream=True)) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.time() + 30
    while loop.num_admitted or llm.engine.has_unfinished_requests():
        assert time.time() < deadline, "the aborted request is still in the engine"
        time.sleep(0.05)
    assert client(url).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


# ---- chat -------------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Speak the prologue."}]


def test_chat_equals_llm_chat_streamed_or_not(server, offline):
    url, _, _ = server
    got = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.0)
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert got.choices[0].message.content == want.outputs[0].text and got.choices[0].message.role == "assistant"
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                      temperature=0.0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text


def test_thinking_mode_returns_reasoning_content(server, offline):
    url, _, _ = server
    got = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.0,
                                              extra_body={"chat_template_kwargs": {"thinking": True}})
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=24, temperature=0.0), thinking_mode="thinking",
                        use_tqdm=False)[0].outputs[0].text
    reasoning, _, content = want.partition("</think>")
    message = got.choices[0].message
    assert message.reasoning_content == reasoning and message.content == content and reasoning


def test_chat_logprobs_hold_the_top_k(server):
    url, _, _ = server
    got = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=2, logprobs=True,
                                              top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert "".join(e.token for e in content) == got.choices[0].message.content and len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob


def test_reasoning_split_across_deltas():
    split = ReasoningSplit(reasoning=True)
    assert [split.feed(t) for t in ("I think", " so</think>Yes", ".")] == [("I think", ""), (" so", "Yes"), ("", ".")]
    assert ReasoningSplit(reasoning=False).feed("a</think>b") == ("", "a</think>b")


def test_json_schema_response_validates(server):
    url, _, _ = server
    schema = {"type": "object", "properties": {"act": {"enum": [1, 2, 3, 4, 5]}, "scene": {"enum": ["I", "II", "III"]}},
              "required": ["act", "scene"], "additionalProperties": False}
    got = client(url).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=96, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "where", "schema": schema}})
    assert got.choices[0].finish_reason == "stop", got.choices[0]
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)


def test_guided_and_structured_outputs_fields(server):
    """vLLM's extensions: guided_choice on a completion, structured_outputs (regex) on a chat reply."""
    url, _, _ = server
    c = client(url)
    got = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, seed=1, temperature=1.0,
                               extra_body={"guided_choice": ["Juliet", "the sun"]})
    assert got.choices[0].text in ("Juliet", "the sun"), got.choices[0]
    chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=2,
                                     extra_body={"structured_outputs": {"regex": "Act [IV]{1,3}"}})
    assert re.fullmatch(r"Act [IV]{1,3}", chat.choices[0].message.content), chat.choices[0]


@pytest.mark.parametrize("body,field", [
    (dict(guided_regex="a+", guided_choice=["a"]), "guided_choice"),
    (dict(structured_outputs={"regx": "a"}), "structured_outputs"),
    (dict(guided_json={"type": "object"}, response_format={"type": "json_object"}), "guided_json"),
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools"),          # no name
    (dict(tool_choice="required"), "tool_choice"),                                          # no tools
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(chat_template_kwargs={"thinkin": True}), "chat_template_kwargs"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
])
def test_bad_chat_requests_are_400s_naming_the_field(server, body, field):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body},
                   headers={"Authorization": "Bearer sk-test"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or field in err["message"], err


# ---- load and faults ----------------------------------------------------------------------------
def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-test"}).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def wait_idle(url: str, loop: EngineLoop) -> None:
    deadline = time.time() + 60
    while loop.num_admitted or metric(url, "deepinfer_requests_running") or metric(url, "deepinfer_cache_used_blocks"):
        assert time.time() < deadline, "requests still in the server"
        time.sleep(0.05)


def test_256_concurrent_streams_complete_equal_offline_and_health_stays_fast(server, offline):
    url, _, loop = server
    prompts = [f"{PROMPTS[i % 2]} {i}" for i in range(256)]

    async def stream(client: httpx.AsyncClient, i: int) -> str:
        body = dict(model=MODEL, prompt=prompts[i], max_tokens=8, seed=i, stream=True)
        text = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)

    async def health(client: httpx.AsyncClient, done: asyncio.Event) -> list[float]:
        latencies = []
        while not done.is_set():
            t0 = time.perf_counter()
            assert (await client.get(f"{url}/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        return latencies

    async def main():
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(headers={"Authorization": "Bearer sk-test"}, timeout=300, limits=limits) as c:
            done = asyncio.Event()
            probe = asyncio.create_task(health(c, done))
            texts = await asyncio.gather(*(stream(c, i) for i in range(256)))
            done.set()
            return texts, await probe

    texts, latencies = asyncio.run(main())
    want = offline.generate(prompts, [SamplingParams(max_tokens=8, seed=i) for i in range(256)], use_tqdm=False)
    assert texts == [o.outputs[0].text for o in want]
    latencies.sort()
    assert len(latencies) >= 10 and latencies[int(0.99 * (len(latencies) - 1))] < 0.05, latencies[-5:]
    wait_idle(url, loop)


def test_random_disconnects_leak_no_slot_or_block(server):
    url, _, loop = server
    rng = random.Random(0)

    async def leave_after(client: httpx.AsyncClient, chunks: int) -> None:
        body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=64, ignore_eos=True, stream=True)
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen > chunks:
                    return                              # closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(headers={"Authorization": "Bearer sk-test"}, timeout=120) as c:
            await asyncio.gather(*(leave_after(c, rng.randrange(0, 6)) for _ in range(64)))

    asyncio.run(main())
    wait_idle(url, loop)
    assert metric(url, "deepinfer_cache_used_slots") == 0
    assert client(url).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("requests", [300, pytest.param(1000, marks=pytest.mark.slow)])
def test_hundreds_of_requests_in_a_row_grow_nothing(server, requests):
    """Peak RSS after a warm-up grows by less than 64 KiB a request (a leak of a request's state,
    tokens or text shows); the cache ends empty."""
    url, _, loop = server
    body = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=1)
    measured = requests - 100
    with httpx.Client(headers={"Authorization": "Bearer sk-test"}, timeout=60) as c:
        def run(n: int) -> None:
            for _ in range(n):
                assert c.post(f"{url}/v1/completions", json=body).status_code == 200
        run(100)                                              # warm-up
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run(measured)
    wait_idle(url, loop)
    assert metric(url, "deepinfer_cache_used_slots") == 0
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown_kib < 64 * measured, f"peak RSS grew {grown_kib} KiB over {measured} requests"


def test_sigterm_finishes_the_running_request_and_exits_0(model_dir, free_port, console_server):
    """SIGTERM: no new connections, the running stream finishes, exit status 0 (`deepinfer serve`)."""
    port = free_port()
    proc = subprocess.Popen(["deepinfer", "serve", "--model", model_dir, "--port", str(port), "--max-model-len",
                             "512", "--num-speculative-tokens", "0", "--shutdown-timeout", "60"])
    url = f"http://127.0.0.1:{port}"
    try:
        console_server.wait_healthy(proc, url, 120)
        console_server.sigterm_mid_stream(proc, url, model_dir, PROMPTS[0])
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")
    finally:
        proc.kill()


def test_the_console_script_names_its_commands(capsys):
    from deepinfer_core import cli
    assert cli.main([]) == 2 and cli.main(["serv"]) == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: COMMAND" in err
    choices = err.split("invalid choice: 'serv' (choose from ", 1)[1]
    assert all(name in choices for name in ("serve", "generate", "chat", "bench", "plugins", "env"))
