"""Prefix caching through the server (bundled model, CPU): a prompt sent again answers the same
with `usage.prompt_tokens_details.cached_tokens` > 0, streamed or not, on both routes; `cache_salt`
(vLLM's field) shares cached prompts only between requests with the same salt, and a salt that is
not a non-empty string is a 400 naming it; `POST /reset_prefix_cache` empties the cache; `/metrics`
counts the hits. Without prefix caching every usage says 0 cached tokens and a reset answers false.
With the engine in a process of its own (`--engine-process`, the CUDA default) the reset goes
through the front end to the engine's process and answers the same.

The cache works in 128-token blocks and a hit leaves the prompt's last token to compute, so the
prompts here are about 300 tokens (two cached blocks)."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from deepinfer_core import LLM

MODEL = "tiny"
AUTH = {"Authorization": "Bearer sk-test"}


def long_prompt(tag: str) -> str:
    """About 300 tokens, distinct per tag (each test caches prompts of its own)."""
    return " ".join(f"{tag}{i}" for i in range(150))


@pytest.fixture(scope="module")
def url(model_dir, start_server):
    llm = LLM(model=model_dir, max_model_len=512, num_speculative_tokens=0,
              enable_prefix_caching=True)
    return start_server(llm, 64, MODEL, "sk-test")[0]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=120)


def complete(url: str, prompt: str, **kw):
    return client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0,
                                          **kw)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": "x"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
@pytest.mark.parametrize("salt", [5, ["a"], ""])
def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(url, route, body, salt):
    r = httpx.post(f"{url}/v1/{route}", json={"model": MODEL, "cache_salt": salt, **body},
                   headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and err["message"].startswith("cache_salt: "), err
    assert "string" in err["message"].lower(), err


def test_a_repeated_prompt_hits_the_cache_and_answers_the_same(url):
    prompt = long_prompt("repeat")
    first, again = complete(url, prompt), complete(url, prompt)
    assert cached(first) == 0 and 128 <= cached(again) < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text
    chunks = list(complete(url, prompt, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert cached(chunks[-1]) == cached(again)


def test_a_repeated_chat_hits_the_cache_streamed_or_not(url):
    messages = [{"role": "user", "content": long_prompt("chat")}]
    chat = client(url).chat.completions.create
    first = chat(model=MODEL, messages=messages, max_tokens=4, temperature=0.0)
    again = chat(model=MODEL, messages=messages, max_tokens=4, temperature=0.0, stream=True,
                 stream_options={"include_usage": True})
    chunks = list(again)
    assert cached(first) == 0 and cached(chunks[-1]) >= 128
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content


def test_only_requests_with_the_same_salt_share_a_cached_prompt(url):
    prompt, salted = long_prompt("salted"), {"cache_salt": "alice"}
    assert cached(complete(url, prompt)) == 0
    assert cached(complete(url, prompt, extra_body=salted)) == 0
    assert cached(complete(url, prompt, extra_body=salted)) >= 128


def test_reset_prefix_cache_then_the_same_prompt_misses(url):
    prompt = long_prompt("reset")
    complete(url, prompt)
    assert cached(complete(url, prompt)) >= 128
    r = httpx.post(f"{url}/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"reset": True}, r.text
    assert cached(complete(url, prompt)) == 0
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 401


def test_metrics_count_the_hits(url):
    prompt = long_prompt("metrics")
    complete(url, prompt)
    complete(url, prompt)
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    values = {line.split()[0].removeprefix("deepinfer_prefix_cache_"): float(line.split()[1])
              for line in text.splitlines() if line.startswith("deepinfer_prefix_cache_")}
    assert values["queries_total"] > values["hits_total"] >= 1
    assert values["query_tokens_total"] > values["hit_tokens_total"] >= 128
    assert values["hit_rate"] == values["hit_tokens_total"] / values["query_tokens_total"]
    assert values["checkpoints_stored_total"] >= 1
    assert {"evicted_blocks_total", "evicted_checkpoints_total"} <= set(values)
    for reason in ("no_checkpoint", "prompt_logprobs", "checkpoint_slots_full"):
        assert f'cut_short_total{{reason="{reason}"}}' in values
    assert "# TYPE deepinfer_prefix_cache_hits_total gauge" in text


def test_without_prefix_caching_usage_says_0_cached_and_a_reset_is_false(model_dir, start_server):
    llm = LLM(model=model_dir, max_model_len=512, num_speculative_tokens=0,
              enable_prefix_caching=False)
    url = start_server(llm, 64, MODEL, "sk-test")[0]
    assert cached(complete(url, long_prompt("plain"))) == 0
    assert httpx.post(f"{url}/reset_prefix_cache", headers=AUTH).json() == {"reset": False}
    assert "deepinfer_prefix_cache_" not in httpx.get(f"{url}/metrics", headers=AUTH).text


def test_reset_prefix_cache_reaches_an_engine_in_its_own_process(model_dir, start_server):
    llm = LLM(model=model_dir, max_model_len=512, num_speculative_tokens=0,
              enable_prefix_caching=True, engine_process=True)
    try:
        url = start_server(llm, 64, MODEL, "sk-test")[0]
        prompt = long_prompt("process")
        complete(url, prompt)
        hit = cached(complete(url, prompt))
        assert hit >= 128, hit
        # the engine process may still be ending the finished request's last step when the reset
        # arrives (its blocks still held: the reset answers false); it is asked again
        for _ in range(20):
            r = httpx.post(f"{url}/reset_prefix_cache", headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            if r.json() == {"reset": True}:
                break
            time.sleep(0.1)
        assert r.json() == {"reset": True}, r.text
        assert cached(complete(url, prompt)) == 0
    finally:
        llm.close()
