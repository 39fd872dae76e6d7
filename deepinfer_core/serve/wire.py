"""The server's JSON on the wire, parsed and encoded by pydantic-core (Rust; the server depends on
pydantic). A request body of 6,000 token ids is parsed and validated in one pass (FastAPI's
`json.loads` alone took 0.5 ms); a response or a streamed event that carries them
(`return_token_ids`) costs ~0.1 ms, where the standard library's encoder took 0.4 ms and FastAPI's
per-element `jsonable_encoder` ~5 ms (benchmarks/host_costs.py). All of it runs on the event
loop's thread, which the engine thread shares."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

M = TypeVar("M", bound=BaseModel)


def body_of(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A route dependency: the request body as `model`. A bad body raises FastAPI's
    RequestValidationError, located under "body" as FastAPI locates it."""
    async def parse(request: Request) -> M:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None
    return parse


class JSON(Response):
    """A JSON response: return it from a route to skip FastAPI's `jsonable_encoder` walk."""
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return to_json(content)


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {to_json(obj).decode()}\n\n"
