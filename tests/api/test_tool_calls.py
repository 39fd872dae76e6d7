"""The DSML tool-call parser (deepinfer_core/api/tool_calls.py) against the renderer it inverts (api/chat.py):
the official goldens and the chat tests' examples parse back to their calls; rendered calls of every argument
shape round-trip both ways; malformed or unfinished blocks come back as text; the streaming parser fed any
chunking equals the whole-text parse."""

from __future__ import annotations

import json
import random

import pytest
from test_chat import CALLS, DSML_CALLS, EOS, TOOL_ROUND, WEATHER, A, load_golden

from deepinfer_core.api.chat import _render_tool_calls, render_chat
from deepinfer_core.api.tool_calls import CLOSE, OPEN, ToolCallStream, parse_tool_calls

D = "｜DSML｜"


def calls_of(calls: list[dict]) -> list[tuple[str, object]]:
    """(name, arguments as parsed JSON, or the raw text when it is not JSON) of OpenAI tool calls."""

    def args(text):
        try:
            return json.loads(text)
        except ValueError:
            return text

    return [(c["function"]["name"], args(c["function"]["arguments"])) for c in calls]


def golden_messages(n: int) -> list[dict]:
    data, _ = load_golden(n)
    return data["messages"] if isinstance(data, dict) else data


