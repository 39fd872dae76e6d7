"""`/v1/chat/completions`: messages rendered in the DeepSeek-V4 chat format (`api/chat.py`, as
`LLM.chat`), the answer returned as the assistant message. In thinking mode the prompt opens the
reasoning, and the text up to `</think>` comes back as `reasoning_content` (in stream deltas too);
a `response_format` grammar then starts after `</think>` (a structured-output trigger)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from ..api.chat import THINK_END, chat_prompts, encode_chat_prompt
from ..api.outputs import CompletionOutput
from .errors import ApiError, field_named
from .protocol import ChatRequest
from .streams import collect, first_outputs, merged, token_text, usage


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


async def create_chat_completion(body: ChatRequest, engine_loop, tokenizer):
    try:
        mode, effort = body.thinking_mode()
        prompt = chat_prompts(body.messages, mode, effort)[0]
        think_end = tokenizer.encode(THINK_END, add_special_tokens=False)
        params = body.sampling_params(think_end if mode == "thinking" else None)
    except ValueError as exc:
        raise ApiError(400, str(exc), field_named(str(exc))) from None
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = [engine_loop.generate(cid, encode_chat_prompt(tokenizer, prompt), params, prompt)]
    firsts = await first_outputs(streams)
    head = dict(id=cid, object="chat.completion", created=int(time.time()), model=body.model)
    thinking = mode == "thinking"
    if body.stream:
        return StreamingResponse(_sse({**head, "object": "chat.completion.chunk"}, firsts, streams, thinking,
                                      body.include_usage, tokenizer, params.logprobs), media_type="text/event-stream")
    request, outs = await collect(firsts[0], streams[0])
    choices = []
    for c in outs:
        reasoning, content = ReasoningSplit(thinking).feed(c.text)
        message = {"role": "assistant", "content": content}
        if thinking:
            message["reasoning_content"] = reasoning
        choices.append(dict(index=c.index, message=message, finish_reason=c.finish_reason,
                            logprobs=_logprobs(c, tokenizer, params.logprobs) if params.logprobs is not None else None))
    return {**head, "choices": choices,
            "usage": usage(len(request.prompt_token_ids), sum(len(c.token_ids) for c in outs))}


def _logprobs(c: CompletionOutput, tokenizer, top: int) -> dict:
    """The chat API's logprobs: {"content": [{token, logprob, bytes, top_logprobs (the `top` most
    likely, by rank)}]}."""
    def entry(t: int, lp) -> dict:
        text = token_text(t, lp, tokenizer)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
    content = []
    for tok, lps in zip(c.token_ids, c.logprobs or []):
        ranked = sorted((t for t in lps if lps[t].rank <= top), key=lambda t: lps[t].rank)
        content.append({**entry(tok, lps[tok]), "top_logprobs": [entry(t, lps[t]) for t in ranked]})
    return {"content": content}


async def _sse(head: dict, firsts, streams, thinking: bool, include_usage: bool, tokenizer, top: int | None):
    splits: dict[int, ReasoningSplit] = {}
    completion_tokens = 0
    async for _, item in merged(firsts, streams):
        for c in item.outputs:
            completion_tokens += len(c.token_ids)
            split = splits.get(c.index)
            delta: dict = {}
            if split is None:
                split = splits[c.index] = ReasoningSplit(thinking)
                delta["role"] = "assistant"
            reasoning, content = split.feed(c.text)
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not thinking:
                delta["content"] = content
            choice = dict(index=c.index, delta=delta, finish_reason=c.finish_reason,
                          logprobs=_logprobs(c, tokenizer, top) if top is not None else None)
            yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
    if include_usage:
        prompt = len(firsts[0].prompt_token_ids)
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(prompt, completion_tokens)})}\n\n"
    yield "data: [DONE]\n\n"

