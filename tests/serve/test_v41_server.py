"""The OpenAI-compatible server over the tiny DeepSeek-V4.1 (CPU, float32, QAT off), with the real
`openai` client: a greedy completion and a greedy chat reply, each on a prompt long enough for both
top-k levels to bind (see tests/engine/test_v41_engine.py), equal `LLM.generate` / `LLM.chat` with
the same parameters, token counts included."""
from __future__ import annotations

import openai
import pytest

from deepinfer_core import LLM, SamplingParams

MODEL = "tiny-v41"
NEW = 16
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks? " * 6            # 86 tokens
MESSAGES = [{"role": "user",
             "content": "Speak the prologue, " + "two households, both alike in dignity, " * 9}]


def v41_llm(tiny_v41_dir) -> LLM:
    return LLM(model=str(tiny_v41_dir), dtype="float32", simulate_qat=False, max_model_len=1024)


@pytest.fixture(scope="module")
def offline(tiny_v41_dir):
    return v41_llm(tiny_v41_dir)


@pytest.fixture(scope="module")
def client(tiny_v41_dir, start_server) -> openai.OpenAI:
    url, _ = start_server(v41_llm(tiny_v41_dir), 8, MODEL, "sk-test")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)


def test_completion_equals_llm_generate(client, offline):
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0.0)
    want = offline.generate([PROMPT], SamplingParams(max_tokens=NEW, temperature=0.0),
                            use_tqdm=False)[0]
    out = want.outputs[0]
    assert len(want.prompt_token_ids) >= 60 and len(out.token_ids) == NEW and out.text
    assert (got.choices[0].text, got.choices[0].finish_reason) == (out.text, out.finish_reason)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == \
        (len(want.prompt_token_ids), NEW)


def test_chat_equals_llm_chat(client, offline):
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=NEW,
                                         temperature=0.0)
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=NEW, temperature=0.0),
                        use_tqdm=False)[0]
    out = want.outputs[0]
    assert len(want.prompt_token_ids) >= 60 and len(out.token_ids) == NEW and out.text
    message = got.choices[0].message
    assert (message.role, message.content) == ("assistant", out.text)
    assert got.choices[0].finish_reason == out.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == \
        (len(want.prompt_token_ids), NEW)
