"""DeepSeek-V4 DSML tool calls in model output -> OpenAI `tool_calls`: the inverse of `api/chat.py`'s
`_render_tool_calls` / `_render_parameters`.

The block the renderer writes after an assistant's content (whitespace between tags is tolerated on input):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>   (one per line)
    </｜DSML｜invoke>                                                          (invokes one per line)
    </｜DSML｜tool_calls>

string="true": VALUE is the raw string; string="false": VALUE is JSON. A lone `arguments` string parameter
whose value is not JSON is the renderer's pass-through of unparsable argument text, and comes back as that
text (a real parameter named `arguments` holding a non-JSON string renders identically, so the two cannot be
told apart; the pass-through reading is taken). The format has no escapes: a string value that itself holds
`</｜DSML｜parameter>` or `</｜DSML｜tool_calls>` ends early (the block then parses differently or is text).
Text after a block, and further blocks, are parsed the same way: the content is all the text outside blocks.

Invariants (tests/api/test_tool_calls.py):
- parse(render(content, calls)) gives back `content` exactly (the renderer's "\\n\\n" separator removed) and
  `calls` with their arguments equal as JSON.
- No text is lost: a block that is malformed or unfinished comes back as content, byte for byte.
- `ToolCallStream` fed the text in any chunking emits the same content and calls as `parse_tool_calls`
  (which is that stream fed the whole text once).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .chat import DSML_TOKEN

OPEN = f"<{DSML_TOKEN}tool_calls>"
CLOSE = f"</{DSML_TOKEN}tool_calls>"
SEPARATOR = "\n\n"  # what the renderer puts between the content and the block

_D = re.escape(DSML_TOKEN)
_INVOKE = re.compile(rf'\s*<{_D}invoke name="([^\n]*?)">')
_PARAMETER = re.compile(rf'\s*<{_D}parameter name="([^\n]*?)" string="(true|false)">([\s\S]*?)</{_D}parameter>')
_INVOKE_END = re.compile(rf"\s*</{_D}invoke>")
_BLOCK_END = re.compile(rf"\s*{re.escape(CLOSE)}")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCalls:
    content: str  # the text outside the tool-call blocks ("" when there is none)
    tool_calls: list[dict]  # OpenAI tool calls: {"id", "type": "function", "function": {"name", "arguments"}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _arguments(params: list[tuple[str, str, str]]) -> str:
    """The OpenAI `arguments` string of one invoke's (key, string flag, value) parameters."""
    if len(params) == 1 and params[0][:2] == ("arguments", "true") and not _is_json(params[0][2]):
        return params[0][2]  # the renderer's pass-through of argument text that was not JSON
    args = {}
    for key, is_string, value in params:
        # A string="false" value that is not JSON is kept as its text rather than dropping the call.
        args[key] = value if is_string == "true" or not _is_json(value) else json.loads(value)
    return json.dumps(args, ensure_ascii=False)


def parse_block(block: str) -> list[tuple[str, str]] | None:
    """(name, arguments) of each invoke of one whole block (OPEN ... CLOSE); None when it is malformed."""
    pos = len(OPEN)
    calls: list[tuple[str, str]] = []
    while invoke := _INVOKE.match(block, pos):
        pos = invoke.end()
        params = []
        while param := _PARAMETER.match(block, pos):
            params.append(param.groups())
            pos = param.end()
        end = _INVOKE_END.match(block, pos)
        if end is None:
            return None
        pos = end.end()
        calls.append((invoke.group(1), _arguments(params)))
    end = _BLOCK_END.match(block, pos)
    if not calls or end is None or end.end() != len(block):
        return None
    return calls


def _held_back(text: str) -> int:
    """Length of the longest tail of `text` that may still become the start of a block: a proper prefix of
    OPEN, with up to two newlines (the separator) before it."""
    prefix = next((k for k in range(min(len(text), len(OPEN) - 1), 0, -1) if OPEN.startswith(text[-k:])), 0)
    rest = text[: len(text) - prefix]
    return prefix + min(2, len(rest) - len(rest.rstrip("\n")))


@dataclass
class ToolCallStream:
    """Incremental parser: `feed` text deltas, get (content delta, OpenAI streamed tool-call deltas).

    Outside a block, text is emitted at once except a tail that may begin one (`_held_back`). A block is held
    until it closes: well-formed, it becomes one delta per call (index, id, type, name and arguments
    together); malformed, it is emitted as content. `finish` flushes what is held (an unfinished block is
    content). Emitting a call only once its block has closed keeps the stream equal to the whole-text parse:
    a block that turns out malformed has not leaked half a call."""

    make_id: Callable[[], str] = new_call_id
    num_calls: int = 0
    _pending: str = ""  # text not emitted yet: a possible block start, or an open block
    _in_block: bool = False
    _searched: int = 0  # how far into an open block CLOSE was looked for: each delta is searched once
    _content: list[str] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._pending += text
        deltas: list[dict] = []
        while self._next_block(deltas):
            pass
        content, self._content = "".join(self._content), []
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        content, deltas = self.feed("")
        content += self._pending
        self._pending, self._in_block, self._searched = "", False, 0
        return content, deltas

    def _next_block(self, deltas: list[dict]) -> bool:
        """Move past the next whole block, if the pending text holds one; False when it must wait."""
        if not self._in_block:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = len(self._pending) - _held_back(self._pending)
                self._content.append(self._pending[:keep])
                self._pending = self._pending[keep:]
                return False
            if self._pending[:start].endswith(SEPARATOR):
                start -= len(SEPARATOR)
            self._content.append(self._pending[:start])
            self._pending, self._in_block = self._pending[start:], True
        close = self._pending.find(CLOSE, max(0, self._searched - len(CLOSE) + 1))
        if close < 0:
            self._searched = len(self._pending)
            return False
        self._searched = 0
        end = close + len(CLOSE)
        block, self._pending, self._in_block = self._pending[:end], self._pending[end:], False
        calls = parse_block(block.removeprefix(SEPARATOR))
        if calls is None:
            self._content.append(block)
            return True
        for name, arguments in calls:
            fn = {"name": name, "arguments": arguments}
            deltas.append({"index": self.num_calls, "id": self.make_id(), "type": "function", "function": fn})
            self.num_calls += 1
        return True


def parse_tool_calls(text: str, make_id: Callable[[], str] = new_call_id) -> ParsedToolCalls:
    """The content and OpenAI tool calls of a whole model output (the content part, after any reasoning)."""
    stream = ToolCallStream(make_id)
    content, deltas = stream.feed(text)
    tail, more = stream.finish()
    calls = [{"id": d["id"], "type": d["type"], "function": d["function"]} for d in deltas + more]
    return ParsedToolCalls(content + tail, calls)
