"""Tool calls in `/v1/chat/completions`.

The bundled tiny model never writes a DSML block, so the response assembly is tested on scripted outputs:
`chat_choice` on whole completions, and the SSE generator on scripted engine deltas in many chunkings (the
joined stream equals the whole answer). The live server (bundled model, CPU, the `openai` client) shows that
tools are accepted and rendered into the prompt exactly as the offline renderer does (usage.prompt_tokens),
that the answers equal `LLM.chat` with the same tools, that tool_choice "required" / a named function makes
even this model call the tools with schema-valid arguments (the DSML grammar), and that bad `tools` /
`tool_choice` are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import openai
import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.api.chat import _render_tool_calls, encode_chat_prompt, render_chat
from deepinfer_core.api.outputs import CompletionOutput, RequestOutput
from deepinfer_core.serve.chat import _sse, chat_choice

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}
CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
    },
    {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
]
BLOCK = _render_tool_calls(CALLS)


def completion(text: str, finish_reason: str = "stop") -> CompletionOutput:
    return CompletionOutput(0, text, [7] * 3, None, None, finish_reason)


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---- response assembly on scripted outputs ---------------------------------------------------------
def test_a_block_becomes_tool_calls_and_the_text_before_it_the_content():
    choice = chat_choice(completion("Let me look." + BLOCK), thinking=False, parse_tools=True)
    message = choice["message"]
    assert message["content"] == "Let me look." and calls_of(message["tool_calls"]) == calls_of(CALLS)
    assert choice["finish_reason"] == "tool_calls" and "reasoning_content" not in message
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    assert chat_choice(completion(BLOCK), False, True)["message"]["content"] is None  # nothing before the block


def test_thinking_splits_first_and_only_the_content_is_parsed():
    text = f"I should call{BLOCK}</think>Checking.{BLOCK}"  # a block inside the reasoning stays reasoning
    choice = chat_choice(completion(text), thinking=True, parse_tools=True)
    message = choice["message"]
    assert message["reasoning_content"] == f"I should call{BLOCK}" and message["content"] == "Checking."
    assert calls_of(message["tool_calls"]) == calls_of(CALLS) and choice["finish_reason"] == "tool_calls"


def test_without_parsing_or_with_a_malformed_block_the_text_is_the_content():
    for text, parse in ((f"a{BLOCK}", False), (f"a{BLOCK[:-5]}", True), ("plain", True)):
        choice = chat_choice(completion(text, "length"), thinking=False, parse_tools=parse)
        assert choice == {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}


def scripted_sse(pieces: list[str], thinking: bool, parse_tools: bool) -> list[dict]:
    """The SSE chunks `_sse` sends for a request whose engine deltas are `pieces` (the last one finishes)."""

    def output(i: int) -> RequestOutput:
        last = i == len(pieces) - 1
        c = CompletionOutput(0, pieces[i], [7], None, None, "stop" if last else None)
        return RequestOutput("r", None, [1, 2, 3], None, [c], finished=last)

    async def rest():
        for i in range(1, len(pieces)):
            yield output(i)

    async def run() -> list[str]:
        body = SimpleNamespace(include_usage=False, return_token_ids=False)     # the request's flags
        sse = _sse({"id": "x"}, [output(0)], [rest()], thinking, parse_tools, body, None, None)
        return [line async for line in sse]

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def join_stream(chunks: list[dict]) -> dict:
    """The chunks joined into one message, the way a client accumulates them."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for d in delta.get("tool_calls", []):
            if d["index"] == len(message["tool_calls"]):  # the first delta of a call names it
                assert d["id"].startswith("call_") and d["type"] == "function"
                message["tool_calls"].append({"function": {"name": d["function"]["name"], "arguments": ""}})
            message["tool_calls"][d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    message["finish_reason"] = chunks[-1]["choices"][0]["finish_reason"]
    return message


@pytest.mark.parametrize(
    "text,thinking",
    [
        (f"Sure.{BLOCK}", False),
        (BLOCK, False),
        (f"reason</think>\n\nText{BLOCK}", True),
        (f"a{BLOCK[:-3]}", False),
        ("no tools here\n\n", False),
        (f"r</think>x{BLOCK}y{BLOCK}", True),
    ],
)
def test_streamed_deltas_join_to_the_whole_answer(text, thinking):
    whole = chat_choice(completion(text), thinking, parse_tools=True)
    want = whole["message"]
    rng = random.Random(0)
    # "</think>" is one token for the engine, so it never straddles two deltas (ReasoningSplit relies on it).
    atoms = [p for part in text.partition("</think>") if part for p in ([part] if part == "</think>" else part)]
    for trial in range(12):
        cuts = sorted(rng.sample(range(1, len(atoms)), min(len(atoms) - 1, 1 + trial * 3)))
        pieces = ["".join(atoms[a:b]) for a, b in zip([0] + cuts, cuts + [len(atoms)])]
        got = join_stream(scripted_sse(pieces, thinking, parse_tools=True))
        assert got["content"] == (want["content"] or "")
        assert got["reasoning_content"] == want.get("reasoning_content", "")
        assert calls_of(got["tool_calls"]) == calls_of(want.get("tool_calls", []))
        assert got["finish_reason"] == whole["finish_reason"]


# ---- the live server ---------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You answer with tools."}, {"role": "user", "content": "Weather in Paris?"}]
ROUND = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
    {"role": "tool", "tool_call_id": "call_a", "content": "sun"},
]


