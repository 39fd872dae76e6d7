"""The request streams a handler holds: the first output of each (a refusal is a 400 before any byte is
sent), the deltas joined into whole completions, or the deltas of several requests merged in arrival
order for one SSE response. Closing a stream aborts its request (engine_loop.py)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..api.outputs import CompletionOutput, Logprob, RequestOutput
from .engine_loop import EngineStopped, QueueFull, merge_into, owned_copy
from .errors import ApiError, field_named
from .wire import sse

# JSON has no -inf; OpenAI and vLLM send this floor for a token the model rules out
MIN_LOGPROB = -9999.0


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
        raise ApiError(400, str(failed), refused_field(str(failed)))
    raise failed


def refused_field(message: str) -> str | None:
    """The request field a refusal at submission names (a plugin's `extra_args.banned_words: ...`,
    a grammar's `so_args...`), else "prompt" when the message is about the prompt."""
    from .protocol import ChatRequest, CompletionRequest
    field = field_named(message)
    if field and field.split(".")[0] in CompletionRequest.model_fields | ChatRequest.model_fields:
        return field
    return "prompt" if "prompt" in message else None


async def collect(first: RequestOutput, stream) -> tuple[RequestOutput, list[CompletionOutput]]:
    """A request's deltas joined into whole completions, in completion order."""
    whole = owned_copy(first)
    while not whole.finished:
        merge_into(whole, await anext(stream))
    return whole, whole.outputs


async def merged(firsts: list[RequestOutput], streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(request index, output) of every request as they arrive, until all have finished; leaving early
    (the client went away) aborts the requests still running."""
    if len(streams) == 1:                 # one request (chat, most completions): no pump task between
        try:
            item = firsts[0]
            while True:
                yield 0, item
                if item.finished:
                    return
                item = await anext(streams[0])
        finally:
            await streams[0].aclose()
        return
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
        yield sse(body)


def token_text(token_id: int, logprob: Logprob, tokenizer) -> str:
    """A logprob entry's token as text (the engine decodes it already when it detokenises)."""
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; `cached_tokens`: the prompt tokens the prefix cache served (always
    there, 0 without prefix caching, as OpenAI always sends it)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
