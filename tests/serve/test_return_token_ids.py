"""`return_token_ids` (vLLM's field) on a live server (bundled model, CPU): with it, each
completions choice carries `token_ids` and `prompt_token_ids` equal to `LLM.generate`'s for the
same greedy request (batches of token-id and of text prompts); streamed, each event carries its
delta's ids, which join to the same ids, and a choice's first event (only) the prompt's; echo with
max_tokens 0 returns no generated ids. Chat: `token_ids` per choice and the reply's
`prompt_token_ids` equal `LLM.chat`'s, streamed or not. Without the field the answer has neither;
a value that is not a boolean is a 400 naming it, on both routes."""
from __future__ import annotations

import httpx
import pytest
from sse import events

from deepinfer_core import LLM, SamplingParams

MODEL = "tiny"
COMMON = {"max_model_len": 256, "num_speculative_tokens": 0}
IDS = [[5, 900, 31, 4000, 77], [7, 12, 3000, 45]]
TEXTS = ["ROMEO.\nBut soft, what light", "KING.\nMy lord, the"]
MESSAGES = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"max_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def url(model_dir, start_server):
    return start_server(LLM(model=model_dir, **COMMON), 64, MODEL, None)[0]


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, **COMMON)


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": MODEL, **body}, timeout=120)


def generate(offline: LLM, prompts: list[str] | None = None,
             prompt_token_ids: list[list[int]] | None = None) -> list:
    params = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0)
    return offline.generate(prompts, params, prompt_token_ids=prompt_token_ids, use_tqdm=False)


def test_completion_ids_equal_llm_generate(url, offline):
    want = generate(offline, prompt_token_ids=IDS)
    got = post(url, "completions", {"prompt": IDS, "return_token_ids": True, **GREEDY})
    assert got.status_code == 200, got.text
    choices = sorted(got.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [w.outputs[0].token_ids for w in want]
    assert [c["prompt_token_ids"] for c in choices] == [w.prompt_token_ids for w in want]
    assert [len(c["token_ids"]) for c in choices] == [GREEDY["max_tokens"]] * 2
    plain = post(url, "completions", {"prompt": IDS[0], **GREEDY}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_streamed_completion_ids_join_to_llm_generate(url, offline):
    want = generate(offline, TEXTS)
    evs = events(url, "completions", {"prompt": TEXTS, "return_token_ids": True,
                                      "stream_options": {"include_usage": True}, **GREEDY})
    for i, w in enumerate(want):
        mine = [e["choices"][0] for e in evs if e["choices"] and e["choices"][0]["index"] == i]
        assert len(mine) > 1
        assert [x for c in mine for x in c["token_ids"]] == w.outputs[0].token_ids
        assert mine[0]["prompt_token_ids"] == w.prompt_token_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
    assert evs[-1]["usage"]["completion_tokens"] == 2 * GREEDY["max_tokens"]


def test_echo_without_generation_returns_no_generated_ids(url):
    body = {"prompt": IDS[1], "echo": True, "max_tokens": 0, "return_token_ids": True}
    choice = post(url, "completions", body).json()["choices"][0]
    assert choice["token_ids"] == [] and choice["prompt_token_ids"] == IDS[1]
    streamed = events(url, "completions", body)
    assert [e["choices"][0]["token_ids"] for e in streamed] == [[]]


def test_chat_ids_equal_llm_chat_streamed_or_not(url, offline):
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0),
                        use_tqdm=False)[0]
    body = {"messages": MESSAGES, "return_token_ids": True, **GREEDY}
    got = post(url, "chat/completions", body).json()
    assert got["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert got["prompt_token_ids"] == want.prompt_token_ids
    evs = events(url, "chat/completions", body)
    assert [x for e in evs for x in e["choices"][0]["token_ids"]] == want.outputs[0].token_ids
    assert evs[0]["prompt_token_ids"] == want.prompt_token_ids
    assert all("prompt_token_ids" not in e for e in evs[1:])


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": "x"}),
    ("chat/completions", {"messages": MESSAGES}),
])
@pytest.mark.parametrize("value", ["maybe", [1]])
def test_a_return_token_ids_that_is_not_a_boolean_is_a_400_naming_it(url, route, body, value):
    r = post(url, route, {"return_token_ids": value, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "return_token_ids" and err["message"].startswith("return_token_ids: ")