@pytest.fixture(scope="module")
def server(model_dir, start_server):
    llm = LLM(model=model_dir, max_model_len=1024, num_speculative_tokens=0)
    url, loop = start_server(llm, 64, MODEL, "sk-test")
    yield url, llm.get_tokenizer()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, max_model_len=1024, num_speculative_tokens=0)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)


def test_tools_are_rendered_as_offline_and_answers_equal_llm_chat(server, offline):
    url, tokenizer = server
    for messages, mode in ((MESSAGES, "chat"), (ROUND, "chat"), (ROUND, "thinking")):
        extra = {"chat_template_kwargs": {"thinking": mode == "thinking"}}
        got = client(url).chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0.0, extra_body=extra
        )
        prompt = render_chat(messages, mode, tools=[WEATHER])
        assert got.usage.prompt_tokens == len(encode_chat_prompt(tokenizer, prompt))
        params = SamplingParams(max_tokens=8, temperature=0.0)
        want = offline.chat(messages, params, thinking_mode=mode, tools=[WEATHER], use_tqdm=False)[0].outputs[0]
        expected = chat_choice(want, mode == "thinking", parse_tools=True)
        message = got.choices[0].message
        assert message.content == expected["message"]["content"]
        assert calls_of([c.model_dump() for c in message.tool_calls or []]) == calls_of(
            expected["message"].get("tool_calls", [])
        )
        assert got.choices[0].finish_reason == expected["finish_reason"]


def test_streamed_with_tools_and_tool_choice_none(server):
    url, tokenizer = server
    prompt_tokens = len(encode_chat_prompt(tokenizer, render_chat(MESSAGES, tools=[WEATHER])))
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=8, temperature=0.0)
    whole = client(url).chat.completions.create(**kw)
    chunks = list(client(url).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    # "none": the tools are still in the prompt (as vLLM renders them), only the parsing is off.
    none = client(url).chat.completions.create(**kw, tool_choice="none")
    assert none.usage.prompt_tokens == prompt_tokens and none.choices[0].message.tool_calls is None


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "body,field",
    [
        (dict(tools="get_weather"), "tools"),
        (dict(tools={}), "tools"),
        (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools"),
        (dict(tools=[{"type": "retrieval"}]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": 'f"x', "parameters": {}}}]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "strict": True}}]), "tools"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nap"}}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice=NAMED, response_format={"type": "json_object"}), "response_format"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(tools=[WEATHER], parallel_tool_calls=False), "parallel_tool_calls"),
    ],
)
def test_bad_tools_and_tool_choice_are_400s_naming_the_field(server, body, field):
    url, _ = server
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, **body},
        headers={"Authorization": "Bearer sk-test"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    if field == "tool_choice":
        assert any(m in err["message"] for m in ("allowed: 'none', 'auto', 'required'", "needs `tools`",
                                                  "is not among the tools", "a named choice is")), err


# ---- forced calls: tool_choice "required" / a named function (serve/tool_grammar.py) ------------------
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "required": ["hour", "tone"],
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"},
                   "tone": {"enum": ["bell", "chime"]}}}}}
ALARM_SCHEMA = ALARM["function"]["parameters"]


def _valid_alarm(arguments: str) -> None:
    import jsonschema
    jsonschema.validate(json.loads(arguments), ALARM_SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
def test_forced_tool_choice_returns_schema_valid_calls(server, choice):
    """The bundled model never calls a tool by itself; the grammar makes it, with arguments that validate."""
    url, _ = server
    # greedy: a sampled continuation's length hinges on float noise (thread counts), and a free string
    # argument can run past max_tokens
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, ALARM], tool_choice=choice, max_tokens=200, seed=3,
              temperature=0.0)
    got = client(url).chat.completions.create(**kw)
    message, finish = got.choices[0].message, got.choices[0].finish_reason
    assert finish == "tool_calls" and message.content is None and message.tool_calls, got
    names = [c.function.name for c in message.tool_calls]
    assert set(names) <= {"get_weather", "set_alarm"} and (choice == "required" or names == ["set_alarm"])
    for c in message.tool_calls:
        if c.function.name == "set_alarm":
            _valid_alarm(c.function.arguments)
    # streamed: the same call arrives as tool_calls deltas
    chunks = list(client(url).chat.completions.create(**kw, stream=True))
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_forced_call_in_thinking_mode_starts_after_the_reasoning():
    """The tiny model's reasoning rarely ends, so this checks the request's so_args: the tool grammar with the
    end-of-thinking ids as its trigger (the trigger machinery itself: the structured-outputs tests)."""
    from deepinfer_core.serve.protocol import ChatRequest
    body = ChatRequest(model=MODEL, messages=MESSAGES, tools=[ALARM], tool_choice="required",
                       chat_template_kwargs={"thinking": True})
    tools, parse, grammar = body.tool_settings()
    params = body.sampling_params([128799, 7], grammar)
    assert tools == [ALARM] and parse and params.so_args == {"schema_type": "ebnf", "schema": grammar,
                                                            "trigger_token_ids": [128799, 7]}
    assert 'name=\\"set_alarm\\"' in grammar and "get_weather" not in grammar
