"""The HTTP routes (FastAPI): `/v1/models`, `/v1/completions`, `/v1/chat/completions` (streamed as
SSE or not), `/tokenize`, `/detokenize`, `/health`, `/metrics`, `/reset_prefix_cache`. Every bad
request is a 400 with an OpenAI-shaped error naming the field; a full server answers 503 with
Retry-After; with an API key, every route but `/health` needs `Authorization: Bearer KEY` (401
otherwise).
"""
from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse

from .chat import create_chat_completion
from .completions import create_completion
from .engine_loop import EngineLoop, EngineStopped
from .errors import ApiError, error_response
from .protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .wire import body_of


def build_app(llm, engine_loop: EngineLoop, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="DeepInfer", version="0")
    tokenizer = llm.get_tokenizer()

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return exc.response()

    @app.exception_handler(EngineStopped)
    async def _engine_stopped(_, exc: EngineStopped):     # mid-request (not streamed): the engine failed
        return error_response(503, str(exc), None, "server_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg')}", None)
        # pydantic's location of the field: ("body", "field", index or union member, ...)
        param = next((str(x) for x in first.get("loc", ())[1:] if isinstance(x, str)), None)
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    async def authorized(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "authentication_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(400, f"model: {name!r} is not served here; this server serves {model_name!r}", "model")

    @app.get("/health")
    async def health():
        why = engine_loop.health_error()
        if why is not None:
            return error_response(503, why, None, "server_error")
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics():
        return PlainTextResponse(engine_loop.metrics.render(engine_loop.num_admitted),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache", dependencies=[Depends(authorized)])
    async def reset_prefix_cache():
        """vLLM's route: drops every cached prefix no running request holds (on every rank when
        the engine runs in processes of its own). {"reset": true} when the cache is empty
        afterwards; false when prefix caching is off or running requests hold some."""
        return {"reset": await engine_loop.reset_prefix_cache()}

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
    async def completions(body: CompletionRequest = Depends(body_of(CompletionRequest))):
        check_model(body.model)
        return await create_completion(body, engine_loop, tokenizer)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest = Depends(body_of(ChatRequest))):
        check_model(body.model)
        return await create_chat_completion(body, engine_loop, tokenizer, llm.model_config.vision)

    return app
