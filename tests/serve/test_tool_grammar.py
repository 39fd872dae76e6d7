"""The DSML grammar that forces tool calls (serve/tool_grammar.py), checked with xgrammar's own string
matcher: the renderer's blocks (api/chat.py, the golden format) are accepted, and what the schema or
tool_choice excludes is not."""
import json

import pytest

from deepinfer_core.api.chat import _render_tool_calls
from deepinfer_core.api.tool_calls import parse_tool_calls
from deepinfer_core.serve.tool_grammar import tool_call_grammar

xgrammar = pytest.importorskip("xgrammar")   # the structured-outputs plugin's dependency (CI installs it)
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "required": ["hour", "tone"],
    "properties": {"hour": {"type": "integer"}, "loud": {"type": "boolean"}, "tone": {"enum": ["bell", "chime"]},
                   "label": {"type": "string"}}}}}
FREE = {"type": "function", "function": {"name": "root"}}     # no parameters schema; a name that is a rule name


def accepts(grammar: str, calls: list[dict]) -> bool:
    block = _render_tool_calls(calls).removeprefix("\n\n")
    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), block)


def call(name: str, **args) -> dict:
    return {"function": {"name": name, "arguments": json.dumps(args)}}


def test_required_accepts_rendered_calls_of_any_tool_in_schema_order():
    g = tool_call_grammar([ALARM, FREE], None)
    assert accepts(g, [call("set_alarm", hour=7, tone="bell")])
    assert accepts(g, [call("set_alarm", hour=7, loud=True, tone="chime", label="wake up")])
    assert accepts(g, [call("root", anything=[1, {"a": None}], text="free")])
    assert accepts(g, [call("set_alarm", hour=7, tone="bell"), call("root")])       # several calls
    assert not accepts(g, [call("set_alarm", tone="bell")])                          # a required one missing
    assert not accepts(g, [call("set_alarm", hour="7", tone="bell")])                # a string for an integer
    assert not accepts(g, [call("set_alarm", hour=7, tone="gong")])                  # outside the enum
    assert not accepts(g, [call("set_alarm", tone="bell", hour=7)])                  # out of schema order
    assert not accepts(g, [call("wake", hour=7)])                                    # not a tool
    assert not accepts(g, [])                                                         # no call at all


def test_named_accepts_exactly_one_call_of_that_function():
    g = tool_call_grammar([ALARM, FREE], "set_alarm")
    assert accepts(g, [call("set_alarm", hour=23, tone="chime")])
    assert not accepts(g, [call("root")])
    assert not accepts(g, [call("set_alarm", hour=1, tone="bell"), call("set_alarm", hour=2, tone="bell")])
    with pytest.raises(ValueError, match=r"tool_choice: function 'nap' is not among the tools \(set_alarm, root\)"):
        tool_call_grammar([ALARM, FREE], "nap")


def test_an_accepted_block_parses_back_to_the_calls():
    calls = [call("set_alarm", hour=6, loud=False, tone="bell", label="early")]
    block = _render_tool_calls(calls).removeprefix("\n\n")
    assert accepts(tool_call_grammar([ALARM], None), calls)
    parsed = parse_tool_calls(block)
    assert parsed.content == "" and [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [
        {"hour": 6, "loud": False, "tone": "bell", "label": "early"}]


def test_an_empty_enum_is_refused_naming_the_parameter():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"mode": {"enum": []}}}}}
    with pytest.raises(ValueError, match=r"tools: parameter 'mode' has an empty enum"):
        tool_call_grammar([tool], None)