def stream(text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """The parser fed `text` cut at `cuts`: the joined content and the tool-call deltas."""
    parser = ToolCallStream()
    content, deltas = [], []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        c, d = parser.feed(text[a:b])
        content.append(c)
        deltas += d
    c, d = parser.finish()
    return "".join(content) + c, deltas + d


# ---- the renderer's own texts parse back ------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_golden_assistant_turns_parse_back(n):
    _, expected = load_golden(n)
    turns = [m for m in golden_messages(n) if m.get("tool_calls")]
    assert turns
    for msg in turns:
        text = (msg.get("content") or "") + _render_tool_calls(msg["tool_calls"])
        assert text + EOS in expected  # the golden's own bytes, not only our renderer's
        parsed = parse_tool_calls(text)
        assert parsed.content == (msg.get("content") or "")
        assert calls_of(parsed.tool_calls) == calls_of(msg["tool_calls"])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_whole_golden_prompt_loses_no_text(n):
    """The whole golden prompt: its tools template mentions the block (an unfinished example that must stay
    text); each assistant's block is a call; the content is the prompt without the blocks."""
    _, expected = load_golden(n)
    parsed = parse_tool_calls(expected)
    want = [c for m in golden_messages(n) for c in m.get("tool_calls") or []]
    assert calls_of(parsed.tool_calls) == calls_of(want)
    stripped = expected
    for m in golden_messages(n):
        if m.get("tool_calls"):
            stripped = stripped.replace(_render_tool_calls(m["tool_calls"]), "", 1)
    assert parsed.content == stripped
    assert (OPEN in parsed.content) == ("## Tools" in expected)  # the tools template names the tag


def test_chat_examples_parse_back():
    parsed = parse_tool_calls(DSML_CALLS)
    assert parsed.content == "" and calls_of(parsed.tool_calls) == calls_of(CALLS)
    prompt = render_chat(TOOL_ROUND, "chat", tools=[WEATHER])
    answer = prompt.split(f"{A}</think>")[1].split(EOS)[0]  # the assistant turn as the model would write it
    assert calls_of(parse_tool_calls(answer).tool_calls) == calls_of(CALLS)
    for call in parse_tool_calls(answer).tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 8


ARGUMENTS = [
    {"city": "Paris", "days": 2},
    {},
    {"q": 'say "hi"\n<b>bold</b> & <｜DSML｜x', "n": -1.5e-07, "flag": True, "none": None},
    {"nested": {"a": [1, {"b": "c"}], "d": {"e": None}}, "list": ["x", 2, False]},
    {"s": "", "ws": "  lead and trail\n\n", "uni": "é漢字🙂", "tab": "a\tb\\c"},
    {"json_looking": '{"a": 1}', "num_string": "5", "bool_string": "true"},
    {"arguments": {"inner": 1}},
]


@pytest.mark.parametrize("args", ARGUMENTS, ids=range(len(ARGUMENTS)))
@pytest.mark.parametrize("content", ["", "Let me check.", "two\n\nparagraphs\n", "ends in newlines\n\n\n"])
def test_round_trip_both_ways(args, content):
    calls = [
        {"type": "function", "function": {"name": "f_1", "arguments": json.dumps(args)}},
        {"type": "function", "function": {"name": "other.tool", "arguments": args}},
    ]
    text = content + _render_tool_calls(calls)
    parsed = parse_tool_calls(text)
    assert parsed.content == content
    assert calls_of(parsed.tool_calls) == [("f_1", args), ("other.tool", args)]
    assert parsed.content + _render_tool_calls(parsed.tool_calls) == text  # the exact inverse
    assert [list(json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [list(args)] * 2  # key order


def test_unparsable_argument_text_and_lenient_values():
    text = _render_tool_calls([{"function": {"name": "f", "arguments": "not json {"}}])
    assert f'<{D}parameter name="arguments" string="true">not json {{</{D}parameter>' in text
    (call,) = parse_tool_calls(text).tool_calls
    assert call["function"]["arguments"] == "not json {"  # the renderer's pass-through, given back as is
    # A real `arguments` parameter whose string is JSON text is a parameter (the pass-through never is JSON).
    text = _render_tool_calls([{"function": {"name": "f", "arguments": {"arguments": "[1]"}}}])
    (call,) = parse_tool_calls(text).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"arguments": "[1]"}
    # string="false" with a value that is not JSON keeps the call, with the text as the value.
    bad = f'{OPEN}\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">three</{D}parameter>\n'
    bad += f"</{D}invoke>\n{CLOSE}"
    assert json.loads(parse_tool_calls(bad).tool_calls[0]["function"]["arguments"]) == {"n": "three"}


def test_whitespace_between_tags_is_tolerated_and_text_after_a_block_is_content():
    text = (
        f'Hi {OPEN}<{D}invoke name="f">  <{D}parameter name="a" string="false"> [1, 2] </{D}parameter>'
        f'</{D}invoke>\n\n<{D}invoke name="g"></{D}invoke>{CLOSE} after'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content == "Hi  after"
    assert calls_of(parsed.tool_calls) == [("f", {"a": [1, 2]}), ("g", {})]
    two = "a" + _render_tool_calls(CALLS[:1]) + "b" + _render_tool_calls(CALLS[1:])
    parsed = parse_tool_calls(two)
    assert parsed.content == "ab" and calls_of(parsed.tool_calls) == calls_of(CALLS)
    assert [c["id"] for c in parsed.tool_calls][0] != [c["id"] for c in parsed.tool_calls][1]


VALID = _render_tool_calls(CALLS)
MALFORMED = [
    VALID[: -len(CLOSE)],  # unfinished: no closing tag
    VALID[:40],
    f"\n\n{OPEN}",
    f"\n\n{OPEN}\n{CLOSE}",  # no invoke
    VALID.replace(f"</{D}invoke>", "", 1),  # an invoke left open
    VALID.replace('string="true"', 'string="maybe"', 1),
    VALID.replace(f'<{D}invoke name="get_weather">', '<invoke name="get_weather">', 1),
    VALID.replace(f"</{D}parameter>\n<{D}parameter", f"</{D}parameter>\nstray text\n<{D}parameter", 1),
    f'{OPEN}<{D}invoke name="f">\n</{D}invoke>\n{CLOSE}trailing{CLOSE}',  # a second close is plain text
    f"{OPEN} free text {CLOSE}",
    f"use <{D}tool_call> or <{D}tool_calls",
    "<｜DSML｜",
    "<",
    "\n\n",
]


@pytest.mark.parametrize("text", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_or_unfinished_blocks_stay_text(text):
    parsed = parse_tool_calls("before" + text)
    if text.startswith(f'{OPEN}<{D}invoke name="f">'):  # a good block, then text that merely looks like a tag
        assert parsed.content == "beforetrailing" + CLOSE and calls_of(parsed.tool_calls) == [("f", {})]
        return
    assert parsed.tool_calls == [] and parsed.content == "before" + text


def test_a_malformed_block_does_not_hide_a_later_good_one():
    text = f"x{OPEN}junk{CLOSE}y{VALID}z"
    parsed = parse_tool_calls(text)
    assert parsed.content == f"x{OPEN}junk{CLOSE}yz" and calls_of(parsed.tool_calls) == calls_of(CALLS)


# ---- streaming ---------------------------------------------------------------------------------------
def test_streaming_holds_back_only_a_possible_block_start():
    parser = ToolCallStream()
    assert parser.feed("Hello <｜DS") == ("Hello ", [])
    assert parser.feed("x and\n") == ("<｜DSx and", [])  # not a block after all; a newline may start one
    assert parser.feed("\n") == ("", [])
    assert parser.feed("\nz") == ("\n\n\nz", [])
    assert parser.feed("\n\n" + OPEN[:-1]) == ("", [])
    content, deltas = parser.feed(VALID[len("\n\n" + OPEN) - 1 :])  # the rest of a real block
    assert content == "" and [d["index"] for d in deltas] == [0, 1]
    for d in deltas:
        assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["name"] == "get_weather"
    assert parser.feed("tail\n") == ("tail", []) and parser.finish() == ("\n", [])
    assert parser.num_calls == 2


CORPUS = (
    ["plain text, no block", "x\n\n", "<", "a < b <｜ c", f"Sure.{VALID}", f"{VALID}\n"]
    + [
        c + _render_tool_calls([{"function": {"name": "f", "arguments": a}}])
        for c, a in zip(["", "c\n"] * 4, ARGUMENTS)
    ]
    + ["before" + m for m in MALFORMED]
    + [f"x{OPEN}junk{CLOSE}y{VALID}z", "A" + _render_tool_calls(CALLS[:1]) + "B" + _render_tool_calls(CALLS[1:])]
)


def joined(content_and_deltas: tuple[str, list[dict]]) -> tuple[str, list]:
    content, deltas = content_and_deltas
    assert [d["index"] for d in deltas] == list(range(len(deltas)))
    return content, [(d["function"]["name"], d["function"]["arguments"]) for d in deltas]


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_streaming_in_any_chunking_equals_the_whole_parse(text):
    whole = parse_tool_calls(text)
    want = (whole.content, [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls])
    assert joined(stream(text, list(range(1, len(text))))) == want  # char by char
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        assert joined(stream(text, cuts)) == want
