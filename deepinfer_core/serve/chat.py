"""`/v1/chat/completions`: messages rendered in the DeepSeek-V4 chat format (`api/chat.py`, as
`LLM.chat`), the answer returned as the assistant message. In thinking mode the prompt opens the
reasoning, and the text up to `</think>` comes back as `reasoning_content` (in stream deltas too);
a `response_format` grammar then starts after `</think>` (a structured-output trigger).

With tools (tool_choice "auto"), a DSML tool-call block in the content part (after the reasoning) becomes
`message.tool_calls` / `delta.tool_calls` (api/tool_calls.py), the text before it the content (null when
empty), and finish_reason "tool_calls".

`return_token_ids` (vLLM's field and shape): each choice carries its generated ids (`token_ids`,
streamed: the delta's) and the reply its prompt's (`prompt_token_ids`, streamed: the first
event)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from ..api.chat import THINK_END, chat_prompts, encode_chat_prompt
from ..api.outputs import CompletionOutput, RequestOutput
from ..api.tool_calls import ToolCallStream, parse_tool_calls
from .errors import ApiError, field_named
from .protocol import ChatRequest
from .streams import MIN_LOGPROB, collect, first_outputs, merged, sse_errors, token_text, usage
from .wire import JSON, sse


@dataclass
class ReasoningSplit:
    """Splits an answer's text, delta by delta, into its reasoning (before `</think>`) and content."""

    reasoning: bool          # still inside the reasoning

    def feed(self, text: str) -> tuple[str, str]:
        if not self.reasoning:
            return "", text
        before, sep, after = text.partition(THINK_END)
        if sep:
            self.reasoning = False
        return before, after


async def create_chat_completion(body: ChatRequest, engine_loop, tokenizer, refuse_media: bool = False):
    try:
        mode, effort = body.thinking_mode()
        tools, parse_tools, tool_grammar = body.tool_settings()
        prompt = chat_prompts(body.messages, mode, effort, tools, refuse_media)[0]
        think_end = tokenizer.encode(THINK_END, add_special_tokens=False)
        params = body.sampling_params(think_end if mode == "thinking" else None, tool_grammar)
    except ValueError as exc:
        raise ApiError(400, str(exc), field_named(str(exc))) from None
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = [engine_loop.generate(cid, encode_chat_prompt(tokenizer, prompt), params, prompt,
                                    body.cache_salt)]
    firsts = await first_outputs(streams)
    head = dict(id=cid, object="chat.completion", created=int(time.time()), model=body.model)
    thinking = mode == "thinking"
    if body.stream:
        stream = _sse({**head, "object": "chat.completion.chunk"}, firsts, streams, thinking, parse_tools,
                      body, tokenizer, params.logprobs)
        return StreamingResponse(sse_errors(stream), media_type="text/event-stream")
    request, outs = await collect(firsts[0], streams[0])
    top = params.logprobs
    choices = [{**chat_choice(c, thinking, parse_tools),
                "logprobs": _logprobs(c, tokenizer, top) if top is not None else None,
                **_token_ids(c, body)}
               for c in outs]
    return JSON({**head, "choices": choices, **_prompt_token_ids(request, body),
                 "usage": usage(len(request.prompt_token_ids), sum(len(c.token_ids) for c in outs),
                                request.num_cached_tokens)})


def _token_ids(c: CompletionOutput, body: ChatRequest) -> dict:
    """A choice's (or a delta's) generated ids with `return_token_ids`, else nothing."""
    return {"token_ids": list(c.token_ids)} if body.return_token_ids else {}


def _prompt_token_ids(request: RequestOutput, body: ChatRequest) -> dict:
    """The reply's prompt ids with `return_token_ids`, else nothing."""
    return {"prompt_token_ids": list(request.prompt_token_ids)} if body.return_token_ids else {}


def chat_choice(c: CompletionOutput, thinking: bool, parse_tools: bool) -> dict:
    """One whole completion as a chat choice (without logprobs): reasoning split off first, then any DSML
    tool calls parsed out of the content."""
    reasoning, content = ReasoningSplit(thinking).feed(c.text)
    message: dict = {"role": "assistant", "content": content}
    finish_reason = c.finish_reason
    parsed = parse_tool_calls(content) if parse_tools else None
    if parsed is not None and parsed.tool_calls:
        message = {"role": "assistant", "content": parsed.content or None, "tool_calls": parsed.tool_calls}
        finish_reason = "tool_calls"
    if thinking:
        message["reasoning_content"] = reasoning
    return {"index": c.index, "message": message, "finish_reason": finish_reason}


def _logprobs(c: CompletionOutput, tokenizer, top: int) -> dict:
    """The chat API's logprobs: {"content": [{token, logprob, bytes, top_logprobs (the `top` most
    likely, by rank)}]}."""
    def entry(t: int, lp) -> dict:
        text = token_text(t, lp, tokenizer)
        return {"token": text, "logprob": max(lp.logprob, MIN_LOGPROB), "bytes": list(text.encode())}
    content = []
    for tok, lps in zip(c.token_ids, c.logprobs or []):
        ranked = sorted((t for t in lps if lps[t].rank <= top), key=lambda t: lps[t].rank)
        content.append({**entry(tok, lps[tok]), "top_logprobs": [entry(t, lps[t]) for t in ranked]})
    return {"content": content}


@dataclass
class _ChoiceStream:
    """What one streamed choice carries between its deltas."""

    split: ReasoningSplit
    tools: ToolCallStream | None    # None: tool calls are not parsed


def _delta(state: _ChoiceStream, c: CompletionOutput, thinking: bool) -> tuple[dict, str | None]:
    """(delta, finish_reason) of one engine delta: reasoning first, then tool calls out of the content; the
    last delta flushes the text the tool-call parser held back."""
    reasoning, content = state.split.feed(c.text)
    calls: list[dict] = []
    if state.tools is not None:
        content, calls = state.tools.feed(content)
        if c.finish_reason is not None:
            tail, more = state.tools.finish()
            content, calls = content + tail, calls + more
    delta: dict = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content or not (thinking or calls):
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    called = state.tools is not None and state.tools.num_calls > 0
    return delta, ("tool_calls" if called and c.finish_reason is not None else c.finish_reason)


async def _sse(head: dict, firsts, streams, thinking: bool, parse_tools: bool, body: ChatRequest,
               tokenizer, top: int | None):
    states: dict[int, _ChoiceStream] = {}
    completion_tokens = 0
    prompt_ids = _prompt_token_ids(firsts[0], body)      # on the first event only
    async for _, item in merged(firsts, streams):
        for c in item.outputs:
            completion_tokens += len(c.token_ids)
            state = states.get(c.index)
            first = state is None
            if state is None:
                tools = ToolCallStream() if parse_tools else None
                state = states[c.index] = _ChoiceStream(ReasoningSplit(thinking), tools)
            delta, finish_reason = _delta(state, c, thinking)
            if first:
                delta = {"role": "assistant", **delta}
            choice = dict(index=c.index, delta=delta, finish_reason=finish_reason,
                          logprobs=_logprobs(c, tokenizer, top) if top is not None else None,
                          **_token_ids(c, body))
            yield sse({**head, 'choices': [choice], **prompt_ids})
            prompt_ids = {}
    if body.include_usage:
        tokens = usage(len(firsts[0].prompt_token_ids), completion_tokens, firsts[0].num_cached_tokens)
        yield sse({**head, 'choices': [], 'usage': tokens})
    yield "data: [DONE]\n\n"
