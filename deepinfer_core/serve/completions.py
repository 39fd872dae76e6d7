"""`/v1/completions`: text in, text out, as OpenAI's legacy completions API (and vLLM's).

`echo` returns the prompt in front of the completion: its text, and with `logprobs` its tokens'
logprobs (null for the first token, which nothing predicts) ahead of the generated tokens'.
`max_tokens: 0` with `echo` scores the prompt alone: the engine runs one step (it always samples a
token), and that token is left out of the answer and of the usage, as vLLM does. Streamed, a
choice's first event carries the echoed prompt.

`return_token_ids` (vLLM's field) adds each choice's generated ids (`token_ids`) and its prompt's
(`prompt_token_ids`); streamed, every event carries its delta's ids and a choice's first event the
prompt's, so a client can resend a conversation's exact history as token ids.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi.responses import StreamingResponse

from ..api.outputs import CompletionOutput, Logprob, RequestOutput
from .errors import ApiError, field_named
from .protocol import CompletionRequest
from .streams import MIN_LOGPROB, collect, first_outputs, merged, sse_errors, token_text, usage
from .wire import JSON, sse

Entries = list[dict[int, Logprob] | None]


async def create_completion(body: CompletionRequest, engine_loop, tokenizer):
    try:
        params = body.sampling_params()
        prompts = body.prompts()
    except ValueError as exc:
        raise ApiError(400, str(exc), field_named(str(exc))) from None
    cid = f"cmpl-{uuid.uuid4().hex}"
    streams = [engine_loop.generate(f"{cid}-{i}", tokenizer.encode(p) if isinstance(p, str) else p,
                                    params, p if isinstance(p, str) else None, body.cache_salt)
               for i, p in enumerate(prompts)]
    firsts = await first_outputs(streams)
    head = {"id": cid, "object": "text_completion", "created": int(time.time()),
            "model": body.model}
    if body.stream:
        return StreamingResponse(sse_errors(_sse(head, firsts, streams, body, params.n, tokenizer)),
                                 media_type="text/event-stream")
    done = await asyncio.gather(*(collect(f, s) for f, s in zip(firsts, streams)))
    choices = [_choice(p * params.n + c.index, c, whole, body, tokenizer)
               for p, (whole, outs) in enumerate(done) for c in outs]
    generated = 0 if body.prompt_only else sum(len(c.token_ids) for _, o in done for c in o)
    return JSON({**head, "choices": choices,
                 "usage": usage(sum(len(r.prompt_token_ids) for r, _ in done), generated,
                                sum(r.num_cached_tokens for r, _ in done))})


def _choice(index: int, c: CompletionOutput, request: RequestOutput | None,
            body: CompletionRequest, tokenizer, offset: int = 0) -> dict:
    """One choice (or one streamed delta of it). `request`: given for the whole answer or a stream's
    first event of the choice: its prompt goes in front with `echo`, its ids are the choice's
    `prompt_token_ids` with `return_token_ids`; `offset`: where the text starts in the choice's
    text (a stream's later deltas)."""
    text, pieces = "", []
    if body.echo and request is not None:
        text = request.prompt
        if text is None:
            text = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        pieces.append((request.prompt_token_ids, request.prompt_logprobs))
    if not body.prompt_only:
        text += c.text
        pieces.append((c.token_ids, c.logprobs))
    finish = "length" if body.prompt_only and c.finish_reason is not None else c.finish_reason
    lps = logprobs_object(pieces, tokenizer, offset) if body.logprobs is not None else None
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": lps}
    if body.return_token_ids:
        choice["token_ids"] = [] if body.prompt_only else list(c.token_ids)
        if request is not None:
            choice["prompt_token_ids"] = list(request.prompt_token_ids)
    return choice


def logprobs_object(pieces: list[tuple[list[int], Entries | None]], tokenizer,
                    offset: int = 0) -> dict:
    """The completions API's logprobs of one choice (or one delta) over (token ids, their logprob
    entries) pieces: the echoed prompt's, then the generated tokens'. Each entry holds the top-K and
    the token itself, as vLLM returns them; a None entry (the prompt's first token) gives a null
    logprob and a null top_logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for ids, entries in pieces:
        entries = entries or []
        if len(entries) < len(ids):
            raise RuntimeError(f"the engine returned {len(entries)} logprob entries for "
                               f"{len(ids)} tokens")
        for tok, entry in zip(ids, entries):
            if entry is None:
                text, lp, top = tokenizer.decode([tok], skip_special_tokens=False), None, None
            else:
                text = token_text(tok, entry[tok], tokenizer)
                lp = max(entry[tok].logprob, MIN_LOGPROB)
                top = {token_text(t, x, tokenizer): max(x.logprob, MIN_LOGPROB)
                       for t, x in entry.items()}
            tokens.append(text)
            token_lps.append(lp)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


async def _sse(head: dict, firsts, streams, body: CompletionRequest, n: int, tokenizer):
    prompt_tokens = completion_tokens = cached_tokens = 0
    sent: dict[int, int] = {}          # choice index -> length of the text sent so far
    async for p, item in merged(firsts, streams):
        for c in item.outputs:
            index = p * n + c.index
            first = item if index not in sent else None
            completion_tokens += 0 if body.prompt_only else len(c.token_ids)
            choice = _choice(index, c, first, body, tokenizer, sent.get(index, 0))
            sent[index] = sent.get(index, 0) + len(choice["text"])
            yield sse({**head, 'choices': [choice]})
        if item.finished:
            prompt_tokens += len(item.prompt_token_ids)
            cached_tokens += item.num_cached_tokens
    if body.include_usage:
        last = {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        yield sse(last)
    yield "data: [DONE]\n\n"
