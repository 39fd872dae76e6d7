"""`/v1/completions`: text in, text out, as OpenAI's legacy completions API (and vLLM's)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi.responses import StreamingResponse

from ..api.outputs import CompletionOutput
from .errors import ApiError, field_named
from .protocol import CompletionRequest
from .streams import collect, first_outputs, merged, sse_errors, token_text, usage


async def create_completion(body: CompletionRequest, engine_loop, tokenizer):
    try:
        params = body.sampling_params()
        prompts = body.prompts()
    except ValueError as exc:
        raise ApiError(400, str(exc), field_named(str(exc))) from None
    cid = f"cmpl-{uuid.uuid4().hex}"
    streams = [engine_loop.generate(f"{cid}-{i}", tokenizer.encode(p) if isinstance(p, str) else p, params,
                                    p if isinstance(p, str) else None) for i, p in enumerate(prompts)]
    firsts = await first_outputs(streams)
    head = dict(id=cid, object="text_completion", created=int(time.time()), model=body.model)
    if body.stream:
        return StreamingResponse(sse_errors(_sse(head, firsts, streams, params.n, body.include_usage, tokenizer)),
                                 media_type="text/event-stream")
    done = await asyncio.gather(*(collect(f, s) for f, s in zip(firsts, streams)))
    choices = [_choice(p * params.n + c.index, c, tokenizer, params.logprobs is not None)
               for p, (_, outs) in enumerate(done) for c in outs]
    return {**head, "choices": choices,
            "usage": usage(sum(len(r.prompt_token_ids) for r, _ in done),
                           sum(len(c.token_ids) for _, outs in done for c in outs))}


def _choice(index: int, c: CompletionOutput, tokenizer, with_logprobs: bool) -> dict:
    return dict(index=index, text=c.text, finish_reason=c.finish_reason,
                logprobs=logprobs_object(c, tokenizer) if with_logprobs else None)


def logprobs_object(c: CompletionOutput, tokenizer) -> dict:
    """The completions API's logprobs of one choice (or one delta): the sampled token and the top-K
    (with the sampled one), as vLLM returns them."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tok, entry in zip(c.token_ids, c.logprobs or []):
        text = token_text(tok, entry[tok], tokenizer)
        tokens.append(text)
        token_lps.append(entry[tok].logprob)
        tops.append({token_text(t, lp, tokenizer): lp.logprob for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _sse(head: dict, firsts, streams, n: int, include_usage: bool, tokenizer):
    prompt_tokens = completion_tokens = 0
    async for p, item in merged(firsts, streams):
        for c in item.outputs:
            completion_tokens += len(c.token_ids)
            choice = _choice(p * n + c.index, c, tokenizer, c.logprobs is not None)
            yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
        prompt_tokens += len(item.prompt_token_ids) if item.finished else 0
    if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(prompt_tokens, completion_tokens)})}\n\n"
    yield "data: [DONE]\n\n"
