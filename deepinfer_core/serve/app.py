"""The HTTP routes (FastAPI): `/v1/models`, `/v1/completions` (streamed as SSE or not), `/tokenize`,
`/detokenize`, `/health`. Every bad request is a 400 with an OpenAI-shaped error naming the field; a
full server answers 503 with Retry-After; with an API key, `/v1` routes need `Authorization: Bearer`.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..api.outputs import CompletionOutput, RequestOutput
from .engine_loop import EngineLoop, QueueFull
from .protocol import CompletionRequest, DetokenizeRequest, TokenizeRequest


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


def _error(status: int, message: str, param: str | None, kind: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(llm, engine_loop: EngineLoop, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="DeepInfer", version="0")
    tokenizer = llm.get_tokenizer()

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return _error(exc.status, exc.message, exc.param, exc.kind, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('msg')}", None, "invalid_request_error")
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param, "invalid_request_error")

    async def authorized(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "authentication_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(400, f"model: {name!r} is not served here; this server serves {model_name!r}", "model")

    @app.get("/health")
    async def health():
        if engine_loop.error is not None:
            return _error(503, f"engine stopped: {engine_loop.error}", None, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "deepinfer", "max_model_len": llm.max_model_len}]}

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < llm.vocab_size]
        if bad:
            raise ApiError(400, f"tokens: ids {bad[:5]} outside the vocabulary [0, {llm.vocab_size})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest):
        check_model(body.model)
        try:
            params = body.sampling_params()
            prompts = body.prompts()
        except ValueError as exc:
            raise ApiError(400, str(exc), _field_named(str(exc))) from None
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = []
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            text = prompt if isinstance(prompt, str) else None
            streams.append(engine_loop.generate(f"{cid}-{i}", ids, params, text))
        firsts = await _first_outputs(streams)
        head = dict(id=cid, object="text_completion", created=created, model=body.model)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(head, streams, firsts, params.n, include_usage, tokenizer),
                                     media_type="text/event-stream")
        done = await asyncio.gather(*(_collect(f, s) for f, s in zip(firsts, streams)))
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p, (req, outs) in enumerate(done):
            prompt_tokens += len(req.prompt_token_ids)
            for c in sorted(outs.values(), key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choices.append(dict(index=p * params.n + c.index, text=c.text, finish_reason=c.finish_reason,
                                    logprobs=_logprobs(c, tokenizer) if params.logprobs is not None else None))
        return {**head, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    return app


def _field_named(message: str) -> str | None:
    """SamplingParams' errors start with the field name (`temperature=...` / `top_p: ...`)."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return head if head.isidentifier() else None


async def _first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's first output, so that a request the engine refuses is a 400 before any byte is
    sent; on a refusal the other requests are aborted."""
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failed is None:
        return firsts
    await asyncio.gather(*(s.aclose() for s in streams))
    if isinstance(failed, QueueFull):
        raise ApiError(503, str(failed), None, "server_busy", headers={"Retry-After": "1"})
    if isinstance(failed, ValueError):
        raise ApiError(400, str(failed), "prompt")
    raise failed


async def _collect(first: RequestOutput, stream) -> tuple[RequestOutput, dict[int, CompletionOutput]]:
    """Join a request's deltas into whole completions (by completion index)."""
    outs: dict[int, CompletionOutput] = {}
    item = first
    while True:
        for c in item.outputs:
            prev = outs.get(c.index)
            if prev is None:
                outs[c.index] = CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                                 list(c.logprobs) if c.logprobs is not None else None,
                                                 c.finish_reason, c.stop_reason)
            else:
                prev.text += c.text
                prev.token_ids += c.token_ids
                if c.logprobs is not None:
                    prev.logprobs = (prev.logprobs or []) + list(c.logprobs)
                prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
        if item.finished:
            return item, outs
        item = await anext(stream)


def _logprobs(c: CompletionOutput, tokenizer) -> dict:
    """The completions API's logprobs object of one choice."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tok, entry in zip(c.token_ids, c.logprobs or []):
        text = tokenizer.decode([tok], skip_special_tokens=False)
        tokens.append(text)
        token_lps.append(entry[tok].logprob if tok in entry else None)
        tops.append({tokenizer.decode([t], skip_special_tokens=False): lp.logprob for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _sse(head: dict, streams, firsts: list[RequestOutput], n: int, include_usage: bool, tokenizer):
    """Server-sent events: one chunk per completion delta, then the usage chunk (when asked), then [DONE]."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, first: RequestOutput, stream) -> None:
        item = first
        while True:
            await merged.put((p, item))
            if item.finished:
                return
            item = await anext(stream)

    tasks = [asyncio.create_task(pump(p, f, s)) for p, (f, s) in enumerate(zip(firsts, streams))]
    prompt_tokens, completion_tokens, live = 0, 0, len(tasks)
    try:
        while live:
            p, item = await merged.get()
            for c in item.outputs:
                completion_tokens += len(c.token_ids)
                choice = dict(index=p * n + c.index, text=c.text, finish_reason=c.finish_reason,
                              logprobs=_logprobs(c, tokenizer) if c.logprobs is not None else None)
                yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
            if item.finished:
                live -= 1
                prompt_tokens += len(item.prompt_token_ids)
        if include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(prompt_tokens, completion_tokens)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:                       # a client that went away: stop pumping, which aborts the requests
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
