"""The request streams a handler holds: the first output of each (a refusal is a 400 before any byte is
sent), the deltas joined into whole completions, or the deltas of several requests merged in arrival
order for one SSE response. Closing a stream aborts its request (engine_loop.py)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from ..api.outputs import CompletionOutput, Logprob, RequestOutput
from .engine_loop import EngineStopped, QueueFull
from .errors import ApiError


async def first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's first output; on a refusal the other requests are aborted and the refusal is a
    400 (or 503 when the server is full)."""
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failed is None:
        return firsts
    await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
    if isinstance(failed, QueueFull):
        raise ApiError(503, str(failed), None, "server_busy", headers={"Retry-After": "1"})
    if isinstance(failed, EngineStopped):
        raise ApiError(503, str(failed), None, "server_error")
    if isinstance(failed, ValueError):
        raise ApiError(400, str(failed), "prompt" if "prompt" in str(failed) else None)
    raise failed


async def collect(first: RequestOutput, stream) -> tuple[RequestOutput, list[CompletionOutput]]:
    """A request's deltas joined into whole completions, in completion order."""
    outs: dict[int, CompletionOutput] = {}
    item = first
    while True:
        for c in item.outputs:
            prev = outs.get(c.index)
            if prev is None:
                outs[c.index] = CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                                 list(c.logprobs) if c.logprobs is not None else None,
                                                 c.finish_reason, c.stop_reason)
                continue
            prev.text += c.text
            prev.token_ids += c.token_ids
            if c.logprobs is not None:
                prev.logprobs = (prev.logprobs or []) + list(c.logprobs)
            prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
        if item.finished:
            return item, [outs[i] for i in sorted(outs)]
        item = await anext(stream)


async def merged(firsts: list[RequestOutput], streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(request index, output) of every request as they arrive, until all have finished; leaving early
    (the client went away) aborts the requests still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, item: RequestOutput, stream) -> None:
        try:
            while True:
                await queue.put((p, item))
                if item.finished:
                    return
                item = await anext(stream)
        except Exception as exc:          # the engine stopped mid-stream: the reader must hear it, not wait
            await queue.put((p, exc))

    tasks = [asyncio.create_task(pump(p, f, s)) for p, (f, s) in enumerate(zip(firsts, streams))]
    live = len(tasks)
    try:
        while live:
            p, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            live -= item.finished
            yield p, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def sse_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE response's events; when the engine stops mid-stream (the status line is long sent), one
    OpenAI-shaped error event ends the stream instead of a cut connection."""
    try:
        async for event in events:
            yield event
    except EngineStopped as exc:
        body = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": 503}}
        yield f"data: {json.dumps(body)}\n\n"


def token_text(token_id: int, logprob: Logprob, tokenizer) -> str:
    """A logprob entry's token as text (the engine decodes it already when it detokenises)."""
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
