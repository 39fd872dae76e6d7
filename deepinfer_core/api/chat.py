"""DeepSeek-V4 chat rendering: OpenAI-style messages -> one prompt string.

V4 ships no Jinja template; the official renderer is `encoding/encoding_dsv4.py` in the checkpoint.
`render_chat` reproduces it byte for byte (the checkpoint's four golden pairs are tests).

Long prompt texts (tools template, effort prefixes) are checked in the tests against the sha256
values taken from the reference renderer, so a retyping error cannot slip through.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Sequence

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML_TOKEN = "｜DSML｜"
TASK_TOKENS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
               "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>"}

THINKING_MODES = ("chat", "thinking")
ROLES = ("system", "user", "developer", "assistant", "tool", "latest_reminder")

# The tool definitions block, unformatted (sha256 09b7269d…); _render_tools fills it in.
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml_token}tool_calls>" block like the following:

<{dsml_token}tool_calls>
<{dsml_token}invoke name="$TOOL_NAME">
<{dsml_token}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml_token}parameter>
...
</{dsml_token}invoke>
<{dsml_token}invoke name="$TOOL_NAME2">
...
</{dsml_token}invoke>
</{dsml_token}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {thinking_start_token}), you MUST output your complete reasoning inside {thinking_start_token}...{thinking_end_token} BEFORE any tool calls or final response.

Otherwise, output directly after {thinking_end_token} with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT_HEADER = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

# Effort prefixes: P_HIGH (476 bytes, sha256 f7a24f3b…) and P_MAX (528 bytes, sha256 53fb31b8…).
EFFORT_TEXT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")
EFFORT_TEXT_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles "
    "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n")
# The effort table differs between checkpoints: "preview" = V4-Flash / V4-Pro encoders,
# "0731" = V4-Flash-0731. Keys are the accepted reasoning_effort values.
EFFORT_PROFILES: dict[str, dict[str | None, str]] = {
    "preview": {None: "", "high": "", "max": EFFORT_TEXT_HIGH},
    "0731": {None: "", "low": "", "high": EFFORT_TEXT_HIGH, "max": EFFORT_TEXT_MAX},
}


# ---- validation ----------------------------------------------------------------------------------
def _check_choice(field: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"render_chat: {field}={value!r} is not valid; allowed: {list(allowed)}")


def _validate_message(i: int, msg: Any) -> None:
    if not isinstance(msg, dict):
        raise ValueError(f"render_chat: messages[{i}] must be a dict, got {type(msg).__name__}")
    role = msg.get("role")
    _check_choice(f"messages[{i}].role", role, ROLES)
    content = msg.get("content")
    if role in ("user", "tool") and not isinstance(content, (str, list)):
        raise ValueError(f"render_chat: messages[{i}] (role {role!r}) needs 'content': a str or a list "
                         f"of content parts, got {type(content).__name__}")
    if role == "latest_reminder" and not isinstance(content, str):
        raise ValueError(f"render_chat: messages[{i}] (role 'latest_reminder') needs 'content': a str")
    if role == "developer" and not (isinstance(content, str) and content):
        raise ValueError(f"render_chat: messages[{i}] (role 'developer') needs a non-empty str 'content'")
    if role in ("system", "assistant") and content is not None and not isinstance(content, str):
        raise ValueError(f"render_chat: messages[{i}].content must be a str or None for role {role!r}")
    if msg.get("task") is not None:
        _check_choice(f"messages[{i}].task", msg["task"], list(TASK_TOKENS))
    calls = msg.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not all(map(_is_tool_call, calls))):
        raise ValueError(f"render_chat: messages[{i}].tool_calls must be a list of "
                         f"{{'function': {{'name': str, 'arguments': str | dict}}}}")


def _is_tool_call(call: Any) -> bool:
    fn = call.get("function", call) if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str)


def _validate_tools(field: str, tools: Any) -> None:
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"render_chat: {field} must be a list of OpenAI tool dicts "
                         f"({{'type': 'function', 'function': {{...}}}})")


# ---- preprocessing (tool results merged into user turns and sorted) ------------------------------
def _attach_tools(messages: list[dict], tools: list) -> list[dict]:
    """Put request-level tools on the leading system/developer message, else on a new empty system
    message at index 0 (vLLM's convention; tools on a user message would not be rendered)."""
    first = messages[0]
    if first.get("role") in ("system", "developer"):
        if first.get("tools"):
            raise ValueError("render_chat: tools given both as an argument and on messages[0]")
        first["tools"] = tools
        return messages
    return [{"role": "system", "content": "", "tools": tools}] + messages


def _content_blocks(content: str | list) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [part if isinstance(part, dict) else {"type": "text", "text": str(part)} for part in content]


def _merge_user_turns(messages: list[dict]) -> list[dict]:
    """Fold tool messages, and user messages that follow a task-less user turn, into one user turn
    holding content blocks. Like the reference, a merged turn keeps only `task` from its first user
    message (so `tools` on a user message neither render nor disable dropping)."""
    merged: list[dict] = []
    for msg in messages:
        role = msg["role"]
        prev_user = merged[-1] if merged and merged[-1]["role"] == "user" else None
        if role == "tool":
            block = {"type": "tool_result", "tool_call_id": msg.get("tool_call_id"),
                     "content": msg["content"]}
            if prev_user is not None:          # the reference absorbs it even when the turn has a task
                prev_user["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            if prev_user is not None and prev_user.get("task") is None:
                prev_user["blocks"].extend(_content_blocks(msg["content"]))
            else:
                turn = {"role": "user", "blocks": _content_blocks(msg["content"])}
                if msg.get("task") is not None:
                    turn["task"] = msg["task"]
                merged.append(turn)
        else:
            merged.append(msg)
    return merged


def _call_id(call: dict) -> Any:
    return call.get("id") or call.get("function", {}).get("id")


def _sort_tool_results(turns: list[dict]) -> None:
    """Reorder tool results of each user turn into the call order of the latest assistant that made
    tool calls; text blocks keep their slots; an unknown id sorts as position 0 (stable)."""
    order: dict[Any, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            order = {}
            for pos, call in enumerate(turn["tool_calls"]):
                if _call_id(call):
                    order[_call_id(call)] = pos          # a repeated id keeps its last position
        elif turn["role"] == "user" and order:
            results = [b for b in turn["blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1:
                ordered = iter(sorted(results, key=lambda b: order.get(b.get("tool_call_id"), 0)))
                turn["blocks"] = [next(ordered) if b.get("type") == "tool_result" else b
                                  for b in turn["blocks"]]


def _last_user_index(turns: list[dict]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)


# ---- per-message rendering (roles, tool calls, tool results) -------------------------------------
def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _render_tools(tools: list[dict]) -> str:
    schemas = "\n".join(_to_json(t.get("function", t)) for t in tools)
    return TOOLS_TEMPLATE.format(tool_schemas=schemas, dsml_token=DSML_TOKEN,
                                 thinking_start_token=THINK_START, thinking_end_token=THINK_END)


def _instructions_suffix(msg: dict) -> str:
    """Tools block and response format of a system/developer message."""
    text = ""
    if msg.get("tools"):
        text += "\n\n" + _render_tools(msg["tools"])
    if msg.get("response_format"):
        text += "\n\n" + RESPONSE_FORMAT_HEADER + _to_json(msg["response_format"])
    return text


def _parts_text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                       for p in content)


def _render_block(block: dict) -> str:
    kind = block.get("type")
    if kind == "text":
        return block.get("text", "")
    if kind == "tool_result":
        return f"<tool_result>{_parts_text(block['content'])}</tool_result>"
    return f"[Unsupported {kind}]"


def _render_parameters(call: dict) -> str:
    args = call.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:   # the preview encoder passes unparsable text through as is
            return f'<{DSML_TOKEN}parameter name="arguments" string="true">{args}</{DSML_TOKEN}parameter>'
    if not isinstance(args, dict):
        raise ValueError(f"render_chat: tool call {call.get('name')!r} arguments must be a JSON object, "
                         f"got {type(args).__name__}")
    return "\n".join(
        f'<{DSML_TOKEN}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else _to_json(v)}</{DSML_TOKEN}parameter>' for key, v in args.items())


def _render_tool_calls(calls: list[dict]) -> str:
    invokes = []
    for call in calls:
        fn = call.get("function", call)
        invokes.append(f'<{DSML_TOKEN}invoke name="{fn["name"]}">\n{_render_parameters(fn)}\n'
                       f'</{DSML_TOKEN}invoke>')
    return f"\n\n<{DSML_TOKEN}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML_TOKEN}tool_calls>"


def _render_message(msg: dict, keep_reasoning: bool) -> str:
    role = msg["role"]
    if role == "system":
        return (msg.get("content") or "") + _instructions_suffix(msg)
    if role == "developer":
        return USER_TOKEN + msg["content"] + _instructions_suffix(msg)
    if role == "user":
        return USER_TOKEN + "\n\n".join(_render_block(b) for b in msg["blocks"])
    if role == "latest_reminder":
        return LATEST_REMINDER_TOKEN + msg["content"]
    # assistant: [reasoning</think>] content [tool calls] EOS
    text = ""
    if keep_reasoning:
        text += (msg.get("reasoning_content") or msg.get("reasoning") or "") + THINK_END
    text += msg.get("content") or ""
    if msg.get("tool_calls"):
        text += _render_tool_calls(msg["tool_calls"])
    return text if msg.get("wo_eos") else text + EOS_TOKEN


def _transition(msg: dict, open_thinking: bool) -> str:
    """Header after a message that is followed by an assistant/reminder or ends the list."""
    task = msg.get("task")
    if task == "action":
        return ASSISTANT_TOKEN + (THINK_START if open_thinking else THINK_END) + TASK_TOKENS[task]
    if task is not None:
        return TASK_TOKENS[task]
    if msg["role"] in ("user", "developer"):
        return ASSISTANT_TOKEN + (THINK_START if open_thinking else THINK_END)
    return ""


# ---- public --------------------------------------------------------------------------------------
def render_chat(messages: list[dict], thinking_mode: str = "chat", reasoning_effort: str | None = None,
                tools: list | None = None, add_generation_prompt: bool = True, *,
                drop_thinking: bool = True, add_bos_token: bool = True,
                effort_profile: str = "preview") -> str:
    """Render `messages` (OpenAI format plus V4's `developer`, `latest_reminder`, `task`, `wo_eos`,
    `reasoning_content`) into the DeepSeek-V4 prompt string.

    `tools` (OpenAI format) go onto the leading system/developer message, as vLLM puts them. With
    `add_generation_prompt=False` nothing follows the last message (no `<｜Assistant｜>` header).
    `drop_thinking` drops earlier reasoning in thinking mode when no tools are defined.
    `effort_profile` picks the checkpoint's effort table: "preview" or "0731".
    """
    _check_choice("thinking_mode", thinking_mode, THINKING_MODES)
    _check_choice("effort_profile", effort_profile, list(EFFORT_PROFILES))
    _check_choice("reasoning_effort", reasoning_effort, list(EFFORT_PROFILES[effort_profile]))
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("render_chat: messages must be a non-empty list of message dicts")
    for i, msg in enumerate(messages):
        _validate_message(i, msg)
        if msg.get("tools") is not None:
            _validate_tools(f"messages[{i}].tools", msg["tools"])
    msgs = copy.deepcopy(list(messages))       # never mutate the caller's conversation
    if tools:
        _validate_tools("tools", tools)
        msgs = _attach_tools(msgs, copy.deepcopy(tools))

    turns = _merge_user_turns(msgs)
    _sort_tool_results(turns)
    thinking = thinking_mode == "thinking"
    drop = thinking and drop_thinking and not any(t.get("tools") for t in turns)
    if drop:   # developer turns before the last user turn vanish entirely
        last = _last_user_index(turns)
        turns = [t for i, t in enumerate(turns) if t["role"] != "developer" or i >= last]
    last_user = _last_user_index(turns)

    out = [BOS_TOKEN] if add_bos_token else []
    if thinking:                               # effort prefix goes before message 0
        out.append(EFFORT_PROFILES[effort_profile][reasoning_effort])
    for i, msg in enumerate(turns):
        prev_has_task = i > 0 and turns[i - 1].get("task") is not None
        keep_reasoning = thinking and not prev_has_task and (not drop or i > last_user)
        out.append(_render_message(msg, keep_reasoning))
        is_last = i == len(turns) - 1
        if (is_last and add_generation_prompt) or (
                not is_last and turns[i + 1]["role"] in ("assistant", "latest_reminder")):
            out.append(_transition(msg, open_thinking=thinking and (not drop or i >= last_user)))
    return "".join(out)


def chat_prompts(conversations: Any, thinking_mode: str = "chat", reasoning_effort: str | None = None,
                 tools: list | None = None, refuse_media: bool = False) -> list[str]:
    """Render one conversation (a list of message dicts) or a list of conversations.
    `refuse_media`: a content part other than text is an error (a multimodal checkpoint served
    text-only, DeepSeek-V4.1), not the "[Unsupported ...]" text the V4 format writes."""
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError("chat: messages must be a non-empty list of message dicts, or a list of such lists")
    if isinstance(conversations[0], dict):
        conversations = [conversations]
    if refuse_media:
        for conv in conversations:
            _refuse_media(conv)
    return [render_chat(c, thinking_mode, reasoning_effort, tools) for c in conversations]


def _refuse_media(messages: list) -> None:
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else "text"
            if kind != "text":
                raise ValueError(f"messages[{i}].content[{j}].type={kind!r}: this model is served text-only "
                                 "(DeepSeek-V4.1's vision tower is not supported); allowed: 'text'")


def encode_chat_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a rendered prompt; no second BOS when the text already starts with BOS."""
    if tokenizer is None:
        raise ValueError("chat: the checkpoint has no tokenizer files; pass LLM(tokenizer=...)")
    bos = getattr(tokenizer, "bos_token", None)
    already_has_bos = bool(bos) and prompt.startswith(bos)
    return tokenizer.encode(prompt, add_special_tokens=not already_has_bos)
